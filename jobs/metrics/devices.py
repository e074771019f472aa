"""The devices a job's workers measured: each worker's figures as the metrics show them,
and the job-wide sums and maxima over workers (docs/ACCOUNTING.md)."""

from __future__ import annotations

from typing import Any, Sequence


def worker_summary(w: dict[str, Any]) -> dict[str, Any]:
    """One worker's measured figures as the metrics show them (docs/ACCOUNTING.md)."""
    me = w.get("measure") or {}
    gpus = me.get("gpus") or []
    return {
        "worker": w.get("worker"),
        "run_id": w.get("run_id"),
        "device_type": w.get("device_type"),
        "device_model": w.get("device_model"),
        "device_count": w.get("device_count"),
        "cpu_count": w.get("cpu_count"),
        "nvml_error": w.get("nvml_error"),
        "load_s": w.get("load_s"),
        "window_s": me.get("window_s"),
        "peak_tree_rss_bytes": me.get("peak_tree_rss_bytes"),
        "tree_cores_busy_mean": me.get("tree_cores_busy_mean"),
        "gpu_process_memory_bytes_max": me.get("gpu_process_memory_bytes_max"),
        "gpu_energy_j": me.get("gpu_energy_j"),
        "gpus": gpus or None,
    }


def gpu_count(gpu_workers: Sequence[dict[str, Any]]) -> int:
    """The GPUs the workers ran on: distinct (host, UUID) pairs of the devices they metered,
    so a worker retried onto the device its dead predecessor leased counts it once; a worker
    row without device UUIDs counts its `device_count`."""
    seen: set[tuple[str, str]] = set()
    unnamed = 0
    for w in gpu_workers:
        host = str(w.get("worker") or "").rsplit(":", 1)[0]
        uuids = [g["uuid"] for g in (w.get("measure") or {}).get("gpus") or [] if g.get("uuid")]
        if uuids:
            seen.update((host, u) for u in uuids)
        else:
            unnamed += int(w.get("device_count") or 0)
    return unnamed + len(seen)


def device_summary(workers: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Job-wide device figures: sums (devices, energy) and maxima (memory) over workers."""
    gpu = [w for w in workers if w.get("device_type") == "gpu"]
    energies = [(w.get("measure") or {}).get("gpu_energy_j") for w in gpu]
    known = [e for e in energies if e is not None]
    mems = [(w.get("measure") or {}).get("gpu_process_memory_bytes_max") for w in gpu]
    rss = [(w.get("measure") or {}).get("peak_tree_rss_bytes") for w in workers]
    return {
        "gpus": gpu_count(gpu),
        "gpu_models": sorted({w["device_model"] for w in gpu if w.get("device_model")}),
        "vcpus": sum(int(w.get("cpu_count") or 0) for w in workers if w.get("device_type") == "cpu"),
        "gpu_energy_wh": (sum(known) / 3600.0) if gpu and len(known) == len(energies) else None,
        "gpu_process_memory_bytes_max": max((x for x in mems if x is not None), default=None),
        "peak_worker_tree_rss_bytes": max((x for x in rss if x is not None), default=None),
        "nvml_errors": [f"{w.get('worker')}: {w['nvml_error']}" for w in workers if w.get("nvml_error")],
        "definition": "GPUs: distinct devices (host, UUID) the workers metered; vCPUs: sum over workers; energy: sum of each worker's NVML energy counter over "
                      "its window; memory: the largest worker's",
    }
