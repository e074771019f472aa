"""Anthropic's Message Batches routes of `tokenmill serve` (docs/ANTHROPIC.md): a FastAPI app
mounted at `/v1/messages` on the server's own app, so that every answer under it, refusals
included, is in Anthropic's error shape (`{"type": "error", "error": {"type", "message"}}`)
while the OpenAI routes keep OpenAI's.  The same keys authenticate (`x-api-key`, as
Anthropic's SDK may send it, or a bearer key), with the same isolation: a key reads its own
batches only (another key's id is not found), an admin key all.

Routes: `POST /v1/messages/batches`, `GET /v1/messages/batches` (`before_id`, `after_id`,
`limit`), `GET /v1/messages/batches/{id}`, `POST /v1/messages/batches/{id}/cancel`,
`DELETE /v1/messages/batches/{id}`, `GET /v1/messages/batches/{id}/results` (JSONL, streamed).
The routes only translate; the service's part is messages.py."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import Depends, FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, StringConstraints
from starlette.exceptions import HTTPException as StarletteHTTPException

from tokenmill.jobs.serve.auth import Caller, key_caller
from tokenmill.jobs.serve.errors import ApiError
from tokenmill.jobs.serve.messages import MessageBatches
from tokenmill.jobs.serve.requests import PRINTABLE, After, ObjectId, error_param
from tokenmill.jobs.serve.service import BatchService
from tokenmill.schemas.wire.anthropic.objects import batch_object, deleted, error_body, page

#: Where the routes are mounted, and the path whose body is a batch's requests (its own body limit).
PREFIX = "/v1/messages"
BATCHES_PATH = f"{PREFIX}/batches"
#: The most batches one list page holds (Anthropic's).
MAX_PAGE = 1000


class CreateMessageBatch(BaseModel):
    """The body of `POST /v1/messages/batches`: the requests (each checked by the service), and
    tokenmill's `completion_window` (how long before the batch expires; default 24 h)."""

    model_config = ConfigDict(extra="forbid")

    requests: list[Any]
    completion_window: Annotated[str, StringConstraints(max_length=16, pattern=PRINTABLE)] | None = None


async def message_caller(request: Request) -> Caller:
    """The one authentication of these routes: `x-api-key`, or else `Authorization: Bearer`, a
    key not revoked."""
    secret = request.headers.get("x-api-key", "").strip()
    if not secret:
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        secret = token.strip() if scheme.lower() == "bearer" else ""
    if not secret:
        raise ApiError(401, "x-api-key header is required", type="authentication_error")
    found = key_caller(request, secret)
    if found is None:
        raise ApiError(401, "invalid x-api-key (unknown or revoked)", type="authentication_error")
    return found


MessageCaller = Annotated[Caller, Depends(message_caller)]


def install_messages(app: FastAPI, svc: BatchService) -> None:
    """Mount the Message Batches routes on the server's app."""
    app.mount(PREFIX, messages_app(svc))


def messages_app(svc: BatchService) -> FastAPI:
    sub = FastAPI(docs_url=None, redoc_url=None, openapi_url=None)
    sub.state.service = svc
    batches = MessageBatches(svc)

    @sub.exception_handler(ApiError)
    async def api_error(request: Request, err: ApiError):
        return JSONResponse(error_body(err.status, str(err)), status_code=err.status)

    @sub.exception_handler(RequestValidationError)
    async def bad_request(request: Request, err: RequestValidationError):
        first = err.errors()[0] if err.errors() else {}
        where = error_param(first.get("loc", ()))
        return JSONResponse(error_body(400, f"{where or 'body'}: {first.get('msg', 'invalid request')}"),
                            status_code=400)

    @sub.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, err: StarletteHTTPException):
        return JSONResponse(error_body(err.status_code, str(err.detail)), status_code=err.status_code)

    def render(request: Request, b: dict[str, Any]) -> dict[str, Any]:
        url = f"{request.url.scheme}://{request.url.netloc}{BATCHES_PATH}/{b['id']}/results"
        return batch_object(b, batches.live(b), url)

    @sub.post("/batches")
    def create(body: CreateMessageBatch, request: Request, who: MessageCaller) -> dict[str, Any]:
        return render(request, batches.create(who.key_id, body.requests, body.completion_window))

    @sub.get("/batches")
    def list_batches(request: Request, who: MessageCaller, limit: int = Query(20, ge=1, le=MAX_PAGE),
                     before_id: After = None, after_id: After = None) -> dict[str, Any]:
        if before_id and after_id:
            raise ApiError(400, "give before_id or after_id, not both")
        rows, more = batches.page(who.scope, limit=limit, before=before_id, after=after_id)
        return page(rows, lambda b: render(request, b), more)

    @sub.get("/batches/{message_batch_id}")
    def get(message_batch_id: ObjectId, request: Request, who: MessageCaller) -> dict[str, Any]:
        return render(request, batches.get(who.scope, message_batch_id))

    @sub.post("/batches/{message_batch_id}/cancel")
    def cancel(message_batch_id: ObjectId, request: Request, who: MessageCaller) -> dict[str, Any]:
        return render(request, batches.cancel(who.scope, message_batch_id))

    @sub.delete("/batches/{message_batch_id}")
    def delete(message_batch_id: ObjectId, who: MessageCaller) -> dict[str, Any]:
        batches.delete(who.scope, message_batch_id)
        return deleted(message_batch_id)

    @sub.get("/batches/{message_batch_id}/results")
    def results(message_batch_id: ObjectId, who: MessageCaller) -> StreamingResponse:
        return StreamingResponse(batches.results(who.scope, message_batch_id), media_type="application/x-jsonl")

    return sub
