"""ReadPrompts: Parquet (local or s3://) into chunks of row dicts, each row with its stable place in the input (`_file_index`, `_row`).

The input is planned at pipeline-construction time (files, row groups, columns,
row counts; the files' footers read in parallel), so a missing path, a file that
is not Parquet or a schema without a prompt column fails before any worker
starts.  The plan is then cut into work units (`plan_units`): slices of one row
group of about `unit_bytes` of uncompressed input, so the number of units grows
with the input (a 10-million-row file with one row group is still many units).
A worker reads one unit at a time (`read_unit`) and the rest of the pipeline
carries it as one `Chunk`: no process holds more than a unit of prompt data.  A row
group cut into several units is decoded once per machine (transforms/spill.py), not
from its first row for every unit.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import lru_cache
from typing import AbstractSet, Any, Generic, Iterator, TypeVar

import apache_beam as beam

from tokenmill.schemas.errors import first_line
from tokenmill.schemas.records import Chunk
from tokenmill.transforms.chunks import over_chunks
from tokenmill.transforms.files import open_file
from tokenmill.transforms.spill import read_spilled

PROMPT_COLUMNS = ("prompt", "messages")
READ_BATCH_ROWS = 1024


class InputError(ValueError):
    """The input as a whole cannot be read; the message is one line."""


@dataclass(frozen=True)
class Shard:
    """Rows `start` .. `start + num_rows` of one row group (a whole row group at planning;
    a work unit after `plan_units`).  `first_row` is the file-level number of the row
    group's first row."""

    file_index: int
    path: str
    row_group: int
    num_rows: int
    start: int = 0
    first_row: int = 0
    bytes_per_row: float = 0.0
    """Uncompressed bytes per row of the row group (Parquet metadata), for sizing units."""
    group_rows: int = 0
    unit_rows: int = 0
    """A work unit's row group's rows and the rows of each unit it is cut into (0: not
    known; a group of several units is split once per machine, transforms/spill.py)."""
    source: str = ""
    """The file's size and modification time when planned ("": not known): which version
    of the file its cached footer and spilled units belong to."""

    @property
    def spills(self) -> bool:
        """A unit of a row group cut into several: read through the group's spill."""
        return 0 < self.unit_rows < self.group_rows

    @property
    def key(self) -> str:
        return f"{self.file_index}.{self.first_row + self.start}"

    @property
    def rows(self) -> range:
        """The file-level row numbers of this unit."""
        return range(self.first_row + self.start, self.first_row + self.start + self.num_rows)


#: A plan's shard type: `Shard` (row groups of Parquet files) or `openai_batch.JsonlShard`.
ShardT = TypeVar("ShardT")


@dataclass
class InputPlan(Generic[ShardT]):
    files: list[str]
    shards: list[ShardT]
    columns: list[str]
    total_rows: int
    format: str = "parquet"
    notes: list[str] = field(default_factory=list)
    bytes: int | None = None
    """The input files' size (Parquet; None where not measured)."""


def _is_remote(path: str) -> bool:
    return "://" in path and not path.startswith("file://")


def s3_client(options=None):
    """A boto3 S3 client built from the pipeline options Beam's S3 filesystem uses
    (endpoint, keys, region), so checks see what the job will see."""
    from apache_beam.io.aws.clients.s3.boto3_client import Client
    from apache_beam.options.pipeline_options import PipelineOptions

    return Client(options or PipelineOptions([])).client


def check_bucket(url: str, what: str = "input", options=None) -> None:
    """For an s3:// URL: the bucket exists and the credentials are accepted, else InputError.
    `options`: the job's PipelineOptions (its S3 endpoint and region).

    Beam's S3 listing turns both into "no files", so ask S3 directly first (the job's
    preflight does, before planning the input)."""
    if not url.startswith("s3://"):
        return
    import botocore.exceptions as BE

    bucket = url[len("s3://"):].split("/", 1)[0]
    try:
        s3_client(options).head_bucket(Bucket=bucket)
    except BE.ClientError as err:
        code = str(err.response.get("Error", {}).get("Code", ""))
        if code in ("404", "NoSuchBucket"):
            raise InputError(f"{what} {url!r}: bucket {bucket!r} does not exist") from None
        if code in ("400", "401", "403", "InvalidAccessKeyId", "SignatureDoesNotMatch", "AccessDenied"):
            raise InputError(
                f"{what} {url!r}: access to bucket {bucket!r} denied (HTTP {code}); check the AWS credentials"
            ) from None
        raise InputError(f"{what} {url!r}: cannot use bucket {bucket!r}: {first_line(err)}") from None
    except BE.NoCredentialsError:
        raise InputError(f"{what} {url!r}: no AWS credentials found (AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY)") from None
    except BE.BotoCoreError as err:  # endpoint unreachable, bad endpoint URL
        raise InputError(f"{what} {url!r}: cannot reach S3: {first_line(err)}") from None


def expand_input(path: str, patterns: tuple[str, ...] = ("*.parquet",)) -> list[str]:
    """Files for a file, folder or glob, local or on a Beam filesystem (s3://)."""
    from apache_beam.io.filesystems import FileSystems

    def match(p: str) -> list[str]:
        try:
            res = FileSystems.match([p])[0]
        except Exception as err:  # Beam raises BeamIOError with nested exceptions
            msg = first_line(err)
            if "NoSuchBucket" in msg or "does not exist" in msg.lower():
                raise InputError(f"input {path!r} does not exist ({msg})") from None
            if "InvalidAccessKeyId" in msg or "SignatureDoesNotMatch" in msg or "AccessDenied" in msg:
                raise InputError(f"cannot read input {path!r}: access denied ({msg})") from None
            return []
        return sorted(m.path for m in res.metadata_list if not m.path.endswith("/"))

    has_glob = any(ch in path for ch in "*?[")
    if has_glob:
        files = match(path)
    else:
        files = []
        if _is_remote(path):
            exact = [f for f in match(path) if f == path]
            files = exact or [f for pat in patterns for f in match(path.rstrip("/") + "/" + pat)]
        else:
            import os

            if os.path.isfile(path):
                files = [os.path.abspath(path)]
            elif os.path.isdir(path):
                files = sorted(f for pat in patterns for f in match(os.path.join(os.path.abspath(path), pat)))
            else:
                raise InputError(f"input {path!r} does not exist")
    if not files:
        raise InputError(f"input {path!r} matched no {'/'.join(patterns)} files")
    return files




def _footer(f: str):
    """(the file's Parquet metadata, its size in bytes, "size:modification time")."""
    from apache_beam.io.filesystems import FileSystems

    try:
        with open_file(f) as fh:
            meta = read_footer(fh)
        m = FileSystems.match([f])[0].metadata_list[0]
        return meta, m.size_in_bytes, f"{m.size_in_bytes}:{m.last_updated_in_seconds}"
    except InputError:
        raise
    except Exception as err:
        raise InputError(f"input file {f!r} is not a readable Parquet file: {first_line(err)}") from None


@lru_cache(maxsize=64)
def cached_footer(path: str, source: str):
    """A file's Parquet metadata, read once per process for one version of the file
    (`source`: its size and modification time when planned), so a worker's later units of
    the file do not read its footer again."""
    with open_file(path) as fh:
        return read_footer(fh)


def read_footer(fh):
    """A Parquet file's metadata, reading only its footer (its last 8 bytes, then the
    footer itself; pyarrow would read a 64 KiB tail, more than a small file's columns)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    fh.seek(-8, 2)
    tail = fh.read(8)
    size = int.from_bytes(tail[:4], "little")
    if tail[4:] != b"PAR1" or size <= 0:
        raise ValueError("no Parquet footer at the end of the file")
    fh.seek(-8 - size, 2)
    return pq.read_metadata(pa.BufferReader(b"PAR1" + fh.read(size) + tail))


#: Footers read at once when planning (an S3 prefix of thousands of objects).
PLAN_THREADS = 16


def plan_parquet(path: str) -> InputPlan:
    from concurrent.futures import ThreadPoolExecutor

    files = expand_input(path)
    with ThreadPoolExecutor(min(PLAN_THREADS, len(files))) as pool:
        metas = list(pool.map(_footer, files))
    shards: list[Shard] = []
    columns: list[str] | None = None
    total = 0
    for i, (f, (meta, _, source)) in enumerate(zip(files, metas)):
        names = meta.schema.to_arrow_schema().names
        if not any(c in names for c in PROMPT_COLUMNS):
            raise InputError(
                f"input file {f!r} has no 'prompt' or 'messages' column; columns found: {', '.join(names) or '(none)'}"
            )
        columns = columns or names
        first = 0
        for rg in range(meta.num_row_groups):
            g = meta.row_group(rg)
            n = g.num_rows
            if n:
                shards.append(Shard(i, f, rg, n, first_row=first, bytes_per_row=g.total_byte_size / n, source=source))
            first += n
        total += meta.num_rows
    return InputPlan(files=files, shards=shards, columns=columns or [], total_rows=total,
                     bytes=sum(size for _, size, _ in metas))


def default_unit_bytes() -> int:
    """Prompt data per work unit, sized from the machine: 1/512 of its memory, between
    4 MiB and 64 MiB (48 MiB on a 24 GiB machine)."""
    import psutil

    return int(min(64 << 20, max(4 << 20, psutil.virtual_memory().total // 512)))


#: Rows per unit at most (bounds per-row overhead for short prompts and the work a
#: retried unit re-reads).
MAX_UNIT_ROWS = 8192


def plan_units(plan: InputPlan, unit_bytes: int | None = None) -> list:
    """Cut the planned row groups into work units of about `unit_bytes` of input and at
    most MAX_UNIT_ROWS rows.  JSONL shards are already units."""
    if plan.format != "parquet":
        return list(plan.shards)
    budget = unit_bytes or default_unit_bytes()
    units: list[Shard] = []
    for sh in plan.shards:
        by_bytes = int(budget // sh.bytes_per_row) if sh.bytes_per_row > 0 else MAX_UNIT_ROWS
        rows = max(1, min(by_bytes, MAX_UNIT_ROWS))
        for start in range(sh.start, sh.start + sh.num_rows, rows):
            n = min(rows, sh.start + sh.num_rows - start)
            units.append(replace(sh, num_rows=n, start=start, group_rows=sh.num_rows, unit_rows=rows))
    return units


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
    import pyarrow.parquet as pq

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
    import pyarrow as pa

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
    from tokenmill.transforms.openai_batch import read_jsonl_shard

    return list(read_jsonl_shard(unit, served, skip))


@dataclass(frozen=True)
class WorkItem:
    """One element of work: part `part` of `parts` of a unit (see records.Chunk)."""

    unit: Any
    part: int = 0
    parts: int = 1


def plan_work(units: list, workers: int = 1) -> list[WorkItem]:
    """The work items: one per unit, or, when the units are fewer than two per worker,
    each unit in enough parts that every worker gets at least two items."""
    parts = max(1, -(-2 * workers // max(1, len(units)))) if workers > 1 else 1
    return [WorkItem(u, p, parts) for u in units for p in range(parts)]


class InputUnreadable(RuntimeError):
    """A worker cannot read its unit's input file where it runs (one line naming its host):
    the step fails, and the job's unanswered rows wait for a rerun."""


def done_rows(db_url: str, job_id: str, unit) -> set[int]:
    """The rows of `unit` a job has already answered or dead-lettered (one range lookup)."""
    from tokenmill.schemas import storage as S

    rows = unit.rows
    return S.ResultWriter(S.connect(db_url)).done_rows(job_id, unit.file_index, rows.start, rows.stop - 1)


class ReadUnitFn(beam.DoFn):
    """Work item → its unit's rows; with a job's database and a unit in one part, only the
    rows it has not yet answered or dead-lettered (a done unit is not opened at all)."""

    def __init__(self, columns: list[str] | None = None, served: Any = None,
                 db_url: str | None = None, job_id: str | None = None):
        self._columns = columns
        self._served = served  # an OpenAI batch input's `openai_batch.LineRules`
        self._url, self._job_id = db_url, job_id
        self._read = beam.metrics.Metrics.counter("tokenmill", "rows_read")
        self._skipped = beam.metrics.Metrics.counter("tokenmill", "rows_skipped_done")

    def process(self, item: WorkItem):
        # A unit in parts is read whole: each part cuts its segment from the whole unit's
        # order (TakePart), which must not move as other parts of it commit (SkipDone drops).
        done = (done_rows(self._url, self._job_id, item.unit)
                if item.parts == 1 and self._url and self._job_id else set())
        self._skipped.inc(len(done))
        if len(done) >= len(item.unit.rows):
            return
        try:
            rows = read_unit(item.unit, self._columns, self._served, done, self._spilled(item))
        except Exception as err:  # a path the launcher reached but this host does not, a bucket it may not read
            import socket

            raise InputUnreadable(f"worker on host {socket.gethostname()}: input {item.unit.path!r} cannot be read "
                                  f"here: {type(err).__name__}: {first_line(err)}") from err
        self._read.inc(len(rows))
        if rows:
            yield Chunk(item.unit.key, rows, item.part, item.parts)


    def _spilled(self, item: WorkItem) -> Iterator | None:
        """A unit of a row group cut into several, in one part, in a job: its batches from the
        group's spill on this machine (the group decoded once, not once per unit)."""
        unit = item.unit
        if not (isinstance(unit, Shard) and unit.spills and item.parts == 1 and self._job_id):
            return None
        url, job = self._url, self._job_id

        def wanted(start: int, rows: int) -> bool:  # a unit not all done: the reader will ask for it
            return url is None or len(done_rows(url, job, replace(unit, start=start, num_rows=rows))) < rows

        return read_spilled(job, unit, self._columns, wanted)


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
                 db_url: str | None = None, job_id: str | None = None):
        super().__init__()
        self._fn = ReadUnitFn(columns, served, db_url, job_id)

    def expand(self, units):
        return units | over_chunks(self._fn, "ReadUnit")


def plan_input(path: str, fmt: str = "parquet") -> InputPlan:
    if fmt == "openai-jsonl":
        from tokenmill.transforms.openai_batch import plan_jsonl

        return plan_jsonl(path)
    return plan_parquet(path)
