"""The engine session a worker process uses: Generate's one entry point into the engines."""

from __future__ import annotations

from tokenmill.schemas.config import EngineConfig
from tokenmill.transforms.engines import leases, registry
from tokenmill.transforms.engines.kinds import engine_of
from tokenmill.transforms.engines.kv import JobTokens
from tokenmill.transforms.engines.protocol import EngineSession


def worker_session(cfg: EngineConfig, model_path: str, factory: registry.SessionFactory | None = None, *,
                   workers: int = 1, group: str = "", restart: bool = False,
                   job_tokens: JobTokens | None = None) -> EngineSession:
    """The session this worker process uses for `cfg` (see `registry.get_session`).

    Without `factory`, the engine `cfg.kind` names makes it, on this process's own devices
    (`lease_devices`), with the start keywords its start policy gives
    (`EngineKind.start_kwargs`: `workers` engines of this job share the host, `group` is
    the job run, `job_tokens` the work an engine started now is for).  A running session
    is reused, unless a new job run (another `group`) brings work that has outgrown it
    (`EngineKind.outgrown`: a CPU engine's KV cache sized for a smaller job), then it is
    started again for that work; within one run it is reused whatever the work.  A given `factory` (a test double) gets the config alone and claims nothing.
    `restart`: replace the current session."""
    start: dict[str, object] = {}
    if factory is None:
        engine = engine_of(cfg.kind)
        lease_devices(engine.devices_per_engine(cfg), job=group)
        factory = engine.session_factory()
        start = engine.start_kwargs(cfg, model_path, workers=workers, group=group, job_tokens=job_tokens)
        held = registry.started_with(cfg, model_path, factory)
        if held is not None and held[0] != group and engine.outgrown(cfg, held[1], job_tokens):
            restart = True
    if restart:
        registry.drop_session(cfg, model_path, factory)
    return registry.get_session(cfg, model_path, factory, for_work=group, **start)


def lease_devices(n: int, *, job: str = "") -> leases.Lease | None:
    """This process's `n` devices for its engine (engines/leases.py: leased once, kept for the
    process's life, `CUDA_VISIBLE_DEVICES` set to them), before the engine is made; None
    when the engine needs none or the host shows no GPU.  A worker that now needs a group
    of another size (a Dask worker's next job) stops its engines first, so no other process
    leases a device an engine of this one still holds."""
    held = leases.held()
    if n > 0 and held is not None and len(held.devices) != n:
        registry.shutdown_all()
    return leases.process_lease(n, job=job)
