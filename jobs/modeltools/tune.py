"""`tokenmill tune`: the cheapest configuration that passes the quality gate, found on a
sample of the job's own prompts (docs/TUNE.md).

The spec as given is the reference.  Each candidate is that spec with some keys changed
(a search space YAML; `tune_space.yaml` is the default); candidates the preflight refuses
on this machine are dropped before anything runs.  The search is successive halving:
every candidate runs on a small sample, the cheaper half of those that pass the gate
runs on a sample twice as large, and so on up to `--sample` rows.  Every run is an
ordinary job in the database (`tune-<tune id>-<candidate>-n<rows>-r<repetition>`), so an
interrupted tune rerun with the same arguments reads the finished jobs back and runs
only the rest.

Each figure is measured `repeats` times (at least twice), interleaved (ref, A, B, ref,
A, B), and a difference is a win only when the ranges of the repetitions do not
overlap; otherwise it is a tie.
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from tokenmill.jobs.metrics.accounting import HEADLINE, get_path

#: The search space used without --space (shipped with the package).
DEFAULT_SPACE = Path(__file__).with_name("tune_space.yaml")
#: Without --gate: the compare gate's own measure (accuracy drop where the input has
#: references, else disagreement = 1 - word similarity), at most 3 points.
DEFAULT_GATE = "auto<=3%"
#: Runs per candidate and sample size; the spread of the runs is the noise a win must clear.
DEFAULT_REPEATS = 2
#: The smallest sample a rung runs on (a smaller one measures start-up, not serving).
MIN_RUNG_ROWS = 4
#: The figure candidates are ranked by: USD per 1M output tokens over generation.
COST = "cost.per_1m_output_tokens"
REFERENCE = "ref"
#: The bundled evaluation set (questions with reference answers, the repository's data/):
#: the default gate's accuracy where the job's own rows have no references.
EVAL_SET = Path(__file__).resolve().parents[2] / "data" / "eval_set.parquet"
#: Output tokens per eval-set answer (greedy), as `make bench-quant` asks them.
EVAL_MAX_TOKENS = 32
#: On a CPU, a candidate whose dtype this machine measured at least this many times slower
#: at a decoder's matrix products than the dtype `auto` picks is dropped up front (its cost
#: could only be higher); a space with `keep_slow_dtypes: true` runs it anyway.
SLOW_DTYPE = 4.0


class TuneError(ValueError):
    """A tune that cannot start or go on (bad space, gate or input; the reference failed); one line."""


class CandidateFailed(RuntimeError):
    """One candidate's run failed (the engine would not start, no output): the candidate is
    dropped with this reason and the tune goes on."""


# ---------------------------------------------------------------- the gate

#: gate metric → the comparison it reads and the direction of its limit
GATE_METRICS = {"auto": "<=", "accuracy_drop": "<=", "disagreement": "<=", "exact_match": ">=", "similarity": ">="}


@dataclass(frozen=True)
class Gate:
    """`METRIC<=LIMIT` or `METRIC>=LIMIT` over `compare`'s measures (jobs/modeltools/compare.py)."""

    metric: str
    op: str
    limit: float
    text: str

    def judge(self, c) -> tuple[bool, float, str]:
        """(passed, quality loss as a fraction, the measure used) of one compare.Comparison.
        The loss is what the plots show: the accuracy drop, or 1 - agreement."""
        if self.metric == "auto":
            return c.gate_value <= self.limit + 1e-12, c.gate_value, c.gate_metric
        if self.metric == "accuracy_drop":
            if c.accuracy_drop is None:
                raise TuneError("gate accuracy_drop needs reference answers: set reference_column in the job spec")
            return c.accuracy_drop <= self.limit + 1e-12, c.accuracy_drop, "accuracy_drop"
        if self.metric == "disagreement":
            v = 1.0 - c.word_similarity
            return v <= self.limit + 1e-12, v, "disagreement"
        v = c.exact_match_rate if self.metric == "exact_match" else c.word_similarity
        return v >= self.limit - 1e-12, 1.0 - v, self.metric


def parse_gate(text: str | None) -> Gate:
    """`auto<=3%`, `accuracy_drop<=0.03`, `disagreement<=5%`, `exact_match>=90%`, `similarity>=0.95`.
    A bare number is a fraction; `%` (or `points`) marks points."""
    text = (text or DEFAULT_GATE).strip()
    m = re.fullmatch(r"([a-z_]+)\s*(<=|>=)\s*(\d+(?:\.\d+)?)\s*(%|points?)?", text)
    if not m:
        raise TuneError(f"--gate must look like 'auto<=3%' or 'exact_match>=0.9' (metrics: {', '.join(GATE_METRICS)}), "
                        f"got {text!r}")
    metric, op, num, unit = m.groups()
    if metric not in GATE_METRICS:
        raise TuneError(f"--gate metric must be one of {', '.join(GATE_METRICS)}, got {metric!r}")
    if op != GATE_METRICS[metric]:
        raise TuneError(f"--gate {metric} is bounded with {GATE_METRICS[metric]}, got {text!r}")
    limit = float(num) / (100.0 if unit else 1.0)
    if not 0.0 <= limit <= 1.0:
        raise TuneError(f"--gate limit must be between 0 and 1 (or 0% and 100%), got {text!r}")
    return Gate(metric, op, limit, text)


# ---------------------------------------------------------------- the search space


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
    import yaml

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
    from tokenmill.jobs.modeltools.quantize import QuantizeError, QuantizeFailed, quantize
    from tokenmill.schemas.models import QUANT_RECORD, models_dir, resolve_model

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
                     **(dict(calibration=calibration) if calibrated else {}))
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
    from tokenmill.schemas.models import is_model_folder, models_dir

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
    import itertools

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


def _label(changes: dict[str, Any]) -> str:
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


def _work(spec) -> str:
    """What a spec's runs depend on (not where it reads, writes or what it is called)."""
    return json.dumps(spec.model_dump(mode="json", exclude={"job_id", "name", "input", "output", "db"}),
                      sort_keys=True)


def make_candidates(reference_data: dict[str, Any], changes_list: list[dict[str, Any]]) -> tuple[Candidate, list[Candidate]]:
    """(the reference, the candidates) from the spec as given and each candidate's changes.
    A change list that makes an invalid spec is a rejected candidate; one equal to the
    reference, or to an earlier candidate, is left out."""
    from tokenmill.schemas.config import SpecError, load_spec

    ref = Candidate(REFERENCE, {}, "spec as given", copy.deepcopy(reference_data))
    seen = {_work(load_spec(ref.spec_data))}
    out: list[Candidate] = []
    for changes in changes_list:
        data = copy.deepcopy(reference_data)
        for p, v in changes.items():
            set_path(data, p, v)
        key = hashlib.sha256(json.dumps(changes, sort_keys=True, default=str).encode()).hexdigest()[:6]
        cand = Candidate(key, dict(changes), _label(changes), data)
        try:
            work = _work(load_spec(data, source=f"candidate {cand.label}"))
        except SpecError as err:
            cand.rejected = str(err)
            out.append(cand)
            continue
        if work in seen:
            continue
        seen.add(work)
        out.append(cand)
    return ref, out


def screen_cpu_dtypes(reference_data: dict[str, Any], cands: list[Candidate], measurement: dict[str, Any], *,
                      keep_slow: bool = False) -> None:
    """For a vLLM job on a CPU: `dtype: auto` resolved as the engine resolves it
    (`measurement`: transforms/engines/cpu.cpu_dtype_measurement), a candidate that then is
    the spec as given, or an earlier candidate, is dropped as a duplicate; one whose dtype
    ran at least SLOW_DTYPE× slower than auto's in that measurement (the engine's output tok/s
    on the probe workload) is dropped with those figures (unless `keep_slow`)."""
    from tokenmill.schemas.config import load_spec

    choice, rates = measurement["choice"], measurement.get("output_tok_per_s") or {}

    def resolved(data: dict[str, Any]) -> tuple[str, str]:
        work = json.loads(_work(load_spec(data)))
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


# ---------------------------------------------------------------- the sample


def rung_sizes(n_candidates: int, sample: int) -> list[int]:
    """Sample sizes of the halving's rungs, doubling up to `sample`: as many rungs as
    halvings take the candidates down to one (one rung for one candidate)."""
    if sample < 1:
        raise TuneError(f"--sample must be at least 1 row, got {sample}")
    rungs = max(1, math.ceil(math.log2(max(n_candidates, 1))))
    floor = min(MIN_RUNG_ROWS, sample)
    sizes = [max(floor, math.ceil(sample / 2 ** (rungs - 1 - i))) for i in range(rungs)]
    return sorted(set(sizes))


def draw_sample(spec, n: int, seed: int, out_dir: Path) -> tuple[Path, int]:
    """Draw `n` of the job input's rows (without replacement, reproducibly from `seed`) and
    write them, in drawn order, to `out_dir/sample.parquet`; a rung of m rows reads the
    first m (so every smaller sample is part of every larger one).  Only the row groups
    that hold drawn rows are read.  Returns (the file, its rows)."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    from tokenmill.transforms.read import InputError, open_file, plan_input

    if spec.resolved_input_format() != "parquet":
        raise TuneError(f"tune samples Parquet input; {spec.input!r} is {spec.resolved_input_format()}")
    try:
        plan = plan_input(spec.input, "parquet")
    except InputError as err:
        raise TuneError(str(err)) from None
    if plan.total_rows == 0:
        raise TuneError(f"input {spec.input!r} has no rows to sample")
    n = min(n, plan.total_rows)
    picks = np.random.default_rng(seed).choice(plan.total_rows, size=n, replace=False)
    order = np.empty(n, dtype=np.int64)
    tables, positions, start = [], [], 0
    rank = {int(g): i for i, g in enumerate(picks)}  # global row → position in the drawn order
    for sh in plan.shards:
        local = [g - start for g in sorted(rank) if start <= g < start + sh.num_rows]
        if local:
            with open_file(sh.path) as fh:
                t = pq.ParquetFile(fh).read_row_group(sh.row_group)
            tables.append(t.take(pa.array(local)))
            positions += [rank[start + i] for i in local]
        start += sh.num_rows
    table = pa.concat_tables(tables, promote_options="default")
    order[np.asarray(positions)] = np.arange(len(positions))
    table = table.take(pa.array(order))
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "sample.parquet"
    tmp = path.with_suffix(".tmp")
    pq.write_table(table, tmp)
    tmp.replace(path)
    return path, n


def rung_file(sample_path: Path, size: int) -> Path:
    """The first `size` rows of the sample, as a Parquet file beside it (written anew, so
    it always matches the sample)."""
    import pyarrow.parquet as pq

    path = sample_path.with_name(f"sample-{size}.parquet")
    tmp = path.with_suffix(".tmp")
    pq.write_table(pq.read_table(sample_path).slice(0, size), tmp)
    tmp.replace(path)
    return path


def sample_digest(sample_path: Path) -> str:
    """A digest of the sampled rows' values: a tune of changed input rows is a new tune."""
    import pyarrow.parquet as pq

    rows = pq.read_table(sample_path).to_pylist()
    return hashlib.sha256(json.dumps(rows, sort_keys=True, default=str).encode()).hexdigest()


# ---------------------------------------------------------------- the search (no engine, no database)

#: (figure name, path in a job's metrics, label, better direction): the table's figures.
FIGURES: tuple[tuple[str, str, str, str], ...] = (
    ("cost", COST, "$/1M out", "lower"),
    ("output_tok_per_s", "throughput.output_tok_per_s", "out tok/s", "higher"),
    ("ttft_p95_s", "latency_s.ttft.p95", "TTFT p95", "lower"),
    ("tpot_p95_s", "latency_s.tpot.p95", "TPOT p95", "lower"),
    ("e2e_p95_s", "latency_s.e2e.p95", "E2E p95", "lower"),
    ("peak_rss_bytes", "memory.peak_worker_rss_bytes", "peak RSS", "lower"),
)


def figures_of(metrics: dict[str, Any]) -> dict[str, Any]:
    """The table's figures plus every headline figure of the report, from a job's metrics."""
    out = {name: get_path(metrics, path) for name, path, _, _ in FIGURES}
    out["headline"] = {path: get_path(metrics, path) for path, _, _ in HEADLINE}
    return out


def beats(a: list[float], b: list[float]) -> bool:
    """Whether figures `a` are lower than figures `b` beyond their noise: every repetition
    of `a` below every repetition of `b` (the two ranges do not overlap)."""
    return bool(a) and bool(b) and max(a) < min(b)


def tied(a: list[float], b: list[float]) -> bool:
    return not beats(a, b) and not beats(b, a)


def mean(xs: list[float]) -> float | None:
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


@dataclass
class Entry:
    """One candidate at one sample size: its repetitions' figures and the gate's verdict."""

    runs: list[dict[str, Any]] = field(default_factory=list)
    passed: bool | None = None
    loss: float | None = None
    gate_metric: str | None = None
    comparison: dict[str, Any] | None = None

    def values(self, name: str = "cost") -> list[float]:
        return [r[name] for r in self.runs if r.get(name) is not None]


def halve(entries: dict[str, Entry]) -> tuple[list[str], dict[str, str]]:
    """(kept, dropped → why) after one rung: the cheaper half (rounded up) of the candidates
    that pass the gate, by mean cost, plus every passing candidate tied with the last one
    kept (a difference inside the noise is no reason to drop it)."""
    passing = sorted((k for k, e in entries.items() if e.passed), key=lambda k: mean(entries[k].values()))
    dropped = {k: "failed the gate" for k, e in entries.items() if not e.passed}
    keep = passing[: math.ceil(len(passing) / 2)]
    if keep:
        last = entries[keep[-1]].values()
        keep += [k for k in passing[len(keep):] if tied(entries[k].values(), last)]
    for k in passing:
        if k not in keep:
            dropped[k] = "costlier half"
    return keep, dropped


@dataclass
class Verdict:
    """The search's outcome at the last sample size every remaining candidate finished."""

    size: int | None
    winner: str
    """A candidate key, or `ref` when none passing the gate is cheaper beyond the noise."""
    best: str | None
    """The cheapest passing candidate by mean cost (may be tied with the reference)."""
    tied_with_best: list[str]
    """Other passing candidates whose cost is tied with the best's."""
    beats_reference: bool


def pick(ref: Entry, entries: dict[str, Entry], size: int | None) -> Verdict:
    """The cheapest passing candidate wins only if it beats the reference beyond the noise;
    otherwise the spec as given stays (`winner` = `ref`)."""
    passing = sorted((k for k, e in entries.items() if e.passed and e.values()),
                     key=lambda k: mean(entries[k].values()))
    if not passing:
        return Verdict(size, REFERENCE, None, [], False)
    best = passing[0]
    ties = [k for k in passing[1:] if tied(entries[k].values(), entries[best].values())]
    wins = beats(entries[best].values(), ref.values())
    return Verdict(size, best if wins else REFERENCE, best, ties, wins)


@dataclass
class SearchLog:
    """Everything the search measured: `entries[key][size]`, and why each candidate stopped."""

    sizes: list[int]
    entries: dict[str, dict[int, Entry]] = field(default_factory=dict)
    outcome: dict[str, str] = field(default_factory=dict)
    dropped_at: dict[str, int] = field(default_factory=dict)
    stopped: str | None = None
    """Why the search stopped before its last rung (the budget), or None."""
    verdict: Verdict | None = None

    def entry(self, key: str, size: int) -> Entry:
        return self.entries.setdefault(key, {}).setdefault(size, Entry())

    def last_size(self, key: str) -> int | None:
        done = [s for s, e in self.entries.get(key, {}).items() if e.runs]
        return max(done) if done else None


def search(keys: list[str], sizes: list[int], *, repeats: int,
           measure: Callable[[str, int, int], dict[str, Any]],
           gate: Callable[[str, int], tuple[bool, float, str, dict[str, Any] | None]],
           rung_fits: Callable[[int, int], bool] = lambda size, jobs: True,
           job_fits: Callable[[], bool] = lambda: True) -> SearchLog:
    """Successive halving over `keys` (the reference, `ref`, runs at every rung).

    `measure(key, size, rep)`: one run's figures (`figures_of`), or CandidateFailed;
    `gate(key, size)`: (passed, loss, measure used, comparison) against the reference's run;
    `rung_fits(size, jobs)`: whether the budget left holds a rung of `jobs` runs of `size`
    rows; `job_fits()`: whether it holds one more run.  Runs are interleaved: every
    candidate's first repetition, then every candidate's second, and so on."""
    if repeats < 2:
        raise TuneError(f"every figure is measured at least twice (repeats >= 2), got {repeats}")
    log = SearchLog(sizes=sizes)
    alive = [k for k in keys if k != REFERENCE]
    complete: int | None = None
    for i, size in enumerate(sizes):
        if i > 0 and not rung_fits(size, repeats * (len(alive) + 1)):
            log.stopped = f"the budget left does not hold the {size}-row rung"
            break
        failed: dict[str, str] = {}
        for rep in range(repeats):
            for key in [REFERENCE, *alive]:
                if key in failed:
                    continue
                if not job_fits():
                    log.stopped = f"the budget ran out during the {size}-row rung"
                    break
                try:
                    log.entry(key, size).runs.append({**measure(key, size, rep), "rep": rep})
                except CandidateFailed as err:
                    if key == REFERENCE:
                        raise TuneError(f"the spec as given failed on the {size}-row sample: {err}") from None
                    failed[key] = str(err)
            if log.stopped:
                break
        if log.stopped:  # an unfinished rung decides nothing (its jobs stay in the database for a rerun)
            for by_size in log.entries.values():
                by_size.pop(size, None)
            break
        complete = size
        for key, why in failed.items():
            log.outcome[key], log.dropped_at[key] = f"failed: {why}", size
        alive = [k for k in alive if k not in failed]
        for key in alive:
            e = log.entry(key, size)
            e.passed, e.loss, e.gate_metric, e.comparison = gate(key, size)
        if i == len(sizes) - 1:
            break
        keep, dropped = halve({k: log.entry(k, size) for k in alive})
        for key, why in dropped.items():
            log.outcome[key], log.dropped_at[key] = why, size
        alive = keep
        if not alive:
            break
    if complete is None:
        log.verdict = Verdict(None, REFERENCE, None, [], False)
    else:
        at = {k: log.entry(k, complete) for k in alive}
        log.verdict = pick(log.entry(REFERENCE, complete), at, complete)
    ref_costs = log.entry(REFERENCE, complete).values() if complete else []
    for key in alive:
        if key == log.verdict.winner:
            log.outcome[key] = "winner"
        elif key == log.verdict.best:
            costs = log.entry(key, complete).values()
            log.outcome[key] = ("passed; costlier than the reference" if beats(ref_costs, costs)
                                else "passed; tied with the reference")
        elif key in log.verdict.tied_with_best:
            log.outcome[key] = "passed; tied with the best"
        else:
            e = log.entry(key, complete) if complete else None
            log.outcome[key] = ("failed the gate" if e is not None and e.passed is False
                                else "passed; costlier" if e is not None and e.passed else "not finished")
        if log.stopped and complete is not None and key not in log.dropped_at:
            log.outcome[key] += f" (stopped at {complete} rows: {log.stopped})"
    log.outcome[REFERENCE] = "winner" if log.verdict.winner == REFERENCE else "reference"
    return log


# ---------------------------------------------------------------- the budget


class Budget:
    """The tune's time, counted as the stored wall time of its jobs, so a resumed tune
    has the same budget left as the interrupted one had."""

    def __init__(self, seconds: float | None):
        self.seconds = seconds
        self.spent = 0.0
        self.runs: list[tuple[int, float, float]] = []  # (rows, job wall s, generation wall s)

    def add(self, rows: int, wall_s: float, gen_s: float) -> None:
        self.spent += wall_s
        self.runs.append((rows, wall_s, gen_s))

    def spend(self, wall_s: float) -> None:
        """Wall time of a job that is not one of the sample's runs (an eval-set job): spent,
        but not a run the estimate of a rung is made from."""
        self.spent += wall_s

    def job_fits(self) -> bool:
        return self.seconds is None or self.spent < self.seconds

    def estimate(self, rows: int) -> float:
        """One run of `rows` rows: the fixed part (start-up, load, export) as measured,
        plus generation scaled by rows."""
        if not self.runs:
            return 0.0
        fixed = mean([max(w - g, 0.0) for _, w, g in self.runs]) or 0.0
        per_row = mean([g / max(n, 1) for n, _, g in self.runs]) or 0.0
        return fixed + per_row * rows

    def rung_fits(self, rows: int, jobs: int) -> bool:
        return self.seconds is None or self.spent + self.estimate(rows) * jobs <= self.seconds


# ---------------------------------------------------------------- the tune: candidates as jobs in the database


@dataclass
class TuneResult:
    """What `tune` found and wrote (`files`: table, report, winning spec, JSON)."""

    tune_id: str
    gate: Gate
    reference: Candidate
    candidates: list[Candidate]
    log: SearchLog
    sample_rows: int
    repeats: int
    table: list[dict[str, Any]]
    recommendation: str
    winner_spec: dict[str, Any]
    files: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {
            "tune_id": self.tune_id, "gate": self.gate.text, "sample_rows": self.sample_rows,
            "repeats": self.repeats, "sizes": self.log.sizes, "stopped": self.log.stopped,
            "winner": self.log.verdict.winner if self.log.verdict else REFERENCE,
            "recommendation": self.recommendation, "table": self.table, "files": self.files, "notes": self.notes,
            "runs": {k: {str(s): e.runs for s, e in by.items()} for k, by in self.log.entries.items()},
            "comparisons": {k: {str(s): e.comparison for s, e in by.items() if e.comparison}
                            for k, by in self.log.entries.items()},
        }


def make_tune_id(reference_spec, *, sample: int, seed: int, gate: Gate, repeats: int,
                 candidates: list[Candidate], rows: str = "") -> str:
    """8 hex digits of what decides the tune's runs, `rows` (`sample_digest`) included;
    not the budget: a larger one goes on where a smaller one stopped."""
    payload = {"ref": json.loads(_work(reference_spec)), "input": reference_spec.input, "sample": sample,
               "rows": rows, "seed": seed, "gate": gate.text, "repeats": repeats,
               "candidates": [c.changes for c in candidates]}
    return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()[:8]


def _run_data(cand: Candidate, *, input: Path, output: Path, job_id: str, name: str) -> dict[str, Any]:
    data = copy.deepcopy(cand.spec_data)
    data.update(input=str(input), output=str(output), job_id=job_id, name=name)
    return data


def tune(spec_data: dict[str, Any], *, sample: int, out: str | Path, db_url: str | None = None,
         gate: str | None = None, budget_minutes: float | None = None, space: str | Path | None = None,
         repeats: int = DEFAULT_REPEATS, seed: int = 0, session_factory=None, eval_set: str | Path | None = None,
         echo: Callable[[str], None] = lambda line: None) -> TuneResult:
    """Search the configurations of `spec_data` (a job spec mapping, the reference) on
    `sample` of its input rows; write the table, the HTML report and the winning spec
    under `out`.  `session_factory`: the engine (tests pass a fake; default vLLM).
    `eval_set`: questions with a `reference` column for the default gate where the job's
    rows have no references (default: the bundled EVAL_SET)."""
    from tokenmill.jobs.lifecycle.preflight import preflight
    from tokenmill.jobs.lifecycle.runner import JobError, run_job
    from tokenmill.jobs.modeltools.compare import CompareError, compare_jobs
    from tokenmill.schemas import storage as S
    from tokenmill.schemas.config import SpecError, load_spec
    from tokenmill.schemas.db import default_db_url
    from tokenmill.schemas.errors import first_line
    from tokenmill.transforms.engines.device import has_nvidia_gpu

    try:
        spec = load_spec(spec_data)
    except SpecError as err:
        raise TuneError(str(err)) from None
    g = parse_gate(gate)
    if g.metric == "accuracy_drop" and not spec.reference_column:
        raise TuneError("gate accuracy_drop needs reference answers: set reference_column in the job spec")
    out = Path(out)
    db_url = db_url or spec.db or default_db_url()
    fake = session_factory is not None
    sp = load_space(space)
    sample_path, n = draw_sample(spec, sample, seed, out / "samples")
    notes = [] if n == sample else [f"the input has {n} rows: the sample is all of them"]
    evals = None  # the default gate without references in the job: accuracy on the eval set
    if g.metric == "auto" and not spec.reference_column:
        evals = Path(eval_set) if eval_set else EVAL_SET
        if not evals.is_file():
            if eval_set:
                raise TuneError(f"eval set {str(evals)!r} does not exist")
            notes.append(f"no eval set at {evals}: the gate is the disagreement with the reference's answers")
            evals = None

    def checked(data: dict[str, Any], size: int) -> list[str]:
        s = load_spec(_run_data(Candidate("", {}, "", data), input=rung_file(sample_path, size),
                                output=out / "jobs" / "preflight", job_id="preflight", name="preflight"))
        return preflight(s, fake_engine=fake).problems

    first = min(MIN_RUNG_ROWS, n)
    problems = checked(spec_data, first)
    if problems:
        raise TuneError(f"the spec as given does not pass preflight: {problems[0]}")
    from tokenmill.schemas.models import ModelNotFound, resolve_model

    try:
        model_path = str(resolve_model(spec.engine.model, need_weights=False))
    except ModelNotFound:
        model_path = None
    changes = space_changes(sp, model_path)
    if sp.get("quantize") and model_path:
        made, made_notes = make_checkpoints(sp["quantize"], spec.engine.model, sample_path, spec.input, echo)
        notes += made_notes
        changes += [{"engine.model": m} for m in made]
    ref, cands = make_candidates(spec_data, changes)
    if not fake and spec.engine.kind == "vllm" and not has_nvidia_gpu() and model_path:
        from tokenmill.transforms.engines.cpu import cpu_dtype_measurement
        from tokenmill.transforms.engines.vllm_session import engine_kwargs

        measured = cpu_dtype_measurement(model_path, engine_kwargs(spec.engine, model_path, on_gpu=False,
                                                                   resolve_auto=False))
        screen_cpu_dtypes(spec_data, cands, measured, keep_slow=bool(sp.get("keep_slow_dtypes")))
    for c in cands:
        if c.rejected is None:
            problems = checked(c.spec_data, first)
            if problems:
                c.rejected = "; ".join(problems)
        if c.rejected:
            echo(f"dropped up front: {c.label}: {c.rejected}")
    runnable = [c for c in cands if c.rejected is None]
    sizes = rung_sizes(len(runnable), n)
    tid = make_tune_id(spec, sample=n, seed=seed, gate=g, repeats=repeats, candidates=runnable,
                       rows=sample_digest(sample_path) + (sample_digest(evals) if evals else ""))
    rungs: dict[int, Path] = {}

    def rung(size: int) -> Path:
        if size not in rungs:
            rungs[size] = rung_file(sample_path, size)
        return rungs[size]

    by_key = {REFERENCE: ref, **{c.key: c for c in runnable}}
    eng = S.connect(db_url)
    budget = Budget(None if budget_minutes is None else budget_minutes * 60.0)
    echo(f"tune {tid}: {len(runnable)} candidates and the spec as given, samples of {sizes} rows, "
         f"{repeats} runs each, gate {g.text}" + (f" on the accuracy over {evals}" if evals else ""))

    def job_id(key: str, size: int, rep: int) -> str:
        return f"tune-{tid}-{key}-n{size}-r{rep}"

    def run_or_read(jid: str, data: dict[str, Any], charge: Callable[[float], None]) -> tuple[dict[str, Any], bool]:
        """(metrics, read back): a tune job that finished before is read back (a rerun resumes),
        else it runs now; CandidateFailed when it fails, its wall charged to the budget first."""
        job = S.get_job(eng, jid)
        if job and job["status"] in ("succeeded", "partial") and job.get("metrics"):
            return job["metrics"], True
        t0 = time.time()
        try:
            res = run_job(load_spec(data), db_url=db_url, session_factory=session_factory)
        except S.JobBusy as err:
            raise TuneError(str(err)) from None
        except (JobError, S.StorageError) as err:
            charge(time.time() - t0)
            raise CandidateFailed(first_line(err)) from None
        if res.status not in ("succeeded", "partial"):
            charge(res.wall_s)
            raise CandidateFailed(f"job {jid} ended {res.status}" + (f": {res.note}" if res.note else ""))
        return res.metrics, False

    def measure(key: str, size: int, rep: int) -> dict[str, Any]:
        jid, cand = job_id(key, size, rep), by_key[key]
        data = _run_data(cand, input=rung(size), output=out / "jobs" / jid, job_id=jid,
                         name=f"tune {tid}: {cand.label}, {size} rows, run {rep + 1}")
        metrics, reused = run_or_read(jid, data, lambda wall: budget.add(size, wall, 0.0))
        th = metrics.get("throughput") or {}
        budget.add(size, th.get("job_wall_s") or 0.0, th.get("generation_wall_s") or 0.0)
        figs = figures_of(metrics)
        echo(f"  {jid} {cand.label}: " + ("read back" if reused else "ran") +
             (f", ${figs['cost']:.4g}/1M out" if figs["cost"] is not None else ", no cost"))
        if figs["cost"] is None:
            raise CandidateFailed(f"job {jid} has no cost per 1M output tokens (no output tokens)")
        return {**figs, "job_id": jid, "reused": reused}

    evals_done: set[str] = set()

    def eval_job(key: str) -> str:
        """The candidate's answers to the eval set (greedy, one run, read back on a rerun), its
        wall in the budget's spending but not in its estimate of a sample's runs."""
        jid = f"tune-{tid}-{key}-eval"
        if jid in evals_done:
            return jid
        data = _run_data(by_key[key], input=evals, output=out / "jobs" / jid, job_id=jid,
                         name=f"tune {tid}: {by_key[key].label}, eval set")
        data["reference_column"] = "reference"
        data["sampling"] = {**(data.get("sampling") or {}), "temperature": 0.0, "max_tokens": EVAL_MAX_TOKENS}
        metrics, reused = run_or_read(jid, data, budget.spend)
        budget.spend((metrics.get("throughput") or {}).get("job_wall_s") or 0.0)
        evals_done.add(jid)
        echo(f"  {jid} {by_key[key].label}: eval set " + ("read back" if reused else "answered"))
        return jid

    def judge(key: str, size: int):
        try:
            c = compare_jobs(eng, job_id(REFERENCE, size, 0), job_id(key, size, 0), max_drop=g.limit, show=3)
        except CompareError as err:
            raise TuneError(str(err)) from None
        if evals is None:
            passed, loss, metric = g.judge(c)
            return passed, loss, metric, c.as_dict()
        try:
            ref_eval = eval_job(REFERENCE)
        except CandidateFailed as err:
            raise TuneError(f"the spec as given failed on the eval set: {err}") from None
        try:
            ce = compare_jobs(eng, ref_eval, eval_job(key), max_drop=g.limit, show=3)
        except CandidateFailed as err:
            return False, None, f"eval set run failed: {err}", {"sample": c.as_dict()}
        except CompareError as err:
            raise TuneError(str(err)) from None
        passed, loss, _ = g.judge(ce)
        return passed, loss, "eval_accuracy_drop", {"eval_set": ce.as_dict(), "sample": c.as_dict()}

    log = search([REFERENCE, *(c.key for c in runnable)], sizes, repeats=repeats, measure=measure, gate=judge,
                 rung_fits=budget.rung_fits, job_fits=budget.job_fits)
    if log.stopped:
        notes.append(f"stopped early: {log.stopped} (budget {budget_minutes:g} min, spent {budget.spent / 60:.1f} min)")
    table = build_table(ref, cands, log)
    winner = by_key[log.verdict.winner]
    winner_spec = copy.deepcopy(spec_data)
    for p, v in winner.changes.items():
        set_path(winner_spec, p, v)
    res = TuneResult(tune_id=tid, gate=g, reference=ref, candidates=cands, log=log, sample_rows=n, repeats=repeats,
                     table=table, recommendation="", winner_spec=winner_spec, notes=notes)
    res.recommendation = recommendation(res)
    write_outputs(res, out)
    return res


# ---------------------------------------------------------------- the table, the recommendation, the files


def build_table(ref: Candidate, cands: list[Candidate], log: SearchLog) -> list[dict[str, Any]]:
    """One row per candidate (the reference first): its figures (means of its runs) at the
    largest sample it ran on, the spread of its cost, the gate, and where it stopped."""
    rows = []
    for c in [ref, *cands]:
        row: dict[str, Any] = {"candidate": c.key, "label": c.label, "changes": c.changes}
        size = log.last_size(c.key)
        if c.rejected or size is None:
            row.update(outcome=f"rejected: {c.rejected}" if c.rejected else log.outcome.get(c.key, "not run"),
                       rows=None, dropped_at=log.dropped_at.get(c.key))
            rows.append(row)
            continue
        e = log.entry(c.key, size)
        costs = e.values("cost")
        ref_costs = log.entry(REFERENCE, size).values("cost")
        row.update(
            outcome=log.outcome.get(c.key, "not finished"), rows=size, dropped_at=log.dropped_at.get(c.key),
            runs=len(e.runs), job_ids=[r["job_id"] for r in e.runs],
            **{name: mean(e.values(name)) for name, _, _, _ in FIGURES},
            cost_runs=costs, cost_spread=(max(costs) - min(costs)) if costs else None,
            cheaper_than_reference=(mean(ref_costs) / mean(costs)) if costs and ref_costs and mean(costs) else None,
            beats_reference=beats(costs, ref_costs) if c.key != REFERENCE else None,
            gate=None if e.passed is None else ("pass" if e.passed else "fail"),
            quality_loss=e.loss, gate_metric=e.gate_metric,
            # word similarity of its answers to the reference's on the sampled rows (what the
            # eval-set gate does not look at)
            sample_similarity=((e.comparison or {}).get("sample") or e.comparison or {}).get("word_similarity"),
        )
        rows.append(row)
    return rows


def _vs_ref(r: dict[str, Any]) -> str:
    """How many times cheaper than the reference on the same rows; `(tie)` when the
    difference is inside the runs' noise."""
    from tokenmill.jobs.metrics.report import fmt

    text = fmt(r.get("cheaper_than_reference"), "ratio")
    if r["candidate"] != REFERENCE and r.get("cheaper_than_reference") and not r.get("beats_reference") \
            and r["cheaper_than_reference"] > 1:
        text += " (tie)"
    return text


def format_table(table: list[dict[str, Any]]) -> str:
    from tabulate import tabulate

    from tokenmill.jobs.metrics.report import fmt

    def cost(r):
        if r.get("cost") is None:
            return "-"
        return f"{fmt(r['cost'], 'usd')} ±{fmt((r.get('cost_spread') or 0) / 2, 'usd')}"

    body = []
    for r in table:
        ran = r.get("rows") is not None
        gate = "-" if not r.get("gate") else (f"{r['gate']} ({r['gate_metric']})" if r.get("quality_loss") is None
                                               else f"{r['gate']} ({r['quality_loss']:+.1%} {r['gate_metric']})")
        sim = r.get("sample_similarity")
        body.append((
            r["label"], r["outcome"] if len(r["outcome"]) < 70 else r["outcome"][:67] + "...",
            r["rows"] if ran else "-", cost(r),
            _vs_ref(r) if ran else "-",
            fmt(r.get("output_tok_per_s")) if ran else "-", fmt(r.get("tpot_p95_s"), "s") if ran else "-",
            fmt(r.get("ttft_p95_s"), "s") if ran else "-", fmt(r.get("e2e_p95_s"), "s") if ran else "-",
            fmt(r.get("peak_rss_bytes"), "bytes") if ran else "-", gate,
            "-" if sim is None or r["candidate"] == REFERENCE else f"{sim:.3f}",
        ))
    return tabulate(body, headers=("candidate", "outcome", "rows", "$/1M out (±half spread)", "× cheaper",
                                   "out tok/s", "TPOT p95", "TTFT p95", "E2E p95", "peak RSS", "gate",
                                   "similarity to ref"),
                    tablefmt="simple", disable_numparse=True)


def recommendation(res: TuneResult) -> str:
    """One line: what the winner gains over the spec as given and at what quality cost."""
    v = res.log.verdict
    rows = {r["candidate"]: r for r in res.table}
    if v.size is None:
        return "No recommendation: the budget ran out before the first sample size finished."
    where = f"{v.size} sampled rows × {res.repeats} runs"
    if v.winner != REFERENCE:
        w, ref = rows[v.winner], rows[REFERENCE]
        tput = (w["output_tok_per_s"] / ref["output_tok_per_s"]) if w.get("output_tok_per_s") and ref.get("output_tok_per_s") else None
        return (f"Use {w['label']}: ${w['cost']:.4g} per 1M output tokens against ${ref['cost']:.4g} for the spec as "
                f"given ({w['cheaper_than_reference']:.2f}× cheaper" + (f", {tput:.2f}× the output tok/s" if tput else "")
                + f"), quality loss {w['quality_loss']:+.1%} ({w['gate_metric']}, gate {res.gate.text}), on {where}.")
    if v.best is None:
        return f"Keep the spec as given: no candidate passed the gate ({res.gate.text}) on {where}."
    b = rows[v.best]
    x = b["cheaper_than_reference"]
    if x > 1:
        return (f"Keep the spec as given: the cheapest candidate that passes the gate, {b['label']} "
                f"({x:.2f}× cheaper by mean), is inside the measured noise of the reference on {where}.")
    return (f"Keep the spec as given: no candidate that passes the gate is cheaper; the cheapest, {b['label']}, "
            f"costs {1 / x:.2f}× the reference's on {where}.")


def plot_figures(res: TuneResult):
    """(cost against quality loss, output throughput against P95 TPOT), one point per
    candidate at the largest sample it ran on; error bars span its runs."""
    import plotly.graph_objects as go

    ran = [r for r in res.table if r.get("rows") is not None]
    groups = (("reference", lambda r: r["candidate"] == REFERENCE, "#1f77b4", "star"),
              ("passes the gate", lambda r: r["candidate"] != REFERENCE and r.get("gate") == "pass", "#2ca02c", "circle"),
              ("fails the gate", lambda r: r.get("gate") == "fail", "#d62728", "x"),
              ("failed to run", lambda r: r["candidate"] != REFERENCE and r.get("gate") is None, "#7f7f7f", "diamond"))

    def bars(r, name):
        vals = [x[name] for x in res.log.entry(r["candidate"], r["rows"]).runs if x.get(name) is not None]
        m = mean(vals)
        return (max(vals) - m, m - min(vals)) if vals else (0, 0)

    cost = go.Figure()
    perf = go.Figure()
    for gname, test, color, symbol in groups:
        rs = [r for r in ran if test(r)]
        if not rs:
            continue
        text = [f"{r['label']} (n={r['rows']})" for r in rs]
        cost.add_trace(go.Scatter(
            x=[(r.get("quality_loss") or 0.0) * 100 for r in rs], y=[r["cost"] for r in rs], mode="markers+text",
            name=gname, text=[r["label"] for r in rs], textposition="top center", hovertext=text,
            marker=dict(color=color, symbol=symbol, size=12),
            error_y=dict(type="data", symmetric=False, array=[bars(r, "cost")[0] for r in rs],
                         arrayminus=[bars(r, "cost")[1] for r in rs])))
        perf.add_trace(go.Scatter(
            x=[(r.get("tpot_p95_s") or 0.0) * 1e3 for r in rs], y=[r.get("output_tok_per_s") for r in rs],
            mode="markers+text", name=gname, text=[r["label"] for r in rs], textposition="top center", hovertext=text,
            marker=dict(color=color, symbol=symbol, size=12),
            error_x=dict(type="data", symmetric=False, array=[bars(r, "tpot_p95_s")[0] * 1e3 for r in rs],
                         arrayminus=[bars(r, "tpot_p95_s")[1] * 1e3 for r in rs]),
            error_y=dict(type="data", symmetric=False, array=[bars(r, "output_tok_per_s")[0] for r in rs],
                         arrayminus=[bars(r, "output_tok_per_s")[1] for r in rs])))
    limit = res.gate.limit if res.gate.op == "<=" else 1.0 - res.gate.limit
    cost.add_vline(x=limit * 100, line_dash="dash", line_color="#999", annotation_text=f"gate {res.gate.text}")
    cost.update_layout(title="Cost against quality loss (lower left is better)", height=460,
                       xaxis_title=f"quality loss against the spec as given (points; {res.gate.metric})",
                       yaxis_title="USD per 1M output tokens (generation)", margin=dict(t=60, b=50))
    perf.update_layout(title="Output throughput against P95 TPOT (upper left is better)", height=460,
                       xaxis_title="TPOT p95 (ms)", yaxis_title="output tok/s", margin=dict(t=60, b=50))
    return cost, perf


def render_html(res: TuneResult, path: Path) -> Path:
    """The self-contained HTML report: recommendation, table, the two plots."""
    import html as H

    from tokenmill.jobs.metrics.report import _fig_html, _page

    cost, perf = plot_figures(res)
    notes = "".join(f"<p class=muted>{H.escape(n)}</p>" for n in res.notes)
    body = (f"<h1>tokenmill tune {H.escape(res.tune_id)}</h1><p><b>{H.escape(res.recommendation)}</b></p>{notes}"
            f"<p class=muted>gate {H.escape(res.gate.text)}; samples of {res.log.sizes} rows, {res.repeats} runs each, "
            "interleaved; a cost is lower only when every run of it is below every run of the other (else a tie)."
            f"</p><h2>Candidates</h2><pre>{H.escape(format_table(res.table))}</pre>"
            + _fig_html(cost) + _fig_html(perf))
    path.write_text(_page(f"tokenmill tune {res.tune_id}", body), encoding="utf-8")
    return path


def write_outputs(res: TuneResult, out: Path) -> None:
    """tune-table.txt, tune-report.html, winner.yaml and tune.json under `out`."""
    import yaml

    out.mkdir(parents=True, exist_ok=True)
    files = {"table": out / "tune-table.txt", "html": out / "tune-report.html", "spec": out / "winner.yaml",
             "json": out / "tune.json", "sample": out / "samples" / "sample.parquet"}
    files["table"].write_text(format_table(res.table) + "\n\n" + res.recommendation + "\n", encoding="utf-8")
    render_html(res, files["html"])
    w = res.log.verdict.winner
    head = (f"# tokenmill tune {res.tune_id}: " + ("the spec as given (no candidate beat it)" if w == REFERENCE
            else next(c.label for c in res.candidates if c.key == w)) + "\n# run it with: tokenmill run "
            f"{files['spec']}\n")
    files["spec"].write_text(head + yaml.safe_dump(res.winner_spec, sort_keys=False), encoding="utf-8")
    res.files = {k: str(v) for k, v in files.items()}
    files["json"].write_text(json.dumps(res.as_dict(), indent=2, default=str), encoding="utf-8")
