"""Which NVIDIA GPUs this process may use: the one detector for the engines, the
launcher and the hardware report.

Asks NVML (`pynvml`, package nvidia-ml-py) rather than torch, so the launcher
and the CLI never import torch to find out."""

from __future__ import annotations

import os
from typing import Any

FORCE_CPU_ENV = "TOKENMILL_FORCE_CPU"


def visible_gpus() -> list[dict[str, Any]]:
    """The GPUs a CUDA program started now would see, in CUDA's order: `index` (NVML's,
    as nvidia-smi numbers them), `uuid`, `name`, `memory_bytes`.

    Empty when `TOKENMILL_FORCE_CPU` is set, when NVML or its driver is absent, or
    when `CUDA_VISIBLE_DEVICES` hides every device (empty or `-1`).  Unset, it shows
    every device; a comma list of indices or `GPU-…` UUIDs shows those, in that order."""
    if os.environ.get(FORCE_CPU_ENV):
        return []
    try:
        import pynvml
    except ImportError:
        return []
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return []
    try:
        devices = describe_devices(pynvml)
    except pynvml.NVMLError:
        return []
    finally:
        try:
            pynvml.nvmlShutdown()
        except pynvml.NVMLError:
            pass
    return select_visible(devices, os.environ.get("CUDA_VISIBLE_DEVICES"))


def has_nvidia_gpu() -> bool:
    """Whether this process's engine would run on a CUDA GPU (see `visible_gpus`)."""
    return bool(visible_gpus())


def describe_devices(nvml) -> list[dict[str, Any]]:
    """Every device an initialised NVML (`pynvml`, or a fake with its functions) reports, in NVML's order."""
    return [_describe(nvml, i) for i in range(nvml.nvmlDeviceGetCount())]


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo), or what `platform` knows."""
    import platform

    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _describe(nvml, i: int) -> dict[str, Any]:
    h = nvml.nvmlDeviceGetHandleByIndex(i)
    return {"index": i, "uuid": _text(nvml.nvmlDeviceGetUUID(h)), "name": _text(nvml.nvmlDeviceGetName(h)),
            "memory_bytes": int(nvml.nvmlDeviceGetMemoryInfo(h).total)}


def _text(v: str | bytes) -> str:
    return v.decode() if isinstance(v, bytes) else v  # older nvidia-ml-py returns bytes


def select_visible(devices: list[dict[str, Any]], cuda_visible_devices: str | None) -> list[dict[str, Any]]:
    """The `devices` (NVML's, with `index` and `uuid`) that `CUDA_VISIBLE_DEVICES` shows,
    in its order.  Like CUDA, the list ends at its first entry that names no device
    (so `-1` hides them all); a UUID may be given by a unique prefix."""
    if cuda_visible_devices is None:
        return list(devices)
    out: list[dict[str, Any]] = []
    for entry in (e.strip() for e in cuda_visible_devices.split(",")):
        if entry.isdigit():
            found = [d for d in devices if d["index"] == int(entry)]
        elif entry.startswith("GPU-"):
            found = [d for d in devices if d["uuid"].startswith(entry)]
        else:
            found = []
        if len(found) != 1 or found[0] in out:
            break
        out.append(found[0])
    return out
