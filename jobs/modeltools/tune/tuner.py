"""`tune`: the candidates of a job spec run as ordinary jobs in the database on the sample's
rungs, judged by the gate against the spec as given, within the budget; a rerun reads the
finished jobs back."""

from __future__ import annotations

import copy
import hashlib
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from tokenmill.jobs.lifecycle.errors import JobError
from tokenmill.jobs.lifecycle.preflight import preflight
from tokenmill.jobs.modeltools.compare import CompareError, compare_jobs
from tokenmill.jobs.modeltools.tune.budget import Budget
from tokenmill.jobs.modeltools.tune.common import REFERENCE, CandidateFailed, TuneError, figures_of
from tokenmill.jobs.modeltools.tune.cpu_screen import measure_cpu_dtypes, screen_cpu_dtypes, screens_cpu_dtype
from tokenmill.jobs.modeltools.tune.gate import Gate, parse_gate
from tokenmill.jobs.modeltools.tune.halving import search
from tokenmill.jobs.modeltools.tune.render import write_outputs
from tokenmill.jobs.modeltools.tune.result import TuneResult, build_table, recommendation
from tokenmill.jobs.modeltools.tune.sample import MIN_RUNG_ROWS, draw_sample, rung_file, rung_sizes, sample_digest
from tokenmill.jobs.modeltools.tune.space import (
    Candidate,
    load_space,
    make_candidates,
    make_checkpoints,
    set_path,
    space_changes,
    work_key,
)
from tokenmill.schemas import storage as S
from tokenmill.schemas.config import DEFAULT_ENGINE_KIND, SpecError, load_spec
from tokenmill.schemas.db import default_db_url
from tokenmill.schemas.errors import first_line
from tokenmill.schemas.models import ModelNotFound, resolve_model
from tokenmill.transforms.engines.kinds import engine_of

#: Runs per candidate and sample size; the spread of the runs is the noise a win must clear.
DEFAULT_REPEATS = 2

#: The bundled evaluation set (questions with reference answers, the repository's data/):
#: the default gate's accuracy where the job's own rows have no references.
EVAL_SET = Path(__file__).resolve().parents[3] / "data" / "eval_set.parquet"

#: Output tokens per eval-set answer (greedy), as `make bench-quant` asks them.
EVAL_MAX_TOKENS = 32


def make_tune_id(reference_spec, *, sample: int, seed: int, gate: Gate, repeats: int,
                 candidates: list[Candidate], rows: str = "") -> str:
    """8 hex digits of what decides the tune's runs, `rows` (`sample_digest`) included;
    not the budget: a larger one goes on where a smaller one stopped."""
    payload = {"ref": json.loads(work_key(reference_spec)), "input": reference_spec.input, "sample": sample,
               "rows": rows, "seed": seed, "gate": gate.text, "repeats": repeats,
               "candidates": [c.changes for c in candidates]}
    return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()[:8]


def _run_data(cand: Candidate, *, input: Path, output: Path, job_id: str, name: str) -> dict[str, Any]:
    data = copy.deepcopy(cand.spec_data)
    # a run measures its engine (throughput, cost): no answer of it may come from the result cache
    data.update(input=str(input), output=str(output), job_id=job_id, name=name, cache="off")
    return data


def eval_cache(data: dict[str, Any]) -> str:
    """The `cache` of an eval-set job (greedy answers, judged for quality only): `read-write`, so
    another tune of the same model and settings (a new tune id) spends no engine time on answers
    already computed (docs/CACHE.md); `off` for an engine whose answers are never cached."""
    kind = (data.get("engine") or {}).get("kind") or DEFAULT_ENGINE_KIND
    return "read-write" if engine_of(kind).local_weights else "off"


def _silent(line: str) -> None:
    pass


@dataclass(frozen=True)
class TuneOptions:
    """How a tune searches (`tokenmill tune`'s options)."""

    sample: int
    """Input rows drawn for the largest sample."""
    out: str | Path
    """Where the table, the HTML report and the winning spec are written."""
    db_url: str | None = None
    gate: str | None = None
    budget_minutes: float | None = None
    space: str | Path | None = None
    repeats: int = DEFAULT_REPEATS
    seed: int = 0
    session_factory: Callable[..., Any] | None = None
    """The engine (tests pass a fake; default the job's own)."""
    eval_set: str | Path | None = None
    """Questions with a `reference` column for the default gate where the job's rows have no
    references (default: the bundled EVAL_SET)."""
    echo: Callable[[str], None] = _silent
    """Tells the terminal one line per step."""


def tune(spec_data: dict[str, Any], options: TuneOptions) -> TuneResult:
    """Search the configurations of `spec_data` (a job spec mapping, the reference) on
    `options.sample` of its input rows; write the table, the HTML report and the winning spec
    under `options.out`."""
    sample, gate, budget_minutes, repeats, seed = (options.sample, options.gate, options.budget_minutes,
                                                   options.repeats, options.seed)
    session_factory, eval_set, echo = options.session_factory, options.eval_set, options.echo
    from tokenmill.jobs.lifecycle.launchers.inprocess import run_here  # Beam: only when a tune runs

    try:
        spec = load_spec(spec_data)
    except SpecError as err:
        raise TuneError(str(err)) from None
    g = parse_gate(gate)
    if g.metric == "accuracy_drop" and not spec.reference_column:
        raise TuneError("gate accuracy_drop needs reference answers: set reference_column in the job spec")
    out = Path(options.out)
    db_url = options.db_url or spec.db or default_db_url()
    fake = session_factory is not None
    sp = load_space(options.space)
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
    if not fake and screens_cpu_dtype(spec) and model_path:
        screen_cpu_dtypes(spec_data, cands, measure_cpu_dtypes(spec, model_path),
                          keep_slow=bool(sp.get("keep_slow_dtypes")))
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
        job = S.JobStore(eng).get(jid)
        if job and job["status"] in ("succeeded", "partial") and job.get("metrics"):
            return job["metrics"], True
        t0 = time.time()
        ran = run_here(load_spec(data), db_url=db_url, session_factory=session_factory)
        if isinstance(ran.error, S.JobBusy):
            raise TuneError(str(ran.error))
        if isinstance(ran.error, (JobError, S.StorageError)):
            charge(time.time() - t0)
            raise CandidateFailed(first_line(ran.error))
        if ran.error is not None:
            raise ran.error
        res = ran.result
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
        assert evals is not None  # the gate asks for eval jobs only with an eval set (judge)
        data = _run_data(by_key[key], input=evals, output=out / "jobs" / jid, job_id=jid,
                         name=f"tune {tid}: {by_key[key].label}, eval set")
        data["reference_column"] = "reference"
        data["sampling"] = {**(data.get("sampling") or {}), "temperature": 0.0, "max_tokens": EVAL_MAX_TOKENS}
        data["cache"] = eval_cache(data)
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
    winner = by_key[log.decided().winner]
    winner_spec = copy.deepcopy(spec_data)
    for p, v in winner.changes.items():
        set_path(winner_spec, p, v)
    res = TuneResult(tune_id=tid, gate=g, reference=ref, candidates=cands, log=log, sample_rows=n, repeats=repeats,
                     table=table, recommendation="", winner_spec=winner_spec, notes=notes)
    res.recommendation = recommendation(res)
    write_outputs(res, out)
    return res
