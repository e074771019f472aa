"""All database tables, on one SQLAlchemy `MetaData` (migrations live in schemas/migrations).

The row tables (outputs, dead letters, batch stats, workers) take their columns from
the records in schemas/records.py; the migrations must create the same, which
tests/test_storage_contract.py checks against a migrated database."""

from __future__ import annotations

import dataclasses

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    Column,
    DateTime,
    Float,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    String,
    Table,
    Text,
    false,
)
from sqlalchemy.types import TypeEngine

from tokenmill.schemas.records import BatchStats, DeadLetterRow, OutputRow, StoredRow, WorkerRow

metadata = MetaData()

jobs = Table(
    "jobs",
    metadata,
    Column("id", String(128), primary_key=True),
    Column("name", String(256)),
    Column("status", String(16), nullable=False, index=True),
    Column("spec", JSON, nullable=False),
    Column("model", String(512)),
    Column("quantization", String(64)),
    Column("kv_cache_dtype", String(32)),
    Column("engine_config", JSON),
    Column("versions", JSON),
    Column("hardware", JSON),
    Column("runner", String(64)),
    Column("submitted_at", DateTime(timezone=True)),
    Column("started_at", DateTime(timezone=True)),
    Column("finished_at", DateTime(timezone=True)),
    Column("heartbeat_at", DateTime(timezone=True)),
    Column("owner", String(256)),
    Column("cancel_requested", Boolean, nullable=False, default=False, server_default=false()),
    Column("total", Integer),
    Column("succeeded", Integer),
    Column("failed", Integer),
    Column("error", Text),
    Column("metrics", JSON),
    # the queue: higher priority first, then submission; a served batch's job names its API key
    # (`api_key`: the server runs it, run-pending does not); runs that ended in an error or a dead
    # process, counted here so that a restarted server keeps the count
    Column("priority", Integer, nullable=False, default=0, server_default="0"),
    Column("api_key", String(64), index=True),
    Column("attempts", Integer, nullable=False, default=0, server_default="0"),
)

_SQL: dict[str, type[TypeEngine]] = {"text": Text, "int": Integer, "bigint": BigInteger, "float": Float, "json": JSON,
                                     "bool": Boolean, "bytes": LargeBinary}


def _sql_type(sql: str) -> TypeEngine:
    kind, _, length = sql.partition(":")
    if kind == "json":  # a record's None is SQL NULL, not the JSON text 'null': no encoding or decoding per row
        return JSON(none_as_null=True)
    return String(int(length)) if kind == "str" else _SQL[kind]()


def row_table(record: type[StoredRow], *extra) -> Table:
    """The table of a stored-row record: one column per field."""
    cols = [
        Column(f.name, _sql_type(f.metadata["sql"]), primary_key=f.metadata["key"],
               nullable=not (f.metadata["key"] or f.metadata["required"]))
        for f in dataclasses.fields(record)
    ]
    return Table(record.TABLE, metadata, *cols, *extra)


#: `ix_outputs_job_batch`: one run's rows (its batch ids start with the run id), read by the export's
#: parts and the run's request summary without reading the rest of the job (docs/JOBS.md, "Export parts")
outputs = row_table(OutputRow, Index("ix_outputs_job_input", "job_id", "input_file", "input_row"),
                    Index("ix_outputs_job_batch", "job_id", "batch_id"))
dead_letters = row_table(DeadLetterRow, Index("ix_dead_letters_job_reason", "job_id", "reason"))
batches = row_table(BatchStats)

workers = row_table(WorkerRow)

#: Each run of a job (the first and every resume), as its launcher saw it: started,
#: last seen alive (heartbeat), finished (None for a run that was killed).
runs = Table(
    "runs",
    metadata,
    Column("job_id", String(128), primary_key=True),
    Column("run_id", String(64), primary_key=True),
    Column("owner", String(256)),
    Column("started_at", Float, nullable=False),
    Column("seen_at", Float),
    Column("finished_at", Float),
    # the run's answered requests summed, counted and binned (storage/merged.py), written when a later
    # accounting first reads the run; None until then
    Column("summary", JSON(none_as_null=True)),
)

#: Which row of the input each id belongs to: the first in input order read so far
#: (duplicates are dead letters).  Filled as each unit is read (ClaimIds); the write
#: settles a duplicate answered before its id's first row was read (storage/results.py).
id_claims = Table(
    "id_claims",
    metadata,
    Column("job_id", String(128), primary_key=True),
    Column("id", String(512), primary_key=True),
    Column("input_file", Integer, nullable=False),
    Column("input_row", Integer, nullable=False),
)

#: A shared job's work units (schemas/storage/leases.py): which holder (a process of a `tokenmill
#: serve` replica) has each unit, until when, and its fencing token (`epoch`, raised at every take);
#: `done_at` once its rows are all answered.  `takeovers`: takes after another holder's lease
#: expired; `lost_rows`, `lost_output_tokens`: engine work whose commit a lost lease refused.
unit_leases = Table(
    "unit_leases",
    metadata,
    Column("job_id", String(128), primary_key=True),
    Column("unit", String(512), primary_key=True),
    Column("holder", String(256)),
    Column("epoch", Integer, nullable=False, default=0, server_default="0"),
    Column("expires_at", Float),
    Column("done_at", Float),
    # the unit's rows: input file and row range (first_row, row_count), so done-ness is one range count
    Column("input_file", Integer),
    Column("first_row", Integer),
    Column("row_count", Integer),
    Column("taken", Integer, nullable=False, default=0, server_default="0"),
    Column("takeovers", Integer, nullable=False, default=0, server_default="0"),
    Column("lost_rows", Integer, nullable=False, default=0, server_default="0"),
    Column("lost_output_tokens", Integer, nullable=False, default=0, server_default="0"),
)

#: The result cache across jobs (docs/CACHE.md): one deterministic answer per key, the key a
#: hash of everything that decides it (the checkpoint's content hash, engine kind and
#: version, dtype, quantization, KV dtype, the rendered prompt, the sampling with its seed,
#: the sample index).  `answer` holds the output row's answer columns (`records.CACHED_COLUMNS`).
result_cache = Table(
    "result_cache",
    metadata,
    Column("key", String(64), primary_key=True),
    # what answered it (the engine's identity hash, transforms/cache.py): `cache stats` groups by it
    Column("fingerprint", String(64), nullable=False, index=True),
    Column("job_id", String(128), nullable=False),
    Column("id", String(512), nullable=False),
    Column("sample", Integer, nullable=False),
    Column("model", String(512)),
    Column("prompt_tokens", Integer),
    Column("output_tokens", Integer),
    Column("size_bytes", Integer, nullable=False),
    Column("created_at", Float, nullable=False, index=True),
    Column("used_at", Float),
    Column("hits", Integer, nullable=False, default=0, server_default="0"),
    Column("answer", JSON, nullable=False),
)

#: Every `tokenmill estimate` made (docs/ESTIMATE.md): what it predicted for a job spec, so
#: `report` and `status` show the estimate beside what happened and caps can be checked.
estimates = Table(
    "estimates",
    metadata,
    Column("job_id", String(128), primary_key=True),
    Column("created_at", Float, primary_key=True),
    Column("sample_rows", Integer),
    Column("total_rows", Integer),
    Column("estimate", JSON, nullable=False),
)

locks = Table(
    "locks",
    metadata,
    Column("name", String(128), primary_key=True),
    Column("owner", String(256), nullable=False),
    Column("acquired_at", DateTime(timezone=True), nullable=False),
)

# ---------------------------------------------------------------- the service (`tokenmill serve`, docs/SERVING.md)

#: API keys: only a key's SHA-256 is stored; `prefix` (its first characters) names it in lists.
api_keys = Table(
    "api_keys",
    metadata,
    Column("id", String(64), primary_key=True),
    Column("name", String(256), nullable=False),
    Column("prefix", String(16), nullable=False),
    Column("hash", String(64), nullable=False, unique=True),
    Column("admin", Boolean, nullable=False, default=False, server_default=false()),
    Column("created_at", Float, nullable=False),
    Column("revoked_at", Float),
    # where the key's batch events go and the secret they are signed with (Standard Webhooks'
    # `whsec_` form: the server must hold it to sign, so it is stored as is, unlike the key)
    Column("webhook_url", String(2048)),
    Column("webhook_secret", String(128)),
    # the key's own quotas (null: the server's `limits`)
    Column("tokens_per_day", BigInteger),
    Column("max_batches_in_flight", Integer),
)

#: Files uploaded to the service or written by it (a batch's output and error files); the bytes
#: live in the service's files store under the file's id, never under a name a client chose.
api_files = Table(
    "api_files",
    metadata,
    Column("id", String(64), primary_key=True),
    Column("owner", String(64), nullable=False, index=True),
    Column("filename", String(512), nullable=False),
    Column("purpose", String(32), nullable=False),
    Column("bytes", BigInteger, nullable=False),
    Column("lines", Integer),
    Column("created_at", Float, nullable=False, index=True),
    Column("deleted_at", Float),
    # when the file expires (OpenAI's `expires_at`; null: kept until deleted): from then on it is
    # not found, and the scheduler's sweep removes its bytes and its row
    Column("expires_at", Float, index=True),
)

#: OpenAI batches: each runs as the tokenmill job of the same id.  Its state is its timestamps
#: (OpenAI's own fields) with the job row: `in_progress_at` once queued to run, one terminal
#: timestamp when it ended (jobs/serve/objects.py derives `status`).
api_batches = Table(
    "api_batches",
    metadata,
    Column("id", String(64), primary_key=True),
    Column("owner", String(64), nullable=False, index=True),
    Column("model", String(512)),
    Column("endpoint", String(64), nullable=False),
    Column("input_file_id", String(64), nullable=False),
    Column("completion_window", String(16), nullable=False),
    Column("metadata", JSON),
    Column("priority", Integer, nullable=False, default=0, server_default="0"),
    Column("validation_attempts", Integer, nullable=False, default=0, server_default="0"),
    Column("lines", Integer),
    Column("errors", JSON),
    Column("created_at", Float, nullable=False, index=True),
    Column("expires_at", Float, nullable=False),
    Column("in_progress_at", Float),
    Column("finalizing_at", Float),
    Column("completed_at", Float),
    Column("failed_at", Float),
    Column("expired_at", Float),
    Column("cancelling_at", Float),
    Column("cancelled_at", Float),
    Column("output_file_id", String(64)),
    Column("error_file_id", String(64)),
    Column("request_counts", JSON),
    Column("usage", JSON),
    # OpenAI's `output_expires_after.seconds`: the output and error files expire this long after they are made
    Column("output_expires_after", Integer),
    Column("deleted_at", Float),  # an ended batch deleted (Anthropic's DELETE): no longer listed or read
)

#: Each online request `tokenmill serve` answered (schemas/storage/online.py): whose key, which
#: model and endpoint, its tokens and times, how it ended (HTTP status; `finish_reason`).
online_requests = Table(
    "online_requests",
    metadata,
    Column("id", String(64), primary_key=True),
    Column("owner", String(64), nullable=False, index=True),
    Column("model", String(512), nullable=False),
    Column("endpoint", String(64), nullable=False),
    Column("stream", Boolean, nullable=False),
    Column("created_at", Float, nullable=False, index=True),
    Column("status", Integer, nullable=False),
    Column("prompt_tokens", Integer),
    Column("output_tokens", Integer),
    Column("cached_tokens", Integer),
    Column("finish_reason", String(32)),
    Column("e2e_s", Float),
    Column("ttft_s", Float),
    Column("tpot_s", Float),
    Column("error", String(1000)),
)

#: Every `tokenmill serve` started over this database (schemas/storage/replicas.py): where it runs
#: and answers, its heartbeat (`seen_at`), whether it is draining (told SIGTERM) and when it stopped.
replicas = Table(
    "replicas",
    metadata,
    Column("id", String(64), primary_key=True),
    Column("host", String(256), nullable=False),
    Column("pid", Integer, nullable=False),
    Column("url", String(512)),
    Column("started_at", Float, nullable=False),
    Column("seen_at", Float, nullable=False, index=True),
    Column("draining", Boolean, nullable=False, default=False, server_default=false()),
    Column("stopped_at", Float),
)

#: A batch's end, to be sent to a webhook: one row per batch and event type (its id derives
#: from both, so a batch finalized twice sends one event), with the body signed at each attempt.
webhook_events = Table(
    "webhook_events",
    metadata,
    Column("id", String(64), primary_key=True),
    Column("batch_id", String(64), nullable=False, index=True),
    Column("owner", String(64), nullable=False),
    Column("type", String(32), nullable=False),
    Column("url", String(2048), nullable=False),
    Column("body", Text, nullable=False),
    Column("created_at", Float, nullable=False),
    Column("next_at", Float, index=True),
    Column("attempts", Integer, nullable=False, default=0, server_default="0"),
    Column("delivered_at", Float),
    Column("gave_up_at", Float),
)

#: Every delivery attempt of a webhook event: when, the answer (HTTP status) or the error.
webhook_attempts = Table(
    "webhook_attempts",
    metadata,
    Column("event_id", String(64), primary_key=True),
    Column("attempt", Integer, primary_key=True),
    Column("batch_id", String(64), nullable=False, index=True),
    Column("at", Float, nullable=False),
    Column("outcome", String(16), nullable=False),
    Column("status_code", Integer),
    Column("error", Text),
    Column("duration_s", Float),
)

#: The live page's login sessions: the cookie carries a random session id, stored here only as
#: its SHA-256, with the key it was opened by and when it ends (never the key itself).
page_sessions = Table(
    "page_sessions",
    metadata,
    Column("id_hash", String(64), primary_key=True),
    Column("key_id", String(64), nullable=False, index=True),
    Column("created_at", Float, nullable=False),
    Column("expires_at", Float, nullable=False, index=True),
)
