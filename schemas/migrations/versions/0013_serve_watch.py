"""The service's webhooks and quotas: `api_keys.webhook_url`, `webhook_secret`,
`tokens_per_day`, `max_batches_in_flight`; `webhook_events` and `webhook_attempts`.

Revision ID: 0013
Revises: 0012
Create Date: 2026-12-05
"""

import sqlalchemy as sa
from alembic import op

revision = "0013"
down_revision = "0012"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("api_keys") as b:
        b.add_column(sa.Column("webhook_url", sa.String(2048)))
        b.add_column(sa.Column("webhook_secret", sa.String(128)))
        b.add_column(sa.Column("tokens_per_day", sa.BigInteger))
        b.add_column(sa.Column("max_batches_in_flight", sa.Integer))
    op.create_table(
        "webhook_events",
        sa.Column("id", sa.String(64), primary_key=True),
        sa.Column("batch_id", sa.String(64), nullable=False, index=True),
        sa.Column("owner", sa.String(64), nullable=False),
        sa.Column("type", sa.String(32), nullable=False),
        sa.Column("url", sa.String(2048), nullable=False),
        sa.Column("body", sa.Text, nullable=False),
        sa.Column("created_at", sa.Float, nullable=False),
        sa.Column("next_at", sa.Float, index=True),
        sa.Column("attempts", sa.Integer, nullable=False, server_default="0"),
        sa.Column("delivered_at", sa.Float),
        sa.Column("gave_up_at", sa.Float),
    )
    op.create_table(
        "webhook_attempts",
        sa.Column("event_id", sa.String(64), primary_key=True),
        sa.Column("attempt", sa.Integer, primary_key=True),
        sa.Column("batch_id", sa.String(64), nullable=False, index=True),
        sa.Column("at", sa.Float, nullable=False),
        sa.Column("outcome", sa.String(16), nullable=False),
        sa.Column("status_code", sa.Integer),
        sa.Column("error", sa.Text),
        sa.Column("duration_s", sa.Float),
    )


def downgrade() -> None:
    op.drop_table("webhook_attempts")
    op.drop_table("webhook_events")
    with op.batch_alter_table("api_keys") as b:
        for col in ("max_batches_in_flight", "tokens_per_day", "webhook_secret", "webhook_url"):
            b.drop_column(col)
