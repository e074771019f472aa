"""The engine session a worker process uses: Generate's one entry point into the engines."""

from __future__ import annotations

import logging

from tokenmill.schemas.config import EngineConfig
from tokenmill.transforms.engines import registry
from tokenmill.transforms.engines.cpu import claim_cpu_slot
from tokenmill.transforms.engines.device import has_nvidia_gpu
from tokenmill.transforms.engines.kv import JobTokens
from tokenmill.transforms.engines.protocol import EngineSession

log = logging.getLogger(__name__)

#: group → whether this process claimed a CPU share for it (False: it runs on a GPU)
_SHARED_CPU: dict[str, bool] = {}
#: group → the cores this process claimed for its llama-server
_CORES: dict[str, list[int]] = {}
#: (model path, group) → the work the last engine for it was started for
_JOB_TOKENS: dict[tuple[str, str], JobTokens] = {}


def worker_session(cfg: EngineConfig, model_path: str, factory: registry.SessionFactory | None = None, *,
                   workers: int = 1, group: str = "", restart: bool = False,
                   job_tokens: JobTokens | None = None) -> EngineSession:
    """The session this worker process uses for `cfg` (see `registry.get_session`).

    When `workers` engines of the default factory share a CPU host, the first call for
    `group` (a job run) claims this process's CPU slot (its own cores) before any engine
    starts, and the engine gets its share of the KV cache memory.  `job_tokens`: the
    work an engine started now is for; on CPU it sizes the KV cache (`cpu.cpu_kv_cache`).
    A running session is reused whatever the work (vLLM queues what its cache cannot
    hold yet); an engine started without `job_tokens` (a restart) is sized for the
    last work named for `group`.  Other factories (test fakes) get the config alone and
    claim nothing, and so do GPU workers.  The `llamacpp` engine claims the same CPU slot
    and binds its server to it; the `openai` engine claims none.  `restart`: replace the
    current session."""
    start: dict[str, object] = {}
    if factory is None and cfg.kind == "openai":  # an HTTP server: no cores, no KV cache here
        from tokenmill.transforms.engines.openai_session import OpenAISession

        factory = OpenAISession
    elif factory is None and cfg.kind == "llamacpp":  # a llama-server bound to this worker's cores
        from tokenmill.transforms.engines.llamacpp_session import LlamaCppSession

        factory = LlamaCppSession
        if workers > 1:
            if group not in _CORES:
                slot, _CORES[group] = claim_cpu_slot(workers, group)
                log.info("CPU slot %d of %d for llama-server group %s, cores %s", slot, workers, group, _CORES[group])
            start["cores"] = _CORES[group]
    elif factory is None:
        if workers > 1:
            if group not in _SHARED_CPU:
                _SHARED_CPU[group] = not has_nvidia_gpu()
                if _SHARED_CPU[group]:
                    slot, cores = claim_cpu_slot(workers, group)
                    log.info("CPU slot %d of %d for engine group %s, cores %s", slot, workers, group, cores)
            if _SHARED_CPU[group]:
                start["workers"] = workers
        if job_tokens is not None:
            _JOB_TOKENS[(model_path, group)] = job_tokens
        if (model_path, group) in _JOB_TOKENS:
            start["job_tokens"] = _JOB_TOKENS[(model_path, group)]
    if restart:
        registry.drop_session(cfg, model_path, factory)
    return registry.get_session(cfg, model_path, factory, **start)
