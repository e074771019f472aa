"""Hourly prices for cost accounting: per GPU by device model, per vCPU and per GiB for CPU workers.

Defaults are on-demand list prices in USD, rounded, as published in 2025 (sources
beside each entry).  They were written down without the pages at hand (this project's
machines reach package registries only) and not checked since: check them against
your provider.  They are estimates for comparing jobs, not bills: override
them per job (`prices` in the job spec: `{"h100": 2.5, "cpu_vcpu": 0.04}`; or the
older flat `price_per_hour`, one price per device-hour for every device, a CPU
worker counting as one device), or for every job with a JSON/YAML file named by
TOKENMILL_PRICES (same keys).  GPU keys are lower-case substrings of the model name
NVML reports; the longest match wins (`l40s` before `l4`).
"""

from __future__ import annotations

import json
import os
from typing import Any

#: GPU model name substring (lower case) → USD per GPU-hour
GPU_PRICES: dict[str, float] = {
    "h200": 3.99,  # Lambda Cloud 8x H200 list price per GPU-hour
    "h100": 2.99,  # Lambda Cloud H100 SXM per GPU-hour
    "a100": 1.29,  # Lambda Cloud A100 40GB per GPU-hour
    "l40s": 1.86,  # AWS g6e.xlarge on-demand, us-east-1 (1 GPU)
    "l4": 0.80,  # AWS g6.xlarge on-demand, us-east-1 (1 GPU)
    "a10g": 1.01,  # AWS g5.xlarge on-demand, us-east-1 (1 GPU)
    "t4": 0.53,  # AWS g4dn.xlarge on-demand, us-east-1 (1 GPU)
}
#: CPU workers: USD per vCPU-hour (the cores the engine is bound to) and per GiB-hour
#: (the worker's peak process-tree RSS).  Google Compute Engine N2 resource-based
#: on-demand prices, us-central1 (cloud.google.com/compute/vm-instance-pricing):
#: $0.031611 per vCPU-hour, $0.004237 per GiB-hour (n2-standard-2 = 2 vCPU + 8 GiB = $0.0971/h).
CPU_PRICES: dict[str, float] = {"cpu_vcpu": 0.031611, "cpu_gib": 0.004237}
#: A GPU whose model has no entry (or could not be read) is priced as this one, and the report says so.
FALLBACK_GPU = "h100"

GIB = 1 << 30


def price_table(overrides: dict[str, float] | None = None) -> dict[str, float]:
    """The defaults, then TOKENMILL_PRICES, then the job spec's `prices` (keys lower-cased).
    A `cpu` key (from an override) is a flat USD per CPU-worker-hour."""
    prices: dict[str, float] = {**GPU_PRICES, **CPU_PRICES}
    path = os.environ.get("TOKENMILL_PRICES")
    if path:
        with open(path) as fh:
            text = fh.read()
        try:
            extra = json.loads(text)
        except json.JSONDecodeError:
            import yaml

            extra = yaml.safe_load(text)
        prices.update({str(k).lower(): float(v) for k, v in (extra or {}).items()})
    prices.update({str(k).lower(): float(v) for k, v in (overrides or {}).items()})
    return prices


def gpu_price(model: str | None, table: dict[str, float]) -> tuple[float, str]:
    """(USD per GPU-hour, where the figure came from) for a GPU model name."""
    name = (model or "").lower()
    gpu_keys = [k for k in table if k not in ("cpu", *CPU_PRICES)]
    for key in sorted(gpu_keys, key=len, reverse=True):
        if name and key in name:
            return table[key], f"price table entry {key!r}"
    why = "GPU model unknown" if not name else f"no price for {model!r}"
    return table.get(FALLBACK_GPU, GPU_PRICES[FALLBACK_GPU]), f"{why}; used the {FALLBACK_GPU.upper()} price"


def worker_rate(w: dict[str, Any], table: dict[str, float], flat: float | None = None) -> dict[str, Any]:
    """What one worker costs an hour: `usd_per_hour`, `units` (what is priced, in words)
    and `source`.  `w`: the worker's measured columns (device_type, device_model,
    device_count, cpu_count, measure.peak_tree_rss_bytes).  `flat`: the job spec's
    `price_per_hour` (per device-hour; a CPU worker is one device)."""
    if w.get("device_type") == "gpu":
        n = int(w.get("device_count") or 1)
        units = f"{n} × {w.get('device_model') or 'GPU (model unknown)'}"
        if flat is not None:
            return {"usd_per_hour": flat * n, "units": units, "source": "job spec price_per_hour"}
        price, source = gpu_price(w.get("device_model"), table)
        return {"usd_per_hour": price * n, "units": units, "source": source}
    vcpus = int(w.get("cpu_count") or 1)
    rss = (w.get("measure") or {}).get("peak_tree_rss_bytes") or w.get("peak_rss_bytes") or 0
    gib = rss / GIB
    units = f"{vcpus} vCPU + {gib:.2f} GiB"
    if flat is not None:
        return {"usd_per_hour": flat, "units": units, "source": "job spec price_per_hour"}
    if "cpu" in table:
        return {"usd_per_hour": table["cpu"], "units": units, "source": "price table entry 'cpu' (per worker-hour)"}
    return {"usd_per_hour": vcpus * table["cpu_vcpu"] + gib * table["cpu_gib"], "units": units,
            "source": "price table entries 'cpu_vcpu' × vCPUs + 'cpu_gib' × GiB"}


def launcher_worker(hw: dict[str, Any]) -> dict[str, Any]:
    """A worker description from the launcher's hardware (jobs/metrics/hardware.describe), for
    worker rows that measured nothing (written before tokenmill measured in workers)."""
    if hw.get("device_type") == "gpu":
        gpus = hw.get("gpus") or [{}]
        return {"device_type": "gpu", "device_model": gpus[0].get("name") or hw.get("device"),
                "device_count": hw.get("device_count") or 1}
    return {"device_type": "cpu", "cpu_count": hw.get("cpu_cores") or 1}
