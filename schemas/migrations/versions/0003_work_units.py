"""Work units at scale: id claims, an index for per-unit resume, engine-side work per worker.

`id_claims` maps each id of a job to the first row (input order) that carries
it, so duplicate ids are found per work unit with a keyed lookup instead of a
shuffle of every id.  `ix_outputs_job_input` serves the per-unit resume lookup
(answered rows of one file's row range) and exports in input order.
`workers.admitted_rows` / `generated_rows` / `generated_tokens` count what a
worker handed its engine and what the engine finished, committed or not
(requests run twice after a failure = Σ admitted − rows answered).

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-01
"""

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "id_claims",
        sa.Column("job_id", sa.String(128), primary_key=True),
        sa.Column("id", sa.String(512), primary_key=True),
        sa.Column("input_file", sa.Integer, nullable=False),
        sa.Column("input_row", sa.Integer, nullable=False),
    )
    op.create_index("ix_outputs_job_input", "outputs", ["job_id", "input_file", "input_row"])
    with op.batch_alter_table("workers") as b:
        b.add_column(sa.Column("admitted_rows", sa.BigInteger))
        b.add_column(sa.Column("generated_rows", sa.BigInteger))
        b.add_column(sa.Column("generated_tokens", sa.BigInteger))


def downgrade() -> None:
    with op.batch_alter_table("workers") as b:
        b.drop_column("generated_tokens")
        b.drop_column("generated_rows")
        b.drop_column("admitted_rows")
    op.drop_index("ix_outputs_job_input", "outputs")
    op.drop_table("id_claims")
