"""SkipDone: on a rerun of a job, drop rows already answered or already dead-lettered."""

from __future__ import annotations

import apache_beam as beam
from sqlalchemy import select

from tokenmill.schemas import tables as T
from tokenmill.schemas.db import db_engine


def done_keys(db_url: str, job_id: str) -> tuple[set[str], set[str]]:
    """(ids with an output, input_refs with a dead letter) for the job."""
    with db_engine(db_url).connect() as conn:
        ids = set(conn.execute(select(T.outputs.c.id).where(T.outputs.c.job_id == job_id)).scalars())
        refs = set(conn.execute(select(T.dead_letters.c.input_ref).where(T.dead_letters.c.job_id == job_id)).scalars())
    return ids, refs


class SkipDoneFn(beam.DoFn):
    def __init__(self, db_url: str, job_id: str):
        self._url, self._job_id = db_url, job_id
        self._ids: set[str] = set()
        self._refs: set[str] = set()

    def setup(self):
        self._ids, self._refs = done_keys(self._url, self._job_id)

    def process(self, rec):
        if rec.id in self._ids or rec.input_ref in self._refs:
            return
        yield rec


class SkipDone(beam.PTransform):
    def __init__(self, db_url: str, job_id: str):
        super().__init__()
        self._fn = SkipDoneFn(db_url, job_id)

    def expand(self, records):
        return records | "DropAnswered" >> beam.ParDo(self._fn)
