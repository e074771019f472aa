"""Reruns cost what is missing: `outputs` indexed by (job_id, batch_id), so one run's rows are read
without the rest of the job (the export's parts, the run's summary), and `runs.summary`, each run's
answered requests summed, counted and binned (schemas/storage/merged.py).

Revision ID: 0016
Revises: 0015
Create Date: 2026-12-07
"""

import sqlalchemy as sa
from alembic import op

revision = "0016"
down_revision = "0015"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_index("ix_outputs_job_batch", "outputs", ["job_id", "batch_id"])
    with op.batch_alter_table("runs") as batch:
        batch.add_column(sa.Column("summary", sa.JSON(none_as_null=True)))


def downgrade() -> None:
    with op.batch_alter_table("runs") as batch:
        batch.drop_column("summary")
    op.drop_index("ix_outputs_job_batch", table_name="outputs")
