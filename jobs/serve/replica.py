"""This `tokenmill serve` as one replica of the service (schemas/storage/replicas.py): registered
when it starts, before it binds its port (on SQLite refused while another replica is live), its
heartbeat beaten by a thread, marked draining on SIGTERM and stopped when it exits cleanly."""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import uuid
from typing import Any

from sqlalchemy.engine import Engine

from tokenmill.schemas import storage as S
from tokenmill.schemas.errors import first_line
from tokenmill.schemas.storage.replicas import HEARTBEAT_S

log = logging.getLogger(__name__)


class ReplicaRefused(RuntimeError):
    """This server may not start: another replica is live over the same SQLite database."""


def refusal(live: dict[str, Any], now: float) -> str:
    """Why a second replica over SQLite does not start, naming the live one."""
    where = f"pid {live['pid']} on {live['host']}" + (f", {live['url']}" if live.get("url") else "")
    return (f"replica {live['id']} ({where}, seen {max(0.0, now - live['seen_at']):.0f} s ago) already serves this "
            "SQLite database, which has one writer; stop it first, or run replicas over PostgreSQL (db: "
            "postgresql://…)")


class Replica:
    """This server's row in `replicas` and the thread that keeps it fresh."""

    def __init__(self, eng: Engine, replica_id: str):
        self.store, self.id = S.ReplicaStore(eng), replica_id
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @classmethod
    def register(cls, eng: Engine) -> "Replica":
        """Register this process and start its heartbeat; ReplicaRefused (one line) when the
        database is SQLite and another replica is live."""
        now = time.time()
        me = cls(eng, "replica_" + uuid.uuid4().hex[:16])
        try:
            me.store.register({"id": me.id, "host": socket.gethostname(), "pid": os.getpid(), "url": None,
                               "started_at": now, "seen_at": now, "draining": False, "stopped_at": None},
                              alone=eng.dialect.name == "sqlite")
        except S.ReplicaLive as err:
            raise ReplicaRefused(refusal(err.live, now)) from None
        me._thread = threading.Thread(target=me._beat, daemon=True, name="tokenmill-serve-heartbeat")
        me._thread.start()
        return me

    def serving(self, url: str) -> None:
        """Where this replica answers, once its port is bound."""
        self.store.set(self.id, url=url)

    def draining(self) -> None:
        self.store.set(self.id, draining=True)

    def stopped(self) -> None:
        """A clean exit: the heartbeat ends and the row says when (a database away now: the row
        goes stale instead, which does not block a restart either)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(HEARTBEAT_S)
        try:
            self.store.set(self.id, stopped_at=time.time())
        except Exception as err:
            log.warning("replica %s: could not mark it stopped: %s", self.id, first_line(err))

    def _beat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            try:
                self.store.set(self.id, seen_at=time.time())
            except Exception as err:  # the database away for a moment: the next beat tries again
                log.warning("replica heartbeat failed: %s", first_line(err))
