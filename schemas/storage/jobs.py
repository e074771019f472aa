"""Job rows and their runs: claim, heartbeat, finish, cancel, the pending-job queue, and a
named lock (`tokenmill run-pending`)."""

from __future__ import annotations

import datetime as dt
import time
from contextlib import contextmanager
from typing import Any, Iterator

from sqlalchemy import delete, func, insert, select, update
from sqlalchemy.exc import IntegrityError

from tokenmill.schemas import tables as T
from tokenmill.schemas.storage.database import (
    SqlStore,
    StorageError,
    aware,
    insert_ignore,
    owner_tag,
    pid_alive,
    utcnow,
    write_lock,
)

#: A running job whose heartbeat is older than this is taken as dead (killed run).
STALE_AFTER_S = 60.0


class JobBusy(RuntimeError):
    pass


def is_live(job: dict[str, Any], now: dt.datetime | None = None) -> bool:
    """A `running` job is live while its owner's heartbeat is fresh and its process exists."""
    if job.get("status") != "running":
        return False
    now = now or utcnow()
    hb = job.get("heartbeat_at")
    fresh = hb is not None and (now - aware(hb)).total_seconds() < STALE_AFTER_S
    return fresh and pid_alive(job.get("owner"))


class JobStore(SqlStore):
    """The `jobs`, `runs` and `locks` tables: a job row is a dict of the `jobs` columns."""

    def get(self, job_id: str) -> dict[str, Any] | None:
        with self.engine.connect() as conn:
            row = conn.execute(select(T.jobs).where(T.jobs.c.id == job_id)).mappings().first()
        return dict(row) if row else None

    def recent(self, limit: int = 20) -> list[dict[str, Any]]:
        """The latest jobs, newest first (by start, else submission)."""
        order = func.coalesce(T.jobs.c.started_at, T.jobs.c.submitted_at)
        with self.engine.connect() as conn:
            rows = conn.execute(select(T.jobs).order_by(order.desc(), T.jobs.c.id).limit(limit)).mappings().all()
        return [dict(r) for r in rows]

    def claim(self, job_id: str, values: dict[str, Any]) -> dict[str, Any]:
        """Create the job row, or take over an existing one, as `running` by this process.

        Two runs of one job id at once: the second raises JobBusy.  The claim is a
        compare-and-set on (status, owner, heartbeat) so two racing claimers cannot
        both win."""
        me = owner_tag()
        now = utcnow()
        inserted_first: IntegrityError | None = None
        with self.engine.begin() as conn:
            row = conn.execute(select(T.jobs).where(T.jobs.c.id == job_id)).mappings().first()
            if row is None:
                try:
                    conn.execute(
                        insert(T.jobs).values(
                            id=job_id, status="running", owner=me, heartbeat_at=now, started_at=now,
                            submitted_at=now, cancel_requested=False, **values,
                        )
                    )
                    return {"resumed": False}
                except IntegrityError as err:
                    inserted_first = err  # someone inserted it first: fall through to the take-over path
        with self.engine.begin() as conn:
            found = conn.execute(select(T.jobs).where(T.jobs.c.id == job_id)).mappings().first()
            if found is None:  # the insert failed for another reason (a NOT NULL column, say), or a delete raced
                raise inserted_first or JobBusy(f"job {job_id!r} vanished while being claimed; run it again")
            job = dict(found)
            if is_live(job):
                raise JobBusy(f"job {job_id!r} is already running (owner {job['owner']}); not starting a second run")
            q = update(T.jobs).where(T.jobs.c.id == job_id, T.jobs.c.status == job["status"])
            q = (q.where(T.jobs.c.owner == job["owner"]) if job["owner"] is not None
                 else q.where(T.jobs.c.owner.is_(None)))
            res = conn.execute(
                q.values(
                    status="running", owner=me, heartbeat_at=now, started_at=job["started_at"] or now,
                    finished_at=None, error=None, cancel_requested=False, **values,
                )
            )
            if res.rowcount != 1:
                raise JobBusy(f"job {job_id!r} was claimed by another run at the same moment; not starting a second run")
        return {"resumed": True, "previous_status": job["status"]}

    def join(self, job_id: str, values: dict[str, Any]) -> dict[str, Any]:
        """A shared job's participant (`runner.lease_s`: several processes run it at once, each
        unit under a lease): the row is created `running`, or a row `pending` or `failed` is made
        `running` again (no owner: every participant's run row says it is alive), or a `running`
        one is joined as it is, its cancel request standing.  A job that ended (succeeded,
        partial, cancelled) is left alone: JobBusy, nothing to join."""
        try:
            return self._join(job_id, values)
        except IntegrityError:  # another participant created the row at the same moment: join it
            return self._join(job_id, values)

    def _join(self, job_id: str, values: dict[str, Any]) -> dict[str, Any]:
        now = utcnow()
        with self.engine.begin() as conn:
            write_lock(conn)
            q = select(T.jobs).where(T.jobs.c.id == job_id)
            if conn.dialect.name == "postgresql":
                q = q.with_for_update()
            row = conn.execute(q).mappings().first()
            if row is None:
                conn.execute(insert(T.jobs).values(id=job_id, status="running", owner=None, heartbeat_at=now,
                                                   started_at=now, submitted_at=now, cancel_requested=False,
                                                   **values))
                return {"resumed": False}
            job = dict(row)
            if job["status"] in ("succeeded", "partial", "cancelled"):
                raise JobBusy(f"job {job_id!r} has ended ({job['status']}); nothing to join")
            fresh = {} if job["status"] == "running" else {"cancel_requested": False, "error": None,
                                                           "finished_at": None}
            conn.execute(update(T.jobs).where(T.jobs.c.id == job_id).values(
                status="running", owner=None, heartbeat_at=now, started_at=job["started_at"] or now,
                **fresh, **values))
        return {"resumed": True, "previous_status": job["status"]}

    def live_runs(self, job_id: str, within_s: float) -> int:
        """Runs of the job not finished and seen (their heartbeat) in the last `within_s` seconds."""
        with self.engine.connect() as conn:
            return int(conn.execute(select(func.count()).select_from(T.runs).where(
                T.runs.c.job_id == job_id, T.runs.c.finished_at.is_(None),
                T.runs.c.seen_at > time.time() - within_s)).scalar() or 0)

    def heartbeat(self, job_id: str, run_id: str | None = None) -> None:
        """Mark the job's owner alive (and, given `run_id`, that run: `runs.seen_at`)."""
        with self.engine.begin() as conn:
            conn.execute(update(T.jobs).where(T.jobs.c.id == job_id, T.jobs.c.owner == owner_tag())
                         .values(heartbeat_at=utcnow()))
            if run_id is not None:
                conn.execute(update(T.runs).where(T.runs.c.job_id == job_id, T.runs.c.run_id == run_id)
                             .values(seen_at=time.time()))

    def finish(self, job_id: str, **values: Any) -> None:
        with self.engine.begin() as conn:
            conn.execute(update(T.jobs).where(T.jobs.c.id == job_id).values(finished_at=utcnow(), **values))

    def request_cancel(self, job_id: str) -> dict[str, Any] | None:
        job = self.get(job_id)
        if job is None:
            raise StorageError(f"no job with id {job_id!r}")
        with self.engine.begin() as conn:
            if job["status"] == "pending":
                conn.execute(update(T.jobs).where(T.jobs.c.id == job_id)
                             .values(status="cancelled", finished_at=utcnow()))
            elif job["status"] == "running":
                conn.execute(update(T.jobs).where(T.jobs.c.id == job_id).values(cancel_requested=True))
        return self.get(job_id)

    def cancel_requested(self, job_id: str) -> bool:
        with self.engine.connect() as conn:
            return bool(conn.execute(select(T.jobs.c.cancel_requested).where(T.jobs.c.id == job_id)).scalar())

    def delete(self, job_id: str) -> None:
        """The job and every row of it, in every table keyed by job id."""
        with self.engine.begin() as conn:
            for t in (T.outputs, T.dead_letters, T.batches, T.workers, T.id_claims, T.runs, T.unit_leases):
                conn.execute(delete(t).where(t.c.job_id == job_id))
            conn.execute(delete(T.jobs).where(T.jobs.c.id == job_id))

    # -- runs of a job (the first and every resume)

    def start_run(self, job_id: str, run_id: str, started_at: float) -> None:
        """Record a run of a job as its launcher starts it (wall clock, time.time())."""
        with self.engine.begin() as conn:
            insert_ignore(conn, T.runs, [{"job_id": job_id, "run_id": run_id, "owner": owner_tag(),
                                          "started_at": started_at, "seen_at": started_at, "finished_at": None}])

    def finish_run(self, job_id: str, run_id: str, finished_at: float) -> None:
        with self.engine.begin() as conn:
            conn.execute(update(T.runs).where(T.runs.c.job_id == job_id, T.runs.c.run_id == run_id)
                         .values(seen_at=finished_at, finished_at=finished_at))

    def runs(self, job_id: str) -> list[dict[str, Any]]:
        """A job's runs, oldest first."""
        with self.engine.connect() as conn:
            q = select(T.runs).where(T.runs.c.job_id == job_id).order_by(T.runs.c.started_at, T.runs.c.run_id)
            return [dict(r) for r in conn.execute(q).mappings()]

    # -- the pending-job queue

    def submit(self, values: dict[str, Any]) -> bool:
        """Insert a job row as given (a `pending` one); False if its id exists already."""
        try:
            with self.engine.begin() as conn:
                conn.execute(insert(T.jobs).values(**values))
            return True
        except IntegrityError:
            return False

    def requeue(self, job_id: str, from_status: str, values: dict[str, Any]) -> bool:
        """Put a job back in the queue (`pending`, no owner, no cancel request, no error) with
        `values` (its spec, submitted_at), only if its status is still `from_status`: a
        compare-and-set, so a racing submit or run makes this return False."""
        with self.engine.begin() as conn:
            res = conn.execute(
                update(T.jobs).where(T.jobs.c.id == job_id, T.jobs.c.status == from_status)
                .values(status="pending", owner=None, heartbeat_at=None, finished_at=None, error=None,
                        cancel_requested=False, **values)
            )
        return res.rowcount == 1

    def queued(self, *, served: bool = False) -> list[dict[str, Any]]:
        """Jobs `pending` or `running`, highest priority first, then in submission order (oldest
        first; ties by id): those of served batches (an `api_key`) with `served`, else the others."""
        j = T.jobs.c
        with self.engine.connect() as conn:
            rows = conn.execute(
                select(T.jobs).where(j.status.in_(("pending", "running")),
                                     j.api_key.is_not(None) if served else j.api_key.is_(None))
                .order_by(j.priority.desc(), j.submitted_at, j.id)
            ).mappings().all()
        return [dict(r) for r in rows]

    def add_attempt(self, job_id: str, n: int = 1) -> int:
        """Count `n` more runs of a job that ended in an error (one statement: two counters
        cannot lose one); returns the new count, 0 when there is no such job."""
        with self.engine.begin() as conn:
            conn.execute(update(T.jobs).where(T.jobs.c.id == job_id).values(attempts=T.jobs.c.attempts + n))
            return int(conn.execute(select(T.jobs.c.attempts).where(T.jobs.c.id == job_id)).scalar() or 0)

    @contextmanager
    def named_lock(self, name: str, stale_after_s: float = 6 * 3600) -> Iterator[bool]:
        """Yields True if this process holds the lock, False if another live process does."""
        me = owner_tag()
        got = False
        with self.engine.begin() as conn:
            row = conn.execute(select(T.locks).where(T.locks.c.name == name)).mappings().first()
            if row is not None:
                age = (utcnow() - aware(row["acquired_at"])).total_seconds()
                if pid_alive(row["owner"]) and age < stale_after_s:
                    got = False
                else:
                    conn.execute(delete(T.locks).where(T.locks.c.name == name, T.locks.c.owner == row["owner"]))
                    row = None
        if row is None:
            try:
                with self.engine.begin() as conn:
                    conn.execute(insert(T.locks).values(name=name, owner=me, acquired_at=utcnow()))
                got = True
            except IntegrityError:
                got = False
        try:
            yield got
        finally:
            if got:
                with self.engine.begin() as conn:
                    conn.execute(delete(T.locks).where(T.locks.c.name == name, T.locks.c.owner == me))
