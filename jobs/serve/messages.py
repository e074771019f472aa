"""Anthropic's Message Batches in the batch service: what the routes (anthropic_routes.py) ask
of it.  A message batch is a batch like an OpenAI one (its row in `api_batches`, its endpoint
`/v1/messages`, the job of its id), so the scheduler, the engines, resume, the result cache,
cancel, expiry, webhooks, usage and the page treat it as they treat any batch.

What differs is at its two ends:

- **create**: the requests arrive in the body, not as an uploaded file.  Each is checked as
  Anthropic checks a create (schemas/wire/anthropic/request.check_request: custom_id, model,
  max_tokens, messages; each custom_id once; a served model, one per batch; at most
  `limits.max_message_batch_requests`); any fault refuses the whole batch with 400 and nothing
  is stored.  The requests are then stored as the batch's input file (a JSONL file of
  `{custom_id, params}` lines in the files store, with its line index), and the batch starts
  `in_progress` at once: its input was checked here, so the scheduler's validation is not run.
  A key at its quota is refused with 429 (Anthropic queues nothing).
- **end**: its results file (finalize.BatchFiles.message_results) is its `output_file_id`.

The rest of a request's params are read when the job runs; what the engine cannot serve
(tools, thinking, ...) is that request's `errored` result."""

from __future__ import annotations

import json
import os
import tempfile
import time
from typing import Any, Iterator

from tokenmill.jobs.serve.blobs import iter_bytes
from tokenmill.jobs.serve.config import window_seconds
from tokenmill.jobs.serve.errors import ApiError
from tokenmill.jobs.serve.requests import storable
from tokenmill.jobs.serve.service import BatchService, new_id
from tokenmill.jobs.serve.validate import served_list
from tokenmill.schemas import tables as T
from tokenmill.schemas.wire.anthropic.objects import processing_status
from tokenmill.schemas.wire.anthropic.request import MAX_REQUESTS, MESSAGES, check_request
from tokenmill.schemas.wire.lines import LineError, LineIndex

#: How long a batch runs before it expires (Anthropic's: 24 hours).
WINDOW = "24h"


class MessageBatches:
    """The service's Message Batches: create, read, list, cancel, delete and results, each read
    filtered by the caller's key (`scope`, None for an admin key) and by the endpoint, so an
    OpenAI batch's id is not found here."""

    def __init__(self, svc: BatchService):
        self.svc = svc

    # ------------------------------------------------------------------ create

    def create(self, owner: str, requests: list[Any], completion_window: str | None = None) -> dict[str, Any]:
        """Check the requests, store them as the batch's input and queue the batch; ApiError (400,
        429) with nothing stored when it is refused.  `completion_window` (tokenmill's extension,
        as OpenAI names it) replaces the 24 hours a batch has before it expires."""
        cfg = self.svc.cfg
        window = completion_window or WINDOW
        storable(window, T.api_batches.c.completion_window, "completion_window")
        seconds = window_seconds(window)
        if seconds is None or not 0 < seconds <= cfg.limits.max_completion_window_s:
            raise ApiError(400, f"completion_window must be like '24h' (s, m, h or d) and at most "
                                f"{cfg.limits.max_completion_window_s} s, got {window[:40]!r}", param="completion_window")
        most = min(MAX_REQUESTS, cfg.limits.max_message_batch_requests)
        if not requests:
            raise ApiError(400, "requests: a batch needs at least one request", param="requests")
        if len(requests) > most:
            raise ApiError(400, f"requests: a batch holds at most {most:,} requests, got {len(requests):,}",
                           param="requests")
        fd, tmp = tempfile.mkstemp(suffix=".jsonl")
        try:
            with os.fdopen(fd, "wb") as out:
                index, model = _write_requests(out, requests, cfg.served_names())
            return self._store(owner, tmp, index, model, window, seconds)
        finally:
            os.unlink(tmp)

    def _store(self, owner: str, path: str, index: LineIndex, model: str, window: str, seconds: int) -> dict[str, Any]:
        """The requests file and its index into the store, then (the key under its quotas) the
        file's and the batch's rows; the stored bytes removed again when the batch is refused."""
        svc = self.svc
        now = time.time()
        batch_id, file_id = new_id("msgbatch_"), new_id("file-")
        svc.blobs.put_file(file_id, path)
        svc.blobs.put_index(file_id, index.to_bytes())  # what validation would store: the job plans from it
        try:
            with svc._lock:  # the in-flight count and the insert together, as service.create_batch holds them
                over = svc.quotas.over(owner, in_flight=svc.batches.in_flight(owner))
                if over is not None:
                    raise ApiError(429, over.message, type="rate_limit_error", param=over.limit)
                svc.files.add({"id": file_id, "owner": owner, "filename": f"{batch_id}_requests.jsonl",
                               "purpose": "batch", "bytes": index.size, "lines": len(index), "created_at": now,
                               "deleted_at": None})
                svc.batches.add({"id": batch_id, "owner": owner, "endpoint": MESSAGES, "input_file_id": file_id,
                                 "completion_window": window, "metadata": None, "priority": 0, "created_at": now,
                                 "expires_at": now + seconds, "in_progress_at": now, "lines": index.requests,
                                 "model": model})
        except ApiError:
            svc.blobs.delete(file_id)
            raise
        svc.scheduler.wake()
        return svc.batches.get(batch_id) or {}

    # ------------------------------------------------------------------ read, cancel, delete

    def get(self, scope: str | None, batch_id: str) -> dict[str, Any]:
        b = self.svc.batches.get(batch_id, scope)
        if b is None or b["endpoint"] != MESSAGES:
            raise ApiError(404, f"message batch {batch_id[:100]!r} not found", param="message_batch_id")
        return b

    def page(self, scope: str | None, *, limit: int, before: str | None,
             after: str | None) -> tuple[list[dict[str, Any]], bool]:
        """A page of the caller's message batches, newest first, and whether there are more
        beyond it (before `before`'s, or after `after`'s)."""
        rows = self.svc.batches.page(scope, limit=limit + 1, after=after, before=before, endpoint=MESSAGES)
        kept = rows[:limit]
        if before:
            kept.reverse()  # the store gives those newer than the cursor nearest it first
        return kept, len(rows) > limit

    def live(self, b: dict[str, Any]) -> dict[str, int] | None:
        """A running batch's requests answered (`succeeded`) and failed (`errored`) so far."""
        counts = self.svc.live_counts(b)
        return None if counts is None else {"succeeded": counts["completed"], "errored": counts["failed"]}

    def cancel(self, scope: str | None, batch_id: str) -> dict[str, Any]:
        """Ask the batch to stop: its requests not run end `canceled`.  One ending already (its
        results being written) ends as its job did."""
        b = self.get(scope, batch_id)
        if processing_status(b) == "ended":
            raise ApiError(400, f"message batch {batch_id} has ended; it cannot be canceled", param="message_batch_id")
        try:
            return self.svc.cancel_batch(scope, batch_id)
        except ApiError as err:
            if err.status != 409:
                raise
            return self.get(scope, batch_id)

    def delete(self, scope: str | None, batch_id: str) -> None:
        """Delete an ended batch with its requests and results files (400 while it runs).  Its
        row stays, marked, so its key's usage and quotas still count it."""
        b = self.get(scope, batch_id)
        status = processing_status(b)
        if status != "ended":
            raise ApiError(400, f"message batch {batch_id} is {status}; a batch can be deleted once it has ended "
                                "(cancel it first)", param="message_batch_id")
        svc = self.svc
        if not svc.batches.set(batch_id, unless="deleted_at", deleted_at=time.time()):
            raise ApiError(404, f"message batch {batch_id[:100]!r} not found", param="message_batch_id")
        for file_id in (b.get("output_file_id"), b.get("input_file_id")):
            if file_id and svc.files.delete(file_id, None):
                svc.blobs.delete(file_id)

    def results(self, scope: str | None, batch_id: str) -> Iterator[bytes]:
        """The results file's bytes (400 until the batch has ended)."""
        b = self.get(scope, batch_id)
        status = processing_status(b)
        if status != "ended" or not b.get("output_file_id"):
            raise ApiError(400, f"message batch {batch_id} is {status}: its results are ready once it has ended",
                           param="message_batch_id")
        return iter_bytes(self.svc.blobs.open(b["output_file_id"]))


def _write_requests(out: Any, requests: list[Any], served: dict[str, str]) -> tuple[LineIndex, str]:
    """Each request checked (`check_request`), once per custom_id, on one served model, and
    written as a JSONL line: the file's line index and the served model.  ApiError (400) naming
    the first fault, as Anthropic's `requests.<i>.<field>`."""
    index, seen = LineIndex(), set()
    named: dict[str, tuple[int, str]] = {}  # served model -> its first request and the name it gave
    offset = 0
    for i, obj in enumerate(requests):
        where = f"requests.{i}"
        try:
            req = check_request(obj, where)
        except LineError as err:
            raise ApiError(400, str(err), param=err.param) from None
        if req.custom_id in seen:
            raise ApiError(400, f"{where}.custom_id: Duplicate custom_id {req.custom_id!r}: each request in a batch "
                                "needs its own", param=f"{where}.custom_id")
        seen.add(req.custom_id)
        if req.model not in served:
            raise ApiError(400, f"{where}.params.model: model {req.model[:80]!r} is not served here (served: "
                                f"{served_list(served)})", param=f"{where}.params.model")
        named.setdefault(served[req.model], (i, req.model))
        if len(named) > 1:
            j, other = next(iter(named.values()))
            raise ApiError(400, f"{where}.params.model: model {req.model[:80]!r}, but requests.{j} names {other!r}; "
                                "a batch runs on one model", param=f"{where}.params.model")
        line = (json.dumps(obj, ensure_ascii=False, separators=(",", ":")) + "\n").encode("utf-8")
        out.write(line)
        index.add(offset, len(line), req.custom_id, MESSAGES, req.model)
        offset += len(line)
    return index, next(iter(named))
