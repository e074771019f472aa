"""On a CPU, the dtypes a vLLM job's `dtype: auto` measured: candidates that then duplicate
another, or whose dtype ran far slower, are dropped before anything runs."""

from __future__ import annotations

import json
from typing import Any

from tokenmill.jobs.modeltools.tune.space import Candidate, work_key
from tokenmill.schemas.config import load_spec
from tokenmill.transforms.engines.cpu import cpu_dtype_measurement
from tokenmill.transforms.engines.device import has_nvidia_gpu
from tokenmill.transforms.engines.kinds import engine_of
from tokenmill.transforms.engines.vllm_session import engine_kwargs

#: On a CPU, a candidate whose dtype this machine measured at least this many times slower
#: at a decoder's matrix products than the dtype `auto` picks is dropped up front (its cost
#: could only be higher); a space with `keep_slow_dtypes: true` runs it anyway.
SLOW_DTYPE = 4.0


def screens_cpu_dtype(spec) -> bool:
    """Whether the job's engine resolves `dtype: auto` by measuring on this machine's CPU."""
    return engine_of(spec.engine.kind).measures_cpu_dtype and not has_nvidia_gpu()


def measure_cpu_dtypes(spec, model_path: str) -> dict[str, Any]:
    """The engine's `dtype: auto` measurement of the job's model on this CPU (cached per model and machine)."""
    return cpu_dtype_measurement(model_path, engine_kwargs(spec.engine, model_path, on_gpu=False, resolve_auto=False))


def screen_cpu_dtypes(reference_data: dict[str, Any], cands: list[Candidate], measurement: dict[str, Any], *,
                      keep_slow: bool = False) -> None:
    """For a vLLM job on a CPU: `dtype: auto` resolved as the engine resolves it
    (`measurement`: transforms/engines/cpu.cpu_dtype_measurement), a candidate that then is
    the spec as given, or an earlier candidate, is dropped as a duplicate; one whose dtype
    ran at least SLOW_DTYPE× slower than auto's in that measurement (the engine's output tok/s
    on the probe workload) is dropped with those figures (unless `keep_slow`)."""
    choice, rates = measurement["choice"], measurement.get("output_tok_per_s") or {}

    def resolved(data: dict[str, Any]) -> tuple[str, str]:
        work = json.loads(work_key(load_spec(data)))
        if work["engine"].get("dtype") == "auto":
            work["engine"]["dtype"] = choice
        return work["engine"]["dtype"], json.dumps(work, sort_keys=True)

    seen = {resolved(reference_data)[1]: "the spec as given"}
    for c in cands:
        if c.rejected:
            continue
        dtype, work = resolved(c.spec_data)
        if work in seen:
            c.rejected = f"the same as {seen[work]} on this machine (`dtype: auto` runs {choice} on this CPU, measured)"
            continue
        seen[work] = c.label
        r, best = rates.get(dtype), rates.get(choice)
        if not keep_slow and r and best and r * SLOW_DTYPE <= best:
            c.rejected = (f"{dtype} ran {r:.3g} output tok/s in the engine on this CPU against {choice}'s "
                          f"{best:.3g} (measured, cpu_dtype.json): {best / r:.0f}× slower, so costlier "
                          f"(keep_slow_dtypes: true runs it)")
