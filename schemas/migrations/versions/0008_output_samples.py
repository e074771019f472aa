"""A row's n samples: `outputs.sample` (0..n-1) joins the outputs' primary key.

A row that asks for `n` samples is answered by n output rows, keyed (job_id, id,
sample); every row stored before this revision is sample 0 (it asked for one).

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-03
"""

import warnings

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None


def _rekey(columns: list[str]) -> None:
    pk = sa.inspect(op.get_bind()).get_pk_constraint("outputs").get("name")
    # SQLite rebuilds the table and warns that the new key differs from the reflected one: it is meant to.
    with warnings.catch_warnings(), op.batch_alter_table("outputs") as b:
        warnings.filterwarnings("ignore", "Table '_alembic_tmp_outputs' specifies", sa.exc.SAWarning)
        if pk:  # PostgreSQL names it; SQLite's is rebuilt with the table
            b.drop_constraint(pk, type_="primary")
        if "sample" not in columns:
            b.drop_column("sample")
        b.create_primary_key("pk_outputs", columns)


def upgrade() -> None:
    with op.batch_alter_table("outputs") as b:
        b.add_column(sa.Column("sample", sa.Integer, nullable=False, server_default="0"))
    _rekey(["job_id", "id", "sample"])


def downgrade() -> None:
    op.execute("DELETE FROM outputs WHERE sample > 0")
    _rekey(["job_id", "id"])
