"""Duplicate ids at scale: the first row of an id in input order wins, found by a claim
pass in the database instead of a shuffle of every id.

`ClaimIds` reads only the id column of each work unit and upserts (id → input
file, input row) into `id_claims`, keeping the earliest row whatever order the
units run in.  ReadPrompts waits for every claim to be in (the claim count is its
side input, so runners schedule reads after the claim pass and no runner holds read
prompts while it runs); `DedupIds` then looks up the claims of one chunk's ids: a row that is not its id's claim is a
`duplicate_id` dead letter naming the row that came first.  Rows without an id
take `row-<file>-<row>` (validate.row_id); a Parquet input without an `id` column
has no duplicates and skips both steps.  A rerun of a job whose earlier run finished the
claim pass finds every claim in place and skips ClaimIds (`ResultWriter.claims_settled`)."""

from __future__ import annotations

import json
from dataclasses import replace
from itertools import islice

import apache_beam as beam

from tokenmill.schemas import records as R
from tokenmill.schemas import storage as S
from tokenmill.schemas.records import Chunk, FailedRecord, format_ref
from tokenmill.transforms.chunks import DEAD
from tokenmill.transforms.read import MAX_UNIT_ROWS, Shard, read_shard, read_unit
from tokenmill.transforms.validate import RAW_LIMIT, row_id

#: Ids claimed in one statement.
CLAIM_ROWS = MAX_UNIT_ROWS


class ClaimIdsFn(beam.DoFn):
    """work item → number of ids its unit claimed (part 0 only).  `columns`: what to read of a Parquet unit (the
    id column alone); JSONL lines are read whole (the id is `custom_id`)."""

    def __init__(self, db_url: str, job_id: str, columns: list[str] | None, served_models: tuple[str, ...] = ()):
        self._url, self._job_id, self._columns, self._served = db_url, job_id, columns, served_models

    def process(self, item):
        if item.part != 0:  # every part of a unit holds the same ids: part 0 claims them
            return
        unit = item.unit
        if isinstance(unit, Shard) and unit.spills:
            # A row group cut into units: its first unit claims the whole group's ids in one
            # pass over the id column (read from the group's first row for every unit, the
            # column would be decoded about units/2 times); the others claim nothing.
            rows = read_shard(replace(unit, num_rows=unit.group_rows), self._columns) if unit.start == 0 else iter(())
        else:
            rows = iter(read_unit(unit, self._columns, self._served))
        writer, claimed = S.ResultWriter(S.connect(self._url)), 0
        while batch := list(islice(rows, CLAIM_ROWS)):
            claimed += writer.claim_ids(self._job_id, [(row_id(r), r["_file_index"], r["_row"]) for r in batch])
        yield claimed


class ClaimIds(beam.PTransform):
    """Work units → the total of claims made (a singleton, for DedupIds to wait on)."""

    def __init__(self, db_url: str, job_id: str, columns: list[str] | None, served_models: tuple[str, ...] = ()):
        super().__init__()
        self._fn = ClaimIdsFn(db_url, job_id, columns, served_models)

    def expand(self, units):
        return units | "ClaimUnitIds" >> beam.ParDo(self._fn) | "AllClaimed" >> beam.CombineGlobally(sum)


def duplicate(rec, first: tuple[int, int]) -> FailedRecord:
    return FailedRecord(
        input_file=rec.input_file,
        input_row=rec.input_row,
        id=rec.id,
        reason=R.DUPLICATE_ID,
        message=f"duplicate id {rec.id!r}: the row at {format_ref(*first)} came first",
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
    """Chunks → chunks without duplicate ids (dead letters on `dead`).  Every claim must be
    in first: ReadPrompts waits for ClaimIds' total (`after`), or an earlier run of the job
    finished the claim pass."""

    def __init__(self, db_url: str, job_id: str):
        super().__init__()
        self._fn = DedupIdsFn(db_url, job_id)

    def expand(self, chunks):
        return chunks | "FirstWins" >> beam.ParDo(self._fn).with_outputs(DEAD, main="ok")
