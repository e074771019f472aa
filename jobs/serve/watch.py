"""The routes of `tokenmill serve` beyond OpenAI's Batch API, for watching the work: the live
page (`/`, page.py), a batch's webhook events and every delivery attempt
(`GET /v1/batches/{id}/webhooks`) and a key's usage per day (`GET /v1/usage`).  The same
authentication as every route (app.py's `caller`; the page's own login takes the same keys): a
key reads only its own batches and usage, an admin key everyone's."""

from __future__ import annotations

import time
from typing import Any

from fastapi import APIRouter, FastAPI, Query, Request

from tokenmill.jobs.serve.auth import SessionPolicy, Who
from tokenmill.jobs.serve.errors import ApiError
from tokenmill.jobs.serve.objects import batch_status
from tokenmill.jobs.serve.page import PageContext, RelativeRedirects, key_resolver, page_router
from tokenmill.jobs.serve.requests import ObjectId
from tokenmill.jobs.serve.service import BatchService
from tokenmill.schemas import storage as S
from tokenmill.schemas.storage.usage import DAY_S

router = APIRouter()


@router.get("/v1/batches/{batch_id}/webhooks")
def batch_webhooks(batch_id: ObjectId, who: Who, request: Request) -> dict[str, Any]:
    svc = request.app.state.service
    if svc.batches.get(batch_id, who.scope) is None:
        raise ApiError(404, f"No such Batch object: {batch_id[:100]}", code="not_found", param="batch_id")
    return {"object": "list", "data": S.WebhookStore(svc.eng).events(batch_id)}


@router.get("/v1/usage")
def usage(who: Who, request: Request, days: int = Query(7, ge=1, le=366)) -> dict[str, Any]:
    svc = request.app.state.service
    now = time.time()
    rows = S.UsageStore(svc.eng).by_day(who.scope, since=now - now % DAY_S - (days - 1) * DAY_S)
    return {"object": "list", "data": rows}


def install(app: FastAPI, svc: BatchService) -> None:
    """Add these routes and the live page to the server's app, and make its redirects
    relative (`RelativeRedirects`: the API's trailing-slash redirects too)."""
    app.include_router(router)
    def engines() -> dict[str, str]:
        out = {}
        for m in svc.cfg.models:
            e = svc.scheduler.engines.get(m)
            out[m] = ("not started" if e is None or not e.alive() else "running a batch" if e.running
                      else "loaded" if e.loaded else "not loaded")
        return out

    def held(b: dict[str, Any]) -> str | None:
        return "held: its key is at a quota" if batch_status(b) == "validating" and svc.quotas.holds(b) else None

    page = svc.cfg.page
    policy = SessionPolicy(page.session_ttl_s, page.behind_tls)
    app.state.page = PageContext(svc.eng, key_resolver(svc.eng), engines=engines, held=held, policy=policy)
    app.include_router(page_router())
    app.add_middleware(RelativeRedirects)
