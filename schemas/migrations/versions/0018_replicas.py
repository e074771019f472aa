"""Several `tokenmill serve` replicas over one database: `replicas`, one row per server started,
its address, heartbeat, whether it drains and when it stopped (schemas/storage/replicas.py).

Revision ID: 0018
Revises: 0017
Create Date: 2026-12-07
"""

import sqlalchemy as sa
from alembic import op

revision = "0018"
down_revision = "0017"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "replicas",
        sa.Column("id", sa.String(64), primary_key=True),
        sa.Column("host", sa.String(256), nullable=False),
        sa.Column("pid", sa.Integer, nullable=False),
        sa.Column("url", sa.String(512)),
        sa.Column("started_at", sa.Float, nullable=False),
        sa.Column("seen_at", sa.Float, nullable=False, index=True),
        sa.Column("draining", sa.Boolean, nullable=False, server_default=sa.false()),
        sa.Column("stopped_at", sa.Float),
    )


def downgrade() -> None:
    op.drop_table("replicas")
