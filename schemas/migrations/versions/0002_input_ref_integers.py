"""input_ref as two integers (input_file, input_row); outputs.error dropped.

The text "<file>:<row>" was parsed again wherever rows were ordered or
matched; the reader has both numbers, so they are stored as they are.
Existing rows are converted in chunks in Python (portable across backends),
dead letters change their primary key to (job_id, input_file, input_row),
and `outputs.error` (never set) goes.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-30
"""

import warnings
from typing import Any

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None

CHUNK_ROWS = 5000
#: The columns that tell a row apart before this revision, per table.
OLD_KEYS = {"outputs": ("job_id", "id"), "dead_letters": ("job_id", "input_ref")}


def _parse(table: str, ref: str) -> tuple[int, int]:
    try:
        f, r = ref.split(":")
        return int(f), int(r)
    except (AttributeError, ValueError):
        raise ValueError(f"{table}.input_ref {ref!r} is not <file>:<row>; cannot convert it") from None


def _backfill(table: str) -> None:
    keys = OLD_KEYS[table]
    cols: dict[str, sa.ColumnClause[Any]] = {c: sa.column(c) for c in (*keys, "input_ref", "input_file", "input_row")}
    t = sa.table(table, *cols.values())
    conn = op.get_bind()
    find = sa.select(*(cols[k] for k in keys), cols["input_ref"]).where(cols["input_file"].is_(None)).limit(CHUNK_ROWS)
    fill = (
        sa.update(t)
        .where(*(cols[k] == sa.bindparam(f"k_{k}") for k in keys))
        .values(input_file=sa.bindparam("v_file"), input_row=sa.bindparam("v_row"))
    )
    while rows := conn.execute(find).all():
        params = []
        for row in rows:
            f, r = _parse(table, row[-1])
            params.append({**{f"k_{k}": v for k, v in zip(keys, row)}, "v_file": f, "v_row": r})
        conn.execute(fill, params)


def upgrade() -> None:
    for table in OLD_KEYS:
        with op.batch_alter_table(table) as b:
            b.add_column(sa.Column("input_file", sa.Integer))
            b.add_column(sa.Column("input_row", sa.Integer))
        _backfill(table)
    with op.batch_alter_table("outputs") as b:
        b.alter_column("input_file", existing_type=sa.Integer, nullable=False)
        b.alter_column("input_row", existing_type=sa.Integer, nullable=False)
        b.drop_column("input_ref")
        b.drop_column("error")
    pk = sa.inspect(op.get_bind()).get_pk_constraint("dead_letters").get("name")
    # SQLite rebuilds the table and warns that the new key differs from the reflected one: it is meant to.
    with warnings.catch_warnings(), op.batch_alter_table("dead_letters") as b:
        warnings.filterwarnings("ignore", "Table '_alembic_tmp_dead_letters' specifies", sa.exc.SAWarning)
        if pk:  # PostgreSQL names it; SQLite's is rebuilt with the table
            b.drop_constraint(pk, type_="primary")
        b.alter_column("input_file", existing_type=sa.Integer, nullable=False)
        b.alter_column("input_row", existing_type=sa.Integer, nullable=False)
        b.drop_column("input_ref")
        b.create_primary_key("pk_dead_letters", ["job_id", "input_file", "input_row"])


def downgrade() -> None:
    raise NotImplementedError("0002 has no downgrade: restore the database from a backup taken before upgrading")
