"""A stand-in for nvidia-ml-py's `pynvml` on a simulated GPU host, for the subprocesses of a
test (tests/test_leases.py puts this folder first on their PYTHONPATH; in the test process
itself it is loaded under its name into `sys.modules`).

The host is read from the environment at each call, so one module serves several hosts:
`FAKE_GPU_COUNT` devices (default 8) named `FAKE_GPU_NAME`, with UUIDs unique to
`FAKE_GPU_HOST` (`GPU-<host>-0003`); device i draws 100 + 10·i W, and its energy counter
(mJ) is that power × the seconds of `time.time()`, the same in every process of the host."""

from __future__ import annotations

import os
import time
from types import SimpleNamespace

NVML_DEVICE_MIG_ENABLE = 1


class NVMLError(Exception):
    pass


def _count() -> int:
    return int(os.environ.get("FAKE_GPU_COUNT", "8"))


def power_w(i: int) -> float:
    return 100.0 + 10.0 * i


def uuid_of(i: int, host: str | None = None) -> str:
    return f"GPU-{host or os.environ.get('FAKE_GPU_HOST', 'host0')}-{i:04d}"


def nvmlInit():
    pass


def nvmlShutdown():
    pass


def nvmlDeviceGetCount():
    return _count()


def nvmlDeviceGetHandleByIndex(i):
    if not 0 <= i < _count():
        raise NVMLError("Invalid Argument")
    return i


def nvmlDeviceGetUUID(h):
    return uuid_of(h)


def nvmlDeviceGetName(h):
    return os.environ.get("FAKE_GPU_NAME", "NVIDIA L4")


def nvmlDeviceGetMemoryInfo(h):
    return SimpleNamespace(total=24 << 30, used=1 << 30, free=23 << 30)


def nvmlDeviceGetUtilizationRates(h):
    return SimpleNamespace(gpu=90, memory=30)


def nvmlDeviceGetPowerUsage(h):
    return int(power_w(h) * 1000)  # milliwatts


def nvmlDeviceGetTotalEnergyConsumption(h):
    return int(power_w(h) * time.time() * 1000)  # millijoules


def nvmlDeviceGetComputeRunningProcesses(h):
    return []


def nvmlDeviceGetMigMode(h):
    raise NVMLError("Not Supported")
