"""Database engines: one pooled engine per URL, and the default URL.

Every SQL statement lives in schemas/storage/, which builds on these.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from sqlalchemy import create_engine, event
from sqlalchemy.engine import Engine, make_url

DEFAULT_DB_ENV = "TOKENMILL_DB_URL"


def default_db_url() -> str:
    from tokenmill.schemas.models import tokenmill_home

    env = os.environ.get(DEFAULT_DB_ENV)
    if env:
        return env
    return f"sqlite:///{tokenmill_home() / 'tokenmill.db'}"


_ENGINES: dict[str, Engine] = {}


def _private_file(path: Path) -> None:
    """A SQLite database file made here is its owner's alone (0600, its folder 0700 when made
    here; SQLite gives its -wal and -shm files the database's mode).  An existing one is left."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    try:
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))  # an empty file is an empty database
    except FileExistsError:
        pass


def db_engine(url: str) -> Engine:
    """One pooled engine per URL per process (workers reuse it across bundles)."""
    eng = _ENGINES.get(url)
    if eng is None:
        u = make_url(url)
        kwargs: dict[str, Any] = {"future": True}
        if u.get_backend_name() == "sqlite":
            if u.database and u.database != ":memory:":
                _private_file(Path(u.database).expanduser())
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
