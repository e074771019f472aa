"""An embedding job's vectors: `outputs.embedding` (float32 little-endian bytes).

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-03
"""

import sqlalchemy as sa
from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("outputs") as b:
        b.add_column(sa.Column("embedding", sa.LargeBinary))


def downgrade() -> None:
    with op.batch_alter_table("outputs") as b:
        b.drop_column("embedding")
