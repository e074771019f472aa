"""Where each output row's token counts came from.

`outputs.token_count_source`: "engine" (the engine's own counts: vLLM's request output,
an HTTP server's `usage`) or "local_tokenizer+stream_chunks" (an HTTP server that sent
no `usage`: the prompt counted by the job's tokenizer, the output by streamed chunks);
schemas/records.py TOKEN_COUNT_SOURCES.  Rows stored before this revision keep null:
their source was not recorded, and is not guessed here.

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-02
"""

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("outputs") as b:
        b.add_column(sa.Column("token_count_source", sa.String(64)))


def downgrade() -> None:
    with op.batch_alter_table("outputs") as b:
        b.drop_column("token_count_source")
