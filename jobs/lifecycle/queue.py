"""The pending-job queue: `submit` records a job, `run_pending` runs the queue (the
coordinator's `take` picks each job, a launcher runs it).

The jobs table is the queue.  `submit` inserts a `pending` row holding the job
spec and returns at once (no model, no engine: a terminal or a service can
submit while the accelerators are busy elsewhere).  `run_pending` is what cron
or Airflow calls: it takes the database lock `run-pending` (one runner at a
time, across machines sharing the database), then runs pending jobs oldest
first, each through the normal job lifecycle, so each is resumable and a
second run of the same id refuses; a job whose runner died (killed host or
process) is picked up again and resumes.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable

from sqlalchemy.engine import Engine

from tokenmill.jobs.lifecycle.coordinator import take
from tokenmill.jobs.lifecycle.jobrow import job_values
from tokenmill.jobs.lifecycle.launchers import Launched
from tokenmill.schemas import storage as S
from tokenmill.schemas.config import JobSpec, SpecError, load_spec

LOCK_NAME = "run-pending"
#: A job in one of these states may be submitted again: it goes back to the queue
#: and its rerun resumes from what the database already holds.
REQUEUABLE = ("failed", "cancelled")


class QueueError(RuntimeError):
    """A submit or run-pending that cannot proceed; the message is one line."""


class QueueBusy(QueueError):
    """Another live process holds the run-pending lock or runs the job."""


@dataclass
class Submitted:
    job_id: str
    status: str
    """`pending` (newly queued or queued again) or `already pending`."""


def absolute_paths(spec: JobSpec) -> JobSpec:
    """Local input/output paths made absolute: run-pending may run in another directory."""
    update = {}
    for key in ("input", "output"):
        v = getattr(spec, key)
        if "://" not in v and not os.path.isabs(v):
            update[key] = os.path.abspath(v)
    return spec.model_copy(update=update) if update else spec


def submit(eng: Engine, spec: JobSpec) -> Submitted:
    """Queue a job.  Submitting an id that is already pending is a no-op (safe to
    retry); a failed or cancelled id is queued again; a running, succeeded or
    partial one is refused.  Local paths are stored absolute."""
    spec = absolute_paths(spec)
    job_id = spec.derived_job_id()
    values = {"id": job_id, **job_values(spec), "status": "pending", "submitted_at": S.utcnow(), "cancel_requested": False}
    if S.JobStore(eng).submit(values):
        return Submitted(job_id, "pending")
    job = S.JobStore(eng).get(job_id)
    if job is None:  # removed since the insert found it
        raise QueueBusy(f"job {job_id!r} changed while it was being queued; try again")
    if job["status"] == "pending":
        return Submitted(job_id, "already pending")
    if job["status"] == "running" and S.is_live(job):
        raise QueueBusy(f"job {job_id!r} is running now (owner {job['owner']}); not queueing it again")
    if job["status"] not in REQUEUABLE and job["status"] != "running":
        raise QueueError(
            f"job {job_id!r} already exists with status {job['status']!r}; choose another --job-id "
            "(or `tokenmill run` the same id to resume it)"
        )
    if not S.JobStore(eng).requeue(job_id, job["status"], {"spec": values["spec"], "submitted_at": values["submitted_at"]}):
        raise QueueBusy(f"job {job_id!r} changed while it was being queued again; try again")
    return Submitted(job_id, "pending")


def pending_jobs(eng: Engine) -> list[dict[str, Any]]:
    """Jobs to run, in submission order (oldest first; ties by id): pending ones, and
    `running` ones whose runner died (stale heartbeat or gone process), which resume."""
    return [j for j in S.JobStore(eng).queued() if j["status"] == "pending" or not S.is_live(j)]


def spec_of(job: dict[str, Any]) -> JobSpec:
    """The JobSpec stored on a pending job row (its db key is not used: the queue's database is)."""
    data = dict(job["spec"] or {})
    data.pop("db", None)
    data["job_id"] = job["id"]
    try:
        return load_spec(data, source=f"stored spec of job {job['id']}")
    except SpecError as err:
        raise QueueError(str(err)) from None


def run_pending(
    eng: Engine,
    run: Callable[[JobSpec], Launched],
    *,
    limit: int | None = None,
    on_start: Callable[[dict[str, Any]], None] | None = None,
    on_done: Callable[[Launched], None] | None = None,
) -> list[Launched]:
    """Run pending jobs oldest first (the coordinator's order: priority, then age) under the
    `run-pending` database lock.

    `run(spec)` runs one job (normally the in-process launcher's `run_here`) and reports its
    `Launched`; a job whose stored spec cannot be read is `failed`, and the queue moves on.
    Jobs submitted while the queue runs are picked up too.  Raises QueueBusy if another live
    process holds the lock.
    """
    outcomes: list[Launched] = []
    with S.JobStore(eng).named_lock(LOCK_NAME) as got:
        if not got:
            raise QueueBusy("another `tokenmill run-pending` holds the queue lock; not starting a second runner")
        tried: set[str] = set()
        while limit is None or len(outcomes) < limit:
            nxt = take((j for j in pending_jobs(eng) if j["id"] not in tried), slots=1)
            if not nxt:
                break
            tried.add(nxt[0]["id"])
            if on_start:
                on_start(nxt[0])
            outcome = _run_one(eng, nxt[0], run)
            outcomes.append(outcome)
            if on_done:
                on_done(outcome)
    return outcomes


def _run_one(eng: Engine, job: dict[str, Any], run: Callable[[JobSpec], Launched]) -> Launched:
    job_id = job["id"]
    try:
        spec = spec_of(job)
    except QueueError as err:
        done = Launched(job_id, "failed", str(err), raised=True, error=err)
    else:
        done = run(spec)
    if done.status == "failed" and done.raised:
        cur = S.JobStore(eng).get(job_id)
        if cur is not None and cur["status"] == "pending":  # failed before it was claimed
            S.JobStore(eng).finish(job_id, status="failed", error=(done.note or "")[:1000])
    return done
