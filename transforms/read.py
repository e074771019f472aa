"""The Beam steps that read the input: `PlanUnits` (the planned work items, spread over the
workers) and `ReadPrompts` (one work item → one `Chunk` of row dicts, each row with its
stable place in the input, `_file_index` and `_row`), and the functions they read a unit
with (`read_unit`), tested without a pipeline.

The input is planned before the pipeline is built, without Beam (transforms/inputs.py;
transforms/planning.py for either format); the planning names are imported here too, for the
code that reads and plans alike.  A worker reads one unit at a time (`read_unit`) and the
rest of the pipeline carries it as one `Chunk`: no process holds more than a unit of prompt
data.  A row group cut into several units is decoded once per machine (transforms/spill.py),
not from its first row for every unit.
"""

from __future__ import annotations

import socket
from dataclasses import replace
from functools import lru_cache
from typing import AbstractSet, Any, Iterator

import apache_beam as beam
import pyarrow as pa
import pyarrow.parquet as pq

from tokenmill.schemas import storage as S
from tokenmill.schemas.errors import first_line
from tokenmill.schemas.records import Chunk
from tokenmill.transforms.chunks import over_chunks
from tokenmill.transforms.files import open_file
from tokenmill.transforms.host_model import s3_client_here
from tokenmill.transforms.inputs import (
    MAX_UNIT_ROWS,
    PLAN_THREADS,
    PROMPT_COLUMNS,
    READ_BATCH_ROWS,
    InputError,
    InputPlan,
    Shard,
    WorkItem,
    check_bucket,
    default_unit_bytes,
    expand_input,
    plan_parquet,
    plan_units,
    plan_work,
    read_footer,
    s3_client,
)
from tokenmill.transforms.leases import holding, lease_key
from tokenmill.transforms.openai_batch import read_jsonl_shard
from tokenmill.transforms.planning import plan_input
from tokenmill.transforms.spill import read_spilled

#: The planning names (transforms/inputs.py, planning.py) read and planned with here and by
#: the pipeline, the launcher and the tests.
__all__ = [
    "MAX_UNIT_ROWS", "PLAN_THREADS", "PROMPT_COLUMNS", "READ_BATCH_ROWS", "InputError", "InputPlan", "Shard",
    "WorkItem", "check_bucket", "default_unit_bytes", "expand_input", "plan_input", "plan_parquet", "plan_units",
    "plan_work", "read_footer", "s3_client",
    "InputUnreadable", "PlanUnits", "ReadPrompts", "ReadUnitFn", "cached_footer", "done_rows", "group_batches",
    "read_shard", "read_unit",
]


@lru_cache(maxsize=64)
def cached_footer(path: str, source: str):
    """A file's Parquet metadata, read once per process for one version of the file
    (`source`: its size and modification time when planned), so a worker's later units of
    the file do not read its footer again."""
    with open_file(path) as fh:
        return read_footer(fh)


def read_shard(shard: Shard, columns: list[str] | None = None,
               skip: AbstractSet[int] = frozenset(), spilled: Iterator | None = None) -> Iterator[dict[str, Any]]:
    """Rows of one unit (a row group's slice) as dicts; string prompt columns come back as
    bytes so that invalid UTF-8 becomes a per-row dead letter rather than a failed read.
    Rows whose file-level number is in `skip` (a rerun's done rows) are not converted.
    `spilled`: the unit's own record batches (spill.read_spilled) instead of its row group
    read from the group's first row."""
    end = shard.start + shard.num_rows
    for at, rb in group_batches(shard, columns, spilled):  # `at`: position of rb's first row in the group
        lo, hi = max(shard.start - at, 0), min(end - at, rb.num_rows)
        first = shard.first_row + at  # file-level number of `rb`'s first row
        keep = [j for j in range(lo, hi) if first + j not in skip]
        if keep:
            yield from _records(rb.slice(lo, hi - lo) if len(keep) == hi - lo else rb.take(keep),
                                [first + j for j in keep], shard.file_index)
        if at + rb.num_rows >= end:
            break


def group_batches(shard: Shard, columns: list[str] | None = None,
                  spilled: Iterator | None = None) -> Iterator[tuple[int, Any]]:
    """(position in the row group of the batch's first row, record batch): the unit's
    `spilled` batches, or its whole row group from the first row."""
    at = shard.start if spilled is not None else 0
    if spilled is not None:
        for rb in spilled:
            yield at, rb
            at += rb.num_rows
        return
    with open_file(shard.path) as fh:
        footer = cached_footer(shard.path, shard.source) if shard.source else None
        # pre_buffer off: each column chunk read on its own, not coalesced with the unused
        # columns between them (pyarrow merges ranges across holes of up to 8 KiB)
        pf = pq.ParquetFile(fh, metadata=footer, pre_buffer=False)
        for rb in pf.iter_batches(batch_size=READ_BATCH_ROWS, row_groups=[shard.row_group], columns=columns):
            yield at, rb
            at += rb.num_rows


def _records(rb, places: list[int], file_index: int) -> Iterator[dict[str, Any]]:
    cols = {}
    for name in rb.schema.names:
        arr = rb.column(name)
        if pa.types.is_string(arr.type) or pa.types.is_large_string(arr.type):
            arr = arr.view(pa.binary()) if pa.types.is_string(arr.type) else arr.view(pa.large_binary())
        cols[name] = arr.to_pylist()
    for j, row in enumerate(places):
        rec = {k: v[j] for k, v in cols.items()}
        rec["_row"] = row  # with the file index: where the row came from, stable across reruns
        rec["_file_index"] = file_index
        yield rec


def read_unit(unit, columns: list[str] | None = None, served: Any = None,
              skip: AbstractSet[int] = frozenset(), spilled: Iterator | None = None) -> list[dict[str, Any]]:
    """The rows of one work unit (a Parquet slice or a JSONL run of lines) but those in `skip`."""
    if isinstance(unit, Shard):
        return list(read_shard(unit, columns, skip, spilled))
    return list(read_jsonl_shard(unit, served, skip, s3_client_here() if unit.path.startswith("s3://") else None))


class InputUnreadable(RuntimeError):
    """A worker cannot read its unit's input file where it runs (one line naming its host):
    the step fails, and the job's unanswered rows wait for a rerun."""


def done_rows(db_url: str, job_id: str, unit) -> set[int]:
    """The rows of `unit` a job has already answered or dead-lettered (one range lookup)."""
    rows = unit.rows
    return S.ResultWriter(S.connect(db_url)).done_rows(job_id, unit.file_index, rows.start, rows.stop - 1)


class ReadUnitFn(beam.DoFn):
    """Work item → its unit's rows; with a job's database and a unit in one part, only the
    rows it has not yet answered or dead-lettered (a done unit is not opened at all)."""

    def __init__(self, columns: list[str] | None = None, served: Any = None,
                 db_url: str | None = None, job_id: str | None = None, lease_s: float | None = None,
                 task: str = "generate"):
        self._columns = columns
        self._served = served  # an OpenAI batch input's `openai_batch.LineRules`
        self._url, self._job_id = db_url, job_id
        self._lease_s, self._task = lease_s, task  # a shared job: a unit is read only under this process's lease
        self._read = beam.metrics.Metrics.counter("tokenmill", "rows_read")
        self._skipped = beam.metrics.Metrics.counter("tokenmill", "rows_skipped_done")

    def process(self, item: WorkItem):
        lease, held = None, None
        if self._lease_s is not None and self._url and self._job_id:
            held = holding(self._url, self._job_id, self._lease_s)
            lease = held.take(self._job_id, lease_key(self._task, item.unit.key))
            if lease is None:  # another replica's engine has it, has done it, or this one is draining
                return
        # A unit in parts is read whole: each part cuts its segment from the whole unit's
        # order (TakePart), which must not move as other parts of it commit (SkipDone drops).
        done = (done_rows(self._url, self._job_id, item.unit)
                if item.parts == 1 and self._url and self._job_id else set())
        self._skipped.inc(len(done))
        if len(done) >= len(item.unit.rows):
            if held is not None and lease is not None:
                held.finish(lease)
            return
        try:
            rows = read_unit(item.unit, self._columns, self._served, done, self._spilled(item))
        except Exception as err:  # a path the launcher reached but this host does not, a bucket it may not read
            raise InputUnreadable(f"worker on host {socket.gethostname()}: input {item.unit.path!r} cannot be read "
                                  f"here: {type(err).__name__}: {first_line(err)}") from err
        self._read.inc(len(rows))
        if rows:
            yield Chunk(item.unit.key, rows, item.part, item.parts, lease)


    def _spilled(self, item: WorkItem) -> Iterator | None:
        """A unit of a row group cut into several, in one part, in a job: its batches from the
        group's spill on this machine (the group decoded once, not once per unit)."""
        unit = item.unit
        if not (isinstance(unit, Shard) and unit.spills and item.parts == 1 and self._job_id):
            return None
        url, job = self._url, self._job_id

        def wanted(start: int, rows: int) -> bool:  # a unit not all done: the reader will ask for it
            return url is None or len(done_rows(url, job, replace(unit, start=start, num_rows=rows))) < rows

        return read_spilled(job, unit, self._columns, wanted, group_batches)


class PlanUnits(beam.PTransform):
    """The work items, spread over workers (each item one element)."""

    def __init__(self, items: list[WorkItem]):
        super().__init__()
        self._items = items

    def expand(self, pbegin):
        return pbegin | "Units" >> beam.Create(self._items, reshuffle=False) | "Spread" >> beam.Reshuffle()


class ReadPrompts(beam.PTransform):
    """Work items → one `Chunk` of row dicts per item (its unit's rows; with `db_url` and
    `job_id`, those the job has not yet answered or dead-lettered)."""

    def __init__(self, columns: list[str] | None = None, served: Any = None,
                 db_url: str | None = None, job_id: str | None = None, lease_s: float | None = None,
                 task: str = "generate"):
        super().__init__()
        self._fn = ReadUnitFn(columns, served, db_url, job_id, lease_s, task)

    def expand(self, units):
        return units | over_chunks(self._fn, "ReadUnit")
