"""What each API key of `tokenmill serve` used, counted by the database from the jobs' own
accounting (a batch is the job of its id): the rows it answered and dead-lettered, their
prompt and output tokens (`outputs`, as `MetricsReader.token_totals` counts them: a prompt once
per request, every sample's output), and the engine time and cost the job's metrics hold once
it finished (`jobs.metrics`: `throughput.generation_wall_s`, `cost.total`, generation only).

A batch counts on the UTC day it was created; the quotas (jobs/serve/quotas.py) read the same
numbers."""

from __future__ import annotations

from typing import Any

from sqlalchemy import Float, case, cast, func, select

from tokenmill.schemas import tables as T
from tokenmill.schemas.storage.database import SqlStore
from tokenmill.schemas.storage.online import OnlineStore
from tokenmill.schemas.storage.serve import TERMINAL

DAY_S = 86400


def _batches(owner: str | None, since: float | None, until: float | None):
    b = T.api_batches.c
    where = []
    if owner is not None:
        where.append(b.owner == owner)
    if since is not None:
        where.append(b.created_at >= since)
    if until is not None:
        where.append(b.created_at < until)
    return where


class UsageStore(SqlStore):
    def tokens_since(self, owner: str, since: float) -> int:
        """Prompt + output tokens of the key's batches created at or after `since`, and of its
        online requests made since then (schemas/storage/online.py)."""
        o, b = T.outputs.c, T.api_batches.c
        mine = select(b.id).where(*_batches(owner, since, None))
        q = select(func.coalesce(func.sum(case((o.sample == 0, func.coalesce(o.prompt_tokens, 0)), else_=0)
                                          + func.coalesce(o.output_tokens, 0)), 0)).where(o.job_id.in_(mine))
        with self.engine.connect() as conn:
            batches = int(conn.execute(q).scalar() or 0)
        return batches + OnlineStore(self.engine).tokens_since(owner, since)

    def running(self, owner: str) -> int:
        """The key's batches past `validating` and not ended (what a queued key waits on)."""
        b = T.api_batches.c
        q = select(func.count()).where(b.owner == owner, b.in_progress_at.is_not(None) | b.cancelling_at.is_not(None),
                                       *[b[c].is_(None) for c in TERMINAL])
        with self.engine.connect() as conn:
            return int(conn.execute(q).scalar() or 0)

    def by_day(self, owner: str | None = None, *, since: float | None = None,
               until: float | None = None) -> list[dict[str, Any]]:
        """Per key per UTC day (`day`: days since 1970-01-01): batches, lines answered and
        failed, prompt and output tokens, engine hours and cost (None where no finished job of
        the day was priced); newest day first, then by key."""
        o, d, b, j = T.outputs.c, T.dead_letters.c, T.api_batches.c, T.jobs.c
        where = _batches(owner, since, until)
        mine = select(b.id).where(*where)
        out = (select(o.job_id.label("job_id"),
                      func.sum(case((o.sample == 0, 1), else_=0)).label("answered"),
                      func.sum(case((o.sample == 0, func.coalesce(o.prompt_tokens, 0)), else_=0)).label("prompt"),
                      func.sum(func.coalesce(o.output_tokens, 0)).label("output"))
               .where(o.job_id.in_(mine)).group_by(o.job_id).subquery())
        dead = (select(d.job_id.label("job_id"), func.count().label("failed")).where(d.job_id.in_(mine))
                .group_by(d.job_id).subquery())
        day = cast(func.floor(b.created_at / DAY_S), Float)
        gen_s = j.metrics[("throughput", "generation_wall_s")].as_float()
        cost = j.metrics[("cost", "total")].as_float()
        q = (select(b.owner.label("key_id"), day.label("day"), func.count(b.id).label("batches"),
                    func.coalesce(func.sum(out.c.answered), 0).label("lines_answered"),
                    func.coalesce(func.sum(dead.c.failed), 0).label("lines_failed"),
                    func.coalesce(func.sum(out.c.prompt), 0).label("prompt_tokens"),
                    func.coalesce(func.sum(out.c.output), 0).label("output_tokens"),
                    func.coalesce(func.sum(gen_s), 0.0).label("engine_s"), func.sum(cost).label("cost"))
             .select_from(T.api_batches.outerjoin(out, out.c.job_id == b.id).outerjoin(dead, dead.c.job_id == b.id)
                          .outerjoin(T.jobs, j.id == b.id))
             .where(*where).group_by(b.owner, day).order_by(day.desc(), b.owner))
        with self.engine.connect() as conn:
            rows = conn.execute(q).mappings().all()
        return [{"key_id": r["key_id"], "day": int(r["day"]), "batches": int(r["batches"]),
                 "lines": int(r["lines_answered"]) + int(r["lines_failed"]),
                 "lines_answered": int(r["lines_answered"]), "lines_failed": int(r["lines_failed"]),
                 "prompt_tokens": int(r["prompt_tokens"]), "output_tokens": int(r["output_tokens"]),
                 "engine_hours": float(r["engine_s"]) / 3600.0,
                 "cost": None if r["cost"] is None else float(r["cost"])} for r in rows]
