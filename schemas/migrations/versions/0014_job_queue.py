"""The jobs table as the one queue: `jobs.priority`, `jobs.api_key` (a served batch's job) and
`jobs.attempts` (runs that ended in an error, kept across a server restart);
`api_batches.validation_attempts` (checks of the input that raised).

Revision ID: 0014
Revises: 0013
Create Date: 2026-12-07
"""

import sqlalchemy as sa
from alembic import op

revision = "0014"
down_revision = "0013"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("jobs") as b:
        b.add_column(sa.Column("priority", sa.Integer, nullable=False, server_default="0"))
        b.add_column(sa.Column("api_key", sa.String(64)))
        b.add_column(sa.Column("attempts", sa.Integer, nullable=False, server_default="0"))
        b.create_index("ix_jobs_api_key", ["api_key"])
    with op.batch_alter_table("api_batches") as b:
        b.add_column(sa.Column("validation_attempts", sa.Integer, nullable=False, server_default="0"))


def downgrade() -> None:
    with op.batch_alter_table("api_batches") as b:
        b.drop_column("validation_attempts")
    with op.batch_alter_table("jobs") as b:
        b.drop_index("ix_jobs_api_key")
        for col in ("attempts", "api_key", "priority"):
            b.drop_column(col)
