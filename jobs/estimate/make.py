"""`estimate_job` (the package's `make_estimate`): profile the input, run a sample of it as a real job of the job's own engine
and settings, predict the whole job from what it measured, store and return the estimate
(docs/ESTIMATE.md has the JSON and how each figure is made)."""

from __future__ import annotations

import math
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np

from tokenmill.jobs.estimate import predict as P
from tokenmill.jobs.estimate.measure import (
    COLUMNS,
    fixed_history,
    fixed_interval,
    fixed_part,
    job_price,
    observe,
)
from tokenmill.jobs.estimate.profile import InputProfile, profile_input
from tokenmill.jobs.estimate.sample import FILL_TOKENS, SampleError, default_sample_rows, draw, write_sample
from tokenmill.jobs.lifecycle.errors import JobError

#: What the sample job's id adds to the job's (job ids allow letters, digits, `._:-`).
SAMPLE_SUFFIX = ":estimate"
COST_COVERS = ("every hour the job holds its workers (start-up, model load, generation, export), at the "
               "workers' hourly price (the job's `prices`, a TOKENMILL_PRICES file or the default table); "
               "`cost_generation_usd` the generation windows only")


class EstimateError(JobError):
    """An estimate that cannot be made; the message is one line (a JobError: a capped `run`
    that estimates first reports it as its own)."""


def sample_job_id(job_id: str) -> str:
    """The id the estimate's sample job runs under: the job's, with SAMPLE_SUFFIX."""
    return job_id[: 128 - len(SAMPLE_SUFFIX)] + SAMPLE_SUFFIX


def slots_of(engine_cfg) -> int:
    """Sequences one engine runs at once: `max_in_flight` for an engine driven over HTTP
    (llama.cpp's slots), else `max_num_seqs` (the batch runner's `max_num_seqs`)."""
    return int(getattr(engine_cfg, "max_in_flight", None) or engine_cfg.max_num_seqs)


def job_concurrency(spec, prof: InputProfile) -> int:
    """Sequences the job's engines will run at once, all workers together: each its slots,
    no more than its batches in flight hold (`max_inflight_batches` × the token budget's
    rows), and no more than the job's rows."""
    workers = max(1, int(spec.runner.num_workers))
    each = slots_of(spec.engine)
    if spec.batching.token_budget:
        per_batch = max(1, int(spec.batching.token_budget // max(1.0, float(prof.budget_tokens().mean()))))
        each = min(each, per_batch * spec.batching.max_inflight_batches)
    return int(min(each * workers, prof.usable))


def sample_spec(spec, input_path: Path, output: Path, job_id: str):
    """The job's spec on the sample file: the same engine, sampling, batching and runner;
    no cap (it is the estimate a cap needs) and no result cache (the sample must run on
    the engine, and its answers must not serve the job)."""
    from tokenmill.schemas.config import load_spec

    data = spec.model_dump(mode="json", exclude_none=True)
    data.update(input=str(input_path), output=str(output), job_id=job_id, name=f"estimate of {spec.derived_job_id()}",
                cache="off", input_format="openai-jsonl" if input_path.suffix == ".jsonl" else "parquet")
    data.pop("max_cost", None)
    data.pop("max_hours", None)
    return load_spec(data, source="the estimate's sample job")


#: The latest jobs of the database whose fixed parts (start-up, load, export) the estimate's
#: interval may take its spread from (`measure.fixed_history`).
HISTORY_JOBS = 200


def estimate_job(spec, *, db_url: str | None = None, sample: int | None = None,
                  stage: Callable[[str], None] | None = None, seed: int = 0) -> dict[str, Any]:
    """Estimate `spec`'s job (see the package docstring), store it under the job's id
    (`EstimateStore`) and return it; EstimateError (one line) when it cannot be made."""
    from tokenmill.jobs.lifecycle.preflight import preflight, resolve_workers
    from tokenmill.schemas import storage as S
    from tokenmill.schemas.db import default_db_url
    from tokenmill.transforms.counting import TokenCounter
    from tokenmill.transforms.engines.kinds import engine_of

    say = stage or (lambda line: None)
    if sample is not None and sample < 1:
        raise EstimateError(f"--sample must be at least 1 row, got {sample}")
    try:
        spec = resolve_workers(spec)
    except JobError as err:
        raise EstimateError(str(err)) from None
    job_id = spec.derived_job_id()
    db_url = db_url or spec.db or default_db_url()
    eng = S.connect(db_url)
    pf = preflight(spec, db_url=db_url)
    if pf.problems:
        raise EstimateError(pf.problems[0])
    block = engine_of(spec.engine.kind).launch_side(spec.engine).block_size(on_gpu=pf.on_gpu)
    counter = pf.counter
    if counter is None:  # the model's own tokenizer, in the folder the engine's preflight found
        if pf.model_path is None:
            raise EstimateError(f"no tokenizer to count the prompts of {spec.engine.model!r} with: "
                                "the engine's preflight found neither a counter nor a model folder")
        counter = TokenCounter.local(pf.model_path, model=spec.engine.model)
    say(f"tokenizing the input: {pf.plan.total_rows:,} rows ({counter.describe()})")
    prof = profile_input(spec, pf.plan, counter, block)
    if not prof.usable:
        raise EstimateError(f"input {spec.input!r}: no row would reach the engine ({prof.read_rows} read; dead "
                            f"letters: {prof.dead or 'none'})")
    n = min(sample or default_sample_rows(prof.usable), prof.usable)
    picks, band, edges = draw(prof.prompt_tokens, n, seed)
    sid = sample_job_id(job_id)
    fill = max(0, job_concurrency(spec, prof) - len(picks))
    say(f"running a sample of {len(picks)} rows ({len(edges) + 1} prompt-length band(s))"
        + (f" and {fill} filler rows of {FILL_TOKENS} tokens (the job's concurrency)" if fill else "")
        + f" as job {sid}")
    with tempfile.TemporaryDirectory(prefix="tokenmill-estimate-") as tmp:
        try:
            path = write_sample(pf.plan, prof.file_index[picks], prof.row[picks], Path(tmp), fill)
        except (SampleError, OSError) as err:
            raise EstimateError(f"cannot write the sample of {spec.input!r}: {err}") from None
        job = _run_sample(sample_spec(spec, path, Path(tmp) / "out", sid), pf, eng, db_url, Path(tmp), say)
    rows = S.MetricsReader(eng).request_rows(sid, COLUMNS)
    if not rows or not job.get("metrics"):
        raise EstimateError(f"the sample job {sid} answered no row ({job.get('failed')} dead letters): nothing to "
                            f"measure; see tokenmill report {sid}")
    say("predicting the whole job from the sample's measurements")
    reader = S.MetricsReader(eng)
    from tokenmill.jobs.lifecycle.jobrow import hardware

    history = fixed_history(S.JobStore(eng).recent(HISTORY_JOBS), spec.engine.kind, spec.engine.model, hardware())
    sample_run = SampleRun(sid, picks, band, rows, reader.batches(sid), reader.workers(sid), job["metrics"])
    est = assemble(spec, prof, sample_run, block=block, first_unit_rows=_first_unit_rows(spec, pf.plan), seed=seed,
                   history=history)
    S.EstimateStore(eng).add(job_id, est, sample_rows=len(picks), total_rows=prof.total_rows,
                             created_at=est["made_at"])
    return est


def _run_sample(sspec, pf, eng, db_url: str, tmp: Path, say: Callable[[str], None]) -> dict[str, Any]:
    """Run the sample job afresh (an earlier sample job of the id removed first) as `tokenmill
    run` runs a job, in a process of its own (the subprocess launcher): its start-up, imports
    and engine load are the job's, not this process's warm ones, and its engine is gone when it
    ends.  Its stage lines are passed on; returns its job row (metrics and all)."""
    from tokenmill.jobs.lifecycle.launchers import Launched
    from tokenmill.jobs.lifecycle.launchers.spawned import SpawnedLauncher
    from tokenmill.schemas import storage as S
    from tokenmill.transforms.engines.kinds import engine_of
    from tokenmill.transforms.engines.protocol import EngineStartError

    sid = sspec.derived_job_id()
    S.JobStore(eng).delete(sid)
    if sspec.runner.runner == "DirectRunner":  # `dtype: auto` measured (once) outside the sample's held time
        try:
            engine_of(sspec.engine.kind).launch_side(sspec.engine).prepare(pf.model_path, say)
        except EngineStartError as err:
            raise EstimateError(str(err)) from None
    ended: list[Launched] = []
    child = SpawnedLauncher(ended.append, lambda line: say(f"sample: {line}"), tmp)
    child.launch(sid, sspec.model_dump(mode="json", exclude_none=True), db_url)
    job = S.JobStore(eng).get(sid) or {}
    if ended[0].status not in ("succeeded", "partial") or job.get("status") not in ("succeeded", "partial"):
        error = ended[0].note if ended[0].raised or ended[0].status == "busy" else None
        raise EstimateError(f"the sample job {sid} failed (exit {child.exit_code}): "
                            f"{error or job.get('error') or 'no error line'}")
    return job


def _first_unit_rows(spec, plan) -> int:
    """Rows of the job's first work unit (its engine is sized for them; they are tokenized
    before it starts)."""
    from tokenmill.transforms.read import plan_units

    units = plan_units(plan, spec.batching.unit_bytes)
    return int(units[0].num_rows if hasattr(units[0], "num_rows") else units[0].num_lines) if units else 0


def _job_requests(spec, prof: InputProfile, band: np.ndarray, block: int, slots: int, seed: int) -> P.Requests:
    """The job's engine requests as the model runs them: rows in the job's order, their
    prefill from the whole input's block hashes, batches by the job's token budget; a job of
    more than SIM_MAX_REQUESTS rows is simulated on a reproducible subset of its rows."""
    from tokenmill.jobs.estimate.engine_model import batches_by_budget, deal
    from tokenmill.transforms.engines.kinds import engine_of

    order = P.job_order(prof.prefix_keys, prof.prompt_tokens, prof.blocks, spec.batching.ordering)
    budget = prof.budget_tokens()
    token_budget = spec.batching.token_budget or max(1, math.ceil(float(budget.mean()) * slots))
    workers = deal(batches_by_budget(budget[order], token_budget), spec.runner.num_workers)
    kind = engine_of(spec.engine.kind)
    if kind.measures_prefix_cache:
        prefill = P.prefill_tokens(order, prof.prompt_tokens, prof.samples, prof.blocks, block, workers,
                                   keep_prompts=slots if kind.prefix_cache_per_slot else None)
    else:  # an engine that does not say what it serves from a cache: every prompt token counts
        prefill = np.repeat(prof.prompt_tokens[order], prof.samples[order])
    keep = np.arange(len(order))
    if len(order) > P.SIM_MAX_REQUESTS:
        keep = np.sort(np.random.default_rng(seed).choice(len(order), P.SIM_MAX_REQUESTS, replace=False))
    first = np.concatenate([[0], np.cumsum(prof.samples[order])[:-1]])  # each row's first request
    req = np.concatenate([first[k] + np.arange(prof.samples[order][k]) for k in keep])
    rows = order[keep]
    reps = prof.samples[rows]
    return P.Requests(band=np.repeat(band[rows], reps), caps=np.repeat(prof.max_tokens[rows], reps),
                      prompt=np.repeat(prof.prompt_tokens[rows], reps), prefill=prefill[req],
                      batch=np.repeat(batches_by_budget(budget[rows], token_budget), reps),
                      scale=prof.scale * len(order) / len(keep))


@dataclass(frozen=True)
class SampleRun:
    """The estimate's sample job, as `assemble` measures it."""

    job_id: str
    picks: np.ndarray
    """The usable rows it ran (indices into the profile's)."""
    band: np.ndarray
    """Every usable row's prompt-length band (`sample.draw`)."""
    rows: list[dict[str, Any]]
    """Its answered rows' `measure.COLUMNS`."""
    batches: list[dict[str, Any]]
    workers: list[dict[str, Any]]
    metrics: dict[str, Any]


def assemble(spec, prof: InputProfile, sample: SampleRun, *, block: int, first_unit_rows: int, seed: int = 0,
             history: list[float] | None = None) -> dict[str, Any]:
    """The estimate's JSON from the profile and the sample job's rows and metrics."""
    band, picks, metrics, sample_id = sample.band, sample.picks, sample.metrics, sample.job_id
    from tokenmill.jobs.lifecycle.jobrow import hardware
    from tokenmill.transforms.engines.kinds import engine_of
    from tokenmill.transforms.engines.kv import JobTokens

    kind = engine_of(spec.engine.kind)
    slots = slots_of(spec.engine)
    gen_wall = float((metrics.get("throughput") or {}).get("generation_wall_s") or 0.0)
    obs, meas = observe(sample.rows, sample.batches, picks=picks, band=band, max_tokens=prof.max_tokens,
                        wall_s=gen_wall,
                        cache_measured=kind.measures_prefix_cache)
    job = _job_requests(spec, prof, band, block, slots, seed)
    engine = P.Engine(slots=slots, max_batches=spec.batching.max_inflight_batches,
                      workers=int(spec.runner.num_workers))
    weights = prof.samples
    prompt = P.exact_or_scaled(prof.prompt_tokens * weights, prof.scale,
                               f"the input tokenized with the job's tokenizer and chat template ({prof.counted_by})")
    output = P.output_figure(obs, band, prof.max_tokens, weights.astype(float), prof.scale, seed)
    total = P.figure(prompt["value"] + output["value"], prompt["lo"] + output["lo"], prompt["hi"] + output["hi"],
                     "prompt + output; interval: their bounds added")
    gen, model = P.wall_figure(meas, obs, job, engine, seed)
    per_s = prof.seconds / max(1, prof.read_rows)
    fixed = fixed_part(metrics, max(0, min(first_unit_rows, prof.usable) - len(picks)) * per_s)
    first = slice(0, min(first_unit_rows, prof.usable))
    price, price_how = job_price(sample.workers, spec, JobTokens.of(prof.budget_tokens()[first].tolist()), block,
                                 hardware())
    fixed_lo, fixed_hi, fixed_how = fixed_interval(fixed.fixed_s, history or [])
    held = P.held_figure(gen, fixed.fixed_s, fixed_lo, fixed_hi, fixed_how)
    cost = P.cost_figure(held, price, "held wall")
    cost_gen = P.cost_figure(gen, price, "generation wall")
    rows_in = prof.total_rows
    per_row_s = gen["value"] / rows_in if rows_in else 0.0
    sample_hit = (metrics.get("prefix_cache") or {}).get("hit_rate")
    return {
        "job_id": spec.derived_job_id(), "rows": rows_in, "sample_rows": int(len(picks)),
        "tokens": {"prompt": prompt, "output": output, "total": total},
        "generation_wall_s": gen, "held_wall_s": held, "cost_usd": cost, "cost_generation_usd": cost_gen,
        "fixed": {"held_s": fixed.fixed_s, "cost_usd": fixed.fixed_s * price / 3600.0},
        "per_row": {"held_s": per_row_s, "cost_usd": per_row_s * price / 3600.0},
        "price_per_hour": price, "cost_covers": COST_COVERS,
        "method": {
            "sample": f"{len(picks)} of {prof.usable:,} usable rows, stratified by prompt-length band, seed {seed}, "
                      f"run as job {sample_id} with the job's engine and settings",
            "tokens.prompt": prompt["how"], "tokens.output": output["how"], "generation_wall_s": gen["how"],
            "held_wall_s": held["how"], "cost_usd": cost["how"], "price_per_hour": price_how,
            "prefix_cache": ("the input's own KV block hashes in the job's order, per worker, "
                             + (f"each of its {slots} slots keeping its last prompt" if kind.prefix_cache_per_slot
                                else "nothing evicted")
                             if kind.measures_prefix_cache else "not modelled: the engine does not report it; "
                                                                "every prompt token counted as prefilled"),
        },
        "engine": spec.engine.kind, "made_at": time.time(), "sample_job_id": sample_id,
        "input": prof.describe(),
        "bands": _bands(obs, band, prof),
        "prefix_cache": {"hit_rate": job.hit_rate() if kind.measures_prefix_cache else None,
                         "sample_hit_rate": sample_hit},
        "engine_model": {**model.describe(), "slots": slots, "workers": engine.workers,
                         "max_inflight_batches": engine.max_batches},
        "sample_measured": {**fixed.describe(), "usd_per_hour": (metrics.get("cost") or {}).get("usd_per_hour"),
                            "output_tokens": int(obs.out.sum()), "requests": int(len(obs.out))},
    }


def _bands(obs: P.Outputs, band: np.ndarray, prof: InputProfile) -> list[dict[str, Any]]:
    out = []
    for b in np.unique(band):
        sel = band == b
        mine = obs.band == b
        out.append({"prompt_tokens": [int(prof.prompt_tokens[sel].min()), int(prof.prompt_tokens[sel].max())],
                    "rows": int(sel.sum()), "sample_answers": int(mine.sum()),
                    "mean_output_tokens": float(obs.out[mine].mean()) if mine.any() else None,
                    "cut_at_max_tokens": float(obs.capped[mine].mean()) if mine.any() else None})
    return out
