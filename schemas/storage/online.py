"""The online requests `tokenmill serve` answered (`online_requests`): one row each, written
when it ends, read for a key's tokens (its quota, its usage) and for the figures per model."""

from __future__ import annotations

from typing import Any

from sqlalchemy import func, insert, select

from tokenmill.schemas import tables as T
from tokenmill.schemas.storage.database import SqlStore


class OnlineStore(SqlStore):
    def record(self, row: dict[str, Any]) -> None:
        """One ended request (its columns; `error` cut to its width)."""
        row = {k: row.get(k) for k in T.online_requests.c.keys()}
        if row.get("error"):
            row["error"] = str(row["error"])[:1000]
        with self.engine.begin() as conn:
            conn.execute(insert(T.online_requests).values(**row))

    def tokens_since(self, owner: str, since: float) -> int:
        """Prompt + output tokens of the key's online requests made at or after `since`."""
        c = T.online_requests.c
        q = select(func.coalesce(func.sum(func.coalesce(c.prompt_tokens, 0) + func.coalesce(c.output_tokens, 0)), 0)
                   ).where(c.owner == owner, c.created_at >= since)
        with self.engine.connect() as conn:
            return int(conn.execute(q).scalar() or 0)

    def get(self, request_id: str) -> dict[str, Any] | None:
        with self.engine.connect() as conn:
            r = conn.execute(select(T.online_requests).where(T.online_requests.c.id == request_id)).mappings().first()
        return dict(r) if r else None

    def recent(self, owner: str | None = None, limit: int = 100) -> list[dict[str, Any]]:
        """The newest requests (a key's, or every key's), newest first."""
        c = T.online_requests.c
        q = select(T.online_requests).order_by(c.created_at.desc()).limit(limit)
        if owner is not None:
            q = q.where(c.owner == owner)
        with self.engine.connect() as conn:
            return [dict(r) for r in conn.execute(q).mappings()]
