"""Accounting measured where the engine runs: per-worker devices and readings, and job runs.

`workers` gains what each worker measured of itself (transforms/engines/meter.py):
the run it belongs to, its device type and model, how many GPUs its engine uses
(visible devices narrowed to TP × PP) or how many cores a CPU engine is bound to,
why NVML could not be read on a GPU worker, and the window's readings (`measure`:
memory, utilization, power, NVML energy, process-tree RSS and CPU time).
`runs` holds each run of a job (a first run and every resume): when the launcher
started it, when it was last seen alive (heartbeat) and when it finished, so a
resumed job's device time is the sum of its runs, not the span from first to last.

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-03
"""

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("workers") as b:
        b.add_column(sa.Column("run_id", sa.String(64)))
        b.add_column(sa.Column("device_type", sa.String(16)))
        b.add_column(sa.Column("device_model", sa.String(256)))
        b.add_column(sa.Column("device_count", sa.Integer))
        b.add_column(sa.Column("cpu_count", sa.Integer))
        b.add_column(sa.Column("nvml_error", sa.Text))
        b.add_column(sa.Column("measure", sa.JSON))
    op.create_table(
        "runs",
        sa.Column("job_id", sa.String(128), primary_key=True),
        sa.Column("run_id", sa.String(64), primary_key=True),
        sa.Column("owner", sa.String(256)),
        sa.Column("started_at", sa.Float, nullable=False),
        sa.Column("seen_at", sa.Float),
        sa.Column("finished_at", sa.Float),
    )


def downgrade() -> None:
    op.drop_table("runs")
    with op.batch_alter_table("workers") as b:
        for c in ("measure", "nvml_error", "cpu_count", "device_count", "device_model", "device_type", "run_id"):
            b.drop_column(c)
