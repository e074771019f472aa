"""What the live page (jobs/serve/page.py) reads: jobs by status, one page of jobs at a time,
and for that page only the running jobs' live counts and every job's dead letters by reason;
the service's batches that are no job yet (validating, queued).
The database does the counting and the paging, so a page costs the same at 10,000 jobs as at
ten.  `owner` scopes every read to the jobs that are that API key's batches (None: all)."""

from __future__ import annotations

from typing import Any

from sqlalchemy import ColumnElement, case, func, select

from tokenmill.schemas import tables as T
from tokenmill.schemas.storage.database import SqlStore
from tokenmill.schemas.storage.serve import TERMINAL

#: The batch columns the page shows of a batch that is not a job yet.
WAITING_COLUMNS = ("id", "owner", "model", "lines", "metadata", "created_at", "expires_at", "in_progress_at",
                   "cancelling_at", "finalizing_at")

#: The job columns a page's rows carry (not the spec or the whole metrics of every job).
ROW_COLUMNS = ("id", "name", "status", "model", "engine_config", "submitted_at", "started_at", "finished_at",
               "heartbeat_at", "total", "succeeded", "failed", "error", "metrics", "spec")


def _scoped(q, owner: str | None):
    if owner is None:
        return q
    return q.where(T.jobs.c.id.in_(select(T.api_batches.c.id).where(T.api_batches.c.owner == owner)))


class WatchReader(SqlStore):
    def status_counts(self, owner: str | None) -> dict[str, int]:
        j = T.jobs.c
        q = _scoped(select(j.status, func.count()).group_by(j.status), owner)
        with self.engine.connect() as conn:
            return {s: int(n) for s, n in conn.execute(q).all()}

    def page(self, owner: str | None, *, limit: int, offset: int = 0,
             status: str | None = None) -> list[dict[str, Any]]:
        """One page of jobs, newest first (by start, else submission): the ids are ordered and
        cut by the database on light columns, then only those rows are read."""
        j = T.jobs.c
        order = func.coalesce(j.started_at, j.submitted_at)
        ids = _scoped(select(j.id), owner)
        if status:
            ids = ids.where(j.status == status)
        ids = ids.order_by(order.desc(), j.id).limit(limit).offset(offset)
        with self.engine.connect() as conn:
            picked = [r[0] for r in conn.execute(ids).all()]
            if not picked:
                return []
            rows = conn.execute(select(*[T.jobs.c[c] for c in ROW_COLUMNS]).where(j.id.in_(picked))).mappings().all()
        by_id = {r["id"]: dict(r) for r in rows}
        return [by_id[i] for i in picked if i in by_id]

    def job(self, job_id: str, owner: str | None) -> dict[str, Any] | None:
        with self.engine.connect() as conn:
            row = conn.execute(_scoped(select(T.jobs).where(T.jobs.c.id == job_id), owner)).mappings().first()
        return dict(row) if row else None

    def live(self, job_ids: list[str]) -> dict[str, dict[str, int]]:
        """Running jobs' rows answered so far and their prompt and output tokens."""
        if not job_ids:
            return {}
        o = T.outputs.c
        first = o.sample == 0
        q = (select(o.job_id, func.sum(case((first, 1), else_=0)),
                    func.coalesce(func.sum(case((first, o.prompt_tokens), else_=0)), 0),
                    func.coalesce(func.sum(o.output_tokens), 0))
             .where(o.job_id.in_(job_ids)).group_by(o.job_id))
        with self.engine.connect() as conn:
            return {j: {"answered": int(n or 0), "prompt": int(p or 0), "output": int(out or 0)}
                    for j, n, p, out in conn.execute(q).all()}

    def dead_by_reason(self, job_ids: list[str]) -> dict[str, dict[str, int]]:
        if not job_ids:
            return {}
        d = T.dead_letters.c
        q = select(d.job_id, d.reason, func.count()).where(d.job_id.in_(job_ids)).group_by(d.job_id, d.reason)
        out: dict[str, dict[str, int]] = {}
        with self.engine.connect() as conn:
            for job_id, reason, n in conn.execute(q).all():
                out.setdefault(job_id, {})[reason] = int(n)
        return out

    def waiting(self, owner: str | None, *, limit: int) -> tuple[int, list[dict[str, Any]]]:
        """The service's batches not ended that are no job yet (validating, or queued for their
        model's engine): how many, and the oldest `limit` of them (the order they run in, save
        priority)."""
        b = T.api_batches.c
        where: list[ColumnElement[bool]] = [*[b[c].is_(None) for c in TERMINAL], ~b.id.in_(select(T.jobs.c.id))]
        if owner is not None:
            where.append(b.owner == owner)
        with self.engine.connect() as conn:
            n = int(conn.execute(select(func.count()).select_from(T.api_batches).where(*where)).scalar() or 0)
            if not n:
                return 0, []
            rows = conn.execute(select(*[b[c] for c in WAITING_COLUMNS]).where(*where)
                                .order_by(b.created_at, b.id).limit(limit)).mappings().all()
        return n, [dict(r) for r in rows]

    def batch_owners(self, job_ids: list[str]) -> dict[str, str]:
        """Which of these jobs are the service's batches, and whose."""
        if not job_ids:
            return {}
        b = T.api_batches.c
        with self.engine.connect() as conn:
            return dict(conn.execute(select(b.id, b.owner).where(b.id.in_(job_ids))).all())
