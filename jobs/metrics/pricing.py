"""Hourly prices for cost accounting: per GPU by device model, per vCPU and per GiB for CPU workers.

Every price the accounting uses says where it came from (its origin): the job
spec (`prices`, or the older flat `price_per_hour`, one price per device-hour for
every device, a CPU worker counting as one device), a user file (a JSON/YAML file
named by TOKENMILL_PRICES, same keys, recorded with its path), or the default
table below (recorded with its source and date).  Precedence: the job spec, then
the user file, then the defaults.

The defaults (`DEFAULT_PRICES`) are on-demand list prices in USD, rounded, as
published in 2025, each with its source.  They were written down without the pages
at hand (this project's machines reach package registries only) and have not been
checked since, and each entry's `as_of` says exactly that rather than a day it was
read: check them against your provider.  They are estimates for comparing jobs,
not bills.  A user file's entry may be a number or `{usd_per_hour, source, as_of}`;
without its own `as_of`, the file's modification date is recorded.  GPU keys are
lower-case substrings of the model name NVML reports; the longest match wins
(`l40s` before `l4`).
"""

from __future__ import annotations

import datetime as dt
import json
import os
from dataclasses import dataclass
from typing import Any, Mapping

JOB_SPEC, USER_FILE, DEFAULT_TABLE = "job spec", "user file", "default table"


@dataclass(frozen=True)
class ListPrice:
    """A default price: USD per hour of one `per` (GPU, vCPU, GiB), where it was
    published (`source`) and when it was read, as far as that is known (`as_of`)."""

    usd_per_hour: float
    per: str
    source: str
    as_of: str


#: What is known of when the defaults were read: 2025's list prices, from memory.
AS_OF_2025 = "2025 list price, written down without the page at hand; not re-checked"
_LAMBDA = "Lambda Cloud on-demand list price"
_AWS = "AWS EC2 on-demand price, us-east-1"
_GCE = ("Google Compute Engine N2 resource-based on-demand price, us-central1 "
        "(cloud.google.com/compute/vm-instance-pricing)")

#: key → the default price.  GPU keys: a model name substring (lower case), per GPU-hour.
#: CPU workers: per vCPU-hour (the cores the engine is bound to) and per GiB-hour (the
#: worker's peak process-tree RSS).
DEFAULT_PRICES: dict[str, ListPrice] = {
    "h200": ListPrice(3.99, "GPU", f"{_LAMBDA}, 8× H200 instance, per GPU-hour", AS_OF_2025),
    "h100": ListPrice(2.99, "GPU", f"{_LAMBDA}, H100 SXM, per GPU-hour", AS_OF_2025),
    "a100": ListPrice(1.29, "GPU", f"{_LAMBDA}, A100 40 GB, per GPU-hour", AS_OF_2025),
    "l40s": ListPrice(1.86, "GPU", f"{_AWS}, g6e.xlarge (1 GPU)", AS_OF_2025),
    "l4": ListPrice(0.80, "GPU", f"{_AWS}, g6.xlarge (1 GPU)", AS_OF_2025),
    "a10g": ListPrice(1.01, "GPU", f"{_AWS}, g5.xlarge (1 GPU)", AS_OF_2025),
    "t4": ListPrice(0.53, "GPU", f"{_AWS}, g4dn.xlarge (1 GPU)", AS_OF_2025),
    "cpu_vcpu": ListPrice(0.031611, "vCPU", f"{_GCE}, per vCPU-hour", AS_OF_2025),
    "cpu_gib": ListPrice(0.004237, "GiB", f"{_GCE}, per GiB-hour (n2-standard-2 = 2 vCPU + 8 GiB = $0.0971/h)",
                         AS_OF_2025),
}
#: GPU model name substring (lower case) → USD per GPU-hour
GPU_PRICES: dict[str, float] = {k: p.usd_per_hour for k, p in DEFAULT_PRICES.items() if p.per == "GPU"}
#: CPU workers: USD per vCPU-hour and per GiB-hour
CPU_PRICES: dict[str, float] = {k: p.usd_per_hour for k, p in DEFAULT_PRICES.items() if p.per != "GPU"}
#: A GPU whose model has no entry (or could not be read) is priced as this one, and the report says so.
FALLBACK_GPU = "h100"

GIB = 1 << 30


class PriceTable(dict):
    """key → USD per hour (a plain dict to read), with `origins`: key → where that price
    came from (`{"origin": "job spec" | "user file" | "default table", ...}`)."""

    def __init__(self, *args: Any, **kw: Any):
        super().__init__(*args, **kw)
        self.origins: dict[str, dict[str, Any]] = {}

    def put(self, key: str, usd: float, origin: dict[str, Any]) -> None:
        self[key] = usd
        self.origins[key] = origin


def _default_origin(p: ListPrice) -> dict[str, Any]:
    return {"origin": DEFAULT_TABLE, "source": p.source, "as_of": p.as_of}


def _user_file(path: str, table: PriceTable) -> None:
    with open(path) as fh:
        text = fh.read()
    try:
        extra = json.loads(text)
    except json.JSONDecodeError:
        import yaml

        extra = yaml.safe_load(text)
    modified = dt.datetime.fromtimestamp(os.path.getmtime(path), dt.timezone.utc).date().isoformat()
    for k, v in (extra or {}).items():
        origin: dict[str, Any] = {"origin": USER_FILE, "path": os.path.abspath(path)}
        if isinstance(v, Mapping):
            origin.update({f: str(v[f]) for f in ("source", "as_of") if v.get(f) is not None})
            v = v.get("usd_per_hour")
        origin.setdefault("as_of", f"file modified {modified}")
        table.put(str(k).lower(), float(v), origin)


def price_table(overrides: dict[str, float] | None = None) -> PriceTable:
    """The defaults, then TOKENMILL_PRICES, then the job spec's `prices` (keys lower-cased),
    each entry with its origin (`PriceTable.origins`).  A `cpu` key (from an override) is a
    flat USD per CPU-worker-hour."""
    prices = PriceTable()
    for k, p in DEFAULT_PRICES.items():
        prices.put(k, p.usd_per_hour, _default_origin(p))
    path = os.environ.get("TOKENMILL_PRICES")
    if path:
        _user_file(path, prices)
    for k, v in (overrides or {}).items():
        prices.put(str(k).lower(), float(v), {"origin": JOB_SPEC, "field": "prices"})
    return prices


def _entry(table: Mapping[str, float], key: str, per: str) -> dict[str, Any]:
    """One price used: key, USD per hour of what, and its origin (None for a plain dict's)."""
    origin = getattr(table, "origins", {}).get(key)
    return {"key": key, "usd_per_hour": table[key], "per": per, **(origin or {"origin": None})}


def price_line(e: dict[str, Any]) -> str:
    """One price used, with its origin, in words: `h100 $2.99 per GPU-hour: default table (…, as of …)`."""
    head = f"{e.get('key')} ${e.get('usd_per_hour'):g} per {e.get('per')}"
    o = e.get("origin")
    if o == JOB_SPEC:
        return f"{head}: job spec ({e.get('field') or 'prices'})"
    if o == USER_FILE:
        extra = ", ".join(x for x in (e.get("source"), e.get("as_of")) if x)
        return f"{head}: user file {e.get('path')} (TOKENMILL_PRICES{'; ' + extra if extra else ''})"
    if o == DEFAULT_TABLE:
        return f"{head}: default table ({e.get('source')}; as of {e.get('as_of')})"
    return f"{head}: origin not recorded"


def _gpu_key(model: str | None, table: Mapping[str, float]) -> tuple[str, str]:
    name = (model or "").lower()
    gpu_keys = [k for k in table if k not in ("cpu", *CPU_PRICES)]
    for key in sorted(gpu_keys, key=len, reverse=True):
        if name and key in name:
            return key, f"price table entry {key!r}"
    why = "GPU model unknown" if not name else f"no price for {model!r}"
    key = FALLBACK_GPU if FALLBACK_GPU in table else ""
    return key, f"{why}; used the {FALLBACK_GPU.upper()} price"


def _gpu_entry(model: str | None, table: Mapping[str, float]) -> tuple[dict[str, Any], str]:
    """The GPU price used for a model name (`_entry`; the default fallback price for a table
    without the fallback's entry) and where the figure came from, in words."""
    key, why = _gpu_key(model, table)
    if key:
        return _entry(table, key, "GPU-hour"), why
    p = DEFAULT_PRICES[FALLBACK_GPU]
    return {"key": FALLBACK_GPU, "usd_per_hour": p.usd_per_hour, "per": "GPU-hour", **_default_origin(p)}, why


def gpu_price(model: str | None, table: Mapping[str, float]) -> tuple[float, str]:
    """(USD per GPU-hour, where the figure came from) for a GPU model name."""
    used, why = _gpu_entry(model, table)
    return used["usd_per_hour"], why


def worker_rate(w: dict[str, Any], table: Mapping[str, float], flat: float | None = None) -> dict[str, Any]:
    """What one worker costs an hour: `usd_per_hour`, `units` (what is priced, in words),
    `source` (which entries, in words) and `prices`: each price used with its origin
    (`price_line`).  `w`: the worker's measured columns (device_type, device_model,
    device_count, cpu_count, measure.peak_tree_rss_bytes).  `flat`: the job spec's
    `price_per_hour` (per device-hour; a CPU worker is one device)."""
    flat_entry = {"key": "price_per_hour", "usd_per_hour": flat, "per": "device-hour", "origin": JOB_SPEC,
                  "field": "price_per_hour"}
    if w.get("device_type") == "gpu":
        n = int(w.get("device_count") or 1)
        units = f"{n} × {w.get('device_model') or 'GPU (model unknown)'}"
        if flat is not None:
            return {"usd_per_hour": flat * n, "units": units, "source": "job spec price_per_hour",
                    "prices": [flat_entry]}
        used, source = _gpu_entry(w.get("device_model"), table)
        return {"usd_per_hour": used["usd_per_hour"] * n, "units": units, "source": source, "prices": [used]}
    vcpus = int(w.get("cpu_count") or 1)
    rss = (w.get("measure") or {}).get("peak_tree_rss_bytes") or w.get("peak_rss_bytes") or 0
    gib = rss / GIB
    units = f"{vcpus} vCPU + {gib:.2f} GiB"
    if flat is not None:
        return {"usd_per_hour": flat, "units": units, "source": "job spec price_per_hour", "prices": [flat_entry]}
    if "cpu" in table:
        return {"usd_per_hour": table["cpu"], "units": units, "source": "price table entry 'cpu' (per worker-hour)",
                "prices": [_entry(table, "cpu", "CPU-worker-hour")]}
    return {"usd_per_hour": vcpus * table["cpu_vcpu"] + gib * table["cpu_gib"], "units": units,
            "source": "price table entries 'cpu_vcpu' × vCPUs + 'cpu_gib' × GiB",
            "prices": [_entry(table, "cpu_vcpu", "vCPU-hour"), _entry(table, "cpu_gib", "GiB-hour")]}


def prices_used(rates: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The distinct prices (with origins) a job's workers were priced with, in first-use order."""
    seen: dict[str, dict[str, Any]] = {}
    for r in rates:
        for e in r.get("prices") or []:
            seen.setdefault(json.dumps(e, sort_keys=True, default=str), e)
    return list(seen.values())


def launcher_worker(hw: dict[str, Any]) -> dict[str, Any]:
    """A worker description from the launcher's hardware (jobs/metrics/hardware.describe), for
    worker rows that measured nothing (written before tokenmill measured in workers)."""
    if hw.get("device_type") == "gpu":
        gpus = hw.get("gpus") or [{}]
        return {"device_type": "gpu", "device_model": gpus[0].get("name") or hw.get("device"),
                "device_count": hw.get("device_count") or 1}
    return {"device_type": "cpu", "cpu_count": hw.get("cpu_cores") or 1}
