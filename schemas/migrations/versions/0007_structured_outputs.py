"""What a structured or log-probability request answered besides its text.

`outputs.logprobs` (per output token: text, log-probability, top alternatives),
`outputs.valid` and `outputs.invalid_reason` (a structured output checked against its
constraint), `outputs.parsed` (a JSON output as JSON) and `outputs.choice_probs` (a
`choice` row's answers with their probabilities); docs/REQUESTS.md.  Rows stored before
this revision keep null: they were free-text requests.

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-03
"""

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("outputs") as b:
        b.add_column(sa.Column("logprobs", sa.JSON))
        b.add_column(sa.Column("valid", sa.Boolean))
        b.add_column(sa.Column("invalid_reason", sa.Text))
        b.add_column(sa.Column("parsed", sa.JSON))
        b.add_column(sa.Column("choice_probs", sa.JSON))


def downgrade() -> None:
    with op.batch_alter_table("outputs") as b:
        for name in ("choice_probs", "parsed", "invalid_reason", "valid", "logprobs"):
            b.drop_column(name)
