"""Work-unit leases: how several processes (the replicas of `tokenmill serve`, each with its
engine) share one job's units, each unit's rows committed by one holder at a time.

A job run in shared mode (`runner.lease_s`) seeds one row per work unit (`seed`).  A worker
takes a unit before it reads it (`take`): a free unit, or one whose holder's lease expired
(its process was killed, frozen or cut off), and the take raises the unit's `epoch`, the
fencing token.  Every batch it commits is fenced (`fence`, inside the commit's transaction):
the unit's row is locked and the commit goes on only while the row still names this holder
and this epoch, so a holder whose unit was taken from it (a zombie resumed after SIGSTOP)
commits nothing, and no row is stored or billed twice.  Holders renew their leases while
they work (`renew`), mark a unit done when its rows are all answered (`finish`), and hand
their units back when they drain (`hand_back`, raising the epoch so nothing in flight lands).

On PostgreSQL the take locks the rows it looks at with FOR UPDATE SKIP LOCKED, so two takers
never wait on each other or take the same unit; SQLite has one writer (`write_lock`)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Iterable

from sqlalchemy import and_, case, func, or_, select, update
from sqlalchemy.engine import Connection

from tokenmill.schemas import tables as T
from tokenmill.schemas.storage.database import SqlStore, chunks, insert_ignore, write_lock


class LeaseLost(RuntimeError):
    """A commit under a lease the holder no longer has: its unit was taken by another holder
    (a higher epoch) or handed back.  Nothing of the commit was written."""


@dataclass(frozen=True)
class Lease:
    """One unit held: by `holder`, at `epoch` (the fencing token every commit shows)."""

    job_id: str
    unit: str
    holder: str
    epoch: int


class LeaseStore(SqlStore):
    """The `unit_leases` table: one row per (job, unit)."""

    def seed(self, job_id: str, units: Iterable[str | tuple[str, int, int, int]]) -> int:
        """One free row per unit not yet known (every participant seeds the same plan; the rows
        of a unit already taken or done are kept): a key, or (key, input file, first row, rows),
        the range `finish_if_complete` counts.  Returns the rows added."""
        rows = []
        for u in units:
            key, f, first, n = (u, None, None, None) if isinstance(u, str) else u
            rows.append({"job_id": job_id, "unit": key, "epoch": 0, "taken": 0, "input_file": f, "first_row": first,
                         "row_count": n})
        n = 0
        with self.engine.begin() as conn:
            for part in chunks(rows):
                n += insert_ignore(conn, T.unit_leases, part)
        return n

    def take(self, job_id: str, unit: str, holder: str, lease_s: float) -> Lease | None:
        """Take `unit` for `lease_s` seconds: when it is not done and free, or its lease expired
        (or is this holder's own).  None when another holder has it, or another taker is
        taking it at this moment (its row locked: skipped, never waited on)."""
        now = time.time()
        c = T.unit_leases.c
        with self.engine.begin() as conn:
            write_lock(conn)
            q = select(c.holder, c.epoch, c.expires_at, c.done_at).where(c.job_id == job_id, c.unit == unit)
            if conn.dialect.name == "postgresql":
                q = q.with_for_update(skip_locked=True)
            row = conn.execute(q).first()
            if row is None or row.done_at is not None:
                return None
            if row.holder is not None and row.holder != holder and (row.expires_at or 0.0) > now:
                return None
            takeover = row.holder is not None and row.holder != holder
            epoch = int(row.epoch) + 1
            conn.execute(update(T.unit_leases).where(c.job_id == job_id, c.unit == unit).values(
                holder=holder, epoch=epoch, expires_at=now + lease_s, taken=c.taken + 1,
                takeovers=c.takeovers + int(takeover)))
        return Lease(job_id, unit, holder, epoch)

    def renew(self, leases: Iterable[Lease], lease_s: float) -> list[Lease]:
        """Extend each lease still held (same holder and epoch, not done) by `lease_s` from now;
        returns the leases lost (taken by another holder, handed back, or done)."""
        lost = []
        now = time.time()
        c = T.unit_leases.c
        with self.engine.begin() as conn:
            for lease in leases:
                res = conn.execute(update(T.unit_leases).where(*_held(lease), c.done_at.is_(None))
                                   .values(expires_at=now + lease_s))
                if res.rowcount != 1:
                    lost.append(lease)
        return lost

    @staticmethod
    def fence(conn: Connection, lease: Lease, lease_s: float | None = None) -> None:
        """In a commit's transaction, before it writes: lock the unit's row and check that
        `lease` still holds it (LeaseLost otherwise: the transaction must not go on).  Given
        `lease_s`, the commit also renews the lease (a holder that commits is alive)."""
        c = T.unit_leases.c
        q = select(c.holder, c.epoch).where(c.job_id == lease.job_id, c.unit == lease.unit)
        if conn.dialect.name == "postgresql":
            q = q.with_for_update()
        row = conn.execute(q).first()
        if row is None or row.holder != lease.holder or int(row.epoch) != lease.epoch:
            now_by = "nobody" if row is None or row.holder is None else f"{row.holder} (epoch {row.epoch})"
            raise LeaseLost(f"unit {lease.unit!r} of job {lease.job_id!r} is no longer held by {lease.holder} "
                            f"at epoch {lease.epoch}: now {now_by}; the commit is refused")
        if lease_s is not None:
            conn.execute(update(T.unit_leases).where(*_held(lease)).values(expires_at=time.time() + lease_s))

    def finish(self, lease: Lease) -> bool:
        """Mark the unit done (its rows all answered or dead-lettered), if `lease` still holds it."""
        with self.engine.begin() as conn:
            res = conn.execute(update(T.unit_leases).where(*_held(lease)).values(done_at=time.time()))
        return res.rowcount == 1

    def unit_rows(self, lease: Lease) -> tuple[int, int, int] | None:
        """(input file, first row, rows) of the unit `lease` still holds and has not finished, as it
        was seeded; None otherwise (or a unit seeded without its range)."""
        c = T.unit_leases.c
        with self.engine.connect() as conn:
            row = conn.execute(select(c.input_file, c.first_row, c.row_count)
                               .where(*_held(lease), c.done_at.is_(None))).first()
        return None if row is None or row.row_count is None else (row.input_file, row.first_row, row.row_count)

    def hand_back(self, holder: str, job_id: str | None = None) -> int:
        """Free every unit `holder` holds and has not finished (of `job_id`, or of every job),
        raising each one's epoch, so a commit still in flight under it is refused.  Returns the
        units handed back."""
        c = T.unit_leases.c
        q = update(T.unit_leases).where(c.holder == holder, c.done_at.is_(None))
        if job_id is not None:
            q = q.where(c.job_id == job_id)
        with self.engine.begin() as conn:
            res = conn.execute(q.values(holder=None, expires_at=None, epoch=c.epoch + 1))
        return int(res.rowcount or 0)

    def add_lost(self, lease: Lease, rows: int, output_tokens: int) -> None:
        """Count engine work whose commit was refused (this lease was lost): rows and output
        tokens generated for nothing, kept on the unit (`work lost to failures`)."""
        c = T.unit_leases.c
        with self.engine.begin() as conn:
            conn.execute(update(T.unit_leases).where(c.job_id == lease.job_id, c.unit == lease.unit).values(
                lost_rows=c.lost_rows + rows, lost_output_tokens=c.lost_output_tokens + output_tokens))

    def state(self, job_id: str, now: float | None = None) -> dict[str, Any]:
        """The job's units: how many, done, held by a live lease, free to take (never taken,
        handed back, or expired), how often taken over after an expiry, and the work lost."""
        now = time.time() if now is None else now
        c = T.unit_leases.c
        live = and_(c.done_at.is_(None), c.holder.is_not(None), c.expires_at > now)
        free = and_(c.done_at.is_(None), or_(c.holder.is_(None), c.expires_at <= now))
        q = select(func.count(), func.count(c.done_at), func.sum(_flag(live)), func.sum(_flag(free)),
                   func.coalesce(func.sum(c.takeovers), 0), func.coalesce(func.sum(c.lost_rows), 0),
                   func.coalesce(func.sum(c.lost_output_tokens), 0)).where(c.job_id == job_id)
        with self.engine.connect() as conn:
            n, done, held, free_n, takeovers, lost_rows, lost_tokens = conn.execute(q).one()
        return {"units": int(n), "done": int(done), "held": int(held or 0), "free": int(free_n or 0),
                "takeovers": int(takeovers), "lost_rows": int(lost_rows), "lost_output_tokens": int(lost_tokens)}

    def lost_work(self, job_id: str) -> dict[str, Any]:
        """Engine work a shared job spent on rows no commit kept, as the job's metrics report it
        (`failures`): units taken over after their holder's lease expired (killed, frozen), rows
        and output tokens whose commit a lost lease refused (a zombie's), and rows admitted to an
        engine that the same worker never committed (each worker writes its admitted count ahead
        of every batch: a killed replica's batches in flight)."""
        st = self.state(job_id)
        w, o = T.workers.c, T.outputs.c
        with self.engine.connect() as conn:
            admitted = {k: int(v or 0) for k, v in conn.execute(
                select(w.worker, w.admitted_rows).where(w.job_id == job_id))}
            committed = {k: int(v) for k, v in conn.execute(
                select(o.worker, func.count()).where(o.job_id == job_id, o.sample == 0).group_by(o.worker))}
        return {"units_taken_over": st["takeovers"], "rows_refused": st["lost_rows"],
                "output_tokens_refused": st["lost_output_tokens"],
                "rows_admitted_not_committed": sum(max(0, n - committed.get(k, 0)) for k, n in admitted.items()),
                "counts": "engine work no commit kept: units another replica took over after their lease expired, "
                          "rows whose commit a lost lease refused, and per engine worker the rows it admitted "
                          "(written ahead of each batch) less the rows it committed (engine-side dead letters "
                          "count as not committed)"}

    def totals(self) -> dict[str, int]:
        """Over every shared job: units taken over after their lease expired, and the rows and
        output tokens whose commit a lost lease refused (what `/metrics` shows as work lost)."""
        c = T.unit_leases.c
        q = select(func.coalesce(func.sum(c.takeovers), 0), func.coalesce(func.sum(c.lost_rows), 0),
                   func.coalesce(func.sum(c.lost_output_tokens), 0))
        with self.engine.connect() as conn:
            takeovers, rows, tokens = conn.execute(q).one()
        return {"units_taken_over": int(takeovers), "rows_refused": int(rows), "output_tokens_refused": int(tokens)}

    def holders(self, job_id: str) -> dict[str, int]:
        """Units done per holder that finished them (which replicas' engines answered the job)."""
        c = T.unit_leases.c
        q = select(c.holder, func.count()).where(c.job_id == job_id, c.done_at.is_not(None)).group_by(c.holder)
        with self.engine.connect() as conn:
            return {h: int(n) for h, n in conn.execute(q)}


def _held(lease: Lease):
    c = T.unit_leases.c
    return c.job_id == lease.job_id, c.unit == lease.unit, c.holder == lease.holder, c.epoch == lease.epoch


def _flag(cond):
    return case((cond, 1), else_=0)
