"""What a worker's engine uses, measured in the worker itself (where the engine runs,
not in the launcher, which on a remote runner has no GPU at all).

`WorkerMeter` is made when a worker's engine is ready (transforms/write.py,
`record_worker`) and read each time the worker reports (`update_worker_peak`); its
reading is stored with the worker's row (`workers`: device_type, device_model,
device_count, cpu_count, nvml_error, measure).

* GPU worker (the engine runs on CUDA): the devices it uses are the visible ones
  (`CUDA_VISIBLE_DEVICES`, engines/device.py) narrowed to the first
  tensor_parallel_size × pipeline_parallel_size, as vLLM places its ranks.  A worker that
  leased its devices (engines/leases.py) sees exactly those, and no other worker of the
  host leases them: the job's GPUs are the devices leased and each device's energy is
  counted once, in its leaseholder's window.  A MIG instance is metered by its own
  handle (NVML gives no energy or power per instance: those are unknown, not its GPU's).  Per device,
  NVML gives the model name, device memory (used, total), this worker's process-tree
  memory on it (`nvmlDeviceGetComputeRunningProcesses`), utilization and power (sampled
  every `every_s`), and energy from NVML's total-energy counter
  (`nvmlDeviceGetTotalEnergyConsumption`, mJ since driver load) read at both ends of
  the meter's window.  Where NVML cannot be read the reading says so (`nvml_error`,
  one warning in the log) and the device count is the engine's TP × PP; it stays a
  GPU worker.
* CPU worker: the cores its engine is bound to (`VLLM_CPU_OMP_THREADS_BIND` when an
  explicit list, else the process's affinity), the process tree's CPU time and RSS.

The window runs from the engine being ready (just before the worker's first batch)
to the latest reading (after its latest finished batch); clock: time.time() of the
worker.
"""

from __future__ import annotations

import logging
import os
import re
import threading
import time
from pathlib import Path
from typing import Any, Callable

from tokenmill.transforms.engines.device import (
    FORCE_CPU_ENV,
    allowed_cores,
    cpu_model,
    describe_devices,
    device_handle,
    select_visible,
)

log = logging.getLogger(__name__)


def engine_device_count(info: dict[str, Any]) -> int:
    """tensor_parallel_size × pipeline_parallel_size of the engine (`info["engine_kwargs"]`), 1 by default."""
    kw = info.get("engine_kwargs") or {}
    tp = int(kw.get("tensor_parallel_size") or 1)
    pp = int(kw.get("pipeline_parallel_size") or 1)
    return max(1, tp) * max(1, pp)


def nvidia_driver_present() -> bool:
    """An NVIDIA driver with at least one GPU, found without NVML (/proc/driver/nvidia/gpus),
    unless `TOKENMILL_FORCE_CPU` or `CUDA_VISIBLE_DEVICES` hides every device."""
    if os.environ.get(FORCE_CPU_ENV):
        return False
    cvd = os.environ.get("CUDA_VISIBLE_DEVICES")
    if cvd is not None and cvd.strip() in ("", "-1"):
        return False
    d = Path("/proc/driver/nvidia/gpus")
    return d.is_dir() and any(d.iterdir())


def bound_cpu_count() -> int:
    """The cores a CPU engine in this process runs on: an explicit `VLLM_CPU_OMP_THREADS_BIND`
    list (`0-3,6`), else this process's CPU affinity."""
    bind = os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "")
    if re.fullmatch(r"\d+(-\d+)?(,\d+(-\d+)?)*", bind):
        n = 0
        for part in bind.split(","):
            lo, _, hi = part.partition("-")
            n += (int(hi) - int(lo) + 1) if hi else 1
        return n
    return len(allowed_cores())


def _tree(pid: int):
    import psutil

    p = psutil.Process(pid)
    return [p] + p.children(recursive=True)


def mean_of(xs):
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


def max_of(xs):
    xs = [x for x in xs if x is not None]
    return max(xs) if xs else None


def _load_nvml():
    import pynvml

    pynvml.nvmlInit()
    return pynvml


class WorkerMeter:
    """Measures one worker's engine (see the module docstring).

    `info`: the engine's `session.info()` (`device` "cuda" or "cpu", `engine_kwargs`);
    `nvml`: the pynvml module to use ("auto": import and initialise it), injectable so
    tests run on a fake; `start()` begins sampling every `every_s` on a daemon thread."""

    def __init__(self, info: dict[str, Any], *, nvml: Any = "auto", every_s: float = 1.0, pid: int | None = None,
                 clock: Callable[[], float] = time.time):
        self.pid = pid or os.getpid()
        self.every_s = every_s
        self._clock = clock
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.nvml_error: str | None = None
        self.devices: list[dict[str, Any]] = []
        self._nvml: Any = None
        self._handles: list[Any] = []
        device = str(info.get("device") or "")
        self.device_type = "gpu" if device.startswith("cuda") else "cpu" if device == "cpu" else None
        if self.device_type is None and os.environ.get(FORCE_CPU_ENV):
            self.device_type = "cpu"
        self.wanted = engine_device_count(info)
        if self.device_type != "cpu":
            self._open_nvml(nvml)
        if self.device_type is None:  # an engine that does not say (test fakes): where NVML or the driver points
            self.device_type = "gpu" if (self.devices or self.nvml_error) else "cpu"
        self.cpu_count = bound_cpu_count() if self.device_type == "cpu" else None
        self.t0 = clock()
        self.t1 = self.t0
        self._energy0 = [self._energy_mj(h) for h in self._handles]
        self._energy1 = list(self._energy0)
        self._gpu: list[list[dict[str, Any]]] = [[] for _ in self._handles]
        self._rss: list[int] = []
        self._cpu_s: dict[int, tuple[float, float]] = {}  # pid → (first, latest) user+system CPU seconds
        self.sample()

    # ------------------------------------------------------------ devices

    def _open_nvml(self, nvml: Any) -> None:
        try:
            self._nvml = _load_nvml() if nvml == "auto" else nvml
            if self._nvml is None:
                raise RuntimeError("no NVML")
            visible = select_visible(describe_devices(self._nvml), os.environ.get("CUDA_VISIBLE_DEVICES"))
        except Exception as err:  # ImportError, NVMLError, a driver/library mismatch
            self._nvml = None
            if self.device_type == "gpu" or nvidia_driver_present():
                self.nvml_error = f"NVML cannot be read ({type(err).__name__}: {str(err)[:200]})"
                log.warning("GPU worker %d: %s; its devices are counted from the engine (%d) and its "
                            "memory, power and energy are unknown", self.pid, self.nvml_error, self.wanted)
            return
        self.devices = visible[: self.wanted]
        if self.devices and len(self.devices) < self.wanted:
            log.warning("the engine wants %d GPUs but %d are visible", self.wanted, len(self.devices))
        self._handles = [device_handle(self._nvml, d) for d in self.devices]

    @property
    def device_model(self) -> str | None:
        if self.device_type == "gpu":
            return self.devices[0]["name"] if self.devices else None
        return cpu_model()

    @property
    def device_count(self) -> int | None:
        if self.device_type != "gpu":
            return None
        return len(self.devices) if self.devices else self.wanted

    def _energy_mj(self, h) -> float | None:
        try:
            return float(self._nvml.nvmlDeviceGetTotalEnergyConsumption(h))  # mJ since the driver loaded
        except Exception:  # pre-Volta devices, or unsupported
            return None

    def _proc_memory(self, h, pids: set[int]) -> int | None:
        try:
            procs = self._nvml.nvmlDeviceGetComputeRunningProcesses(h)
        except Exception:
            return None
        used = [p.usedGpuMemory for p in procs if p.pid in pids and p.usedGpuMemory is not None]
        return int(sum(used)) if used else None

    # ------------------------------------------------------------ sampling

    def sample(self) -> None:
        """One reading: process-tree RSS and CPU time; per used GPU memory, utilization, power."""
        try:
            tree = _tree(self.pid)
        except Exception:
            tree = []
        rss = 0
        pids = set()
        for p in tree:
            try:
                rss += p.memory_info().rss
                t = p.cpu_times()
                busy = t.user + t.system
                pids.add(p.pid)
            except Exception:
                continue
            with self._lock:
                first = self._cpu_s.get(p.pid, (busy, busy))[0]
                self._cpu_s[p.pid] = (first, busy)
        gpu = []
        for h in self._handles:
            g: dict[str, Any] = {}
            try:
                mem = self._nvml.nvmlDeviceGetMemoryInfo(h)
                g["memory_used_bytes"], g["memory_total_bytes"] = int(mem.used), int(mem.total)
            except Exception:
                pass
            try:
                g["util_pct"] = float(self._nvml.nvmlDeviceGetUtilizationRates(h).gpu)
            except Exception:
                pass
            try:
                g["power_w"] = self._nvml.nvmlDeviceGetPowerUsage(h) / 1000.0  # NVML reports milliwatts
            except Exception:
                pass
            g["process_memory_bytes"] = self._proc_memory(h, pids)
            gpu.append(g)
        energy = [self._energy_mj(h) for h in self._handles]
        with self._lock:
            if tree:
                self._rss.append(rss)
            for i, g in enumerate(gpu):
                self._gpu[i].append(g)
            self._energy1 = energy
            self.t1 = self._clock()

    def start(self) -> "WorkerMeter":
        def loop():
            while not self._stop.wait(self.every_s):
                try:
                    self.sample()
                except Exception:  # never fail a worker for a missed sample
                    pass

        self._thread = threading.Thread(target=loop, daemon=True, name="tokenmill-worker-meter")
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    # ------------------------------------------------------------ the reading stored with the worker's row

    def reading(self) -> dict[str, Any]:
        """The worker-row columns: device_type, device_model, device_count, cpu_count, nvml_error, measure."""
        self.sample()
        with self._lock:
            window = self.t1 - self.t0
            gpus = []
            for d, rs, e0, e1 in zip(self.devices, self._gpu, self._energy0, self._energy1):
                power = mean_of([r.get("power_w") for r in rs])
                energy_j = (e1 - e0) / 1000.0 if e0 is not None and e1 is not None else None
                gpus.append({
                    "index": d["index"], "uuid": d.get("uuid"), "name": d["name"],
                    "memory_total_bytes": d.get("memory_bytes"),
                    "memory_used_bytes_max": max_of([r.get("memory_used_bytes") for r in rs]),
                    "process_memory_bytes_max": max_of([r.get("process_memory_bytes") for r in rs]),
                    "util_pct_mean": mean_of([r.get("util_pct") for r in rs]),
                    "util_pct_max": max_of([r.get("util_pct") for r in rs]),
                    "power_w_mean": power,
                    "power_w_max": max_of([r.get("power_w") for r in rs]),
                    "energy_j": energy_j,
                    "energy_j_from_power": power * window if power is not None else None,
                })
            cpu_s = sum(last - first for first, last in self._cpu_s.values())
            measure = {
                "window_started_at": self.t0,
                "window_ended_at": self.t1,
                "window_s": window,
                "samples": len(self._rss),
                "clock": "worker time.time(): engine ready -> latest report",
                "peak_tree_rss_bytes": max_of(self._rss),
                "tree_cpu_s": cpu_s,
                "tree_cores_busy_mean": (cpu_s / window) if window > 0 else None,
                "gpus": gpus or None,
                "gpu_energy_j": (sum(g["energy_j"] for g in gpus)
                                 if gpus and all(g["energy_j"] is not None for g in gpus) else None),
                "gpu_process_memory_bytes_max": (sum(g["process_memory_bytes_max"] for g in gpus)
                                                 if gpus and all(g["process_memory_bytes_max"] is not None
                                                                 for g in gpus) else None),
            }
        return {
            "device_type": self.device_type,
            "device_model": self.device_model,
            "device_count": self.device_count,
            "cpu_count": self.cpu_count,
            "nvml_error": self.nvml_error,
            "measure": measure,
        }
