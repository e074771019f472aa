"""The live page's login sessions (`page_sessions`): a random id's SHA-256, its key, its end.

Revision ID: 0015
Revises: 0014
Create Date: 2026-12-07
"""

import sqlalchemy as sa
from alembic import op

revision = "0015"
down_revision = "0014"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "page_sessions",
        sa.Column("id_hash", sa.String(64), primary_key=True),
        sa.Column("key_id", sa.String(64), nullable=False, index=True),
        sa.Column("created_at", sa.Float, nullable=False),
        sa.Column("expires_at", sa.Float, nullable=False, index=True),
    )


def downgrade() -> None:
    op.drop_table("page_sessions")
