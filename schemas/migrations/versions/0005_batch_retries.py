"""An HTTP engine's retries, stored with each batch.

`batches.retries`: the retried attempts of the batch's requests by the failed attempt's
reason code (`rate_limited`, `server_error`, `request_timeout`, `connection_dropped`,
`bad_response`, `server_down`), so the report can say how often the server had to be
asked again even where every row was answered in the end. Null for engines that do
not retry (vLLM in process).

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-04
"""

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("batches") as b:
        b.add_column(sa.Column("retries", sa.JSON))


def downgrade() -> None:
    with op.batch_alter_table("batches") as b:
        b.drop_column("retries")
