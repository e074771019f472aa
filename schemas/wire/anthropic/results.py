"""Anthropic's batch results: one line per request, `{custom_id, result}`, the result one of

- `succeeded`: a Messages response (`message`: one text block, `stop_reason`, and `usage`
  with `input_tokens` (the prompt's tokens not read from the prefix cache, as Anthropic counts
  them), `output_tokens`, `cache_read_input_tokens` (the engine's prefix-cache hits) and
  `cache_creation_input_tokens` 0);
- `errored`: Anthropic's error object, `invalid_request_error` for a request that could not be
  served as given, `api_error` for one the engine failed;
- `canceled`, `expired`: a request that never ran because its batch was canceled or expired.

Message ids derive from the job and the custom_id, so writing a batch's results twice writes
the same lines."""

from __future__ import annotations

import hashlib
import json
from typing import Any

from tokenmill.schemas import records as R

#: The dead-letter reasons that are the engine's fault (`api_error`); any other is the request's.
API_ERRORS = (R.ENGINE_ERROR, R.ENGINE_TIMEOUT, R.SERVER_ERROR, R.RATE_LIMITED, R.REQUEST_TIMEOUT,
              R.CONNECTION_DROPPED, R.BAD_RESPONSE)
#: An output row's `finish_reason` → the Messages `stop_reason` (`stop_sequence` where the row
#: names the stop string that ended it: `OutputRow.stop_sequence`).
STOP_REASONS = {"length": "max_tokens", "stop": "end_turn"}
#: How a request that never ran is answered, by how its batch ended.
UNRUN = {"cancelled": "canceled", "expired": "expired"}
FAILED_MESSAGE = "This request was not processed because its batch failed."


def message_id(job_id: str, custom_id: str) -> str:
    return "msg_" + hashlib.sha256(f"{job_id}\0{custom_id}".encode()).hexdigest()[:24]


def message(row: dict[str, Any], model: str | None) -> dict[str, Any]:
    """A Messages response of one output row, under the model name its request gave."""
    prompt, cached = int(row.get("prompt_tokens") or 0), int(row.get("cached_tokens") or 0)
    stop = row.get("stop_sequence") if (row.get("finish_reason") or "stop") == "stop" else None
    return {"id": message_id(row["job_id"], row["id"]), "type": "message", "role": "assistant",
            "model": model or row.get("model") or "", "content": [{"type": "text", "text": row.get("text") or ""}],
            "stop_reason": "stop_sequence" if stop else STOP_REASONS.get(row.get("finish_reason") or "stop", "end_turn"),
            "stop_sequence": stop or None,
            "usage": {"input_tokens": max(0, prompt - cached), "output_tokens": int(row.get("output_tokens") or 0),
                      "cache_read_input_tokens": cached, "cache_creation_input_tokens": 0}}


def _line(custom_id: str, result: dict[str, Any]) -> str:
    return json.dumps({"custom_id": custom_id, "result": result}, ensure_ascii=False)


def error_object(message: str, type: str = "invalid_request_error") -> dict[str, Any]:
    """Anthropic's error shape (an HTTP error's body, and an errored result's `error`)."""
    return {"type": "error", "error": {"type": type, "message": message}}


def succeeded_line(row: dict[str, Any], model: str | None) -> str:
    return _line(row["id"], {"type": "succeeded", "message": message(row, model)})


def errored_line(r: dict[str, Any]) -> str:
    """The result of one dead-letter row; a row without a custom_id is named by its line (`line-<ref>`)."""
    cid = r.get("id") or f"line-{R.format_ref(r['input_file'], r['input_row'])}"
    kind = "api_error" if r["reason"] in API_ERRORS else "invalid_request_error"
    return _line(cid, {"type": "errored", "error": error_object(f"{r['reason']}: {r['message']}", kind)})


def unrun_line(custom_id: str, ended: str) -> str:
    """The result of a request that never ran, by how its batch ended (OpenAI's status names:
    `cancelled`, `expired`, else failed)."""
    kind = UNRUN.get(ended)
    if kind is not None:
        return _line(custom_id, {"type": kind})
    return _line(custom_id, {"type": "errored", "error": error_object(FAILED_MESSAGE, "api_error")})
