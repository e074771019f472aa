"""All database tables, on one SQLAlchemy `MetaData` (migrations live in jobs/migrations)."""

from __future__ import annotations

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    Column,
    DateTime,
    Float,
    Index,
    Integer,
    MetaData,
    String,
    Table,
    Text,
    false,
)

metadata = MetaData()

JOB_STATUSES = ("pending", "running", "succeeded", "partial", "failed", "cancelled")

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
)

outputs = Table(
    "outputs",
    metadata,
    Column("job_id", String(128), primary_key=True),
    Column("id", String(512), primary_key=True),
    Column("input_ref", String(512), nullable=False),
    Column("text", Text),
    Column("finish_reason", String(32)),
    Column("prompt_tokens", Integer),
    Column("output_tokens", Integer),
    Column("cached_tokens", Integer),
    Column("ttft_s", Float),
    Column("tpot_s", Float),
    Column("e2e_s", Float),
    Column("queue_s", Float),
    Column("model", String(512)),
    Column("batch_id", String(64)),
    Column("worker", String(128)),
    Column("finished_at", Float),
    Column("reference", Text),
    Column("error", Text),
)

dead_letters = Table(
    "dead_letters",
    metadata,
    Column("job_id", String(128), primary_key=True),
    Column("input_ref", String(512), primary_key=True),
    Column("id", String(512)),
    Column("reason", String(64), nullable=False),
    Column("message", Text, nullable=False),
    Column("raw", Text),
    Column("created_at", Float),
    Index("ix_dead_letters_job_reason", "job_id", "reason"),
)

batches = Table(
    "batches",
    metadata,
    Column("job_id", String(128), primary_key=True),
    Column("batch_id", String(64), primary_key=True),
    Column("worker", String(128)),
    Column("requests", Integer),
    Column("prompt_tokens", Integer),
    Column("output_tokens", Integer),
    Column("cached_tokens", Integer),
    Column("started_at", Float),
    Column("finished_at", Float),
    Column("tail_s", Float),
    Column("engine_idle_s", Float),
)

workers = Table(
    "workers",
    metadata,
    Column("job_id", String(128), primary_key=True),
    Column("worker", String(128), primary_key=True),
    Column("hostname", String(256)),
    Column("pid", Integer),
    Column("device", String(256)),
    Column("load_s", Float),
    Column("engine_info", JSON),
    Column("peak_rss_bytes", BigInteger),
    Column("started_at", Float),
    Column("updated_at", Float),
)

locks = Table(
    "locks",
    metadata,
    Column("name", String(128), primary_key=True),
    Column("owner", String(256), nullable=False),
    Column("acquired_at", DateTime(timezone=True), nullable=False),
)
