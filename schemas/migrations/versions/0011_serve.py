"""The service's tables (`tokenmill serve`, docs/SERVING.md): `api_keys`, `api_files`,
`api_batches`.

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-04
"""

import sqlalchemy as sa
from alembic import op

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "api_keys",
        sa.Column("id", sa.String(64), primary_key=True),
        sa.Column("name", sa.String(256), nullable=False),
        sa.Column("prefix", sa.String(16), nullable=False),
        sa.Column("hash", sa.String(64), nullable=False, unique=True),
        sa.Column("admin", sa.Boolean, nullable=False, server_default=sa.false()),
        sa.Column("created_at", sa.Float, nullable=False),
        sa.Column("revoked_at", sa.Float),
    )
    op.create_table(
        "api_files",
        sa.Column("id", sa.String(64), primary_key=True),
        sa.Column("owner", sa.String(64), nullable=False, index=True),
        sa.Column("filename", sa.String(512), nullable=False),
        sa.Column("purpose", sa.String(32), nullable=False),
        sa.Column("bytes", sa.BigInteger, nullable=False),
        sa.Column("lines", sa.Integer),
        sa.Column("created_at", sa.Float, nullable=False, index=True),
        sa.Column("deleted_at", sa.Float),
    )
    op.create_table(
        "api_batches",
        sa.Column("id", sa.String(64), primary_key=True),
        sa.Column("owner", sa.String(64), nullable=False, index=True),
        sa.Column("model", sa.String(512)),
        sa.Column("endpoint", sa.String(64), nullable=False),
        sa.Column("input_file_id", sa.String(64), nullable=False),
        sa.Column("completion_window", sa.String(16), nullable=False),
        sa.Column("metadata", sa.JSON),
        sa.Column("priority", sa.Integer, nullable=False, server_default="0"),
        sa.Column("lines", sa.Integer),
        sa.Column("errors", sa.JSON),
        sa.Column("created_at", sa.Float, nullable=False, index=True),
        sa.Column("expires_at", sa.Float, nullable=False),
        sa.Column("in_progress_at", sa.Float),
        sa.Column("finalizing_at", sa.Float),
        sa.Column("completed_at", sa.Float),
        sa.Column("failed_at", sa.Float),
        sa.Column("expired_at", sa.Float),
        sa.Column("cancelling_at", sa.Float),
        sa.Column("cancelled_at", sa.Float),
        sa.Column("output_file_id", sa.String(64)),
        sa.Column("error_file_id", sa.String(64)),
        sa.Column("request_counts", sa.JSON),
        sa.Column("usage", sa.JSON),
    )


def downgrade() -> None:
    op.drop_table("api_batches")
    op.drop_table("api_files")
    op.drop_table("api_keys")
