"""The OpenAI online API on `tokenmill serve` (docs/SERVING.md, "Online requests"):
`POST /v1/chat/completions` and `POST /v1/completions` (whole, or with `stream: true` as
server-sent events ending `data: [DONE]`), and `GET /v1/models`; the same keys (`Who`) and
OpenAI's error shape as the batch routes.

A request's body is read as a batch line's body is (`request_fields`: the same fields served,
the same refusals, `check_sampling`), then sent to its model's engine process (the one its
batches run in: `Scheduler.engine`), where it is answered in the warm engine
(online_engine.py); the engine's messages come back on a reader thread and are handed to the
waiting request's asyncio queue.  Limits, each a 429 at once: `online.max_per_key` requests of
one key in flight, `online.max_queue` of one model, and the key's `tokens_per_day` (batches and
online requests together).  A client that leaves mid-stream cancels its request in the engine
(its sequence freed).  Each request that reached the engine is recorded when it ends
(`OnlineStore`: key, model, tokens, TTFT, latency, status)."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import uuid
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, AsyncIterator

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.background import BackgroundTask

from tokenmill.jobs.serve.auth import Who
from tokenmill.jobs.serve.errors import ApiError
from tokenmill.jobs.serve.online_engine import Cancel, Done, OnlineSetup, State, Submit, Text
from tokenmill.schemas import storage as S
from tokenmill.schemas.wire.lines import LineError
from tokenmill.schemas.wire.openai import stream as sse
from tokenmill.schemas.wire.openai.objects import error_body
from tokenmill.schemas.wire.openai.request import CHAT, COMPLETIONS, check_sampling, request_fields
from tokenmill.schemas.wire.openai.response import response_body

if TYPE_CHECKING:
    from tokenmill.jobs.serve.service import BatchService

log = logging.getLogger(__name__)

#: Body fields of an online request that a batch line has no place for: read here, not passed on.
ONLINE_ONLY = ("stream", "stream_options", "user")
#: The histograms' upper bounds (seconds) of online TTFT and TPOT per model (/metrics).
TTFT_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
TPOT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)


class OnlineRouter:
    """The server's side of the online requests: limits, the waiting requests' queues, the
    engines' messages (`on_message`, from their reader threads), records and figures."""

    def __init__(self, svc: BatchService):
        self.svc, self.cfg = svc, svc.cfg
        self.started_at = time.time()
        self.store = S.OnlineStore(svc.eng)
        self._lock = threading.Lock()
        self._waiting: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue, str]] = {}
        self._per_key: Counter[str] = Counter()
        self._per_model: Counter[str] = Counter()
        self.states: dict[str, dict[str, int]] = {}
        """Model → what its engine holds (`SharedSession.state`), as last reported."""
        self.hist: dict[tuple[str, str], list[float]] = {}
        """(model, "ttft" | "tpot") → the bucket counts, then the sum and the count (/metrics)."""
        self.ended: Counter[tuple[str, int]] = Counter()
        """(model, HTTP status) → online requests ended since the server started."""

    def setup(self, model: str) -> OnlineSetup:
        """What the model's engine process needs to answer online requests: its batches' job spec."""
        spec = self.cfg.job_spec(model, input="online.jsonl", output=str(self.cfg.work_root() / "online"),
                                 job_id="online")
        o = self.cfg.online
        return OnlineSetup(spec.model_dump(mode="json", exclude_none=True), o.batch_floor, o.reserve_seqs, o.idle_s)

    def on_message(self, model: str, msg: Any) -> None:
        """An engine process's online message (None: the process is gone, its requests end 503)."""
        if msg is None:
            with self._lock:
                gone = [rid for rid, (_, _, m) in self._waiting.items() if m == model]
            for rid in gone:
                self._hand(rid, Done(rid, None, f"the engine process of model {model!r} stopped", 503))
            self.states.pop(model, None)
        elif isinstance(msg, State):
            self.states[model] = msg.state
            e = self.svc.scheduler.engines.get(model)
            if e is not None:
                e.loaded = True
        else:
            self._hand(msg.id, msg)

    def _hand(self, rid: str, msg: Any) -> None:
        with self._lock:
            entry = self._waiting.get(rid)
        if entry is not None:
            loop, q, _ = entry
            try:
                loop.call_soon_threadsafe(q.put_nowait, msg)
            except RuntimeError:  # its loop is closed: the server stops
                pass

    def admit(self, owner: str, model: str) -> None:
        """Count a request in, or refuse it with 429 (module doc)."""
        lim = self.cfg.online
        over = self.svc.quotas.over(owner, in_flight=0)
        if over is not None:
            raise ApiError(429, over.message, type="rate_limit_error", code="rate_limit_exceeded", param=over.limit)
        with self._lock:
            if self._per_key[owner] >= lim.max_per_key:
                raise ApiError(429, f"online.max_per_key: this key has {self._per_key[owner]} online requests in "
                                    f"flight, the most it may have; wait for one to end", type="rate_limit_error",
                               code="rate_limit_exceeded", param="max_per_key")
            if self._per_model[model] >= lim.max_queue:
                raise ApiError(429, f"online.max_queue: model {model!r} has {self._per_model[model]} online requests "
                                    "in flight, the most it takes; try again shortly", type="rate_limit_error",
                               code="rate_limit_exceeded", param="max_queue")
            self._per_key[owner] += 1
            self._per_model[model] += 1

    def release(self, owner: str, model: str, rid: str) -> None:
        with self._lock:
            self._per_key[owner] -= 1
            self._per_model[model] -= 1
            self._waiting.pop(rid, None)

    def open(self, rid: str, model: str, fields: dict[str, Any]) -> asyncio.Queue:
        """Send the request to its model's engine process; its messages come on the queue."""
        q: asyncio.Queue = asyncio.Queue()
        with self._lock:
            self._waiting[rid] = (asyncio.get_running_loop(), q, model)
        if not self.svc.scheduler.engine(model).send_online(Submit(rid, fields)):
            raise ApiError(503, f"the engine of model {model!r} cannot take requests now; try again",
                           type="server_error", code="engine_unavailable")
        return q

    def cancel(self, model: str, rid: str) -> None:
        e = self.svc.scheduler.engines.get(model)
        if e is not None:
            e.send_online(Cancel(rid))

    def record(self, rid: str, owner: str, model: str, url: str, stream: bool, t0: float, first_at: float | None,
               done: Done | None) -> None:
        """The request's row (once it reached the engine) and its figures."""
        row = (done.row if done is not None else None) or {}
        status = 499 if done is None else done.status  # 499: the client left first
        ttft = None if first_at is None else first_at - t0
        rec = {"id": rid, "owner": owner, "model": model, "endpoint": url, "stream": stream, "created_at": t0,
               "status": status, "finish_reason": row.get("finish_reason"), "prompt_tokens": row.get("prompt_tokens"),
               "output_tokens": row.get("output_tokens"), "cached_tokens": row.get("cached_tokens"),
               "ttft_s": ttft, "tpot_s": row.get("tpot_s"), "e2e_s": time.time() - t0,
               "error": None if done is None else done.error}
        try:
            self.store.record(rec)
        except Exception:  # the answer is given; a record lost is logged, not the client's fault
            log.exception("online request %s: its record", rid)
        with self._lock:
            self.ended[(model, status)] += 1
            for name, value, bounds in (("ttft", ttft, TTFT_BUCKETS), ("tpot", row.get("tpot_s"), TPOT_BUCKETS)):
                if value is None:
                    continue
                h = self.hist.setdefault((model, name), [0.0] * (len(bounds) + 2))
                for i, b in enumerate(bounds):
                    if value <= b:
                        h[i] += 1
                h[-2] += value
                h[-1] += 1


router = APIRouter()


def _online(request: Request) -> OnlineRouter:
    return request.app.state.online


@router.get("/v1/models")
def list_models(request: Request, who: Who) -> dict[str, Any]:
    on = _online(request)
    return {"object": "list", "data": [{"id": name, "object": "model", "created": int(on.started_at),
                                        "owned_by": "tokenmill"} for name in on.cfg.served_names()]}


@router.post("/v1/chat/completions")
async def chat_completions(request: Request, who: Who) -> Any:
    return await _answer(request, who.key_id, CHAT)


@router.post("/v1/completions")
async def completions(request: Request, who: Who) -> Any:
    return await _answer(request, who.key_id, COMPLETIONS)


async def _answer(request: Request, owner: str, url: str) -> Any:
    on = _online(request)
    try:
        body = await request.json()
    except ValueError:
        raise ApiError(400, "the body is not valid JSON", code="invalid_json") from None
    if not isinstance(body, dict):
        raise ApiError(400, f"the body must be a JSON object, got {type(body).__name__}", code="invalid_value")
    name = body.get("model")
    served = on.cfg.served_names()
    if not isinstance(name, str) or name not in served:
        raise ApiError(404, f"The model `{str(name)[:100]}` does not exist (served: {', '.join(served)})",
                       param="model", code="model_not_found")
    model = served[name]
    stream = body.get("stream") is True
    options = body.get("stream_options")
    include_usage = stream and isinstance(options, dict) and options.get("include_usage") is True
    if body.get("n") not in (None, 1):
        raise ApiError(400, f"n must be 1 for an online request (one request per answer), got {str(body['n'])[:20]}",
                       param="n", code="invalid_value")
    try:
        fields = request_fields({"custom_id": "online", "url": url,
                                 "body": {k: v for k, v in body.items() if k not in ONLINE_ONLY}})
        check_sampling(fields)
    except LineError as err:
        raise ApiError(400, str(err), param=err.param, code=err.code) from None
    on.admit(owner, model)
    rid = f"{'chatcmpl' if url == CHAT else 'cmpl'}-{uuid.uuid4().hex[:24]}"
    t0 = time.time()
    try:
        q = on.open(rid, model, fields)
    except BaseException:
        on.release(owner, model, rid)
        raise
    done: Done | None = None
    first_at = None
    try:
        while done is None:
            msg = await q.get()
            if isinstance(msg, Text):
                first_at = first_at or time.time()
                if stream:  # the answer has begun: streamed from here (a refusal came before it, as a status)
                    end = _Ending(on, rid, owner, model, url, t0, first_at)
                    # the ending also runs after the response (a client gone before the stream began)
                    return StreamingResponse(_events(q, rid, name, url, t0, include_usage, msg, end),
                                             media_type="text/event-stream", headers={"Cache-Control": "no-cache"},
                                             background=BackgroundTask(end, None))
            else:
                done = msg
    except BaseException:
        on.cancel(model, rid)  # the request was cancelled (the server stops)
        on.release(owner, model, rid)
        on.record(rid, owner, model, url, stream, t0, first_at, None)
        raise
    assert done is not None
    on.release(owner, model, rid)
    on.record(rid, owner, model, url, stream, t0, first_at, done)
    if done.row is None:
        raise ApiError(done.status, done.error or "the engine failed", code="engine_error" if done.status >= 500
                       else "invalid_value", type="server_error" if done.status >= 500 else "invalid_request_error")
    if stream:  # answered before any text came (no output tokens): the whole answer as one stream
        return StreamingResponse(_events(None, rid, name, url, t0, include_usage, done, None),
                                 media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
    return JSONResponse(_body(done.row, rid, url, name))


def _body(row: dict[str, Any], rid: str, url: str, name: str) -> dict[str, Any]:
    """The whole answer, shaped as a batch line's response body (one place for that shape)."""
    body = response_body({**row, "job_id": "online", "id": rid, "sample": 0}, url, name)
    body["id"] = rid
    return body


@dataclass
class _Ending:
    """A streamed request's end, once: cancelled in the engine when it did not finish (its
    client left), its place given back, its record written."""

    on: OnlineRouter
    rid: str
    owner: str
    model: str
    url: str
    t0: float
    first_at: float | None
    ended: bool = False

    def __call__(self, done: Done | None) -> None:
        if self.ended:
            return
        self.ended = True
        if done is None:  # the client left mid-stream: free its sequence in the engine
            self.on.cancel(self.model, self.rid)
        self.on.release(self.owner, self.model, self.rid)
        self.on.record(self.rid, self.owner, self.model, self.url, True, self.t0, self.first_at, done)


async def _events(q: asyncio.Queue | None, rid: str, name: str, url: str, t0: float, include_usage: bool,
                  first: Text | Done, end: _Ending | None) -> AsyncIterator[str]:
    """The request's server-sent events from its first message on (`q` None: `first` is its end,
    already counted); `end` is called when it ends, or when its client leaves mid-stream."""
    created = int(t0)
    done: Done | None = None
    msg: Any = first
    try:
        if url == CHAT:
            yield sse.event(sse.chunk(rid, url, name, created, role=True, text=""))
        while True:
            if isinstance(msg, Text):
                yield sse.event(sse.chunk(rid, url, name, created, text=msg.text))
            else:
                done = msg
                break
            assert q is not None
            msg = await q.get()
        if done.row is None:
            yield sse.event(error_body(done.error or "the engine failed", type="server_error" if done.status >= 500
                                       else "invalid_request_error", code=str(done.status)))
        else:
            yield sse.event(sse.chunk(rid, url, name, created, finish_reason=done.row.get("finish_reason") or "stop"))
            if include_usage:
                yield sse.event(sse.usage_chunk(rid, url, name, created, _body(done.row, rid, url, name)["usage"]))
        yield sse.DONE
    finally:
        if end is not None:
            end(done)


def install(app: FastAPI, svc: BatchService) -> None:
    """Add the online routes to the server's app; each engine process the scheduler starts
    from now on answers online requests too."""
    on = OnlineRouter(svc)
    app.state.online = on
    svc.scheduler.online = on
    app.include_router(router)
