"""SkipDone: on a rerun of a job, drop rows already answered or already dead-lettered; and
settle a late duplicate whose id's first row claimed the id after the duplicate passed
DedupIds (its `duplicate_id` dead letter is written then, so it ends in one place).

One lookup per work unit, bounded by the unit: the rows of its file and row range
that the database holds (outputs or dead letters), and who holds its ids
(`ResultWriter.settle_done`).  No process loads the job's whole key set."""

from __future__ import annotations

import apache_beam as beam

from tokenmill.schemas import storage as S
from tokenmill.schemas.records import Chunk
from tokenmill.transforms.chunks import over_chunks


def undone(eng, job_id: str, chunk: Chunk) -> Chunk | None:
    """The chunk's records that still need work (None: none do)."""
    recs = chunk.items
    if not recs:
        return None
    by_file: dict[int, list] = {}
    for r in recs:
        by_file.setdefault(r.input_file, []).append(r)
    keep = []
    for f, rs in by_file.items():
        run, _ = S.ResultWriter(eng).settle_done(job_id, f, [(r.id, r.input_row) for r in rs])
        keep += [r for r in rs if r.input_row in run]
    return chunk.with_items(keep) if keep else None


class SkipDoneFn(beam.DoFn):
    def __init__(self, db_url: str, job_id: str):
        self._url, self._job_id = db_url, job_id

    def process(self, chunk: Chunk):
        left = undone(S.connect(self._url), self._job_id, chunk)
        if left is not None:
            yield left


class SkipDone(beam.PTransform):
    def __init__(self, db_url: str, job_id: str):
        super().__init__()
        self._fn = SkipDoneFn(db_url, job_id)

    def expand(self, chunks):
        return chunks | over_chunks(self._fn, "DropAnswered")
