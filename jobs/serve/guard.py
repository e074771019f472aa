"""What one connection may hold of `tokenmill serve` and `tokenmill ui` (docs/SERVING.md,
"Limits at the HTTP layer"): uvicorn's h11 protocol with the bounds uvicorn has no setting for
(a connection cap in all and per client address, a time limit on a request's headers, an idle
limit and a least mean rate on its body), and the head's own bounds (URL length, header count)
as ASGI middleware.  uvicorn's own settings bound the rest (`HttpLimits.uvicorn_settings`)."""

from __future__ import annotations

import asyncio
from typing import Any, Mapping

import h11
from starlette.responses import JSONResponse
from uvicorn.protocols.http.h11_impl import H11Protocol

from tokenmill.jobs.serve.config import HttpLimits
from tokenmill.schemas.wire.anthropic.objects import error_body as anthropic_error
from tokenmill.schemas.wire.openai.objects import error_body

_BUSY = b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: text/plain\r\nconnection: close\r\ncontent-length: 21\r\n\r\ntoo many connections\n"
_SLOW = b"HTTP/1.1 408 Request Timeout\r\ncontent-type: text/plain\r\nconnection: close\r\ncontent-length: 32\r\n\r\nthe request's headers came late\n"


#: Bytes a multipart upload may add around the file itself (boundaries, the purpose field).
FORM_OVERHEAD = 64 * 1024
#: The largest JSON body a non-upload route reads.
JSON_BODY_BYTES = 1 << 20


class BodyTooLarge(Exception):
    pass


class BodyLimit:
    """ASGI middleware: a request body larger than the route allows is refused (413) before it is
    all read, whether or not the client sent a Content-Length."""

    def __init__(self, app, upload_bytes: int, bodies: Mapping[str, int] | None = None):
        self.app, self.upload_bytes = app, upload_bytes
        self.bodies = dict(bodies or {})
        """Paths whose JSON body may be larger (Anthropic's batch create): path → its limit."""

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        limit = self.upload_bytes if path == "/v1/files" else self.bodies.get(path, JSON_BODY_BYTES)
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > limit):
            return await _too_large(send, limit, path)
        seen, refused, started = 0, False, False

        async def counted():
            nonlocal seen, refused
            msg = await receive()
            if msg["type"] == "http.request":
                seen += len(msg.get("body", b""))
                if seen > limit and not refused:
                    refused = True
                    if not started:  # answered here, whatever the route makes of the cut body is dropped
                        await _too_large(send, limit, path)
                    raise BodyTooLarge()
            return msg

        async def sent(message):
            nonlocal started
            if not refused:
                started = True
                await send(message)

        try:
            await self.app(scope, counted, sent)
        except Exception:
            if not refused:  # a route's error after the 413 (its 500, its form parser's 400) is noise
                raise


async def _too_large(send, limit: int, path: str) -> None:
    message = f"the request body is larger than {limit:,} bytes, the most this route takes"
    # each API's own error shape: Anthropic's under its prefix (anthropic_routes.py), else OpenAI's
    body = anthropic_error(413, message) if path.startswith("/v1/messages/") else error_body(
        message, code="request_too_large")
    resp = JSONResponse(body, status_code=413)
    await resp({"type": "http"}, _no_body, send)


class GuardedH11(H11Protocol):
    """uvicorn's h11 protocol, holding each connection to `limits`: over a connection cap it is
    answered 503 and closed before anything is read; a head not complete `head_timeout_s` after
    the connection or its previous response is answered 408 and closed; a body that pauses
    longer than `body_timeout_s`, or runs under `min_body_bytes_per_s` after that grace, is
    closed; a body still coming after its answer (a 413) is read and dropped for at most
    `body_timeout_s`, then the connection is closed."""

    limits: HttpLimits = HttpLimits()

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._timer: asyncio.TimerHandle | None = None
        self._phase: Any = None
        self._partial = False  # bytes of a head came in this cycle (a quiet keep-alive gets no 408)
        self._head_at = self._body_at = self._last = self._drain_until = self.loop.time()
        self._got = 0
        if self._over_cap():
            transport.write(_BUSY)
            transport.close()
            return
        self._follow()

    def _over_cap(self) -> bool:
        others = [c for c in self.connections if c is not self]
        same = sum(1 for c in others if _host(c) == _host(self))
        return len(others) >= self.limits.max_connections or same >= self.limits.max_connections_per_client

    def data_received(self, data: bytes) -> None:
        if self._answered():
            self.conn.receive_data(data)
            return self._drain()
        if self.conn.their_state is h11.SEND_BODY:
            self._got += len(data)
            self._last = self.loop.time()
        elif self.conn.their_state is h11.IDLE:
            self._partial = True
        super().data_received(data)
        self._follow()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self._answered():
            self._drain_until = self.loop.time() + self.limits.body_timeout_s
            self._drain()
        self._follow()

    def _answered(self) -> bool:
        return self.cycle is not None and self.cycle.response_complete and self.conn.their_state is h11.SEND_BODY

    def _drain(self) -> None:
        """The answer went before the body was read (a 413): drop the rest as it comes, so the
        close that follows it does not reset the connection under the answer."""
        while not self.transport.is_closing():
            try:
                event = self.conn.next_event()
            except h11.RemoteProtocolError:
                event = None
            if event is h11.NEED_DATA:
                return
            if not isinstance(event, h11.Data):
                self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        if getattr(self, "_timer", None) is not None:
            self._timer.cancel()  # type: ignore[union-attr]
        super().connection_lost(exc)

    def _follow(self) -> None:
        """Start the clock of the request's phase when it changes: its head, then its body."""
        state = self.conn.their_state
        if state is self._phase or self.transport.is_closing():
            return
        self._phase, now = state, self.loop.time()
        if state is h11.IDLE:
            self._head_at, self._partial = now, False
        elif state is h11.SEND_BODY:
            self._body_at = self._last = now
            self._got = 0
        if self._timer is None:
            self._timer = self.loop.call_later(0, self._check)

    def _due(self, now: float) -> float | None:
        """When the current phase runs out unless more comes; None: the route's turn, not the client's."""
        lim, state = self.limits, self.conn.their_state
        if state is h11.IDLE:
            return self._head_at + lim.head_timeout_s
        if state is not h11.SEND_BODY:
            return None
        if self._answered():
            return self._drain_until
        if self.flow.read_paused:  # the route is behind, not the client
            self._body_at = self._last = now
            self._got = 0
        return min(self._last + lim.body_timeout_s,
                   max(self._body_at + lim.body_timeout_s, self._body_at + self._got / lim.min_body_bytes_per_s))

    def _check(self) -> None:
        self._timer = None
        if self.transport.is_closing():
            return
        now = self.loop.time()
        due = self._due(now)
        if due is None:
            return
        if now < due:
            self._timer = self.loop.call_later(due - now, self._check)
            return
        if self.conn.their_state is h11.IDLE and self._partial:
            self.transport.write(_SLOW)
        self.transport.close()


def _host(conn: Any) -> str | None:
    client = getattr(conn, "client", None)
    return client[0] if client else None


def protocol(limits: HttpLimits) -> type[GuardedH11]:
    """The protocol class uvicorn builds each connection with (its `http` setting)."""
    return type("GuardedH11", (GuardedH11,), {"limits": limits})


class HeadLimit:
    """ASGI middleware: a request whose URL or header count is over `limits` is refused (414,
    431) before the app sees it."""

    def __init__(self, app: Any, limits: HttpLimits):
        self.app, self.limits = app, limits

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            url = len(scope.get("raw_path") or b"") + len(scope.get("query_string") or b"")
            if url > self.limits.max_url_bytes:
                return await _refuse(send, 414, f"the URL is longer than {self.limits.max_url_bytes:,} bytes",
                                     "url_too_long")
            if len(scope.get("headers") or ()) > self.limits.max_headers:
                return await _refuse(send, 431, f"the request has more than {self.limits.max_headers} headers",
                                     "too_many_headers")
        await self.app(scope, receive, send)


async def _refuse(send, status: int, message: str, code: str) -> None:
    resp = JSONResponse(error_body(message, code=code), status_code=status, headers={"connection": "close"})
    await resp({"type": "http"}, _no_body, send)


async def _no_body():
    return {"type": "http.request", "body": b"", "more_body": False}
