"""The search space: the space YAML (`tune_space.yaml` beside this module is the default),
the candidates it makes from the spec as given, and the quantized checkpoints it tries."""

from __future__ import annotations

import copy
import hashlib
import itertools
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import yaml

from tokenmill.jobs.modeltools.quantize import QuantizeError, QuantizeFailed, quantize
from tokenmill.jobs.modeltools.schemes import CalibrationSet
from tokenmill.jobs.modeltools.tune.common import REFERENCE, TuneError
from tokenmill.jobs.modeltools.tune.sample import sample_digest
from tokenmill.schemas.config import SpecError, load_spec
from tokenmill.schemas.models import QUANT_RECORD, is_model_folder, models_dir, resolve_model

#: The search space used without --space (shipped with the package).
DEFAULT_SPACE = Path(__file__).with_name("tune_space.yaml")


@dataclass
class Candidate:
    """The spec as given with `changes` (key path → value) applied."""

    key: str
    """`ref` for the reference; else 6 hex digits of the changes (stable across reruns)."""
    changes: dict[str, Any]
    label: str
    spec_data: dict[str, Any]
    rejected: str | None = None
    """Why the candidate never ran (an invalid key, a preflight refusal); None if it may run."""


def load_space(path: str | Path | None) -> dict[str, Any]:
    """The search space YAML (`grid`, `candidates`, `quantized`, `keep_slow_dtypes`); TuneError in one line otherwise."""
    path = Path(path) if path else DEFAULT_SPACE
    try:
        data = yaml.safe_load(path.read_text())
    except OSError as err:
        raise TuneError(f"cannot read search space {str(path)!r}: {err.strerror}") from None
    except yaml.YAMLError as err:
        raise TuneError(f"search space {str(path)!r} is not valid YAML: {str(err).splitlines()[0]}") from None
    data = data or {}
    if not isinstance(data, dict):
        raise TuneError(f"search space {str(path)!r} must be a mapping with grid, candidates, quantized")
    unknown = set(data) - {"grid", "candidates", "quantized", "quantize", "keep_slow_dtypes"}
    if unknown:
        raise TuneError(f"search space {str(path)!r}: unknown key(s) {', '.join(sorted(unknown))} "
                        "(expected grid, candidates, quantized, quantize, keep_slow_dtypes)")
    make = data.get("quantize") or []
    if not isinstance(make, list) or any(not isinstance(q, dict) or not isinstance(q.get("scheme"), str)
                                         or set(q) - {"scheme", "method", "group_size"} for q in make):
        raise TuneError(f"search space {str(path)!r}: quantize must be a list of mappings with scheme "
                        "(and optionally method, group_size)")
    grid = data.get("grid") or {}
    if not isinstance(grid, dict) or any(not isinstance(v, list) or not v for v in grid.values()):
        raise TuneError(f"search space {str(path)!r}: grid must map key paths to non-empty lists of values")
    cands = data.get("candidates") or []
    if not isinstance(cands, list) or any(not isinstance(c, dict) or not c for c in cands):
        raise TuneError(f"search space {str(path)!r}: candidates must be a list of mappings of key paths to values")
    return {"grid": grid, "candidates": cands, "quantized": bool(data.get("quantized")), "quantize": make,
            "keep_slow_dtypes": bool(data.get("keep_slow_dtypes"))}


def make_checkpoints(wanted: list[dict[str, Any]], model: str, sample_path: Path, calibration: str,
                     echo: Callable[[str], None]) -> tuple[list[str], list[str]]:
    """The space's `quantize` entries made from the job's model by `tokenmill quantize`,
    calibrated (where the method calibrates) on `calibration`, the job's own input (quantize
    draws its samples from it, as `tokenmill quantize --calibration` does), into the models
    folder; a checkpoint made earlier from the same model and recipe for the same sampled
    rows is reused.  (model folders, notes: what was made or why not)."""
    src = resolve_model(model)
    digest = sample_digest(sample_path)[:8]
    made, notes = [], []
    for q in wanted:
        method = q.get("method") or "rtn"
        calibrated = method != "rtn"
        name = f"{src.name}-{q['scheme']}-{method.replace('+', '-')}" + (f"-g{q['group_size']}" if q.get("group_size") else "")
        folder = models_dir() / (f"{name}-tune{digest}" if calibrated else name)
        if (folder / QUANT_RECORD).is_file():
            made.append(str(folder))
            continue
        t0 = time.time()
        try:
            quantize(str(src), q["scheme"], folder, method=method, group_size=q.get("group_size"),
                     calibration=CalibrationSet(calibration) if calibrated else None)
        except (QuantizeError, QuantizeFailed) as err:
            notes.append(f"quantize {q['scheme']} {method}: not made: {err}")
            echo(f"quantize {q['scheme']} {method}: not made: {err}")
            continue
        notes.append(f"made {folder.name} ({q['scheme']}, {method}" + (f", calibrated on {calibration}"
                     if calibrated else "") + f") in {time.time() - t0:.0f} s, outside the budget")
        echo(notes[-1])
        made.append(str(folder))
    return made, notes


def quantized_checkpoints(model_path: str | None) -> list[str]:
    """Model folders in the models folder that `tokenmill quantize` made from `model_path`."""
    if not model_path:
        return []
    out = []
    for d in sorted(models_dir().glob("*")):
        marker = d / "TOKENMILL_QUANTIZED.json"
        if is_model_folder(d) and marker.is_file():
            try:
                src = json.loads(marker.read_text()).get("source")
            except (OSError, ValueError):
                continue
            if src and Path(src).resolve() == Path(model_path).resolve():
                out.append(str(d))
    return out


def space_changes(space: dict[str, Any], model_path: str | None = None) -> list[dict[str, Any]]:
    """The candidates' changes, in the space's order: the grid's combinations, then the
    listed candidates, then one per quantized checkpoint of the job's model."""
    grid = space.get("grid") or {}
    out = [dict(zip(grid, combo)) for combo in itertools.product(*grid.values())] if grid else []
    out += [dict(c) for c in space.get("candidates") or []]
    if space.get("quantized"):
        out += [{"engine.model": p} for p in quantized_checkpoints(model_path)]
    return out


def set_path(data: dict[str, Any], path: str, value: Any) -> None:
    """`data["engine"]["dtype"] = value` for "engine.dtype" (mappings made on the way)."""
    keys = path.split(".")
    cur = data
    for k in keys[:-1]:
        nxt = cur.get(k)
        if not isinstance(nxt, dict):
            nxt = cur[k] = {}
        cur = nxt
    cur[keys[-1]] = value


def describe_changes(changes: dict[str, Any]) -> str:
    def short(v):
        if isinstance(v, str) and "/" in v:
            return Path(v).name
        if isinstance(v, dict) and "method" in v:  # speculative_config: its method names it
            return str(v["method"])
        if isinstance(v, (dict, list)):
            text = json.dumps(v, sort_keys=True, separators=(",", ":"))
            return text if len(text) <= 40 else text[:37] + "..."
        return str(v)

    return " ".join(f"{p.split('.')[-1]}={short(v)}" for p, v in changes.items()) or "spec as given"


def work_key(spec) -> str:
    """What a spec's runs depend on (not where it reads, writes or what it is called)."""
    return json.dumps(spec.model_dump(mode="json", exclude={"job_id", "name", "input", "output", "db"}),
                      sort_keys=True)


def make_candidates(reference_data: dict[str, Any], changes_list: list[dict[str, Any]]) -> tuple[Candidate, list[Candidate]]:
    """(the reference, the candidates) from the spec as given and each candidate's changes.
    A change list that makes an invalid spec is a rejected candidate; one equal to the
    reference, or to an earlier candidate, is left out."""
    ref = Candidate(REFERENCE, {}, "spec as given", copy.deepcopy(reference_data))
    seen = {work_key(load_spec(ref.spec_data))}
    out: list[Candidate] = []
    for changes in changes_list:
        data = copy.deepcopy(reference_data)
        for p, v in changes.items():
            set_path(data, p, v)
        key = hashlib.sha256(json.dumps(changes, sort_keys=True, default=str).encode()).hexdigest()[:6]
        cand = Candidate(key, dict(changes), describe_changes(changes), data)
        try:
            work = work_key(load_spec(data, source=f"candidate {cand.label}"))
        except SpecError as err:
            cand.rejected = str(err)
            out.append(cand)
            continue
        if work in seen:
            continue
        seen.add(work)
        out.append(cand)
    return ref, out
