"""Database connection helpers shared by the workers and the job lifecycle.

Only engine creation and idempotent bulk inserts live here; the lifecycle
(migrations, job rows, locks) lives in jobs/storage.py.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, Iterable

from sqlalchemy import BigInteger, Table, create_engine, event
from sqlalchemy.engine import Engine, make_url
from sqlalchemy.ext.compiler import compiles
from sqlalchemy.sql.functions import FunctionElement

DEFAULT_DB_ENV = "TOKENMILL_DB_URL"


def default_db_url() -> str:
    from tokenmill.schemas.models import tokenmill_home

    env = os.environ.get(DEFAULT_DB_ENV)
    if env:
        return env
    return f"sqlite:///{tokenmill_home() / 'tokenmill.db'}"


def mask_url(url: str) -> str:
    """The URL with any password replaced by ***, safe for logs, reports and the jobs table."""
    try:
        return make_url(url).render_as_string(hide_password=True)
    except Exception:  # not a URL SQLAlchemy can parse: mask anything that looks like user:pass@
        return re.sub(r"//([^:/@]+):[^@]*@", r"//\1:***@", url)


_ENGINES: dict[str, Engine] = {}


def db_engine(url: str) -> Engine:
    """One pooled engine per URL per process (workers reuse it across bundles)."""
    eng = _ENGINES.get(url)
    if eng is None:
        u = make_url(url)
        kwargs: dict[str, Any] = {"future": True}
        if u.get_backend_name() == "sqlite":
            if u.database and u.database != ":memory:":
                Path(u.database).expanduser().parent.mkdir(parents=True, exist_ok=True)
            kwargs["connect_args"] = {"timeout": 60}
        else:
            kwargs["pool_pre_ping"] = True
            kwargs["connect_args"] = {"connect_timeout": 10} if u.get_backend_name() == "postgresql" else {}
        eng = create_engine(url, **kwargs)
        if u.get_backend_name() == "sqlite":

            @event.listens_for(eng, "connect")
            def _sqlite_pragmas(dbapi_conn, _rec):  # WAL lets readers run beside one writer
                cur = dbapi_conn.cursor()
                cur.execute("PRAGMA journal_mode=WAL")
                cur.execute("PRAGMA busy_timeout=60000")
                cur.execute("PRAGMA synchronous=NORMAL")
                cur.close()

        _ENGINES[url] = eng
    return eng


def insert_ignore(conn, table: Table, rows: Iterable[dict[str, Any]]) -> int:
    """Bulk insert; rows whose primary key exists are skipped (reruns never duplicate)."""
    rows = list(rows)
    if not rows:
        return 0
    dialect = conn.dialect.name
    if dialect == "sqlite":
        from sqlalchemy.dialects.sqlite import insert
    elif dialect == "postgresql":
        from sqlalchemy.dialects.postgresql import insert
    else:  # pragma: no cover - other backends: plain insert, one by one on conflict
        from sqlalchemy import insert as _insert

        n = 0
        for r in rows:
            try:
                with conn.begin_nested():
                    conn.execute(_insert(table), [r])
                n += 1
            except Exception:
                pass
        return n
    stmt = insert(table).on_conflict_do_nothing()
    if dialect == "postgresql":
        # SQLAlchemy batches an ON CONFLICT executemany into multi-row INSERTs
        # ("insertmanyvalues") only with RETURNING; without it psycopg2 sends one
        # statement per row (bench/db_writes.py: several times slower).  RETURNING
        # yields only the rows actually inserted, which is the count we want.
        res = conn.execute(stmt.returning(*table.primary_key.columns), rows)
        return len(res.all())
    res = conn.execute(stmt, rows)
    return res.rowcount if res.rowcount is not None and res.rowcount >= 0 else len(rows)


# ---------------------------------------------------------------- input order


class _RefPart(FunctionElement):
    """Part `n` (1: file index, 2: row) of an `input_ref` ("<file>:<row>") as an integer,
    so that exports sort "0:2" before "0:10" in every dialect."""

    type = BigInteger()
    inherit_cache = True
    name = "ref_part"

    def __init__(self, col, n: int):
        self.n = n
        super().__init__(col)


@compiles(_RefPart)
def _ref_part_default(el, compiler, **kw):  # SQLite
    col = compiler.process(list(el.clauses)[0], **kw)
    if el.n == 1:
        return f"CAST(substr({col}, 1, instr({col}, ':') - 1) AS INTEGER)"
    return f"CAST(substr({col}, instr({col}, ':') + 1) AS INTEGER)"


@compiles(_RefPart, "postgresql")
def _ref_part_pg(el, compiler, **kw):
    col = compiler.process(list(el.clauses)[0], **kw)
    return f"CAST(split_part({col}, ':', {el.n}) AS BIGINT)"


@compiles(_RefPart, "mysql")
@compiles(_RefPart, "mariadb")
def _ref_part_mysql(el, compiler, **kw):
    col = compiler.process(list(el.clauses)[0], **kw)
    part = f"SUBSTRING_INDEX({col}, ':', 1)" if el.n == 1 else f"SUBSTRING_INDEX({col}, ':', -1)"
    return f"CAST({part} AS UNSIGNED)"


def input_order(col) -> tuple:
    """ORDER BY terms that put rows back in input order (file, then row number)."""
    return (_RefPart(col, 1), _RefPart(col, 2))
