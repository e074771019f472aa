"""Who is asking `tokenmill serve`: the one authentication every route but /health takes
(`Who`, a bearer key not revoked), and the caller it gives; and what the live page's login
holds to (`SessionPolicy`: when its cookie is `Secure`, how long a session lasts;
`same_site`: a login or logout posted from another site is refused)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated
from urllib.parse import urlsplit

from fastapi import Depends, Request

from tokenmill.jobs.serve.errors import ApiError
from tokenmill.schemas import storage as S


@dataclass(frozen=True)
class Caller:
    """Who is asking: the key's id, and whether it is an admin key (it sees every key's rows)."""

    key_id: str
    admin: bool

    @property
    def scope(self) -> str | None:
        """The owner a query is filtered by (None: an admin sees all)."""
        return None if self.admin else self.key_id


async def caller(request: Request) -> Caller:
    """The one authentication every route but /health takes: a bearer key, not revoked.

    It runs on the event loop (one indexed read, no thread hop), as does the polled
    `GET /v1/batches/{id}`: a poll's CPU is taken from the engine on a host whose engine
    uses every core (docs/BENCHMARKS.md, "Serving")."""
    auth = request.headers.get("authorization", "")
    scheme, _, secret = auth.partition(" ")
    if scheme.lower() != "bearer" or not secret.strip():
        raise ApiError(401, "You didn't provide an API key. Send it as 'Authorization: Bearer <key>'.",
                       code="invalid_api_key")
    found = key_caller(request, secret.strip())
    if found is None:
        raise ApiError(401, "Incorrect API key provided (unknown or revoked).", code="invalid_api_key")
    return found


def key_caller(request: Request, secret: str) -> Caller | None:
    """The caller a presented key is (one indexed read), or None when it is unknown or revoked."""
    row = S.KeyStore(request.app.state.service.eng).by_secret(secret)
    return Caller(row["id"], bool(row["admin"])) if row is not None else None


Who = Annotated[Caller, Depends(caller)]


@dataclass(frozen=True)
class SessionPolicy:
    """The page's sessions: how long one lasts, and whether its cookie is `Secure` without the
    request being https (`ServeConfig.page`)."""

    ttl_s: float = 12 * 3600.0
    behind_tls: bool = False

    def secure(self, request: Request) -> bool:
        """Whether this request reached the server over TLS: configured so, or its scheme (which
        the server takes from `X-Forwarded-Proto` of `http.trusted_proxies` only)."""
        return self.behind_tls or request.url.scheme == "https"


def same_site(request: Request) -> bool:
    """Whether a state-changing page request (login, logout) comes from the page itself: a
    browser says where it posts from (`Sec-Fetch-Site`, or else `Origin` or `Referer`, whose host
    must be the one it posted to; `Origin: null` is no site's); a request with neither is no browser's, so no other site's."""
    fetch_site = request.headers.get("sec-fetch-site")
    if fetch_site is not None:
        return fetch_site.lower() in ("same-origin", "none")
    origin = request.headers.get("origin") or request.headers.get("referer")
    if origin is None:
        return True
    parts = urlsplit(origin)
    return bool(parts.netloc) and parts.netloc.lower() == request.headers.get("host", "").lower()
