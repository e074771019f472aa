"""Anthropic's MessageBatch object, its list page, the deleted object and the error shape, built
from the service's batch row (the row OpenAI's batches use too: schemas/tables.api_batches).

A batch's `processing_status` derives from the row's timestamps: `ended` once it has a terminal
one, `canceling` once a cancel was asked, else `in_progress`.  Its `request_counts` are the live
counts while it runs (`processing` the rest) and those stored when it ended.  Times are RFC 3339
strings, as Anthropic gives them.  Checked against the `anthropic` package's own types by the
tests (the package is not a server dependency)."""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any, Callable

from tokenmill.schemas.wire.anthropic.results import error_object

#: The batch row's terminal timestamps (any one set: the batch ended).
ENDED_AT = ("completed_at", "failed_at", "expired_at", "cancelled_at")
#: The kinds of a request's result, as `request_counts` names them.
RESULT_KINDS = ("succeeded", "errored", "canceled", "expired")
#: Each HTTP status's error type, among those the `anthropic` SDK's `ErrorObject` knows (its
#: union has no `request_too_large`: a 413 is an `invalid_request_error` naming the limit).
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 405: "invalid_request_error", 409: "invalid_request_error",
               413: "invalid_request_error", 422: "invalid_request_error", 429: "rate_limit_error",
               500: "api_error", 503: "overloaded_error", 504: "timeout_error", 529: "overloaded_error"}


def rfc3339(ts: float | None) -> str | None:
    if ts is None:
        return None
    return datetime.fromtimestamp(ts, timezone.utc).isoformat().replace("+00:00", "Z")


def ended_at(b: dict[str, Any]) -> float | None:
    return next((b[c] for c in ENDED_AT if b.get(c) is not None), None)


def processing_status(b: dict[str, Any]) -> str:
    if ended_at(b) is not None:
        return "ended"
    return "canceling" if b.get("cancelling_at") is not None else "in_progress"


def request_counts(b: dict[str, Any], live: dict[str, int] | None = None) -> dict[str, int]:
    """The batch's counts: stored once it ended, else `live` (succeeded, errored so far) with the
    rest `processing`."""
    stored = b.get("request_counts") if ended_at(b) is not None else None
    got = stored or live or {}
    counts = {k: int(got.get(k) or 0) for k in RESULT_KINDS}
    counts["processing"] = 0 if stored else max(0, int(b.get("lines") or 0) - counts["succeeded"] - counts["errored"])
    return counts


def batch_object(b: dict[str, Any], live: dict[str, int] | None = None,
                 results_url: str | None = None) -> dict[str, Any]:
    """A batch row as Anthropic's `MessageBatch`; `results_url` is given once it ended."""
    status = processing_status(b)
    return {"id": b["id"], "type": "message_batch", "processing_status": status,
            "request_counts": request_counts(b, live), "ended_at": rfc3339(ended_at(b)),
            "created_at": rfc3339(b["created_at"]), "expires_at": rfc3339(b["expires_at"]),
            "cancel_initiated_at": rfc3339(b.get("cancelling_at")), "archived_at": None,
            "results_url": results_url if status == "ended" else None}


def deleted(batch_id: str) -> dict[str, Any]:
    return {"id": batch_id, "type": "message_batch_deleted"}


def page(rows: list[dict[str, Any]], render: Callable[[dict[str, Any]], dict[str, Any]], has_more: bool) -> dict:
    """Anthropic's list page: `data`, `has_more`, `first_id`, `last_id` (newest first)."""
    data = [render(r) for r in rows]
    return {"data": data, "has_more": has_more, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None}


def error_body(status: int, message: str) -> dict[str, Any]:
    """Anthropic's error shape for an HTTP status."""
    return error_object(message, ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error"))
