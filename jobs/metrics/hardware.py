"""What the job ran on (CPU model and cores, or the visible GPUs' name and count via NVML), and
how busy it was while the job ran (`UtilizationSampler`).

Utilization is sampled in the launcher, not in workers: a daemon thread reads
the machine's CPU utilization (psutil, all cores) and the RSS of the launcher
and its child processes (vLLM's engine core and Beam workers on this host), and,
where NVML answers, the memory used, utilization and power of each GPU that
`CUDA_VISIBLE_DEVICES` shows it (another job's devices on the host are not this
job's).  Without a GPU the NVML part is a no-op that yields None.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any, Callable, Sequence

from tokenmill.transforms.engines.device import cpu_model, describe_devices, device_handle, select_visible


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
    """The GPUs this process may use (index, name, memory), as the engine sees them:
    `TOKENMILL_FORCE_CPU` and `CUDA_VISIBLE_DEVICES` honoured; empty where there is none."""
    from tokenmill.transforms.engines.device import visible_gpus

    return [{k: g[k] for k in ("index", "name", "memory_bytes")} for g in visible_gpus()]


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


# ---------------------------------------------------------------- utilization during a job


def load_nvml():
    """The initialised `pynvml` module, or None where NVML is absent or no GPU is visible."""
    if not gpus():
        return None
    try:
        import pynvml

        pynvml.nvmlInit()
        return pynvml
    except Exception:
        return None


def visible_devices(nvml) -> list[dict[str, Any]]:
    """The devices of an initialised NVML that `CUDA_VISIBLE_DEVICES` shows this process:
    every GPU by its index when unset, else those it names (engines/device.py)."""
    cvd = os.environ.get("CUDA_VISIBLE_DEVICES")
    if cvd is None:
        return [{"index": i} for i in range(nvml.nvmlDeviceGetCount())]
    return select_visible(describe_devices(nvml), cvd)


def nvml_sample(nvml, devices: list[dict[str, Any]] | None = None) -> list[dict[str, Any]] | None:
    """One reading per device of `devices` (default: `visible_devices`, not every GPU of the
    host: another job's devices are not this job's): memory used/total (bytes), GPU and
    memory-bus utilization (%), power (W).  None when `nvml` is None; a figure the device
    cannot give is None."""
    if nvml is None:
        return None
    out = []
    for d in visible_devices(nvml) if devices is None else devices:
        i = d["index"]
        h = device_handle(nvml, d)
        mem = nvml.nvmlDeviceGetMemoryInfo(h)
        gpu_pct: float | None
        mem_pct: float | None
        try:
            util = nvml.nvmlDeviceGetUtilizationRates(h)
            gpu_pct, mem_pct = float(util.gpu), float(util.memory)
        except Exception:
            gpu_pct = mem_pct = None
        try:
            power_w = nvml.nvmlDeviceGetPowerUsage(h) / 1000.0  # NVML reports milliwatts
        except Exception:
            power_w = None
        out.append({
            "index": i, **({"mig": d["mig"]} if "mig" in d else {}), "memory_used_bytes": int(mem.used), "memory_total_bytes": int(mem.total),
            "util_pct": gpu_pct, "memory_util_pct": mem_pct, "power_w": power_w,
        })
    return out


def process_tree_rss_bytes(pid: int | None = None) -> int | None:
    """RSS of a process and all its descendants (the launcher, vLLM's engine core, local workers)."""
    try:
        import psutil

        p = psutil.Process(pid)
        total = p.memory_info().rss
        for c in p.children(recursive=True):
            try:
                total += c.memory_info().rss
            except psutil.Error:
                pass
        return int(total)
    except Exception:
        return None


def process_tree_cpu_s() -> float:
    """CPU seconds (user + system) this process and its descendants have used so far: its own,
    its live descendants', and those of every descendant that ended and was waited for (each
    counted once, in whichever live process waited for it).  Two readings' difference is what
    a job's processes used between them (SDK workers, engines, the launcher)."""
    import psutil

    total = 0.0
    me = psutil.Process()
    for p in (me, *me.children(recursive=True)):
        try:
            t = p.cpu_times()
        except psutil.Error:
            continue
        total += t.user + t.system + t.children_user + t.children_system
    return total


def _mean(xs: Sequence[float | None]) -> float | None:
    known = [x for x in xs if x is not None]
    return sum(known) / len(known) if known else None


def _max(xs: Sequence[float | None]) -> float | None:
    known = [x for x in xs if x is not None]
    return max(known) if known else None


def summarize_samples(cpu_pct: list[float], rss: list[int | None], gpu: list[list[dict[str, Any]]],
                      wall_s: float) -> dict[str, Any]:
    """Mean/peak of the samples; GPU energy = mean power × sampled wall time."""
    out: dict[str, Any] = {
        "samples": len(cpu_pct),
        "sampled_wall_s": wall_s,
        "clock": "launcher wall clock (time.monotonic), one sample per interval",
        "cpu_util_pct_mean": _mean(cpu_pct),
        "cpu_util_pct_max": _max(cpu_pct),
        "cpu_util_definition": "whole machine, mean over all cores (psutil.cpu_percent)",
        "peak_process_tree_rss_bytes": _max(rss),
        "gpus": None,
    }
    if gpu:
        per: dict[tuple[int, int], list[dict[str, Any]]] = {}
        for reading in gpu:
            for g in reading:
                per.setdefault((g["index"], g.get("mig", -1)), []).append(g)
        gpus = []
        for (idx, mig), rs in sorted(per.items()):
            pw = _mean([r["power_w"] for r in rs])
            gpus.append({
                "index": idx, **({"mig": mig} if mig >= 0 else {}),
                "memory_used_bytes_max": _max([r["memory_used_bytes"] for r in rs]),
                "memory_total_bytes": rs[0]["memory_total_bytes"],
                "util_pct_mean": _mean([r["util_pct"] for r in rs]),
                "util_pct_max": _max([r["util_pct"] for r in rs]),
                "power_w_mean": pw,
                "power_w_max": _max([r["power_w"] for r in rs]),
                "energy_wh": (pw * wall_s / 3600.0) if pw is not None else None,
            })
        out["gpus"] = gpus
    return out


class UtilizationSampler(threading.Thread):
    """Samples CPU utilization, process-tree RSS and (with NVML) GPU figures every
    `every_s` seconds until `stop()`; `summary()` gives the means and peaks.

    `nvml` and `cpu_percent` are injectable so the parsing is tested without a GPU."""

    def __init__(self, every_s: float = 1.0, *, nvml: Any = "auto",
                 cpu_percent: Callable[[], float] | None = None, clock: Callable[[], float] = time.monotonic):
        super().__init__(daemon=True, name="tokenmill-utilization")
        self.every_s = every_s
        self._nvml = load_nvml() if nvml == "auto" else nvml
        if cpu_percent is None:
            import psutil

            psutil.cpu_percent(None)  # the first call only sets the baseline
            cpu_percent = lambda: psutil.cpu_percent(None)  # noqa: E731
        self._cpu_percent = cpu_percent
        self._clock = clock
        self._stop_event = threading.Event()
        self.cpu: list[float] = []
        self.rss: list[int | None] = []
        self.gpu: list[list[dict[str, Any]]] = []
        self._t0 = self._t1 = clock()

    def sample(self) -> None:
        self.cpu.append(float(self._cpu_percent()))
        self.rss.append(process_tree_rss_bytes())
        g = nvml_sample(self._nvml)  # the devices visible now: a launcher that runs the engine itself has leased them
        if g is not None:
            self.gpu.append(g)
        self._t1 = self._clock()

    def run(self) -> None:
        while not self._stop_event.wait(self.every_s):
            try:
                self.sample()
            except Exception:  # never fail a job for a missed sample
                pass

    def stop(self) -> dict[str, Any]:
        self._stop_event.set()
        if self.is_alive():
            self.join(timeout=5)
        if not self.cpu:  # a job shorter than one interval still gets a reading
            try:
                self.sample()
            except Exception:
                pass
        return self.summary()

    def summary(self) -> dict[str, Any]:
        return summarize_samples(self.cpu, self.rss, self.gpu, self._t1 - self._t0)
