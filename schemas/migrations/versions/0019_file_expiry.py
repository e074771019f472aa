"""Files that expire (OpenAI's `expires_after`, `output_expires_after`): `api_files.expires_at`
(null: kept until deleted; the files of earlier revisions keep that) and
`api_batches.output_expires_after` (seconds; null: the batch's result files are kept).

Revision ID: 0019
Revises: 0018
Create Date: 2026-12-07
"""

import sqlalchemy as sa
from alembic import op

revision = "0019"
down_revision = "0018"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("api_files") as b:
        b.add_column(sa.Column("expires_at", sa.Float))
    op.create_index("ix_api_files_expires_at", "api_files", ["expires_at"])
    with op.batch_alter_table("api_batches") as b:
        b.add_column(sa.Column("output_expires_after", sa.Integer))


def downgrade() -> None:
    with op.batch_alter_table("api_batches") as b:
        b.drop_column("output_expires_after")
    op.drop_index("ix_api_files_expires_at", "api_files")
    with op.batch_alter_table("api_files") as b:
        b.drop_column("expires_at")
