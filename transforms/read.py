"""ReadPrompts: Parquet (local or s3://) into row dicts, each with its stable place in the input (`_file_index`, `_row`).

The input is planned at pipeline-construction time (files, row groups, columns,
row counts), so a missing path, a file that is not Parquet or a schema without
a prompt column fails before any worker starts.  Workers then read one row
group at a time in small record batches, so no process holds the whole input.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterator

import apache_beam as beam

from tokenmill.schemas.errors import first_line

PROMPT_COLUMNS = ("prompt", "messages")
READ_BATCH_ROWS = 1024


class InputError(ValueError):
    """The input as a whole cannot be read; the message is one line."""


@dataclass(frozen=True)
class Shard:
    file_index: int
    path: str
    row_group: int
    num_rows: int


@dataclass
class InputPlan:
    files: list[str]
    shards: list[Shard]
    columns: list[str]
    total_rows: int
    format: str = "parquet"
    notes: list[str] = field(default_factory=list)


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




def open_file(path: str):
    from apache_beam.io.filesystems import FileSystems

    return FileSystems.open(path, compression_type="uncompressed")


def plan_parquet(path: str) -> InputPlan:
    import pyarrow.parquet as pq

    files = expand_input(path)
    shards: list[Shard] = []
    columns: list[str] | None = None
    total = 0
    for i, f in enumerate(files):
        try:
            with open_file(f) as fh:
                meta = pq.ParquetFile(fh).metadata
                names = meta.schema.to_arrow_schema().names
        except InputError:
            raise
        except Exception as err:
            raise InputError(f"input file {f!r} is not a readable Parquet file: {first_line(err)}") from None
        if not any(c in names for c in PROMPT_COLUMNS):
            raise InputError(
                f"input file {f!r} has no 'prompt' or 'messages' column; columns found: {', '.join(names) or '(none)'}"
            )
        columns = columns or names
        for rg in range(meta.num_row_groups):
            n = meta.row_group(rg).num_rows
            if n:
                shards.append(Shard(i, f, rg, n))
        total += meta.num_rows
    return InputPlan(files=files, shards=shards, columns=columns or [], total_rows=total)


def read_shard(shard: Shard, columns: list[str] | None = None) -> Iterator[dict[str, Any]]:
    """Rows of one row group as dicts; string prompt columns come back as bytes so that
    invalid UTF-8 becomes a per-row dead letter rather than a failed read."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    with open_file(shard.path) as fh:
        pf = pq.ParquetFile(fh)
        # Row offset of this row group inside the file.
        offset = sum(pf.metadata.row_group(i).num_rows for i in range(shard.row_group))
        row = offset
        for rb in pf.iter_batches(batch_size=READ_BATCH_ROWS, row_groups=[shard.row_group], columns=columns):
            cols = {}
            for name in rb.schema.names:
                arr = rb.column(name)
                if pa.types.is_string(arr.type) or pa.types.is_large_string(arr.type):
                    arr = arr.view(pa.binary()) if pa.types.is_string(arr.type) else arr.view(pa.large_binary())
                cols[name] = arr.to_pylist()
            for j in range(rb.num_rows):
                rec = {k: v[j] for k, v in cols.items()}
                rec["_row"] = row  # with the file index: where the row came from, stable across reruns
                rec["_file_index"] = shard.file_index
                row += 1
                yield rec


class ReadShardFn(beam.DoFn):
    def __init__(self, columns: list[str] | None = None):
        self._columns = columns

    def process(self, shard: Shard):
        yield from read_shard(shard, self._columns)


class ReadPrompts(beam.PTransform):
    """Planned shards → row dicts. `plan` comes from `plan_input()` at construction."""

    def __init__(self, plan: InputPlan, columns: list[str] | None = None):
        super().__init__()
        self._plan = plan
        self._columns = columns

    def expand(self, pbegin):
        if self._plan.format == "openai-jsonl":
            from tokenmill.transforms.openai_batch import ReadOpenAIBatch

            return pbegin | "ReadJsonl" >> ReadOpenAIBatch(self._plan)
        return (
            pbegin
            | "Shards" >> beam.Create(self._plan.shards, reshuffle=False)
            | "Spread" >> beam.Reshuffle()
            | "ReadRowGroups" >> beam.ParDo(ReadShardFn(self._columns))
        )


def plan_input(path: str, fmt: str = "parquet") -> InputPlan:
    if fmt == "openai-jsonl":
        from tokenmill.transforms.openai_batch import plan_jsonl

        return plan_jsonl(path)
    return plan_parquet(path)
