"""The result cache across jobs (table `result_cache`, docs/CACHE.md): one deterministic answer
per key, the key a hash of everything that decides it (transforms/cache.py makes keys and
entries; this module holds every statement on the table).

An entry is written in the transaction of the batch that answered it (`put_entries`, called by
`ResultWriter.commit_batch`), insert-if-absent: the first answer stays.  Serving reads a chunk's
keys at once (`CacheStore.lookup`), and the served rows are committed with their entries'
`hits` and `used_at` (`mark_used`) in one transaction.  `stats` and `prune` are what
`tokenmill cache stats|prune` run."""

from __future__ import annotations

import time
from collections import Counter
from typing import Any, Iterable

from sqlalchemy import func, select, update
from sqlalchemy.engine import Connection

from tokenmill.schemas import tables as T
from tokenmill.schemas.storage.database import SqlStore, chunks, insert_ignore

#: What a lookup reads back of an entry.
_SERVED = ("key", "job_id", "answer")


def put_entries(conn: Connection, entries: list[dict[str, Any]]) -> int:
    """Insert cache entries (rows of `result_cache`), keeping an entry already there for a key;
    returns how many were new.  In key order, as `mark_used` updates them: two transactions
    never wait on each other's entries in a cycle (PostgreSQL)."""
    return insert_ignore(conn, T.result_cache, sorted(entries, key=lambda e: e["key"])) if entries else 0


def mark_used(conn: Connection, keys: Iterable[str], at: float | None = None) -> None:
    """Count a serving of each of `keys` (a key served twice counts twice) and set its `used_at`."""
    c = T.result_cache.c
    at = time.time() if at is None else at
    by_times: dict[int, list[str]] = {}
    for key, n in Counter(keys).items():
        by_times.setdefault(n, []).append(key)
    for n, keys_n in by_times.items():
        for part in chunks(sorted(keys_n)):
            conn.execute(update(T.result_cache).where(c.key.in_(part)).values(hits=c.hits + n, used_at=at))


class CacheStore(SqlStore):
    """The `result_cache` table: lookups by key, inserts, what it holds, pruning."""

    def lookup(self, keys: Iterable[str]) -> dict[str, dict[str, Any]]:
        """The entries of `keys` that exist: key → {key, job_id, answer} (bounded IN lists)."""
        c = T.result_cache.c
        out: dict[str, dict[str, Any]] = {}
        with self.engine.connect() as conn:
            for part in chunks(sorted(set(keys))):
                for row in conn.execute(select(*(c[k] for k in _SERVED)).where(c.key.in_(part))).mappings():
                    out[row["key"]] = dict(row)
        return out

    def put(self, entries: list[dict[str, Any]]) -> int:
        """Insert entries in one transaction (insert-if-absent); returns how many were new."""
        with self.engine.begin() as conn:
            return put_entries(conn, entries)

    def stats(self) -> dict[str, Any]:
        """What the cache holds: entries, bytes, hits, the oldest and newest entry and the
        latest use, overall and per fingerprint (with the models its entries name), largest first."""
        c = T.result_cache.c
        figures = (func.count(), func.coalesce(func.sum(c.size_bytes), 0), func.coalesce(func.sum(c.hits), 0),
                   func.min(c.created_at), func.max(c.created_at), func.max(c.used_at))
        with self.engine.connect() as conn:
            total = conn.execute(select(*figures)).one()
            groups = conn.execute(select(c.fingerprint, *figures).group_by(c.fingerprint)
                                  .order_by(func.sum(c.size_bytes).desc(), c.fingerprint)).all()
            models: dict[str, list[str]] = {}
            for fp, model in conn.execute(select(c.fingerprint, c.model).distinct().order_by(c.fingerprint, c.model)):
                models.setdefault(fp, []).append(model)
        return {**_figures(total), "by_fingerprint": [
            {"fingerprint": g[0], "models": models.get(g[0], []), **_figures(g[1:])} for g in groups]}

    def prune(self, unused_since: float, *, fingerprint: str | None = None) -> dict[str, int]:
        """Delete the entries last used (or, never used, created) before `unused_since` (a Unix
        time), of one fingerprint if given; returns the entries and bytes deleted."""
        c = T.result_cache.c
        where = [func.coalesce(c.used_at, c.created_at) < unused_since]
        if fingerprint is not None:
            where.append(c.fingerprint == fingerprint)
        with self.engine.begin() as conn:
            n, size = conn.execute(select(func.count(), func.coalesce(func.sum(c.size_bytes), 0)).where(*where)).one()
            conn.execute(T.result_cache.delete().where(*where))
        return {"entries": int(n), "bytes": int(size)}


def _figures(row) -> dict[str, Any]:
    entries, size, hits, oldest, newest, used = row
    return {"entries": int(entries), "bytes": int(size), "hits": int(hits), "oldest_created_at": oldest,
            "newest_created_at": newest, "last_used_at": used}
