"""OpenAI's Batch and File objects, field for field as its API returns them, built from the
service's stored rows: a batch's status from its timestamps, its request counts and usage, a
file's object, lists and the error shape.  Checked against the `openai` package's own types
where they leave the service (jobs/serve/objects.py)."""

from __future__ import annotations

from typing import Any, Callable

#: A batch's status from its timestamps, first match wins (OpenAI's states).
_STATUS = (("failed_at", "failed"), ("cancelled_at", "cancelled"), ("expired_at", "expired"),
           ("completed_at", "completed"), ("finalizing_at", "finalizing"), ("cancelling_at", "cancelling"),
           ("in_progress_at", "in_progress"))
#: Statuses a batch ends in.
ENDED = ("failed", "cancelled", "expired", "completed")


def batch_status(b: dict[str, Any]) -> str:
    return next((status for col, status in _STATUS if b.get(col) is not None), "validating")


def _ts(v: float | None) -> int | None:
    return None if v is None else int(v)


def file_object(f: dict[str, Any]) -> dict[str, Any]:
    return {"id": f["id"], "object": "file", "bytes": int(f["bytes"]), "created_at": int(f["created_at"]),
            "filename": f["filename"], "purpose": f["purpose"], "status": "processed",
            "expires_at": _ts(f.get("expires_at")),
            "status_details": None}


def file_deleted(file_id: str) -> dict[str, Any]:
    return {"id": file_id, "object": "file", "deleted": True}


def batch_object(b: dict[str, Any], counts: dict[str, int] | None = None) -> dict[str, Any]:
    """A batch row as OpenAI's `Batch`; `counts` (completed, failed so far) while it runs, the
    stored request counts once it ended."""
    status = batch_status(b)
    total = int(b.get("lines") or 0)
    rc = b.get("request_counts") or {"total": total, "completed": (counts or {}).get("completed", 0),
                                     "failed": (counts or {}).get("failed", 0)}
    return {
        "id": b["id"], "object": "batch", "endpoint": b["endpoint"], "model": b.get("model"),
        "errors": {"object": "list", "data": b["errors"]} if b.get("errors") else None,
        "input_file_id": b["input_file_id"], "completion_window": b["completion_window"], "status": status,
        "output_file_id": b.get("output_file_id"), "error_file_id": b.get("error_file_id"),
        "created_at": int(b["created_at"]), "expires_at": _ts(b.get("expires_at")),
        **{k: _ts(b.get(k)) for k in ("in_progress_at", "finalizing_at", "completed_at", "failed_at", "expired_at",
                                      "cancelling_at", "cancelled_at")},
        "request_counts": rc, "metadata": b.get("metadata"), "usage": b.get("usage"),
    }


def page(rows: list[dict[str, Any]], render: Callable[[dict[str, Any]], dict[str, Any]], has_more: bool) -> dict:
    data = [render(r) for r in rows]
    return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None, "has_more": has_more}


def error_body(message: str, *, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    """OpenAI's error shape."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def line_error(code: str, message: str, line: int | None, param: str | None = None) -> dict[str, Any]:
    """One of a batch's `errors` (OpenAI's `BatchError`): what failed, at which 1-based line."""
    return {"code": code, "message": message, "param": param, "line": line}


def usage_of(tokens: dict[str, Any] | None) -> dict[str, Any]:
    """A job's token totals as a batch's `usage`."""
    t = tokens or {}
    prompt, output = int(t.get("prompt") or 0), int(t.get("output") or 0)
    return {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": int(t.get("cached") or 0)},
            "output_tokens": output, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt + output}
