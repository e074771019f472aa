"""Hourly device prices for cost accounting.

Defaults are on-demand list prices per device-hour in USD, rounded, as
published by the cloud providers in 2025 (AWS EC2 on-demand, us-east-1,
divided by the GPUs in the instance; Lambda Cloud for H100/H200 where AWS
has no single-GPU size).  They are estimates for comparing jobs, not bills:
override them per job (`price_per_hour`) or with a YAML/JSON file named by
TOKENMILL_PRICES ({device substring: price}).
"""

from __future__ import annotations

import json
import os
from typing import Any

#: device name substring (lower case) → USD per device-hour
DEFAULT_PRICES: dict[str, float] = {
    "h200": 3.99,  # Lambda Cloud 8x H200 list price per GPU-hour
    "h100": 2.99,  # Lambda Cloud H100 SXM per GPU-hour
    "a100": 1.29,  # Lambda Cloud A100 40GB per GPU-hour
    "l40s": 1.86,  # AWS g6e.xlarge on-demand
    "l4": 0.80,  # AWS g6.xlarge on-demand
    "a10g": 1.01,  # AWS g5.xlarge on-demand
    "t4": 0.53,  # AWS g4dn.xlarge on-demand
    "cpu": 0.10,  # a 2-vCPU, 24 GiB general-purpose VM (AWS m7i.large is 0.10/h for 8 GiB; r7i.large 0.13/h for 16 GiB)
}


def _table() -> dict[str, float]:
    prices = dict(DEFAULT_PRICES)
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
    return prices


def price_for(hw: dict[str, Any], override: float | None = None) -> tuple[float, str]:
    """(USD per device-hour, where the figure came from)."""
    if override is not None:
        return float(override), "job spec price_per_hour"
    table = _table()
    name = str(hw.get("device", "")).lower()
    if hw.get("device_type") == "gpu":
        for key in sorted(table, key=len, reverse=True):
            if key != "cpu" and key in name:
                return table[key], f"price table entry {key!r}"
        return table.get("h100", 2.99), "no price for this GPU; used the H100 default"
    return table["cpu"], "price table entry 'cpu'"
