"""The job lifecycle: check, claim, run the Beam pipeline, export, account, finish.

Everything that can be checked before a worker starts is checked first (the
database here, then preflight.py: model, engine options, output, input), so bad
input costs seconds, not an engine start.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from contextlib import ExitStack
from dataclasses import dataclass, field, replace
from typing import Any, Callable, cast

import apache_beam as beam
from apache_beam.metrics.metric import MetricsFilter

from tokenmill.jobs.lifecycle.caps import CapError, CapWatch, before_start, capped
from tokenmill.jobs.lifecycle.direct_runner import watch_sdk_workers, worker_died
from tokenmill.jobs.lifecycle.errors import JobError
from tokenmill.jobs.lifecycle.export import finished_export, previous_parts, write_marker
from tokenmill.jobs.lifecycle.jobrow import hardware, job_values, versions
from tokenmill.jobs.lifecycle.preflight import pipeline_options, preflight, resolve_workers
from tokenmill.jobs.lifecycle.reconcile import mismatch_note
from tokenmill.jobs.lifecycle.shared import finisher_or_busy, run_shared, work_lost
from tokenmill.jobs.lifecycle.sinks import export_job
from tokenmill.jobs.metrics.accounting import JobTerms
from tokenmill.jobs.metrics.catalog import values
from tokenmill.jobs.metrics.figures import stored_metrics
from tokenmill.jobs.metrics.hardware import UtilizationSampler, process_tree_cpu_s
from tokenmill.pipelines.batch import PipelineParts, build_pipeline
from tokenmill.schemas import storage as S
from tokenmill.schemas.config import JobSpec
from tokenmill.schemas.db import default_db_url
from tokenmill.schemas.errors import first_line
from tokenmill.transforms.counting import TokenCounter
from tokenmill.transforms.engines.kinds import LaunchSide, engine_of
from tokenmill.transforms.engines.protocol import EngineStartError
from tokenmill.transforms.spill import remove_job_spill

log = logging.getLogger(__name__)


@dataclass
class JobResult:
    job_id: str
    status: str
    total: int
    succeeded: int
    failed: int
    resumed: bool
    wall_s: float
    metrics: dict[str, Any] = field(default_factory=dict)
    files: dict[str, Any] = field(default_factory=dict)
    note: str | None = None

    def summary(self) -> dict[str, Any]:
        """What `tokenmill run` prints (and `--json` writes): the counts, and the summary view's
        figures (metrics.catalog.VIEWS)."""
        return {
            "job_id": self.job_id,
            "status": self.status,
            "rows_in": self.total,
            "succeeded": self.succeeded,
            "failed": self.failed,
            "wall_s": round(self.wall_s, 2),
            **values("summary", self.metrics),
            "outputs": self.files.get("outputs"),
            "note": self.note,
        }


@dataclass(frozen=True)
class RunContext:
    """One run of a job as `run_job` resolved it before its pipeline starts: what each of its
    passes and pipelines is given, as one object."""

    spec: JobSpec
    """The job's spec; a pass's (`for_task`) names its own engine task."""
    job_id: str
    run_id: str
    plan: Any
    """The input's plan (transforms/read.py)."""
    model_path: str | None
    """The folder Tokenize reads (the engine's preflight found it: a str once it has no problem)."""
    db_url: str
    eng: Any
    """The job database's SQLAlchemy engine."""
    say: Callable[[str], None]
    """Tells the terminal one line per stage."""
    session_factory: Callable[..., Any] | None = None
    """A test double's engine session (None: the engine kind's own)."""
    block_size: int | None = None
    counter: TokenCounter | None = None
    """How Tokenize counts the prompts (the engine's preflight says)."""

    @property
    def launch(self) -> LaunchSide:
        """What the launcher asks of the job's engine (`EngineKind.launch_side`)."""
        return engine_of(self.spec.engine.kind).launch_side(self.spec.engine, stand_in=self.session_factory is not None)

    def for_task(self, task: str) -> RunContext:
        """This run with the engine config given `task` (`JobSpec.for_task`)."""
        return replace(self, spec=self.spec.for_task(task))

    def pipeline_parts(self) -> PipelineParts:
        """What build_pipeline needs beyond the spec, with this pass's engine (its task too) as
        the result cache's keys name it (None with cache off)."""
        launch, cache = self.launch, self.spec.cache
        return PipelineParts(job_id=self.job_id, run_id=self.run_id, plan=self.plan, model_name=self.spec.engine.model,
                             model_path=cast(str, self.model_path), db_url=self.db_url, counter=self.counter,
                             session_factory=self.session_factory, block_size=self.block_size,
                             fingerprint=launch.fingerprint(cache, self.model_path),
                             adapter_hashes=launch.adapter_hashes(cache))


class _Heartbeat(threading.Thread):
    def __init__(self, eng, job_id: str, on_tick: Callable[[], None] | None = None, every_s: float = 5.0,
                 run_id: str | None = None):
        super().__init__(daemon=True, name="tokenmill-heartbeat")
        self.eng, self.job_id, self.on_tick, self.every_s, self.run_id = eng, job_id, on_tick, every_s, run_id
        self.stop_event = threading.Event()

    def run(self):
        while not self.stop_event.wait(self.every_s if self.on_tick is None else 1.0):
            try:
                S.JobStore(self.eng).heartbeat(self.job_id, self.run_id)
                if self.on_tick:
                    self.on_tick()
            except Exception as err:  # never kill the job for a missed heartbeat
                log.debug("heartbeat failed: %s", err)


def run_job(
    spec: JobSpec,
    *,
    db_url: str | None = None,
    session_factory=None,
    progress: Callable[[int, int, int], None] | None = None,
    stage: Callable[[str], None] | None = None,
) -> JobResult:
    """Run one job to its end.  `progress(done, total, output_tokens)` is called about once a
    second while the pipeline runs; `stage(line)` once per stage with a line for a person."""
    t0 = time.time()
    say = stage or (lambda line: None)
    cpu0 = process_tree_cpu_s()
    spec = resolve_workers(spec, fake_engine=session_factory is not None, say=say)
    db_url = db_url or spec.db or default_db_url()
    job_id = spec.derived_job_id()

    # 1. Everything checkable before any worker starts (the checks `validate` runs).
    eng = S.connect(db_url)
    pf = preflight(spec, fake_engine=session_factory is not None, db_url=db_url)
    if pf.problems:
        raise JobError(pf.problems[0])
    plan, model_path, on_gpu = pf.plan, pf.model_path, pf.on_gpu
    say(f"checked: {plan.total_rows:,} input rows, model {spec.engine.model}, output {spec.output}")
    if (done := _already_finished(eng, job_id, spec, plan.total_rows, t0)) is not None:
        say(f"already finished ({done.status}): every row is answered and {spec.output} holds its export; nothing to do")
        return done
    held_before_s, estimate = 0.0, None
    if capped(spec):  # a job whose estimate crosses its cap does not start (jobs/lifecycle/caps.py)
        try:
            estimate, held_before_s = before_start(spec, job_id, eng, db_url, plan.total_rows, say,
                                                   stored_only=session_factory is not None)
        except CapError as err:
            raise JobError(str(err)) from None

    launch = engine_of(spec.engine.kind).launch_side(spec.engine, stand_in=session_factory is not None)
    if spec.runner.runner == "DirectRunner":
        # the workers run here: what the engine measures once is measured in the launcher, where the terminal is told
        try:
            launch.prepare(model_path, say)
        except EngineStartError as err:
            raise JobError(str(err)) from None

    # 2. Claim the job row (a second concurrent run of the same id refuses), or, for a shared job
    # (`runner.lease_s`: serve replicas), join it: every participant runs the units it can lease.
    hw = hardware()
    shared = spec.runner.lease_s
    values = {**job_values(spec), "versions": versions(spec.engine.kind), "hardware": hw, "total": plan.total_rows}
    claim = S.JobStore(eng).join(job_id, values) if shared else S.JobStore(eng).claim(job_id, values)
    run_id = uuid.uuid4().hex[:6]
    S.JobStore(eng).start_run(job_id, run_id, t0)  # this run's device time starts with the launcher (docs/ACCOUNTING.md)

    counted: dict[str, float] = {"next": 0.0, "rows": 0, "tokens": 0}

    def count_progress() -> None:
        """The rows done and the output tokens so far, counted over the job's stored rows at
        most every second, and so that counting takes at most PROGRESS_SHARE of the time: a
        10M-row job's counts take seconds, and are taken that much less often."""
        now = time.monotonic()
        if now < counted["next"]:
            return
        reader = S.MetricsReader(eng)
        c = reader.counts(job_id)
        counted.update(rows=c["succeeded"] + c["failed"], tokens=reader.output_tokens(job_id) if progress else 0)
        counted["next"] = now + max(1.0, (time.monotonic() - now) / PROGRESS_SHARE)

    def rows_done() -> int:
        count_progress()
        return int(counted["rows"])

    watch = None if estimate is None else CapWatch(spec, estimate, total_rows=plan.total_rows,
                                                    held_before_s=held_before_s, done=rows_done)
    last_cap_check = [0.0]

    def tick():
        if progress is not None:
            count_progress()
            progress(int(counted["rows"]), plan.total_rows, int(counted["tokens"]))
        if watch is not None and time.time() - last_cap_check[0] >= CAP_CHECK_EVERY_S:
            last_cap_check[0] = time.time()
            if watch.check():  # stopped as a cancel is: the batches in flight finish, every finished row kept
                say(f"stopping: {watch.reason}")
                S.JobStore(eng).request_cancel(job_id)

    hb = _Heartbeat(eng, job_id, tick if progress or watch else None, run_id=run_id)
    hb.start()
    sampler = UtilizationSampler()  # CPU utilization, process-tree RSS, NVML on GPU; launcher-side
    sampler.start()
    status, error, read = "failed", None, None
    say("resuming: rows already answered are skipped" if claim["resumed"] else
        f"starting the pipeline ({spec.runner.runner}, {spec.runner.num_workers} worker"
        f"{'s' if spec.runner.resolved_workers() > 1 else ''}); the engine loads first")
    try:
        ctx = RunContext(spec, job_id, run_id, plan, model_path, db_url, eng, say, session_factory,
                         launch.block_size(on_gpu=on_gpu), pf.counter)
        read = run_shared(ctx, job_tasks(spec, plan), _run_passes) if shared else _run_passes(ctx)
        status = "done"
    except KeyboardInterrupt:
        error = "interrupted"
        raise
    except Exception as err:
        error = f"{type(err).__name__}: {first_line(err, 1000)}"[:1000]
        log.exception("pipeline failed")
    finally:
        hb.stop_event.set()
        hb.join(timeout=5)
        utilization = sampler.stop()
        if status != "done":
            S.JobStore(eng).finish_run(job_id, run_id, time.time())
        if status != "done" and not shared:  # a shared job's other participants go on; its units were handed back
            c = S.MetricsReader(eng).counts(job_id)
            S.JobStore(eng).finish(job_id, status="failed", error=error, **c, heartbeat_at=None, owner=None)
            fmt = spec.output_format or "parquet"  # the earlier export's parts stay named, for the next run to keep
            _mark_failed(spec.output, {"job_id": job_id, "run_id": run_id, "rows_in": plan.total_rows, **c,
                                       "files": {}, "format": fmt, "parts": previous_parts(spec.output, job_id, fmt)},
                         f"the pipeline failed; this run exported nothing: {error or 'stopped'}")
    if progress is not None:
        tick()
    if status != "done":
        raise JobError(f"job {job_id} failed: {error}")
    with ExitStack() as finishing:
        if shared:  # one participant finishes the job: the one that finds every unit done and takes the lock
            finisher_or_busy(eng, job_id, run_id, finishing)
        remove_job_spill(job_id)  # every unit was read: what a large row group spilled here is spent

        # 3. Export (the old marker removed first), reconcile, account; then the marker of the final status.
        cancelled = bool(_job_row(eng, job_id).get("cancel_requested"))
        c = S.MetricsReader(eng).counts(job_id)
        files = export_job(eng, job_id, spec.output, spec.output_format or "parquet")
        say(f"exported {spec.output}: {files.get('outputs', 0):,} outputs, {files.get('dead_letters', 0):,} dead letters")
        S.JobStore(eng).finish_run(job_id, run_id, time.time())  # after export: the devices were held until now
        metrics = compute_metrics(eng, job_id, spec, plan.total_rows, hw, job_wall_s=time.time() - t0,
                                  utilization=utilization, merged=True)
        metrics["input"] = input_read(read, plan)
        metrics["work_lost"] = work_lost(eng, job_id, shared=bool(shared))
        note = None
        if cancelled:
            final = "cancelled"
        elif plan.total_rows != c["succeeded"] + c["failed"]:
            final = "failed"
            note = mismatch_note(eng, job_id, plan, c)
        else:
            final = "partial" if c["failed"] else "succeeded"
            if plan.total_rows == 0:
                note = "the input has no rows: nothing to do"
        reason = note if final == "failed" else (
            f"{'cancel requested' if watch is None or watch.reason is None else watch.reason}: stopped after the "
            f"batches in flight, {c['succeeded'] + c['failed']} of {plan.total_rows} rows answered"
            if final == "cancelled" else None)
        if final == "cancelled" and watch is not None and watch.reason:
            note = reason
        tok = metrics.get("tokens") or {}
        write_marker(spec.output, final, {**files, "run_id": run_id, "rows_in": plan.total_rows, **c,
                                          "tokens": {k: tok.get(k) for k in ("prompt", "output", "total")}}, reason)
        S.JobStore(eng).finish(job_id, status=final, error=note if final == "failed" else None, metrics=metrics,
                               heartbeat_at=None, owner=None, **c)
        if final in ("succeeded", "partial") and not claim["resumed"]:  # what `workers: auto` reads next time
            launch.remember_run(spec.runner, plan.total_rows, time.time() - t0, process_tree_cpu_s() - cpu0)
        return JobResult(
            job_id=job_id,
            status=final,
            total=plan.total_rows,
            succeeded=c["succeeded"],
            failed=c["failed"],
            resumed=claim["resumed"],
            wall_s=time.time() - t0,
            metrics=metrics,
            files=files.get("files", {}),
            note=note,
        )


#: Seconds between two checks of a capped job's bill while it runs (jobs/lifecycle/caps.py).
CAP_CHECK_EVERY_S = 5.0
#: The share of the heartbeat thread's time its progress counts may take (`count_progress`).
PROGRESS_SHARE = 0.05


def _already_finished(eng, job_id: str, spec: JobSpec, total: int, t0: float) -> JobResult | None:
    """A rerun of a job that ended succeeded or partial on this input, its export (`finished_export`) and its
    stored rows agreeing: its stored result, nothing run, exported or counted again (minutes at 10M rows)."""
    job = S.JobStore(eng).get(job_id) or {}
    if job.get("status") not in ("succeeded", "partial") or job.get("total") != total:
        return None
    stored = {"succeeded": job["succeeded"], "failed": job["failed"]}  # a finished job's counts reconciled with `total`
    manifest = finished_export(spec.output, {"job_id": job_id, "status": job["status"], "rows_in": total,
                                             "format": spec.output_format or "parquet", **stored})
    if manifest is None or S.MetricsReader(eng).counts(job_id) != stored:  # the export agrees; then the database
        return None
    return JobResult(job_id, job["status"], total, stored["succeeded"], stored["failed"], resumed=True,
                     wall_s=time.time() - t0, metrics=job.get("metrics") or {}, files=manifest["files"],
                     note="already finished: nothing ran again")


def _mark_failed(output: str, manifest: dict[str, Any], reason: str) -> None:
    """`_FAILED.json` for a run whose pipeline failed (an earlier run's `_SUCCESS.json` removed),
    so the folder does not read as this run's finished export; a failure to write it is logged,
    never raised over the job's own error."""
    try:
        write_marker(output, "failed", manifest, reason)
    except Exception as err:
        log.warning("job %s: could not mark %s as failed: %s", manifest.get("job_id"), output, first_line(err))


def job_tasks(spec: JobSpec, plan) -> list[str]:
    """The engine tasks a job runs, one pass each: an OpenAI batch input's lines name theirs
    (`JsonlPlan.tasks`: generate for chat and completions lines, embed for /v1/embeddings
    lines), any other input runs `engine.task`."""
    return getattr(plan, "tasks", None) or [spec.engine.task]


def _run_passes(run: RunContext) -> dict[str, int] | None:
    """The job's pipeline once per task its input names (`job_tasks`), in one run: each pass reads
    only its own task's lines (the OpenAI batch plan's `task`) with the engine config given that
    task (`JobSpec.for_task`); a cancel requested during a pass ends the job after it.  Returns
    the passes' `tokenmill` counters summed (None: the runner reports none)."""
    tasks = job_tasks(run.spec, run.plan)
    counters: dict[str, int] | None = None
    for i, task in enumerate(tasks):
        if hasattr(run.plan, "task"):
            run.plan.task = task
        if i and _job_row(run.eng, run.job_id).get("cancel_requested"):
            break
        if len(tasks) > 1:
            run.say(f"pass {i + 1} of {len(tasks)}: the {EMBED_LINES if task == 'embed' else GENERATE_LINES} lines, "
                f"engine task {task}")
        got = _run_with_retries(run.for_task(task))
        if got is not None:
            counters = {k: (counters or {}).get(k, 0) + got.get(k, 0) for k in {*(counters or {}), *got}}
    return counters


GENERATE_LINES, EMBED_LINES = "chat and completions", "/v1/embeddings"


def _job_row(eng, job_id: str) -> dict[str, Any]:
    """The job's row, which the running job holds claimed: JobError if it is gone."""
    job = S.JobStore(eng).get(job_id)
    if job is None:
        raise JobError(f"job {job_id} is no longer in the database")
    return job


def _run_with_retries(run: RunContext) -> dict[str, int] | None:
    """Run the pipeline; when one of its worker processes died (kill -9, the OOM killer), run it
    again, up to `runner.worker_retries` times, in the same run (the launcher held its devices
    all along): the new pipeline resumes from the database, so only the dead worker's batches
    in flight are generated twice.  Returns the last pipeline's `tokenmill` counters (None:
    its runner reports none)."""
    retries = run.spec.runner.worker_retries
    for attempt in range(retries + 1):
        try:
            return _run_pipeline(run)
        except Exception as err:
            if attempt == retries or not worker_died(err):
                raise
            log.warning("job %s: %s; running the pipeline again (retry %d of %d), resuming from the database",
                        run.job_id, first_line(err), attempt + 1, retries)
    return None  # not reached: worker_retries >= 0, and the last attempt returns or raises


def _run_pipeline(run: RunContext) -> dict[str, int] | None:
    watch_sdk_workers()  # a dead SDK worker fails the pipeline instead of hanging it
    parts = run.pipeline_parts()
    p = beam.Pipeline(options=pipeline_options(run.spec))
    build_pipeline(p, run.spec, parts)
    result = p.run()
    result.wait_until_finish()
    state = str(getattr(result, "state", "DONE"))
    if "FAIL" in state.upper() or "CANCEL" in state.upper():
        raise RuntimeError(f"pipeline ended in state {state}")
    return _counters(result)


def _counters(result) -> dict[str, int] | None:
    """The pipeline's `tokenmill` counters, summed over steps (None: the runner reports none)."""
    try:
        found = result.metrics().query(MetricsFilter().with_namespace("tokenmill"))["counters"]
    except Exception:  # a runner without metrics (Beam's DaskRunner)
        return None
    out: dict[str, int] = {}
    for c in found:
        out[c.key.metric.name] = out.get(c.key.metric.name, 0) + int(c.committed or c.attempted or 0)
    return out


def input_read(counters: dict[str, int] | None, plan) -> dict[str, Any]:
    """What this run's workers read of the input (metrics `input`)."""
    c = counters or {}
    return {
        "rows_read": c.get("rows_read"),
        "rows_skipped_done": c.get("rows_skipped_done"),
        "bytes_read": c.get("input_bytes_read"),
        "file_bytes": plan.bytes,
        "counts": "this run's workers (Beam counters; null: the runner reports none): rows turned into records, "
                  "rows left out as already done, and bytes read from the input's Parquet files (footers, row "
                  "groups; not JSONL) against the files' size; summed over the run's passes (a batch file "
                  "mixing tasks: a later pass counts the rows an earlier pass answered as done)",
    }


def compute_metrics(eng, job_id: str, spec: JobSpec, total: int, hw: dict[str, Any], job_wall_s: float | None = None,
                    utilization: dict[str, Any] | None = None, merged: bool = False):
    m = stored_metrics(eng, job_id, JobTerms(
        total=total, hardware=hw, price_per_hour=spec.price_per_hour, prices=spec.prices,
        engine_config=spec.engine.model_dump(mode="json"), token_budget=spec.batching.token_budget,
        job_wall_s=job_wall_s, utilization=utilization, cache_mode=spec.cache,
    ), merged=merged)
    m["hardware"] = hw
    return m
