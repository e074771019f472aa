"""The `tokenmill serve` replicas over one database (`replicas`): each registers when it starts,
beats its heart while it runs, says when it drains (told SIGTERM) and when it stopped.

A replica is live while it has not stopped, its heartbeat is fresh (`STALE_S`), and, on this
host, its pid still runs: a killed replica's row stops counting within `STALE_S` (at once on
its own host), so it never blocks a restart.  On SQLite (one writer) `register(alone=True)`
refuses a second live replica in the transaction that would add it."""

from __future__ import annotations

import time
from typing import Any

from sqlalchemy import insert, select, update

from tokenmill.schemas import tables as T
from tokenmill.schemas.storage.database import SqlStore, pid_alive, write_lock

#: How often a replica beats its heart (jobs/serve/replica.py).
HEARTBEAT_S = 5.0
#: A replica whose last heartbeat is older than this is taken as gone (killed, frozen, cut off).
STALE_S = 4 * HEARTBEAT_S


class ReplicaLive(RuntimeError):
    """A replica may not start alone: `live` is the row of one that runs."""

    def __init__(self, live: dict[str, Any]):
        super().__init__(f"replica {live['id']} is live")
        self.live = live


def is_live(row: dict[str, Any], now: float | None = None) -> bool:
    """Not stopped, its heartbeat fresh, and (on this host) its process running."""
    now = time.time() if now is None else now
    return (row["stopped_at"] is None and row["seen_at"] > now - STALE_S
            and pid_alive(f"{row['host']}:{row['pid']}"))


class ReplicaStore(SqlStore):
    def register(self, row: dict[str, Any], *, alone: bool = False) -> None:
        """Add a replica's row; with `alone`, only while no other replica is live (ReplicaLive
        names one that is), checked and added under the database's write lock."""
        r = T.replicas.c
        with self.engine.begin() as conn:
            write_lock(conn)
            if alone:
                now = time.time()
                for other in conn.execute(select(T.replicas).where(r.stopped_at.is_(None), r.seen_at > now - STALE_S)
                                          .order_by(r.started_at)).mappings():
                    if is_live(dict(other), now):
                        raise ReplicaLive(dict(other))
            conn.execute(insert(T.replicas).values(**row))

    def set(self, replica_id: str, **values: Any) -> None:
        """Update a replica's row: its `url` once it listens, `seen_at` (a heartbeat), `draining`,
        `stopped_at`."""
        with self.engine.begin() as conn:
            conn.execute(update(T.replicas).where(T.replicas.c.id == replica_id).values(**values))

    def get(self, replica_id: str) -> dict[str, Any] | None:
        with self.engine.connect() as conn:
            row = conn.execute(select(T.replicas).where(T.replicas.c.id == replica_id)).mappings().first()
        return dict(row) if row else None

    def live(self, now: float | None = None) -> list[dict[str, Any]]:
        """The live replicas, oldest first."""
        now = time.time() if now is None else now
        r = T.replicas.c
        with self.engine.connect() as conn:
            rows = conn.execute(select(T.replicas).where(r.stopped_at.is_(None), r.seen_at > now - STALE_S)
                                .order_by(r.started_at)).mappings().all()
        return [dict(x) for x in rows if is_live(dict(x), now)]

