"""The values of a job's row that come from its spec, built once for `submit` and `run`."""

from __future__ import annotations

import platform
from typing import Any

from tokenmill.schemas.config import DEFAULT_ENGINE_KIND, JobSpec
from tokenmill.schemas.secrets import mask_url
from tokenmill.transforms.engines.kinds import engine_of


def stored_spec(spec: JobSpec) -> dict[str, Any]:
    """The spec as stored on the job row: the job id fixed, credentials in the db URL masked."""
    d = spec.model_dump(mode="json")
    d["job_id"] = spec.derived_job_id()
    if d.get("db"):
        d["db"] = mask_url(d["db"])
    return d


def job_values(spec: JobSpec) -> dict[str, Any]:
    """The job row's columns a spec defines (name, stored spec, model and engine); the
    caller adds its own (`status` and `submitted_at` on submit; versions, hardware and
    the row count on run)."""
    job_id = spec.derived_job_id()
    engine = spec.engine.model_dump(mode="json")  # its engine's keys: quantization and KV dtype where it has them
    return {
        "name": spec.name or job_id,
        "spec": stored_spec(spec),
        "model": spec.engine.model,
        "quantization": engine.get("quantization"),
        "kv_cache_dtype": engine.get("kv_cache_dtype"),
        "engine_config": engine,
        "runner": spec.runner.runner,
    }


def versions(kind: str = DEFAULT_ENGINE_KIND) -> dict[str, str]:
    """What ran: Python, tokenmill and the libraries every job uses, and the engine's own (`EngineKind.versions`)."""
    from importlib import metadata

    out = {"python": platform.python_version()}
    for pkg in ("tokenmill", "apache-beam", "transformers", "sqlalchemy", "pyarrow"):
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            pass
    return {**out, **engine_of(kind).versions()}


def hardware() -> dict[str, Any]:
    from tokenmill.jobs.metrics.hardware import describe

    return describe()
