"""Input planning without Beam: the input's files (local, a folder, a glob or s3://), their
row groups and the work units cut from them, and the S3 client of the job's options.

The input is planned at pipeline-construction time (files, row groups, columns, row counts;
the files' footers read in parallel), so a missing path, a file that is not Parquet or a
schema without a prompt column fails before any worker starts.  The plan is then cut into
work units (`plan_units`): slices of one row group of about `unit_bytes` of uncompressed
input, so the number of units grows with the input (a 10-million-row file with one row
group is still many units).  The Beam steps that read the units are transforms/read.py's.

Nothing here imports Beam (an import-linter contract says so): the CLI, `quantize` and
`tune` plan an input without it.  Files are matched as Beam's filesystems match them
(`*` within a folder, `**` across folders, a folder's files listed recursively before
matching) and read directly: local files with `open`, s3:// objects with ranged GETs
(`S3Ranges`) on a boto3 client made from the same pipeline options Beam's S3 filesystem
reads (`s3_client`).
"""

from __future__ import annotations

import gzip
import io
import os
import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any, Generic, TypeVar

from tokenmill.schemas.errors import first_line

PROMPT_COLUMNS = ("prompt", "messages")
READ_BATCH_ROWS = 1024
#: Footers read at once when planning (an S3 prefix of thousands of objects).
PLAN_THREADS = 16
#: Rows per unit at most (bounds per-row overhead for short prompts and the work a
#: retried unit re-reads).
MAX_UNIT_ROWS = 8192
#: Bytes an s3:// text file is read ahead by when scanned line by line (Beam's S3 reader's buffer).
S3_READ_AHEAD = 16 << 20


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


# ---------------------------------------------------------------- S3 and files

_options: Any = None


def use_options(options: Any) -> None:
    """The pipeline options planning reads S3 with in this process when a caller gives none
    (the job's preflight sets them, as it sets Beam's filesystems')."""
    global _options
    _options = options


def _error_code(err: Exception) -> str | None:
    """The S3 error code of a botocore ClientError (None: another error)."""
    response = getattr(err, "response", None)
    return str(response.get("Error", {}).get("Code", "")) if isinstance(response, dict) else None


def s3_client(options: Any = None):
    """A boto3 S3 client built from the pipeline options Beam's S3 filesystem uses (endpoint,
    keys, region; boto3's defaults where none are given), so checks see what the job will see."""
    import boto3  # off the CLI's fast path: only an s3:// input needs it

    o = options.get_all_options() if hasattr(options, "get_all_options") else dict(options or {})
    return boto3.session.Session().client(
        service_name="s3", region_name=o.get("s3_region_name"), api_version=o.get("s3_api_version"),
        use_ssl=not o.get("s3_disable_ssl", False), verify=o.get("s3_verify"), endpoint_url=o.get("s3_endpoint_url"),
        aws_access_key_id=o.get("s3_access_key_id"), aws_secret_access_key=o.get("s3_secret_access_key"),
        aws_session_token=o.get("s3_session_token"))


def planning_client(options: Any = None):
    """The S3 client planning reads with: of `options`, else of `use_options`' options."""
    return s3_client(options if options is not None else _options)


def check_bucket(url: str, what: str = "input", options=None) -> None:
    """For an s3:// URL: the bucket exists and the credentials are accepted, else InputError.
    `options`: the job's PipelineOptions (its S3 endpoint and region).

    Beam's S3 listing turns both into "no files", so ask S3 directly first (the job's
    preflight does, before planning the input)."""
    if not url.startswith("s3://"):
        return
    import botocore.exceptions as BE  # off the CLI's fast path

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


class S3Ranges(io.RawIOBase):
    """An s3:// object as a seekable file whose every read is one ranged GET of the bytes
    asked for (Beam's S3 reader asks for the object from the read position to its end and
    buffers 16 MiB of it, so each row group read would fetch the rest of the file)."""

    def __init__(self, client, url: str):
        super().__init__()
        self._client = client
        self._bucket, self._key = url[len("s3://"):].split("/", 1)
        self._size = client.head_object(Bucket=self._bucket, Key=self._key)["ContentLength"]
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        self._pos = max(0, offset + {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._size}[whence])
        return self._pos

    def tell(self) -> int:
        return self._pos

    def read(self, size: int | None = -1) -> bytes:
        end = self._size if size is None or size < 0 else min(self._size, self._pos + size)
        if end <= self._pos:
            return b""
        got = self._client.get_object(Bucket=self._bucket, Key=self._key, Range=f"bytes={self._pos}-{end - 1}")
        data = got["Body"].read()
        self._pos += len(data)
        return data

    def readinto(self, buf) -> int:
        data = self.read(len(buf))
        buf[:len(data)] = data
        return len(data)


def open_input(path: str, client: Any = None, *, lines: bool = False):
    """An input file opened for reading, local or s3:// (on `client`, else `planning_client()`);
    `lines`: for reading line by line (an s3:// object read ahead, a `.gz` file decompressed)."""
    if path.startswith("s3://"):
        raw: Any = S3Ranges(client or planning_client(), path)
        fh = io.BufferedReader(raw, S3_READ_AHEAD) if lines else raw
    else:
        fh = open(path, "rb")
    return gzip.GzipFile(fileobj=fh, mode="rb") if lines and path.endswith(".gz") else fh


def _translate(pattern: str) -> str:
    """A glob as the regular expression Beam's filesystems match it with: `*` within a
    folder, `**` across folders, `?` one character, `[...]` a class (`[!...]` negated)."""
    out = []
    for tok in re.findall(r"\*\*|\*|\?|\[!?\]?[^\]]*\]|.", pattern, re.S):
        if tok == "**":
            out.append(".*")
        elif tok == "*":
            out.append(r"[^/\\]*")
        elif tok == "?":
            out.append(".")
        elif tok.startswith("[") and len(tok) > 1:
            inner = tok[1:-1].replace("\\", "\\\\")
            out.append("[" + ("^" + inner[1:] if inner.startswith("!") else "\\" + inner if inner.startswith("^")
                              else inner) + "]")
        else:
            out.append(re.escape(tok))
    return r"(?ms)" + "".join(out) + r"\Z"


def _s3_objects(client, prefix: str) -> list[tuple[str, int, float]]:
    """(URL, size, modification time) of every object under an s3:// prefix (none where the
    bucket does not exist, as Beam's listing)."""
    bucket, _, key = prefix[len("s3://"):].partition("/")
    found = []
    try:
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=key):
            for o in page.get("Contents", []):
                found.append((f"s3://{bucket}/{o['Key']}", o["Size"], o["LastModified"].timestamp()))
    except Exception as err:
        if _error_code(err) not in ("404", "NoSuchBucket"):
            raise
    return found


def stat(path: str, client: Any = None) -> tuple[int, float] | None:
    """(size, modification time) of a file or s3:// object, None when there is none."""
    if not path.startswith("s3://"):
        return (os.path.getsize(path), os.path.getmtime(path)) if os.path.exists(path) else None
    bucket, _, key = path[len("s3://"):].partition("/")
    try:
        head = (client or planning_client()).head_object(Bucket=bucket, Key=key)
    except Exception as err:
        if _error_code(err) in ("404", "NoSuchKey", "NotFound"):
            return None
        raise
    return head["ContentLength"], head["LastModified"].timestamp()


def match(pattern: str, client: Any = None) -> list[str]:
    """The files a path or glob names, as Beam's `FileSystems.match` finds them."""
    if pattern.endswith(("/", "\\")):
        pattern += "*"
    prefix = re.split(r"[[*?]", pattern, maxsplit=1)[0]  # the part before the first glob character
    if prefix == pattern:
        return [pattern] if stat(pattern, client) is not None else []
    if pattern.startswith("s3://"):
        listed = [url for url, _, _ in _s3_objects(client or planning_client(), prefix)]
    else:
        root = os.path.dirname(prefix)
        listed = [os.path.join(d, f) for d, _, files in os.walk(root) for f in files] if os.path.exists(root) else []
    regex = re.compile(_translate(pattern))
    return [p for p in listed if regex.match(p)]


def is_remote(path: str) -> bool:
    return "://" in path and not path.startswith("file://")


def expand_input(path: str, patterns: tuple[str, ...] = ("*.parquet",), client: Any = None) -> list[str]:
    """Files for a file, folder or glob, local or s3:// (on `client`, else `planning_client()`)."""
    client = client or (planning_client() if path.startswith("s3://") else None)

    def found(p: str) -> list[str]:
        try:
            res = match(p, client)
        except Exception as err:
            msg = first_line(err)
            if "NoSuchBucket" in msg or "does not exist" in msg.lower():
                raise InputError(f"input {path!r} does not exist ({msg})") from None
            if "InvalidAccessKeyId" in msg or "SignatureDoesNotMatch" in msg or "AccessDenied" in msg:
                raise InputError(f"cannot read input {path!r}: access denied ({msg})") from None
            return []
        return sorted(m for m in res if not m.endswith("/"))

    if any(ch in path for ch in "*?["):
        files = found(path)
    elif is_remote(path):
        files = [f for f in found(path) if f == path] or [f for pat in patterns for f in found(path.rstrip("/") + "/" + pat)]
    elif os.path.isfile(path):
        files = [os.path.abspath(path)]
    elif os.path.isdir(path):
        files = sorted(f for pat in patterns for f in found(os.path.join(os.path.abspath(path), pat)))
    else:
        raise InputError(f"input {path!r} does not exist")
    if not files:
        raise InputError(f"input {path!r} matched no {'/'.join(patterns)} files")
    return files


# ---------------------------------------------------------------- Parquet plans and work units


def read_footer(fh):
    """A Parquet file's metadata, reading only its footer (its last 8 bytes, then the
    footer itself; pyarrow would read a 64 KiB tail, more than a small file's columns)."""
    import pyarrow as pa  # heavy: off the CLI's fast path, as is every pyarrow import here
    import pyarrow.parquet as pq

    fh.seek(-8, 2)
    tail = fh.read(8)
    size = int.from_bytes(tail[:4], "little")
    if tail[4:] != b"PAR1" or size <= 0:
        raise ValueError("no Parquet footer at the end of the file")
    fh.seek(-8 - size, 2)
    return pq.read_metadata(pa.BufferReader(b"PAR1" + fh.read(size) + tail))


def _footer(f: str, client: Any):
    """(the file's Parquet metadata, its size in bytes, "size:modification time")."""
    try:
        with open_input(f, client) as fh:
            meta = read_footer(fh)
        size, mtime = stat(f, client) or (0, 0.0)
        return meta, size, f"{size}:{mtime}"
    except Exception as err:
        raise InputError(f"input file {f!r} is not a readable Parquet file: {first_line(err)}") from None


def plan_parquet(path: str, options: Any = None) -> InputPlan:
    client = planning_client(options) if path.startswith("s3://") else None
    files = expand_input(path, client=client)
    with ThreadPoolExecutor(min(PLAN_THREADS, len(files))) as pool:
        metas = list(pool.map(lambda f: _footer(f, client), files))
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
