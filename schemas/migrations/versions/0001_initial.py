"""Initial schema: jobs, outputs, dead letters, batches, workers, locks.

Revision ID: 0001
Revises:
Create Date: 2026-11-29
"""

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "jobs",
        sa.Column("id", sa.String(128), primary_key=True),
        sa.Column("name", sa.String(256)),
        sa.Column("status", sa.String(16), nullable=False, index=True),
        sa.Column("spec", sa.JSON, nullable=False),
        sa.Column("model", sa.String(512)),
        sa.Column("quantization", sa.String(64)),
        sa.Column("kv_cache_dtype", sa.String(32)),
        sa.Column("engine_config", sa.JSON),
        sa.Column("versions", sa.JSON),
        sa.Column("hardware", sa.JSON),
        sa.Column("runner", sa.String(64)),
        sa.Column("submitted_at", sa.DateTime(timezone=True)),
        sa.Column("started_at", sa.DateTime(timezone=True)),
        sa.Column("finished_at", sa.DateTime(timezone=True)),
        sa.Column("heartbeat_at", sa.DateTime(timezone=True)),
        sa.Column("owner", sa.String(256)),
        sa.Column("cancel_requested", sa.Boolean, nullable=False, server_default=sa.false()),
        sa.Column("total", sa.Integer),
        sa.Column("succeeded", sa.Integer),
        sa.Column("failed", sa.Integer),
        sa.Column("error", sa.Text),
        sa.Column("metrics", sa.JSON),
    )
    op.create_table(
        "outputs",
        sa.Column("job_id", sa.String(128), primary_key=True),
        sa.Column("id", sa.String(512), primary_key=True),
        sa.Column("input_ref", sa.String(512), nullable=False),
        sa.Column("text", sa.Text),
        sa.Column("finish_reason", sa.String(32)),
        sa.Column("prompt_tokens", sa.Integer),
        sa.Column("output_tokens", sa.Integer),
        sa.Column("cached_tokens", sa.Integer),
        sa.Column("ttft_s", sa.Float),
        sa.Column("tpot_s", sa.Float),
        sa.Column("e2e_s", sa.Float),
        sa.Column("queue_s", sa.Float),
        sa.Column("model", sa.String(512)),
        sa.Column("batch_id", sa.String(64)),
        sa.Column("worker", sa.String(128)),
        sa.Column("finished_at", sa.Float),
        sa.Column("reference", sa.Text),
        sa.Column("error", sa.Text),
    )
    op.create_table(
        "dead_letters",
        sa.Column("job_id", sa.String(128), primary_key=True),
        sa.Column("input_ref", sa.String(512), primary_key=True),
        sa.Column("id", sa.String(512)),
        sa.Column("reason", sa.String(64), nullable=False),
        sa.Column("message", sa.Text, nullable=False),
        sa.Column("raw", sa.Text),
        sa.Column("created_at", sa.Float),
    )
    op.create_index("ix_dead_letters_job_reason", "dead_letters", ["job_id", "reason"])
    op.create_table(
        "batches",
        sa.Column("job_id", sa.String(128), primary_key=True),
        sa.Column("batch_id", sa.String(64), primary_key=True),
        sa.Column("worker", sa.String(128)),
        sa.Column("requests", sa.Integer),
        sa.Column("prompt_tokens", sa.Integer),
        sa.Column("output_tokens", sa.Integer),
        sa.Column("cached_tokens", sa.Integer),
        sa.Column("started_at", sa.Float),
        sa.Column("finished_at", sa.Float),
        sa.Column("tail_s", sa.Float),
        sa.Column("engine_idle_s", sa.Float),
    )
    op.create_table(
        "workers",
        sa.Column("job_id", sa.String(128), primary_key=True),
        sa.Column("worker", sa.String(128), primary_key=True),
        sa.Column("hostname", sa.String(256)),
        sa.Column("pid", sa.Integer),
        sa.Column("device", sa.String(256)),
        sa.Column("load_s", sa.Float),
        sa.Column("engine_info", sa.JSON),
        sa.Column("peak_rss_bytes", sa.BigInteger),
        sa.Column("started_at", sa.Float),
        sa.Column("updated_at", sa.Float),
    )
    op.create_table(
        "locks",
        sa.Column("name", sa.String(128), primary_key=True),
        sa.Column("owner", sa.String(256), nullable=False),
        sa.Column("acquired_at", sa.DateTime(timezone=True), nullable=False),
    )


def downgrade() -> None:
    for t in ("locks", "workers", "batches", "dead_letters", "outputs", "jobs"):
        op.drop_table(t)
