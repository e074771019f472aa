"""The HTTP surface of `tokenmill serve`: thin FastAPI routes over the batch service, one
authentication dependency every route but `/health` takes, every refusal in OpenAI's error
shape, and a bound on what a request body may hold.

Routes: `/v1/files` (upload, list, get, content, delete), `/v1/batches` (create, get, list,
cancel), `/health`, `/metrics` (Prometheus text; an admin key)."""

from __future__ import annotations

import os
import tempfile
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from tokenmill.jobs.serve.anthropic_routes import BATCHES_PATH, install_messages
from tokenmill.jobs.serve.auth import Caller, Who
from tokenmill.jobs.serve.blobs import iter_bytes
from tokenmill.jobs.serve.config import ServeConfig
from tokenmill.jobs.serve.errors import ApiError
from tokenmill.jobs.serve.guard import FORM_OVERHEAD, BodyLimit
from tokenmill.jobs.serve.objects import batch_object, error_body, file_deleted, file_object, page
from tokenmill.jobs.serve.online import install as install_online
from tokenmill.jobs.serve.requests import (
    EXPIRES_ANCHOR,
    EXPIRES_SECONDS,
    After,
    CreateBatch,
    ObjectId,
    Purpose,
    describe_upload,
    error_param,
    upload_expiry,
)
from tokenmill.jobs.serve.service import BatchService
from tokenmill.jobs.serve.watch import install


def create_app(cfg: ServeConfig, service: BatchService | None = None) -> FastAPI:
    svc = service or BatchService(cfg)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        svc.start()
        yield
        svc.stop()

    app = FastAPI(title="tokenmill", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.service = svc

    @app.exception_handler(ApiError)
    async def api_error(request: Request, err: ApiError):
        return JSONResponse(error_body(str(err), type=err.type, param=err.param, code=err.code),
                            status_code=err.status)

    @app.exception_handler(RequestValidationError)
    async def bad_request(request: Request, err: RequestValidationError):
        first = err.errors()[0] if err.errors() else {}
        where = error_param(first.get("loc", ()))
        return JSONResponse(error_body(f"{where or 'body'}: {first.get('msg', 'invalid request')}", param=where or None,
                                       code="invalid_value"), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, err: StarletteHTTPException):
        return JSONResponse(error_body(str(err.detail), code="not_found" if err.status_code == 404 else None),
                            status_code=err.status_code)

    @app.get("/health")
    def health() -> dict[str, Any]:
        return {"status": "ok"}

    @app.post("/v1/files", openapi_extra=describe_upload())
    async def upload(request: Request, who: Who) -> dict[str, Any]:
        lim = cfg.limits
        form = await request.form(max_files=1, max_fields=4)
        purpose, upload = form.get("purpose"), form.get("file")
        if purpose != "batch":
            raise ApiError(400, f"purpose must be 'batch' (the files this server runs), got {str(purpose)[:40]!r}",
                           param="purpose", code="invalid_value")
        if upload is None or isinstance(upload, str):
            raise ApiError(400, "a multipart field 'file' with the JSONL file is required", param="file")
        ttl_s = upload_expiry(form.get(EXPIRES_ANCHOR), form.get(EXPIRES_SECONDS))
        fd, tmp = tempfile.mkstemp(suffix=".jsonl")
        nbytes = lines = 0
        try:
            with os.fdopen(fd, "wb") as out:
                while chunk := await upload.read(1 << 20):
                    nbytes += len(chunk)
                    if nbytes > lim.max_file_bytes:
                        raise ApiError(400, f"the file is larger than {lim.max_file_bytes:,} bytes, the most a batch "
                                            "file may be", param="file", code="file_too_large")
                    lines += chunk.count(b"\n")
                    out.write(chunk)
            if nbytes and not chunk_ends_with_newline(tmp):
                lines += 1
            if lines > lim.max_file_lines:
                raise ApiError(400, f"the file has {lines:,} lines; a batch file holds at most "
                                    f"{lim.max_file_lines:,} requests", param="file", code="too_many_lines")
            row = svc.add_file(who.key_id, upload.filename, purpose, tmp, nbytes, lines, ttl_s=ttl_s)
        finally:
            os.unlink(tmp)
        return file_object(row)

    @app.get("/v1/files")
    def list_files(who: Who, purpose: Purpose = None, limit: int = Query(10000, ge=1, le=10000),
                   after: After = None, order: str = Query("desc", pattern="^(asc|desc)$")) -> dict:
        rows = svc.files.page(who.scope, purpose=purpose, limit=limit + 1, after=after, newest_first=order == "desc")
        return page(rows[:limit], file_object, len(rows) > limit)

    def owned_file(file_id: str, who: Caller) -> dict[str, Any]:
        f = svc.files.get(file_id, who.scope)
        if f is None:
            raise ApiError(404, f"No such File object: {file_id[:100]}", code="not_found", param="file_id")
        return f

    @app.get("/v1/files/{file_id}")
    def get_file(file_id: ObjectId, who: Who) -> dict[str, Any]:
        return file_object(owned_file(file_id, who))

    @app.get("/v1/files/{file_id}/content")
    def file_content(file_id: ObjectId, who: Who) -> Response:
        f = owned_file(file_id, who)
        return StreamingResponse(iter_bytes(svc.blobs.open(f["id"])), media_type="application/jsonl",
                                 headers={"content-length": str(f["bytes"])})

    @app.delete("/v1/files/{file_id}")
    def delete_file(file_id: ObjectId, who: Who) -> dict[str, Any]:
        svc.delete_file(who.scope, owned_file(file_id, who)["id"])
        return file_deleted(file_id)

    def render(b: dict[str, Any]) -> dict[str, Any]:
        return batch_object(b, svc.live_counts(b))

    @app.post("/v1/batches")
    def create_batch(body: CreateBatch, who: Who) -> dict[str, Any]:
        expiry = body.output_expires_after
        return render(svc.create_batch(who.key_id, body.input_file_id, body.endpoint, body.completion_window,
                                       body.metadata, output_expires_after=expiry.seconds if expiry else None))

    @app.get("/v1/batches")
    def list_batches(who: Who, limit: int = Query(20, ge=1, le=100), after: After = None) -> dict[str, Any]:
        rows = svc.batches.page(who.scope, limit=limit + 1, after=after)
        return page(rows[:limit], render, len(rows) > limit)

    @app.get("/v1/batches/{batch_id}")
    async def get_batch(batch_id: ObjectId, who: Who) -> Response:
        b = svc.batches.get(batch_id, who.scope)
        if b is None:
            raise ApiError(404, f"No such Batch object: {batch_id[:100]}", code="not_found", param="batch_id")
        return JSONResponse(render(b))  # already checked against `Batch`: no second validation

    @app.post("/v1/batches/{batch_id}/cancel")
    def cancel_batch(batch_id: ObjectId, who: Who) -> dict[str, Any]:
        return render(svc.cancel_batch(who.scope, batch_id))

    install(app, svc)  # the live page, a batch's webhook attempts, a key's usage
    install_messages(app, svc)  # Anthropic's Message Batches, under /v1/messages (anthropic_routes.py)
    install_online(app, svc)  # the OpenAI online API on the same engines (online.py)

    @app.get("/metrics")
    def metrics(who: Who) -> Response:
        from tokenmill.jobs.serve.metrics import CONTENT_TYPE, exposition

        if not who.admin:
            raise ApiError(403, "the metrics are for an admin key", type="permission_error", code="forbidden")
        return Response(exposition(svc), media_type=CONTENT_TYPE)

    return app


def chunk_ends_with_newline(path: str) -> bool:
    with open(path, "rb") as fh:
        fh.seek(-1, os.SEEK_END)
        return fh.read(1) == b"\n"


def asgi_app(cfg: ServeConfig, service: BatchService | None = None) -> Any:
    """The app with its body limit, as uvicorn runs it."""
    return BodyLimit(create_app(cfg, service), cfg.limits.max_file_bytes + FORM_OVERHEAD,
                     {BATCHES_PATH: cfg.limits.max_message_batch_bytes})
