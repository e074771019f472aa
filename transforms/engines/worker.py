"""The engine session a worker process uses: Generate's one entry point into the engines."""

from __future__ import annotations

import logging

from tokenmill.schemas.config import EngineConfig
from tokenmill.transforms.engines import registry
from tokenmill.transforms.engines.cpu import claim_cpu_slot, worker_engine_config
from tokenmill.transforms.engines.device import has_nvidia_gpu
from tokenmill.transforms.engines.protocol import EngineSession

log = logging.getLogger(__name__)

#: group → whether this process claimed a CPU share for it (False: it runs on a GPU)
_SHARED_CPU: dict[str, bool] = {}


def worker_session(cfg: EngineConfig, model_path: str, factory: registry.SessionFactory | None = None, *,
                   workers: int = 1, group: str = "", restart: bool = False) -> EngineSession:
    """The session this worker process uses for `cfg` (see `registry.get_session`).

    When `workers` engines of the default factory share a CPU host, the first call for
    `group` (a job run) claims this process's CPU slot (its own cores) before any engine
    starts, and the engine gets its share of the KV cache memory.  Other factories (test
    fakes) and GPU workers claim nothing.  `restart`: replace the current session."""
    if workers > 1 and factory is None:
        if group not in _SHARED_CPU:
            _SHARED_CPU[group] = not has_nvidia_gpu()
            if _SHARED_CPU[group]:
                slot, cores = claim_cpu_slot(workers, group)
                log.info("CPU slot %d of %d for engine group %s, cores %s", slot, workers, group, cores)
        if _SHARED_CPU[group]:
            cfg = worker_engine_config(cfg, workers)
    if restart:
        registry.drop_session(cfg, model_path, factory)
    return registry.get_session(cfg, model_path, factory)
