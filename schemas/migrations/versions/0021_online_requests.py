"""The online API of `tokenmill serve`: `online_requests`, one row per online request answered
(its key, model, endpoint, tokens, times, status; schemas/storage/online.py).

Revision ID: 0021
Revises: 0018
Create Date: 2026-12-07
"""

import sqlalchemy as sa
from alembic import op

revision = "0021"
down_revision = "0020"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "online_requests",
        sa.Column("id", sa.String(64), primary_key=True),
        sa.Column("owner", sa.String(64), nullable=False, index=True),
        sa.Column("model", sa.String(512), nullable=False),
        sa.Column("endpoint", sa.String(64), nullable=False),
        sa.Column("stream", sa.Boolean, nullable=False),
        sa.Column("created_at", sa.Float, nullable=False, index=True),
        sa.Column("status", sa.Integer, nullable=False),
        sa.Column("prompt_tokens", sa.Integer),
        sa.Column("output_tokens", sa.Integer),
        sa.Column("cached_tokens", sa.Integer),
        sa.Column("finish_reason", sa.String(32)),
        sa.Column("e2e_s", sa.Float),
        sa.Column("ttft_s", sa.Float),
        sa.Column("tpot_s", sa.Float),
        sa.Column("error", sa.String(1000)),
    )


def downgrade() -> None:
    op.drop_table("online_requests")
