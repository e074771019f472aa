"""The server's scheduler: each tick moves every unfinished batch along (validate it, run its
job, ask the job to stop, finalize it), and the coordinator (`coordinator.take`: priority,
then age; `concurrent_models`; one job per model's engine) starts queued jobs on the warm
engine pool (engines.py), whose typed reports (`Launched`, `ProcessDied`) end them.  What is
done with a batch's files at its steps is the service's (`BatchSteps`, finalize.BatchFiles).
Every `sweep_s` the thread also removes the expired files (`sweep`: OpenAI's `expires_after`).

A batch's job row is the queue and run store (`JobStore`): it holds the batch's priority and
API key, and its `attempts`, the runs that ended in an error or a dead engine process, so a
restarted server keeps counting where the last one stopped; a batch whose job failed
`MAX_ATTEMPTS` times fails.  Whether a batch's run is over is read from its job's row (`ended`)."""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Protocol

from sqlalchemy.engine import Engine

from tokenmill.jobs.lifecycle.coordinator import queue_order, take
from tokenmill.jobs.lifecycle.jobrow import job_values
from tokenmill.jobs.lifecycle.launchers import DONE, Event, Launched, ProcessDied
from tokenmill.jobs.serve.blobs import Blobs
from tokenmill.jobs.serve.config import ServeConfig
from tokenmill.jobs.serve.engines import EngineProcess
from tokenmill.jobs.serve.quotas import Quotas
from tokenmill.schemas import storage as S
from tokenmill.schemas.errors import first_line
from tokenmill.schemas.wire.openai.objects import batch_status, line_error

log = logging.getLogger(__name__)

#: Runs of one batch's job that ended in an error or a dead engine process before the batch
#: fails (and checks of its input that raised before it fails in validation).
MAX_ATTEMPTS = 3
#: The longest wait between ticks (a new batch, a cancel or an engine's report wakes it sooner).
TICK_S = 0.5
#: A shared job's run is taken as alive while its heartbeat (every 5 s, runner._Heartbeat) is this fresh.
RUN_SEEN_S = 15.0


def ended(job: dict[str, Any] | None) -> bool:
    """Whether a batch's job has run its last: every row answered or dead-lettered, cancelled,
    or failed with no attempt left."""
    if job is None:
        return False
    return job["status"] in (*DONE, "cancelled") or (job["status"] == "failed"
                                                     and int(job.get("attempts") or 0) >= MAX_ATTEMPTS)


class BatchSteps(Protocol):
    """What the scheduler has done at a batch's steps, with its files and its row
    (finalize.BatchFiles)."""

    def validate(self, b: dict[str, Any]) -> dict[str, Any] | None:
        """Check the batch's input file: its row failed with the errors (None), or queued (the row)."""
        ...

    def fail_validating(self, b: dict[str, Any], errors: list[dict[str, Any]], *, lines: int,
                        model: str | None) -> None:
        """End the batch `failed` in validation, with its errors."""
        ...

    def finalize(self, b: dict[str, Any]) -> None:
        """End the batch as its job's row says its job ended, with its result files."""
        ...


class Scheduler:
    """The service's scheduler thread (`start`, `stop`) and the warm engines it starts jobs on
    (`engines`, by model).  `steps` does what a batch's files need at validation and at its
    end; `quotas` holds a key's batches back in `validating`."""

    def __init__(self, cfg: ServeConfig, eng: Engine, steps: BatchSteps, *, quotas: Quotas, blobs: Blobs):
        self.cfg, self.eng, self.steps, self.quotas, self.blobs = cfg, eng, steps, quotas, blobs
        self.db_url = cfg.db_url()
        self.batches, self.files = S.BatchStore(eng), S.FileStore(eng)
        self.engines: dict[str, EngineProcess] = {}
        self._sweep_at = 0.0  # when the next sweep of expired files is due (monotonic)
        #: The online API's router (jobs/serve/online.py), which each engine process started
        #: answers online requests for (None: batches only)
        self.online: Any = None
        self._engines_lock = threading.Lock()
        #: The replica was told SIGTERM (service.start_draining): no new run is dispatched.
        self.draining = False
        self._wake, self._stop = threading.Event(), threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, daemon=True, name="tokenmill-serve-scheduler")
        self._thread.start()

    def stop(self) -> None:
        """End the thread (after its tick) and stop every engine process."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(10)
        for e in self.engines.values():
            e.stop()

    def wake(self) -> None:
        """Tick now: a batch was created or asked to stop."""
        self._wake.set()

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.tick()
            except Exception:  # one bad batch or a database hiccup must not stop the service
                log.exception("scheduler tick failed")
            if time.monotonic() >= self._sweep_at:  # apart from the tick: neither stops the other
                self._sweep_at = time.monotonic() + self.cfg.sweep_s
                try:
                    self.sweep(time.time())
                except Exception:  # a files store that does not answer: the next sweep tries again
                    log.exception("sweep of expired files failed")
            self._wake.wait(TICK_S)
            self._wake.clear()

    def tick(self) -> None:
        now = time.time()
        queued: list[dict[str, Any]] = []
        for b in self.batches.unfinished():
            status = batch_status(b)
            running = any(e.running == b["id"] for e in self.engines.values())
            if status == "validating":
                if self.quotas.holds(b):
                    continue
                try:
                    valid = self.steps.validate(b)
                except Exception as err:  # the server's fault or its store's, not the file's: tried again
                    self._validation_fault(b, err)
                    valid = None
                if valid is not None:
                    queued.append(valid)
            elif status == "finalizing":
                self.steps.finalize(b)
            elif running:
                if status == "cancelling" or now >= b["expires_at"]:
                    self._ask_job_to_stop(b["id"])
            else:
                job = S.JobStore(self.eng).get(b["id"])
                if status == "cancelling" or now >= b["expires_at"] or ended(job):
                    if not ended(job) and self._runs_elsewhere(job):
                        self._ask_job_to_stop(b["id"])  # other replicas' engines stop; the last one ends the job
                    else:
                        self.steps.finalize(b)  # its job ended, perhaps while no server watched
                elif self._wants_hands(job):
                    queued.append(b)
        self._dispatch(queued)

    def sweep(self, now: float) -> int:
        """Remove the files expired at `now` that no batch not ended reads: each marked deleted
        (not found from then on), its bytes and line index removed from the files store, then its
        row.  Every step may be done twice (another replica's sweep, one cut off): none fails for
        it.  Returns the files removed."""
        removed = 0
        for file_id in self.files.expired(now):
            if self.files.take_expired(file_id, now):
                self.blobs.delete(file_id)
                self.files.drop(file_id)
                removed += 1
        if removed:
            log.info("removed %d expired file(s)", removed)
        return removed

    def _runs_elsewhere(self, job: dict[str, Any] | None) -> bool:
        """Whether a shared job is running on another replica's engine (a run of it seen lately)."""
        return bool(job and job["status"] == "running" and self.cfg.replicated()
                    and S.JobStore(self.eng).live_runs(job["id"], within_s=RUN_SEEN_S))

    def _wants_hands(self, job: dict[str, Any] | None) -> bool:
        """Whether this replica's engine should run the batch's job now: it has not started, or
        (a shared job, docs/SERVING.md "Replicas") units of it are free to take (never taken, a
        dead replica's expired, a drained one's handed back), or every unit is done but nobody
        is finishing it (its finisher died).  A shared job whose every unit a live replica holds
        is left to them: asking would start a run that finds nothing to do."""
        if job is None or job["status"] != "running" or not self.cfg.replicated():
            return True
        st = S.LeaseStore(self.eng).state(job["id"])
        if st["units"] == 0 or st["free"]:
            return True
        return st["done"] == st["units"] and not S.JobStore(self.eng).live_runs(job["id"], within_s=RUN_SEEN_S)

    def _dispatch(self, queued: list[dict[str, Any]]) -> None:
        if self.draining:
            return
        busy = [model for model, e in self.engines.items() if e.running]
        for b in take(sorted(queued, key=lambda b: queue_order(b, at="created_at")),
                      slots=self.cfg.concurrent_models, busy=busy, model_of=lambda b: b["model"]):
            e = self.engine(b["model"])
            spec = self.cfg.job_spec(b["model"], input=self.blobs.url(b["input_file_id"]),
                                     output=str(self.cfg.work_root() / b["id"]), job_id=b["id"])
            # the job's row, queued: its priority, its key and the count of its attempts (once; a rerun keeps it)
            S.JobStore(self.eng).submit({"id": b["id"], **job_values(spec), "status": "pending",
                                         "submitted_at": S.utcnow(), "cancel_requested": False,
                                         "priority": b["priority"], "api_key": b["owner"]})
            e.launch(b["id"], spec.model_dump(mode="json", exclude_none=True), self.db_url)

    def engine(self, model: str) -> EngineProcess:
        """The model's engine process, started (again) when there is none alive (a batch's
        dispatch and an online request alike)."""
        with self._engines_lock:
            e = self.engines.get(model)
            if e is None or not e.alive():
                e = self._engine(model)
            return e

    def _engine(self, model: str) -> EngineProcess:
        old = self.engines.get(model)
        if old is not None:
            old.stop(timeout=1)
        e = EngineProcess(model, self.cfg.idle_unload_s, str(self.cfg.home() / "logs" / f"engine-{model}.log"),
                          self.on_engine)
        if self.online is not None:
            e.online, e.on_online = self.online.setup(model), self.online.on_message
        e.start()
        self.engines[model] = e
        return e

    def on_engine(self, model: str, event: Event) -> None:
        """An engine process's report (its reader thread): a run's end frees the engine; one
        that raised or died counts an attempt; one that ended `failed` is not tried again."""
        if isinstance(event, ProcessDied) and event.job_id is not None and self.draining:
            pass  # stopped at drain_s (a preemption), not the batch's fault: its units are handed back
        elif isinstance(event, ProcessDied) and event.job_id is not None:
            self._count_attempt(event.job_id, "its engine process died")
        elif isinstance(event, Launched) and event.raised:
            self._count_attempt(event.job_id, event.note or "the job failed")
        elif isinstance(event, Launched) and event.status == "failed":  # its rows do not reconcile: final
            S.JobStore(self.eng).add_attempt(event.job_id, MAX_ATTEMPTS)
        e = self.engines.get(model)
        if isinstance(event, (Launched, ProcessDied)) and e is not None:
            e.running = None  # busy: run again at a later tick, once the job's last owner is gone
        self._wake.set()

    def _count_attempt(self, job_id: str, why: str) -> None:
        js = S.JobStore(self.eng)
        n = js.add_attempt(job_id)
        log.warning("batch %s: %s (attempt %d)", job_id, why, n)
        if n >= MAX_ATTEMPTS:
            js.finish(job_id, status="failed", error=f"the batch's job failed {MAX_ATTEMPTS} times; last: {why}"[:1000],
                      heartbeat_at=None, owner=None)

    def _ask_job_to_stop(self, batch_id: str) -> None:
        js = S.JobStore(self.eng)
        job = js.get(batch_id)
        if job is not None and job["status"] == "running" and not job.get("cancel_requested"):
            js.request_cancel(batch_id)

    def _validation_fault(self, b: dict[str, Any], err: Exception) -> None:
        """Validation raised (a store that did not answer, a fault in the server): checked again at
        the next ticks, and after `MAX_ATTEMPTS` the batch fails with the reason, so it never waits
        in `validating` for good (the count is the batch row's, kept across a restart)."""
        log.exception("batch %s: validation", b["id"])
        n = int(b.get("validation_attempts") or 0) + 1
        self.batches.set(b["id"], validation_attempts=n)
        if n >= MAX_ATTEMPTS:
            error = line_error("validation_failed", f"the server could not check the file ({n} tries); last: "
                                                    f"{first_line(err, 500)}", None)
            self.steps.fail_validating(b, [error], lines=0, model=None)
