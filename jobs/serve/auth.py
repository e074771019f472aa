"""Who is asking `tokenmill serve`: the one authentication every route but /health takes
(`Who`, a bearer key not revoked), and the caller it gives."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

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
    row = S.KeyStore(request.app.state.service.eng).by_secret(secret.strip())
    if row is None:
        raise ApiError(401, "Incorrect API key provided (unknown or revoked).", code="invalid_api_key")
    return Caller(row["id"], bool(row["admin"]))


Who = Annotated[Caller, Depends(caller)]
