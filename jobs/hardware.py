"""What the job ran on: CPU model and cores, or GPU name and count (via NVML when present)."""

from __future__ import annotations

import os
import platform
from typing import Any


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def gpus() -> list[dict[str, Any]]:
    """GPU names and memory through NVML (nvidia-ml-py); empty where there is none."""
    try:
        import pynvml  # provided by nvidia-ml-py, a vLLM (CUDA) dependency

        pynvml.nvmlInit()
    except Exception:
        return []
    out = []
    try:
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            name = pynvml.nvmlDeviceGetName(h)
            mem = pynvml.nvmlDeviceGetMemoryInfo(h)
            out.append({"index": i, "name": name.decode() if isinstance(name, bytes) else name, "memory_bytes": int(mem.total)})
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:
            pass
    return out


def describe() -> dict[str, Any]:
    g = gpus()
    flags = cpu_flags()
    d: dict[str, Any] = {
        "cpu_model": cpu_model(),
        "cpu_cores": os.cpu_count(),
        "cpu_isa": sorted(f for f in flags if f.startswith(("avx512", "amx")) or f in ("avx2",)),
        "memory_bytes": _mem_total(),
        "gpus": g,
    }
    if g:
        d["device"] = g[0]["name"]
        d["device_type"] = "gpu"
        d["device_count"] = len(g)
    else:
        d["device"] = f"cpu ({d['cpu_cores']} cores)"
        d["device_type"] = "cpu"
        d["device_count"] = 1
    return d


def _mem_total() -> int | None:
    try:
        import psutil

        return int(psutil.virtual_memory().total)
    except Exception:
        return None
