"""The estimates `tokenmill estimate` made (table `estimates`): one row per estimate of a job
id, the newest read back by `run` (cost and time caps), `report` and `status` (the estimate
beside what happened).  The estimate itself is JSON (jobs/estimate/: its shape and how each
figure and interval was computed)."""

from __future__ import annotations

import time
from typing import Any

from sqlalchemy import delete, insert, select

from tokenmill.schemas import tables as T
from tokenmill.schemas.storage.database import SqlStore


class EstimateStore(SqlStore):
    """The `estimates` table: an estimate is a dict (its JSON)."""

    def add(self, job_id: str, estimate: dict[str, Any], *, sample_rows: int | None = None,
            total_rows: int | None = None, created_at: float | None = None) -> float:
        """Store an estimate of `job_id`; returns its time (its key beside the job id)."""
        at = time.time() if created_at is None else created_at
        with self.engine.begin() as conn:
            conn.execute(insert(T.estimates).values(job_id=job_id, created_at=at, sample_rows=sample_rows,
                                                    total_rows=total_rows, estimate=estimate))
        return at

    def latest(self, job_id: str) -> dict[str, Any] | None:
        """The newest estimate of `job_id` (its row: created_at, sample_rows, total_rows,
        estimate), or None."""
        e = T.estimates
        with self.engine.connect() as conn:
            row = conn.execute(select(e).where(e.c.job_id == job_id).order_by(e.c.created_at.desc()).limit(1)
                               ).mappings().first()
        return dict(row) if row else None

    def delete(self, job_id: str) -> int:
        with self.engine.begin() as conn:
            return conn.execute(delete(T.estimates).where(T.estimates.c.job_id == job_id)).rowcount or 0
