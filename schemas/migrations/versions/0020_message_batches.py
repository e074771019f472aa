"""Anthropic's Message Batches: an ended batch may be deleted (`api_batches.deleted_at`; its row
stays, so its key's usage and quotas still count it: schemas/storage/usage.py), and an output
row keeps the stop string that ended its text (`outputs.stop_sequence`, a Messages result's
`stop_sequence`).

Revision ID: 0020
Revises: 0018
Create Date: 2026-12-07
"""

import sqlalchemy as sa
from alembic import op

revision = "0020"
# written beside 0019 (files' expiry); once both are merged, this one revises 0019
down_revision = "0019"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("api_batches") as b:
        b.add_column(sa.Column("deleted_at", sa.Float))
    with op.batch_alter_table("outputs") as b:
        b.add_column(sa.Column("stop_sequence", sa.Text))


def downgrade() -> None:
    with op.batch_alter_table("outputs") as b:
        b.drop_column("stop_sequence")
    with op.batch_alter_table("api_batches") as b:
        b.drop_column("deleted_at")
