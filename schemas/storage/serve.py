"""What `tokenmill serve` keeps in the database: API keys (`KeyStore`), the files clients
upload and the batches' output files (`FileStore`), and the batches (`BatchStore`).

Every read of a file or a batch names its owner (the key that made it), except with
`owner=None`, which only an admin key's request passes: a key never reads another key's
rows, and a list never shows them.  The bytes of the files are not here: the service's
files store holds them under the file's id (jobs/serve/blobs.py)."""

from __future__ import annotations

import hashlib
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator

from sqlalchemy import Select, delete, func, insert, select, update
from sqlalchemy.engine import Connection

from tokenmill.schemas import tables as T
from tokenmill.schemas.storage.database import SqlStore, write_lock


def key_hash(secret: str) -> str:
    """How a key is stored and looked up: its SHA-256, hex (keys are long random strings, so a
    plain hash is enough; the secret itself is never stored)."""
    return hashlib.sha256(secret.encode("utf-8")).hexdigest()


#: A batch that has ended: one of these is set.
TERMINAL = ("completed_at", "failed_at", "expired_at", "cancelled_at")


class KeyStore(SqlStore):
    """The `api_keys` table."""

    def add(self, key_id: str, name: str, secret: str, *, admin: bool = False, webhook_url: str | None = None,
            webhook_secret: str | None = None) -> dict[str, Any]:
        row = {"id": key_id, "name": name, "prefix": secret[:10], "hash": key_hash(secret), "admin": admin,
               "created_at": time.time(), "revoked_at": None, "webhook_url": webhook_url,
               "webhook_secret": webhook_secret}
        with self.engine.begin() as conn:
            conn.execute(insert(T.api_keys).values(**row))
        return row

    def by_secret(self, secret: str) -> dict[str, Any] | None:
        """The key row of a presented secret that is not revoked, or None."""
        k = T.api_keys.c
        with self.engine.connect() as conn:
            row = conn.execute(select(T.api_keys).where(k.hash == key_hash(secret), k.revoked_at.is_(None))
                               ).mappings().first()
        return dict(row) if row else None

    def all(self) -> list[dict[str, Any]]:
        with self.engine.connect() as conn:
            rows = conn.execute(select(T.api_keys).order_by(T.api_keys.c.created_at)).mappings().all()
        return [{k: v for k, v in r.items() if k not in ("hash", "webhook_secret")} for r in rows]

    def get(self, key_id: str) -> dict[str, Any] | None:
        """A key's row by id (revoked or not), its webhook secret included: the server's own use."""
        with self.engine.connect() as conn:
            row = conn.execute(select(T.api_keys).where(T.api_keys.c.id == key_id)).mappings().first()
        return dict(row) if row else None

    def update(self, key_id_or_prefix: str, **values: Any) -> str | None:
        """Set columns of the one unrevoked key with this id or prefix (webhook, quotas); its id,
        or None when none (or more than one) matches."""
        k = T.api_keys.c
        with self.engine.begin() as conn:
            found = conn.execute(select(k.id).where((k.id == key_id_or_prefix) | (k.prefix == key_id_or_prefix),
                                                    k.revoked_at.is_(None))).scalars().all()
            if len(found) != 1:
                return None
            conn.execute(update(T.api_keys).where(k.id == found[0]).values(**values))
        return found[0]

    def revoke(self, key_id_or_prefix: str) -> int:
        """Revoke the key with this id or prefix; returns how many were revoked (0 or 1)."""
        k = T.api_keys.c
        with self.engine.begin() as conn:
            found = conn.execute(select(k.id).where((k.id == key_id_or_prefix) | (k.prefix == key_id_or_prefix),
                                                    k.revoked_at.is_(None))).scalars().all()
            if len(found) != 1:
                return 0
            conn.execute(update(T.api_keys).where(k.id == found[0]).values(revoked_at=time.time()))
        return 1


def _owned(tbl, owner: str | None):
    return (tbl.c.owner == owner) if owner is not None else True


def _live():
    """A file not deleted and not expired (at the clock's time now)."""
    f = T.api_files.c
    return f.deleted_at.is_(None) & (f.expires_at.is_(None) | (f.expires_at > time.time()))


def _batches_reading(file_id: Any) -> Select:
    """The batches not ended that read the file `file_id` (an id, or the api_files id column) as their input."""
    b = T.api_batches
    return select(b.c.id).where(b.c.input_file_id == file_id, *[b.c[c].is_(None) for c in TERMINAL])


class FileStore(SqlStore):
    """The `api_files` table (a deleted file keeps its row, marked, so its id is never reused; an
    expired one is not found from its `expires_at` on, and `expired`, `take_expired` and `drop`
    remove it whole: the scheduler's sweep)."""

    def add(self, row: dict[str, Any]) -> None:
        with self.engine.begin() as conn:
            conn.execute(insert(T.api_files).values(**row))

    def get(self, file_id: str, owner: str | None) -> dict[str, Any] | None:
        f = T.api_files
        with self.engine.connect() as conn:
            row = conn.execute(select(f).where(f.c.id == file_id, _owned(f, owner), _live())).mappings().first()
        return dict(row) if row else None

    def known(self, file_id: str) -> bool:
        """Whether the id has a row, deleted, expired or not (an id is never given twice)."""
        with self.engine.connect() as conn:
            return conn.execute(select(T.api_files.c.id).where(T.api_files.c.id == file_id)).first() is not None

    def page(self, owner: str | None, *, purpose: str | None = None, limit: int = 10000,
             after: str | None = None, newest_first: bool = True) -> list[dict[str, Any]]:
        f = T.api_files
        q = select(f).where(_owned(f, owner), _live())
        if purpose:
            q = q.where(f.c.purpose == purpose)
        q = _page(q, f, owner, after, newest_first)
        with self.engine.connect() as conn:
            return [dict(r) for r in conn.execute(q.limit(limit)).mappings()]

    def delete(self, file_id: str, owner: str | None) -> bool:
        f = T.api_files
        with self.engine.begin() as conn:
            n = conn.execute(update(f).where(f.c.id == file_id, _owned(f, owner), f.c.deleted_at.is_(None))
                             .values(deleted_at=time.time())).rowcount
        return bool(n)

    def delete_unused(self, file_id: str, owner: str | None) -> tuple[bool, str | None]:
        """Delete the file unless a batch not ended reads it, in one transaction that holds the
        file's row (`live_file`), so a batch created over it meanwhile is either seen here or
        refused there: (whether it was deleted, the id of a batch that uses it)."""
        f, b = T.api_files, T.api_batches
        with self.engine.begin() as conn:
            if live_file(conn, file_id, owner) is None:
                return False, None
            using = conn.execute(_batches_reading(file_id).order_by(b.c.created_at, b.c.id).limit(1)).scalar()
            if using is not None:
                return False, str(using)
            conn.execute(update(f).where(f.c.id == file_id).values(deleted_at=time.time()))
        return True, None

    def expired(self, now: float, limit: int = 500) -> list[str]:
        """Ids of files expired at `now` (deleted or not) that no batch not ended reads, soonest
        expired first: what a sweep removes."""
        f = T.api_files
        q = (select(f.c.id).where(f.c.expires_at <= now, ~_batches_reading(f.c.id).exists())
             .order_by(f.c.expires_at, f.c.id).limit(limit))
        with self.engine.connect() as conn:
            return [str(x) for x in conn.execute(q).scalars()]

    def take_expired(self, file_id: str, now: float) -> bool:
        """Mark an expired file deleted, unless a batch not ended reads it, in one transaction
        holding its row (as `delete_unused`): whether its bytes may be removed now (then `drop`)."""
        f = T.api_files
        with self.engine.begin() as conn:
            write_lock(conn)
            row = conn.execute(select(f.c.id, f.c.deleted_at).where(f.c.id == file_id, f.c.expires_at <= now)
                               .with_for_update()).mappings().first()
            if row is None or conn.execute(_batches_reading(file_id).limit(1)).first() is not None:
                return False
            if row["deleted_at"] is None:
                conn.execute(update(f).where(f.c.id == file_id).values(deleted_at=now))
        return True

    def drop(self, file_id: str) -> None:
        """Remove a deleted file's row (its bytes are gone)."""
        f = T.api_files
        with self.engine.begin() as conn:
            conn.execute(delete(f).where(f.c.id == file_id, f.c.deleted_at.is_not(None)))


def live_file(conn, file_id: str, owner: str | None) -> dict[str, Any] | None:
    """The file's row, not deleted, not expired and `owner`'s, held until the transaction ends: SQLite's
    write lock taken first, PostgreSQL's row lock (SELECT ... FOR UPDATE; a row deleted while
    this waited is not found)."""
    write_lock(conn)
    f = T.api_files
    row = conn.execute(select(f).where(f.c.id == file_id, _owned(f, owner), _live())
                       .with_for_update()).mappings().first()
    return dict(row) if row else None


def _page(q, tbl, owner: str | None, after: str | None, newest_first: bool):
    """Order by creation (newest first, as OpenAI lists) and start after the row `after`, looked
    up among `owner`'s rows only: another key's id is an unknown one (an empty page), so a key
    learns neither that it exists nor when it was made."""
    order = (tbl.c.created_at.desc(), tbl.c.id.desc()) if newest_first else (tbl.c.created_at, tbl.c.id)
    if after:
        at = select(tbl.c.created_at).where(tbl.c.id == after, _owned(tbl, owner)).scalar_subquery()
        if newest_first:
            q = q.where((tbl.c.created_at < at) | ((tbl.c.created_at == at) & (tbl.c.id < after)))
        else:
            q = q.where((tbl.c.created_at > at) | ((tbl.c.created_at == at) & (tbl.c.id > after)))
    return q.order_by(*order)


def _ended(row: dict[str, Any]) -> bool:
    return any(row[c] is not None for c in TERMINAL)


@dataclass(frozen=True)
class Ending:
    """A batch held while it is ended (`BatchStore.ending`): its row as read under the hold,
    and the connection whose transaction holds it (None on SQLite)."""

    row: dict[str, Any]
    conn: Connection | None


class BatchStore(SqlStore):
    """The `api_batches` table."""

    #: A batch may be marked cancelling only while none of these is set (`set(unless=...)`).
    NOT_CANCELLABLE = ("cancelling_at", "finalizing_at", *TERMINAL)

    def add(self, row: dict[str, Any]) -> None:
        with self.engine.begin() as conn:
            conn.execute(insert(T.api_batches).values(**row))

    def add_over_file(self, row: dict[str, Any]) -> bool:
        """Add the batch if its input file is still there (not deleted, its owner's), in one
        transaction holding the file's row (`live_file`): a deletion of the file cannot pass
        between the check and the insert.  Returns whether it was added."""
        with self.engine.begin() as conn:
            if live_file(conn, row["input_file_id"], row["owner"]) is None:
                return False
            conn.execute(insert(T.api_batches).values(**row))
        return True

    def get(self, batch_id: str, owner: str | None = None) -> dict[str, Any] | None:
        """A batch's row, `owner`'s and not deleted."""
        b = T.api_batches
        with self.engine.connect() as conn:
            row = conn.execute(select(b).where(b.c.id == batch_id, _owned(b, owner), b.c.deleted_at.is_(None))
                               ).mappings().first()
        return dict(row) if row else None

    def page(self, owner: str | None, *, limit: int = 20, after: str | None = None, before: str | None = None,
             endpoint: str | None = None) -> list[dict[str, Any]]:
        """`owner`'s batches not deleted (of one `endpoint`, when given), newest first after the
        cursor `after`; with `before`, the ones made after that cursor, nearest it first."""
        b = T.api_batches
        q = select(b).where(_owned(b, owner), b.c.deleted_at.is_(None))
        if endpoint is not None:
            q = q.where(b.c.endpoint == endpoint)
        q = _page(q, b, owner, before or after, before is None)
        with self.engine.connect() as conn:
            return [dict(r) for r in conn.execute(q.limit(limit)).mappings()]

    def set(self, batch_id: str, *, unless: str | tuple[str, ...] | None = None, **values: Any) -> bool:
        """Set columns of a batch; with `unless` (a column, or several), only while each is unset
        (a compare-and-set: a terminal time is written once).  Returns whether the row changed."""
        b = T.api_batches
        q = update(b).where(b.c.id == batch_id)
        for col in (unless,) if isinstance(unless, str) else unless or ():
            q = q.where(b.c[col].is_(None))
        with self.engine.begin() as conn:
            return bool(conn.execute(q.values(**values)).rowcount)

    @contextmanager
    def ending(self, batch_id: str) -> Iterator[Ending | None]:
        """Mark a batch `finalizing` (its own transaction: a client sees it while its files are
        written) and hold it while it is ended: None when it has ended, or when another replica
        is ending it now.  On PostgreSQL its row is locked (FOR UPDATE SKIP LOCKED: a second
        replica's scheduler skips it, never waits) until the block leaves, and what ends it is
        written through `Ending.conn`, the lock's transaction; a replica killed meanwhile
        releases the lock with its connection, and the next one ends the batch.  SQLite has one
        replica, whose scheduler ends one batch at a time: its row is read, not held."""
        b = T.api_batches
        mine = select(b.c.id).where(b.c.id == batch_id, b.c.finalizing_at.is_(None), *[b.c[c].is_(None) for c in TERMINAL])
        if self.engine.dialect.name == "postgresql":
            mine = mine.with_for_update(skip_locked=True)  # a replica that holds it now is not waited on
        with self.engine.begin() as conn:
            conn.execute(update(b).where(b.c.id.in_(mine)).values(finalizing_at=time.time()))
        if self.engine.dialect.name != "postgresql":
            row = self.get(batch_id)
            yield None if row is None or _ended(row) else Ending(row, None)
            return
        with self.engine.begin() as conn:
            held = conn.execute(select(b).where(b.c.id == batch_id).with_for_update(skip_locked=True)).mappings().first()
            yield None if held is None or _ended(dict(held)) else Ending(dict(held), conn)

    def unfinished(self) -> list[dict[str, Any]]:
        """Batches not ended, oldest first: what a (re)started server takes up again."""
        b = T.api_batches
        q = select(b).where(*[b.c[c].is_(None) for c in TERMINAL]).order_by(b.c.created_at, b.c.id)
        with self.engine.connect() as conn:
            return [dict(r) for r in conn.execute(q).mappings()]

    def in_flight(self, owner: str) -> int:
        """The key's batches not ended (what its in-flight limit counts)."""
        b = T.api_batches
        q = select(func.count()).select_from(b).where(b.c.owner == owner, *[b.c[c].is_(None) for c in TERMINAL])
        with self.engine.connect() as conn:
            return int(conn.execute(q).scalar() or 0)

    def by_status_times(self) -> list[dict[str, Any]]:
        """Every batch's timestamps (for the metrics' batches-by-status count)."""
        b = T.api_batches
        cols = [b.c.id, b.c.model, b.c.in_progress_at, b.c.finalizing_at, b.c.cancelling_at, b.c.errors,
                *[b.c[c] for c in TERMINAL]]
        with self.engine.connect() as conn:
            return [dict(r) for r in conn.execute(select(*cols)).mappings()]
