"""Several `tokenmill serve` replicas over one database: `unit_leases`, one row per work unit of a
shared job, its holder, lease expiry and fencing token (schemas/storage/leases.py).

Revision ID: 0017
Revises: 0016
Create Date: 2026-12-07
"""

import sqlalchemy as sa
from alembic import op

revision = "0017"
down_revision = "0016"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "unit_leases",
        sa.Column("job_id", sa.String(128), primary_key=True),
        sa.Column("unit", sa.String(512), primary_key=True),
        sa.Column("holder", sa.String(256)),
        sa.Column("epoch", sa.Integer, nullable=False, server_default="0"),
        sa.Column("expires_at", sa.Float),
        sa.Column("done_at", sa.Float),
        sa.Column("input_file", sa.Integer),
        sa.Column("first_row", sa.Integer),
        sa.Column("row_count", sa.Integer),
        sa.Column("taken", sa.Integer, nullable=False, server_default="0"),
        sa.Column("takeovers", sa.Integer, nullable=False, server_default="0"),
        sa.Column("lost_rows", sa.Integer, nullable=False, server_default="0"),
        sa.Column("lost_output_tokens", sa.Integer, nullable=False, server_default="0"),
    )


def downgrade() -> None:
    op.drop_table("unit_leases")
