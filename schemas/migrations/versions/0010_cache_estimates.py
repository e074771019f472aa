"""The result cache across jobs (`result_cache`, `outputs.cached_from`) and the estimates
`tokenmill estimate` made (`estimates`).

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-04
"""

import sqlalchemy as sa
from alembic import op

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("outputs") as b:
        b.add_column(sa.Column("cached_from", sa.String(128)))
    op.create_table(
        "result_cache",
        sa.Column("key", sa.String(64), primary_key=True),
        sa.Column("fingerprint", sa.String(64), nullable=False),
        sa.Column("job_id", sa.String(128), nullable=False),
        sa.Column("id", sa.String(512), nullable=False),
        sa.Column("sample", sa.Integer, nullable=False),
        sa.Column("model", sa.String(512)),
        sa.Column("prompt_tokens", sa.Integer),
        sa.Column("output_tokens", sa.Integer),
        sa.Column("size_bytes", sa.Integer, nullable=False),
        sa.Column("created_at", sa.Float, nullable=False),
        sa.Column("used_at", sa.Float),
        sa.Column("hits", sa.Integer, nullable=False, server_default="0"),
        sa.Column("answer", sa.JSON, nullable=False),
    )
    op.create_index("ix_result_cache_fingerprint", "result_cache", ["fingerprint"])
    op.create_index("ix_result_cache_created_at", "result_cache", ["created_at"])
    op.create_table(
        "estimates",
        sa.Column("job_id", sa.String(128), primary_key=True),
        sa.Column("created_at", sa.Float, primary_key=True),
        sa.Column("sample_rows", sa.Integer),
        sa.Column("total_rows", sa.Integer),
        sa.Column("estimate", sa.JSON, nullable=False),
    )


def downgrade() -> None:
    op.drop_table("estimates")
    op.drop_index("ix_result_cache_created_at", "result_cache")
    op.drop_index("ix_result_cache_fingerprint", "result_cache")
    op.drop_table("result_cache")
    with op.batch_alter_table("outputs") as b:
        b.drop_column("cached_from")
