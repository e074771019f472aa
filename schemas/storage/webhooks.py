"""What `tokenmill serve` keeps of its webhooks: one event per batch ending (`webhook_events`,
written in the transaction that ends the batch, its body fixed then, so every attempt sends
the same bytes under the same id) and every delivery attempt (`webhook_attempts`), read back
per batch.  The sending is
jobs/serve/webhooks.py's."""

from __future__ import annotations

from typing import Any

from sqlalchemy import func, select, update
from sqlalchemy.engine import Connection

from tokenmill.schemas import tables as T
from tokenmill.schemas.storage.database import SqlStore, insert_ignore, write_lock


class WebhookStore(SqlStore):
    def end_batch(self, batch_id: str, *, ended: str, values: dict[str, Any], event: dict[str, Any] | None,
                  conn: Connection | None = None) -> bool:
        """A batch's ending and its event, in one transaction (`conn`'s, where the batch is held
        by `BatchStore.ending`): the batch's `ended` column (its terminal time) and `values` are
        written only while that column is unset, and the event (None: the batch names no URL)
        is inserted with them, so a server killed at any point leaves both or neither, and a
        batch finalized again makes no second event.  Returns whether this call ended the batch."""
        if conn is None:
            with self.engine.begin() as own:
                return self.end_batch(batch_id, ended=ended, values=values, event=event, conn=own)
        b = T.api_batches.c
        done = bool(conn.execute(update(T.api_batches).where(b.id == batch_id, b[ended].is_(None))
                                 .values(**values)).rowcount)
        if done and event is not None:
            insert_ignore(conn, T.webhook_events, [event])
        return done

    def claim(self, now: float, hold_s: float) -> dict[str, Any] | None:
        """Take the event due first for one attempt: its `next_at` moves `hold_s` ahead in the
        transaction that reads it, so no other sender (another replica's) takes it meanwhile,
        and a sender killed during the attempt leaves it due again once the hold lapses (the
        attempt's `record` sets the real next time).  On PostgreSQL the row is read FOR UPDATE
        SKIP LOCKED (two senders never wait on each other); SQLite has one writer.  None: no
        event is due."""
        e = T.webhook_events.c
        q = (select(T.webhook_events).where(e.next_at.is_not(None), e.next_at <= now).order_by(e.next_at, e.id)
             .limit(1))
        with self.engine.begin() as conn:
            write_lock(conn)
            if conn.dialect.name == "postgresql":
                q = q.with_for_update(skip_locked=True)
            row = conn.execute(q).mappings().first()
            if row is None:
                return None
            conn.execute(update(T.webhook_events).where(e.id == row["id"]).values(next_at=now + hold_s))
        return dict(row)

    def next_due(self) -> float | None:
        """When the next pending event is due (None: none pending)."""
        with self.engine.connect() as conn:
            return conn.execute(select(func.min(T.webhook_events.c.next_at))).scalar()

    def record(self, event: dict[str, Any], attempt: dict[str, Any], *, next_at: float | None,
               delivered_at: float | None = None, gave_up_at: float | None = None) -> None:
        """An attempt and the event's state after it, in one transaction (a server killed
        between the two would send the attempt again, never skip it)."""
        e = T.webhook_events.c
        with self.engine.begin() as conn:
            insert_ignore(conn, T.webhook_attempts, [{"event_id": event["id"], "batch_id": event["batch_id"],
                                                      **attempt}])
            conn.execute(update(T.webhook_events).where(e.id == event["id"]).values(
                attempts=attempt["attempt"], next_at=next_at, delivered_at=delivered_at, gave_up_at=gave_up_at))

    def events(self, batch_id: str) -> list[dict[str, Any]]:
        """A batch's events (without their bodies), each with its attempts in order."""
        e, a = T.webhook_events.c, T.webhook_attempts.c
        cols = [e.id, e.type, e.url, e.created_at, e.next_at, e.attempts, e.delivered_at, e.gave_up_at]
        with self.engine.connect() as conn:
            events = [dict(r) for r in conn.execute(select(*cols).where(e.batch_id == batch_id)
                                                    .order_by(e.created_at, e.id)).mappings()]
            tries = conn.execute(select(T.webhook_attempts).where(a.batch_id == batch_id)
                                 .order_by(a.event_id, a.attempt)).mappings().all()
        for ev in events:
            ev["attempt_log"] = [{k: v for k, v in t.items() if k not in ("event_id", "batch_id")} for t in tries
                                 if t["event_id"] == ev["id"]]
        return events
