"""The vLLM engine as an `EngineSession`: `vllm.LLM` driven request by request.

vllm is imported lazily, inside worker-side calls."""

from __future__ import annotations

import contextlib
import io
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any, Sequence

from tokenmill.schemas import records as R
from tokenmill.schemas.errors import first_line
from tokenmill.transforms.engines import kv, lora
from tokenmill.transforms.engines.checks import check_engine_config
from tokenmill.transforms.engines.cpu import (
    apply_cpu_env,
    cpu_dtype,
    cpu_dtype_measurement,
    cpu_kv_cache,
    single_process_omp_env,
)
from tokenmill.transforms.engines.device import has_nvidia_gpu
from tokenmill.transforms.engines.protocol import EngineStartError, Finished
from tokenmill.transforms.engines.vllm_config import VllmConfig
from tokenmill.transforms.engines.vllm_outputs import finished_of, sampling_params

log = logging.getLogger(__name__)


#: VllmConfig fields that are not `EngineArgs`: `kind` picks the engine, `model` names the
#: model (the path is passed instead), `extra` holds further EngineArgs, merged last; `task`
#: and `pooling` are translated (`embed_kwargs`); `kv_cache_sized_for` picks the size tokenmill
#: gives `kv_cache_memory_bytes` on a CPU (`cpu.cpu_kv_cache`).
NOT_ENGINE_ARGS = {"kind", "model", "extra", "task", "pooling", "lora_adapters", "max_loras", "max_lora_rank",
                   "kv_cache_sized_for"}


def engine_kwargs(cfg: VllmConfig, model_path: str, *, on_gpu: bool, resolve_auto: bool = True) -> dict[str, Any]:
    """The `vllm.LLM` arguments for this config: its fields (named as vLLM's `EngineArgs`,
    unset ones left to vLLM), the model path, the tokenizer defaulting to it, stats on,
    `cfg.extra`, LoRA on (`enable_lora`, `max_loras`, `max_lora_rank`) when the job declares
    adapters, the device's defaults for `gpu_memory_utilization` and `enforce_eager`
    (VllmConfig), and on CPU the measured dtype for `auto` (`cpu.cpu_dtype`, measured with
    these arguments; `resolve_auto=False` leaves `auto`)."""
    kw: dict[str, Any] = {"model": model_path, "tokenizer": model_path}
    kw.update(cfg.model_dump(exclude=NOT_ENGINE_ARGS, exclude_none=True))
    if cfg.lora_adapters:  # vLLM's LoRA keys, only for a job that declares adapters
        # on CPU one slot more: the zero adapter the rows without one run with (VllmSession.no_adapter)
        kw.update(enable_lora=True, max_loras=cfg.max_loras + (0 if on_gpu else 1), max_lora_rank=cfg.max_lora_rank)
    kw["disable_log_stats"] = False  # per-request metrics (TTFT, queue time) need stats on
    kw["gpu_memory_utilization"] = cfg.memory_share(on_gpu=on_gpu)
    kw.setdefault("enforce_eager", not on_gpu)
    kw.update(cfg.extra)
    if resolve_auto and not on_gpu and kw.get("dtype", "auto") == "auto":
        kw["dtype"] = cpu_dtype(model_path, kw)
    return kw


def embed_kwargs(cfg: VllmConfig) -> dict[str, Any]:
    """For `task: embed`, the pooling runner on the same causal-LM folder (vLLM converts it to
    an embedding model) with the job's pooling and normalized vectors; else nothing."""
    pooling = cfg.embedding_pooling()
    if pooling is None:
        return {}
    return {"runner": "pooling", "convert": "embed", "pooler_config": {"pooling_type": pooling.upper()}}


def _single_process_env(kwargs: dict[str, Any]) -> dict[str, str] | None:
    """On CPU, the engine core process runs the model itself (one process fewer to
    start, each re-importing torch and vLLM) unless the job chose an executor, the
    engine core runs inside this process, or the cores are not an explicit list: the
    OpenMP environment to start it with, or None for vLLM's own executor."""
    if "distributed_executor_backend" in kwargs or os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "1") != "1":
        return None
    return single_process_omp_env()


def _owned_executor(kwargs: dict[str, Any], omp_env: dict[str, str] | None, *, on_gpu: bool):
    """The executor class for an engine core that exits with its owner
    (`executors.exit_with_owner`), or None to leave the choice to the job or vLLM: on
    CPU, with the engine core a process of its own and no executor chosen by the job,
    vLLM's `UniProcExecutor` when the core runs the model itself (`omp_env`), else its
    `MultiprocExecutor` (what vLLM-CPU picks there).  On GPU what vLLM picks on one
    host: `UniProcExecutor` for an engine on one device, `MultiprocExecutor` for
    tensor or pipeline parallel (a job that names an executor, Ray, keeps it).
    Imports vLLM."""
    if "distributed_executor_backend" in kwargs or os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "1") != "1":
        return None
    from tokenmill.transforms.engines.executors import OwnedMultiprocExecutor, OwnedUniProcExecutor

    if on_gpu:
        world = int(kwargs.get("tensor_parallel_size") or 1) * int(kwargs.get("pipeline_parallel_size") or 1)
        return OwnedUniProcExecutor if world == 1 else OwnedMultiprocExecutor
    return OwnedUniProcExecutor if omp_env else OwnedMultiprocExecutor


def auto_dtype_measurement(cfg: VllmConfig, model_path: str, *, on_measure=None) -> dict[str, Any] | None:
    """With `dtype: auto` on a CPU, the measurement the engine's dtype will come from (made now
    when this CPU and model have none yet: `cpu.cpu_dtype_measurement`); None for a given
    dtype or a GPU (where `auto` stays vLLM's own choice)."""
    if has_nvidia_gpu():
        return None
    return _measured_auto(model_path, engine_kwargs(cfg, model_path, on_gpu=False, resolve_auto=False),
                          on_measure=on_measure)


def _measured_auto(model_path: str, kwargs: dict[str, Any], *, on_measure=None) -> dict[str, Any] | None:
    """On a CPU, the dtype measurement for these engine arguments when they leave `dtype` to `auto`."""
    if kwargs.get("dtype", "auto") != "auto":
        return None
    return cpu_dtype_measurement(model_path, kwargs, on_measure=on_measure)


def dtype_auto_summary(m: dict[str, Any] | None) -> dict[str, Any] | None:
    """What a job records of the measurement behind `dtype: auto` (None when the dtype was given)."""
    if not m:
        return None
    return {"choice": m["choice"], "reason": m["reason"], "output_tok_per_s": m["output_tok_per_s"],
            "ratio": m["ratio"], "agreement_with_float32": m["quality"]["agreement_with_float32"],
            "measured_at": m.get("measured_at"), "cpu": (m.get("key") or {}).get("cpu"),
            "from_cache": bool(m.get("cached"))}


# ---------------------------------------------------------------- vLLM session


class VllmSession:
    """`vllm.LLM` driven request by request through its LLMEngine, so the Generate
    step can hand the engine the next batch while the current one's tail decodes."""

    def __init__(self, cfg: VllmConfig, model_path: str, *, job_tokens: kv.JobTokens | None = None,
                 workers: int = 1):
        """`job_tokens`: the work this engine is started for, which sizes its KV cache
        on CPU (`cpu.cpu_kv_cache`); `workers`: CPU engines sharing this host."""
        self.cfg = cfg
        self.model_path = model_path
        on_gpu = has_nvidia_gpu()
        check_engine_config(cfg, on_gpu=on_gpu)
        if not on_gpu:
            apply_cpu_env()
        else:
            # the engine core and its workers start by spawn: forking a process that holds
            # threads (Beam's bundle threads, the meter) and maybe a CUDA context is unsafe
            os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
        import psutil

        t = time.perf_counter()  # load time counts importing vLLM (seconds on a cold worker)
        from vllm import LLM

        self.kwargs = engine_kwargs(cfg, model_path, on_gpu=on_gpu, resolve_auto=False)
        #: on CPU with `dtype: auto`, the measurement that chose the dtype (cpu.cpu_dtype_measurement)
        self.dtype_auto = None if on_gpu else _measured_auto(model_path, self.kwargs)
        if self.dtype_auto:
            self.kwargs["dtype"] = self.dtype_auto["choice"]
        self.kwargs.update(embed_kwargs(cfg))  # after the dtype: `auto` is measured generating
        self.embed = cfg.task == "embed"
        self._added: dict[str, float] = {}
        """request id → when it was added, for an embedding request (its output has no timings)"""
        self.kv_sizing: dict[str, Any] = {"source": "vllm"}
        omp_env: dict[str, str] | None = None
        if not on_gpu:
            kv_bytes, self.kv_sizing = cpu_kv_cache(cfg, model_path, self.kwargs["dtype"], job_tokens=job_tokens,
                                                    workers=workers)
            if kv_bytes is not None:
                self.kwargs["kv_cache_memory_bytes"] = kv_bytes
            omp_env = _single_process_env(self.kwargs)
        executor = _owned_executor(self.kwargs, omp_env, on_gpu=on_gpu)
        #: "uni": the engine core process runs the model itself; "mp": in a worker process of its own;
        #: else the job's or vLLM's choice
        self.executor = executor.kind if executor else str(self.kwargs.get("distributed_executor_backend", "default"))
        me = psutil.Process()
        before = {c.pid for c in me.children(recursive=True)}
        try:
            with contextlib.ExitStack() as stack:
                start: dict[str, Any] = {}
                if omp_env:
                    from vllm.utils.system_utils import set_env_var

                    for k, v in omp_env.items():  # the engine core process starts with them
                        stack.enter_context(set_env_var(k, v))
                if executor:
                    # a class, not "uni": vLLM-CPU turns "uni" into "mp" when the engine core is a process
                    start["distributed_executor_backend"] = executor
                self.llm = LLM(**self.kwargs, **start)
        except Exception as err:
            raise EngineStartError(f"vLLM engine failed to start: {first_line(err)}") from err
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
        self._logprobs: dict[str, int | None] = {}
        """request id → the alternatives per token it asked for (None: no log-probabilities)"""
        self.progress: dict[str, tuple[str, int]] = {}
        """streamed request id → (its text so far, its output tokens so far), as of the last step"""
        #: adapter name → its `LoRARequest`; what a request naming none runs with (engines/lora.py)
        self.loras, self.no_adapter, self._zero_dir = lora.vllm_requests(cfg, on_gpu=on_gpu)

    def add(self, request_id: str, token_ids: Sequence[int], sampling: dict[str, Any], *, source: Any = None,
            adapter: str | None = None, images: Sequence[bytes] = (), priority: int = 0, stream: bool = False) -> None:
        """`source` (a prompt's text) is not used: vLLM is sent the token ids; `adapter`: the
        row's LoRA adapter (its `LoRARequest`); `images`: the row's images, decoded into vLLM's
        `multi_modal_data` (its processor puts each image's tokens where its placeholder is);
        `priority`: lower runs first (`scheduling_policy: priority` only); `stream`: its text
        so far is kept in `progress` after each step (transforms/engines/shared_session.py)."""
        from vllm.inputs import TokensPrompt

        if adapter is not None and adapter not in self.loras:
            raise ValueError(f"adapter {adapter!r} is not declared in engine.lora_adapters")
        adapter_request = self.no_adapter if adapter is None else self.loras[adapter]
        prompt = TokensPrompt(prompt_token_ids=list(token_ids))
        if images:  # file bytes that Validate decoded and checked (transforms/images.py)
            from PIL import Image

            prompt["multi_modal_data"] = {"image": [Image.open(io.BytesIO(b)).convert("RGB") for b in images]}
        if self.embed:
            from vllm import PoolingParams

            self.engine.add_request(request_id, prompt, PoolingParams(task="embed"))
            self._added[request_id] = time.time()
            return
        params = sampling_params(sampling, stream=stream)
        self.engine.add_request(request_id, prompt, params, lora_request=adapter_request,
                                **({"priority": priority} if priority else {}))
        self._logprobs[request_id] = params.logprobs
        if stream:
            self.progress[request_id] = ("", 0)

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
                if o.request_id in self.progress:  # a streamed request: its text so far
                    self.progress[o.request_id] = (o.outputs[0].text, len(o.outputs[0].token_ids))
                continue
            if self.embed:
                done.append(self._embedded(o, now))
                continue
            self.progress.pop(o.request_id, None)
            done.append(finished_of(o, now, self._logprobs.pop(o.request_id, None)))
        return done

    def _embedded(self, o: Any, now: float) -> Finished:
        """A finished pooling request: its vector, its prompt tokens, its time since added."""
        added = self._added.pop(o.request_id, None)
        return Finished(
            request_id=o.request_id, text=None, finish_reason=None, prompt_tokens=len(o.prompt_token_ids or []),
            output_tokens=0, cached_tokens=int(o.num_cached_tokens or 0), e2e_s=None if added is None else now - added,
            finished_at=now, embedding=R.embedding_bytes(o.outputs.data.float().cpu().numpy()),
        )

    def num_unfinished(self) -> int:
        return self.engine.get_num_unfinished_requests()

    def abort(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self._logprobs.pop(rid, None)
            self._added.pop(rid, None)
            self.progress.pop(rid, None)
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
        """Prefix-cache queries and hits and preemptions so far (summed over labelled series)."""
        out: dict[str, float] = {}
        try:
            for m in self.llm.get_metrics():
                if m.name in ("vllm:prefix_cache_queries", "vllm:prefix_cache_hits", "vllm:num_preemptions"):
                    key = m.name.split(":", 1)[1]
                    out[key] = out.get(key, 0) + float(getattr(m, "value", 0))  # labelled series sum
        except Exception:
            pass
        return out

    def info(self) -> dict[str, Any]:
        vc = self.engine.vllm_config
        cc = vc.cache_config
        mc = vc.model_config
        hf = mc.hf_text_config
        kv_dtype = str(cc.cache_dtype)
        try:
            shape = kv.attention_shape({k: getattr(hf, k) for k in kv.SHAPE_KEYS if getattr(hf, k, None) is not None})
            elem = kv.elem_bytes(str(mc.dtype) if kv_dtype == "auto" else ("fp8" if kv_dtype.startswith("fp8") else kv_dtype))
            per_token = kv.bytes_per_token(shape, elem)
        except kv.KvError:
            per_token = 0
        blocks = cc.num_gpu_blocks or 0
        weights = sum(f.stat().st_size for f in Path(self.model_path).glob("*.safetensors"))
        return {
            "device": self.device,
            "dtype": str(mc.dtype).replace("torch.", ""),
            "quantization": mc.quantization,
            "kv_cache_dtype": kv_dtype,
            "block_size": cc.block_size,
            "kv_cache_blocks": blocks,
            "kv_cache_tokens": blocks * cc.block_size,
            "kv_bytes_per_token": per_token,
            "kv_cache_bytes": blocks * cc.block_size * per_token,
            "weights_file_bytes": weights,
            "weights_path": self.model_path,
            "max_model_len": mc.max_model_len,
            "max_num_seqs": self.max_num_seqs,
            "max_num_batched_tokens": vc.scheduler_config.max_num_batched_tokens,
            "load_s": self.load_s,
            "kv_sizing": self.kv_sizing,
            "executor": self.executor,
            "dtype_auto": dtype_auto_summary(self.dtype_auto),
            "task": self.cfg.task, "pooling": self.cfg.embedding_pooling(),
            "lora_adapters": sorted(self.loras) or None,
            "embedding_dim": mc.get_hidden_size() if self.embed else None,
            "engine_kwargs": {k: v for k, v in self.kwargs.items() if k not in ("model", "tokenizer")},
        }

    def shutdown(self) -> None:
        """Stop the engine now.  Every result is committed by the time this runs, so
        nothing is lost by not waiting: vLLM's default graceful stop waited ~5 s per
        worker here for an engine core with nothing left to do (and Beam stops its
        workers one after another), and an engine core given 1 s to stop used all of
        it tearing down torch.  vLLM's own shutdown with no grace period (SIGTERM,
        then SIGKILL at once; it cleans up this side's sockets), then a kill for any
        engine process still there."""
        import psutil

        self._closing = True
        try:
            self.engine.engine_core.shutdown(timeout=0)
        except Exception:
            pass
        lora.remove_zero_adapter(getattr(self, "_zero_dir", None))
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

