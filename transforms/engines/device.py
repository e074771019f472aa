"""Which NVIDIA GPUs (and which CPU cores) this process may use: the one detector for the
engines, the launcher and the hardware report.

Asks NVML (`pynvml`, package nvidia-ml-py) rather than torch, so the launcher
and the CLI never import torch to find out."""

from __future__ import annotations

import os
from typing import Any

FORCE_CPU_ENV = "TOKENMILL_FORCE_CPU"


def visible_gpus() -> list[dict[str, Any]]:
    """The GPUs a CUDA program started now would see, in CUDA's order: `index` (NVML's,
    as nvidia-smi numbers them), `uuid`, `name`, `memory_bytes` (see `host_gpus`).

    Empty when there is none (`host_gpus`) or when `CUDA_VISIBLE_DEVICES` hides every
    device (empty or `-1`).  Unset, it shows every device; a comma list of indices or
    `GPU-…`/`MIG-…` UUIDs shows those, in that order."""
    return select_visible(host_gpus(), os.environ.get("CUDA_VISIBLE_DEVICES"))


def host_gpus() -> list[dict[str, Any]]:
    """Every device of this host, whatever `CUDA_VISIBLE_DEVICES` says, in NVML's order (a GPU
    in MIG mode as its MIG instances, see `describe_devices`): what the host's workers
    lease from (engines/leases.py).  Empty when `TOKENMILL_FORCE_CPU` is set or when NVML
    or its driver is absent."""
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
        return describe_devices(pynvml)
    except pynvml.NVMLError:
        return []
    finally:
        try:
            pynvml.nvmlShutdown()
        except pynvml.NVMLError:
            pass


def has_nvidia_gpu() -> bool:
    """Whether this process's engine would run on a CUDA GPU (see `visible_gpus`)."""
    return bool(visible_gpus())


def describe_devices(nvml) -> list[dict[str, Any]]:
    """Every device an initialised NVML (`pynvml`, or a fake with its functions) reports, in NVML's order.

    A GPU in MIG mode is listed as its MIG instances, as CUDA sees them: each with its own
    `MIG-…` uuid, name and memory, the GPU's `index`, and `mig` (its slot on that GPU), so
    each instance is leased and metered as a device of its own."""
    out: list[dict[str, Any]] = []
    for i in range(nvml.nvmlDeviceGetCount()):
        h = nvml.nvmlDeviceGetHandleByIndex(i)
        migs = _mig_instances(nvml, h)
        if migs is None:
            out.append(_describe(nvml, h, i))
        else:
            out += [{**_describe(nvml, m, i), "mig": slot} for slot, m in migs]
    return out


def device_handle(nvml, d: dict[str, Any]) -> Any:
    """NVML's handle of a device `describe_devices` listed (a MIG instance's own, not its GPU's)."""
    h = nvml.nvmlDeviceGetHandleByIndex(d["index"])
    return nvml.nvmlDeviceGetMigDeviceHandleByIndex(h, d["mig"]) if "mig" in d else h


def _mig_instances(nvml, h) -> list[tuple[int, Any]] | None:
    """(slot, handle) of each MIG instance of a GPU in MIG mode; None for a GPU that is not
    (or an NVML without MIG)."""
    try:
        current, _pending = nvml.nvmlDeviceGetMigMode(h)
    except Exception:  # NVML_ERROR_NOT_SUPPORTED on a GPU without MIG; an older NVML or a fake without it
        return None
    if current != getattr(nvml, "NVML_DEVICE_MIG_ENABLE", 1):
        return None
    found = []
    for slot in range(nvml.nvmlDeviceGetMaxMigDeviceCount(h)):
        try:
            found.append((slot, nvml.nvmlDeviceGetMigDeviceHandleByIndex(h, slot)))
        except Exception:  # NVML_ERROR_NOT_FOUND: no instance in this slot
            continue
    return found


def allowed_cores() -> list[int]:
    """The CPU cores this process may run on (its affinity: a bound worker's own cores, a
    container's cpuset), sorted; every core where affinity is unknown."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


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


def _describe(nvml, h, i: int) -> dict[str, Any]:
    return {"index": i, "uuid": _text(nvml.nvmlDeviceGetUUID(h)), "name": _text(nvml.nvmlDeviceGetName(h)),
            "memory_bytes": int(nvml.nvmlDeviceGetMemoryInfo(h).total)}


def _text(v: str | bytes) -> str:
    return v.decode() if isinstance(v, bytes) else v  # older nvidia-ml-py returns bytes


def select_visible(devices: list[dict[str, Any]], cuda_visible_devices: str | None) -> list[dict[str, Any]]:
    """The `devices` (NVML's, with `index` and `uuid`) that `CUDA_VISIBLE_DEVICES` shows,
    in its order.  Like CUDA, the list ends at its first entry that names no device
    (so `-1` hides them all); a `GPU-…` or `MIG-…` UUID may be given by a unique prefix;
    an index names that GPU (its first MIG instance, in MIG mode)."""
    if cuda_visible_devices is None:
        return list(devices)
    out: list[dict[str, Any]] = []
    for entry in (e.strip() for e in cuda_visible_devices.split(",")):
        if entry.isdigit():
            found = [d for d in devices if d["index"] == int(entry)][:1]
        elif entry.startswith(("GPU-", "MIG-")):
            found = [d for d in devices if d["uuid"].startswith(entry)]
        else:
            found = []
        if len(found) != 1 or found[0] in out:
            break
        out.append(found[0])
    return out
