"""SkipDone: on a rerun of a job, drop rows already answered or already dead-lettered."""

from __future__ import annotations

import apache_beam as beam

from tokenmill.schemas import storage as S


class SkipDoneFn(beam.DoFn):
    def __init__(self, db_url: str, job_id: str):
        self._url, self._job_id = db_url, job_id
        self._ids: set[str] = set()
        self._refs: set[tuple[int, int]] = set()

    def setup(self):
        self._ids, self._refs = S.done_keys(S.connect(self._url), self._job_id)

    def process(self, rec):
        if rec.id in self._ids or rec.input_order in self._refs:
            return
        yield rec


class SkipDone(beam.PTransform):
    def __init__(self, db_url: str, job_id: str):
        super().__init__()
        self._fn = SkipDoneFn(db_url, job_id)

    def expand(self, records):
        return records | "DropAnswered" >> beam.ParDo(self._fn)
