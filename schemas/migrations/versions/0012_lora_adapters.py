"""The LoRA adapter that answered an output row: `outputs.adapter` (null: the base model).

Revision ID: 0012
Revises: 0011
Create Date: 2026-12-05
"""

import sqlalchemy as sa
from alembic import op

revision = "0012"
down_revision = "0011"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("outputs") as b:
        b.add_column(sa.Column("adapter", sa.String(128)))


def downgrade() -> None:
    with op.batch_alter_table("outputs") as b:
        b.drop_column("adapter")
