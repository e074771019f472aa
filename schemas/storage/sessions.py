"""The live page's login sessions (`page_sessions`): logging in with a key opens one, a random
id the cookie carries; only its SHA-256 is stored, with the key's id and an expiry.  A session
of a revoked key, an expired one or a closed one (logout) opens nothing."""

from __future__ import annotations

import hashlib
import secrets
import time
from typing import Any

from sqlalchemy import delete, insert, select

from tokenmill.schemas import tables as T
from tokenmill.schemas.storage.database import SqlStore


def session_hash(session_id: str) -> str:
    """How a session id is stored and looked up: its SHA-256, hex (ids are 256 random bits)."""
    return hashlib.sha256(session_id.encode("utf-8")).hexdigest()


class SessionStore(SqlStore):
    """The `page_sessions` table."""

    def open(self, key_id: str, ttl_s: float) -> str:
        """A new session of `key_id` ending in `ttl_s`: its id (given once, for the cookie).
        Expired sessions are removed on the way."""
        sid = secrets.token_urlsafe(32)
        now = time.time()
        with self.engine.begin() as conn:
            conn.execute(delete(T.page_sessions).where(T.page_sessions.c.expires_at <= now))
            conn.execute(insert(T.page_sessions).values(id_hash=session_hash(sid), key_id=key_id, created_at=now,
                                                        expires_at=now + ttl_s))
        return sid

    def lookup(self, session_id: str) -> dict[str, Any] | None:
        """The live session of this id: `key_id`, and `admin` of its key (None: the key is no
        API key, e.g. `tokenmill ui`'s token); None when unknown, expired, or its key is revoked."""
        s, k = T.page_sessions, T.api_keys
        q = (select(s.c.key_id, k.c.admin, k.c.revoked_at).select_from(s.outerjoin(k, k.c.id == s.c.key_id))
             .where(s.c.id_hash == session_hash(session_id), s.c.expires_at > time.time()))
        with self.engine.connect() as conn:
            row = conn.execute(q).mappings().first()
        if row is None or row["revoked_at"] is not None:
            return None
        return {"key_id": row["key_id"], "admin": None if row["admin"] is None else bool(row["admin"])}

    def close(self, session_id: str) -> None:
        """End one session (logout)."""
        with self.engine.begin() as conn:
            conn.execute(delete(T.page_sessions).where(T.page_sessions.c.id_hash == session_hash(session_id)))
