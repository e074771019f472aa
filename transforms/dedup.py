"""Duplicate ids at scale: the first row of an id in input order wins, found through
claims in the database instead of a shuffle of every id, with no step waiting for the
whole input.

`ClaimIds` upserts (id → input file, input row) into `id_claims` for each chunk's rows
as they come from ReadPrompts, keeping the earliest row whatever order the units run in.
`DedupIds` then looks up the claims of one chunk's ids: a row that is not its id's
claim is a `duplicate_id` dead letter naming the row that came first.  A later row whose
unit ran before its id's first row was read passes DedupIds; the write settles it
(`ResultWriter`): its batch commits no output for a row that lost its claim, and a claim
that moves to an earlier row turns an output already stored into the dead letter.  Every
id ends answered once.  Rows without an id take `row-<file>-<row>`
(validate.row_id); a Parquet input without an `id` column has no duplicates and skips
both steps."""

from __future__ import annotations

import json
from itertools import islice

import apache_beam as beam

from tokenmill.schemas import records as R
from tokenmill.schemas import storage as S
from tokenmill.schemas.records import Chunk, FailedRecord, duplicate_message
from tokenmill.transforms.chunks import DEAD, over_chunks, with_dead
from tokenmill.transforms.read import MAX_UNIT_ROWS
from tokenmill.transforms.validate import RAW_LIMIT, row_id

#: Ids claimed in one statement.
CLAIM_ROWS = MAX_UNIT_ROWS


class ClaimIdsFn(beam.DoFn):
    """Chunk of read rows → the same chunk, its rows' ids claimed first.  Every part of a
    unit claims (the same rows: the upsert is idempotent), so no part reaches DedupIds
    before its ids are claimed."""

    def __init__(self, db_url: str, job_id: str):
        self._url, self._job_id = db_url, job_id
        self._retracted = beam.metrics.Metrics.counter("tokenmill", "outputs_retracted_duplicate")

    def process(self, chunk: Chunk):
        writer, rows = S.ResultWriter(S.connect(self._url)), iter(chunk.items)
        while batch := list(islice(rows, CLAIM_ROWS)):
            self._retracted.inc(writer.claim_ids(self._job_id, [(row_id(r), r["_file_index"], r["_row"]) for r in batch]))
        yield chunk


class ClaimIds(beam.PTransform):
    """Chunks of read rows → the same chunks, their ids claimed (fused with the read)."""

    def __init__(self, db_url: str, job_id: str):
        super().__init__()
        self._fn = ClaimIdsFn(db_url, job_id)

    def expand(self, chunks):
        return chunks | over_chunks(self._fn, "ClaimRowIds")


def duplicate(rec, first: tuple[int, int]) -> FailedRecord:
    return FailedRecord(
        input_file=rec.input_file,
        input_row=rec.input_row,
        id=rec.id,
        reason=R.DUPLICATE_ID,
        message=duplicate_message(rec.id, first),
        raw=json.dumps({"id": rec.id, "prompt": rec.prompt, "messages": rec.messages}, ensure_ascii=False)[:RAW_LIMIT],
    )


class DedupIdsFn(beam.DoFn):
    def __init__(self, db_url: str, job_id: str):
        self._url, self._job_id = db_url, job_id

    def process(self, chunk: Chunk):
        claims = S.ResultWriter(S.connect(self._url)).id_claims(self._job_id, [r.id for r in chunk.items])
        ok = []
        for r in chunk.items:
            first = claims.get(r.id)
            if first is None or first == (r.input_file, r.input_row):
                ok.append(r)
            elif chunk.part == 0:
                yield beam.pvalue.TaggedOutput(DEAD, duplicate(r, first))
        if ok:
            yield chunk.with_items(ok)


class DedupIds(beam.PTransform):
    """Chunks → chunks without the rows whose id an earlier row has claimed so far (dead
    letters on `dead`); the claims of the chunk's own rows are in (ClaimIds ran on them)."""

    def __init__(self, db_url: str, job_id: str):
        super().__init__()
        self._fn = DedupIdsFn(db_url, job_id)

    def expand(self, chunks):
        return chunks | with_dead(self._fn, "FirstWins")
