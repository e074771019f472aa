"""The database itself: connecting with the schema at head, migrations, and the SQL
helpers the stores share (idempotent bulk inserts, bounded IN lists, the owner tag).

`connect(url)` gives the SQLAlchemy engine for a URL (one per URL per process, the
schema migrated to head on first use); the stores (jobs.py, results.py, reader.py)
are small classes over that engine.
"""

from __future__ import annotations

import datetime as dt
import os
import socket
from pathlib import Path
from typing import Any, Iterator

from sqlalchemy import insert
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.exc import IntegrityError, OperationalError, SQLAlchemyError

from tokenmill.schemas import tables as T
from tokenmill.schemas.db import db_engine
from tokenmill.schemas.errors import first_line
from tokenmill.schemas.records import StoredRow
from tokenmill.schemas.secrets import mask_url

MIGRATIONS = Path(__file__).parent.parent / "migrations"
#: Ids per IN (...) list: well under SQLite's 32,766 bound parameters and PostgreSQL's 65,535.
IN_CHUNK = 1000


class StorageError(RuntimeError):
    """A database problem a user can act on; the message is one line."""


class SqlStore:
    """A store over one database engine (from `connect`); its methods hold the SQL."""

    def __init__(self, engine: Engine):
        self.engine = engine


def utcnow() -> dt.datetime:
    return dt.datetime.now(dt.timezone.utc)


def aware(t: dt.datetime) -> dt.datetime:
    """A datetime read back from the database, in UTC (SQLite returns naive datetimes)."""
    if t.tzinfo is None:
        return t.replace(tzinfo=dt.timezone.utc)
    return t


def owner_tag(pid: int | None = None) -> str:
    """A process as an owner or lease holder: host and pid (this process's by default)."""
    return f"{socket.gethostname()}:{pid or os.getpid()}"


def pid_alive(owner: str | None) -> bool:
    """Whether the process an owner tag names still runs (another host's: assumed so)."""
    if not owner or ":" not in owner:
        return False
    host, pid = owner.rsplit(":", 1)
    if host != socket.gethostname():
        return True  # cannot tell for another host: trust the heartbeat
    try:
        os.kill(int(pid), 0)
        return True
    except (ProcessLookupError, ValueError):
        return False
    except PermissionError:
        return True


def alembic_config(conn: Connection | None):
    from alembic.config import Config

    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS))
    cfg.attributes["connection"] = conn
    return cfg


def head_revision() -> str | None:
    from alembic.script import ScriptDirectory

    return ScriptDirectory.from_config(alembic_config(None)).get_current_head()


def current_revision(conn: Connection) -> str | None:
    from alembic.runtime.migration import MigrationContext

    return MigrationContext.configure(conn).get_current_revision()


def upgrade(engine: Engine) -> str | None:
    """Bring the schema to head; refuse a database from a newer tokenmill."""
    from alembic import command
    from alembic.script import ScriptDirectory

    script = ScriptDirectory.from_config(alembic_config(None))
    known = {r.revision for r in script.walk_revisions()}
    head = script.get_current_head()
    for attempt in range(3):
        with engine.begin() as conn:
            cur = current_revision(conn)
            if cur is not None and cur not in known:
                raise StorageError(
                    f"database {mask_url(str(engine.url))} has schema revision {cur!r}, newer than this tokenmill "
                    f"knows (head {head!r}); upgrade tokenmill"
                )
            if cur == head:
                return head
            try:
                command.upgrade(alembic_config(conn), "head")
                return head
            except (OperationalError, IntegrityError):
                if attempt == 2:  # another process migrated at the same time: look again
                    raise
    return head


_READY: set[str] = set()


def connect(url: str, *, migrate: bool = True) -> Engine:
    """An engine for the URL with the schema at head; unreachable databases raise StorageError."""
    try:
        eng = db_engine(url)
        if migrate and url not in _READY:
            upgrade(eng)
            _READY.add(url)
        elif not migrate:
            with eng.connect():
                pass
        return eng
    except StorageError:
        raise
    except SQLAlchemyError as err:
        # the driver's own message (err.orig), not SQLAlchemy's wrapper with the SQL and a link
        raise StorageError(f"cannot use database {mask_url(url)}: {first_line(getattr(err, 'orig', None) or err)}") from None
    except Exception as err:  # driver import errors, bad URLs
        raise StorageError(f"cannot use database {mask_url(url)}: {first_line(err)}") from None


# ---------------------------------------------------------------- SQL the stores share


def table(record: type[StoredRow]):
    """The table of a stored-row record."""
    return T.metadata.tables[record.TABLE]


def dialect_insert(conn: Connection, tbl):
    """The backend's INSERT with its ON CONFLICT clauses (SQLite's or PostgreSQL's); None elsewhere."""
    dialect = {"sqlite": sqlite, "postgresql": postgresql}.get(conn.dialect.name)
    return None if dialect is None else dialect.insert(tbl)


def write_lock(conn: Connection) -> None:
    """Take the database's write lock now, at the start of a transaction that reads and
    then writes on what it read (SQLite: BEGIN IMMEDIATE; pysqlite itself begins only at
    the first write, so the reads before it would see another writer's state).  PostgreSQL
    locks rows instead (FOR SHARE, upserts)."""
    if conn.dialect.name == "sqlite":
        conn.exec_driver_sql("BEGIN IMMEDIATE")


def insert_ignore(conn: Connection, tbl, rows: list[dict[str, Any]]) -> int:
    """Bulk insert; rows whose primary key exists are skipped (reruns never duplicate)."""
    if not rows:
        return 0
    stmt = dialect_insert(conn, tbl)
    if stmt is None:  # pragma: no cover - other backends: plain insert, one by one on conflict
        n = 0
        for r in rows:
            try:
                with conn.begin_nested():
                    conn.execute(insert(tbl), [r])
                n += 1
            except IntegrityError:
                pass
        return n
    stmt = stmt.on_conflict_do_nothing()
    if conn.dialect.name == "postgresql":
        # SQLAlchemy batches an ON CONFLICT executemany into multi-row INSERTs
        # ("insertmanyvalues") only with RETURNING; without it psycopg2 sends one
        # statement per row (bench/db_writes.py: several times slower).  RETURNING
        # yields only the rows actually inserted, which is the count we want.
        res = conn.execute(stmt.returning(*tbl.primary_key.columns), rows)
        return len(res.all())
    res = conn.execute(stmt, rows)
    return res.rowcount if res.rowcount is not None and res.rowcount >= 0 else len(rows)


def chunks(items: list, n: int = IN_CHUNK) -> Iterator[list]:
    """`items` in lists of at most `n` (one IN (...) list each)."""
    for i in range(0, len(items), n):
        yield items[i:i + n]
