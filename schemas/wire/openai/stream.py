"""OpenAI's streamed answers (`stream: true` on `/v1/chat/completions` and `/v1/completions`):
server-sent events, each `data: <chunk>` and a blank line, the last `data: [DONE]`.  A chat
chunk is a `chat.completion.chunk` (its choice's `delta`: the role first, then content, then
the finish reason), a completion chunk a `text_completion` with its choice's new `text`; with
`stream_options.include_usage` one more chunk with no choices carries `usage`."""

from __future__ import annotations

import json
from typing import Any

from tokenmill.schemas.wire.openai.request import COMPLETIONS

DONE = "data: [DONE]\n\n"


def event(obj: dict[str, Any]) -> str:
    """One server-sent event of a JSON object."""
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def chunk(rid: str, url: str, model: str, created: int, *, text: str | None = None, role: bool = False,
          finish_reason: str | None = None) -> dict[str, Any]:
    """One streamed chunk of request `rid` answered at `url`: new text, the role (a chat's first
    chunk) or the finish reason (the last with a choice)."""
    if url == COMPLETIONS:
        choice: dict[str, Any] = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}
        return {"id": rid, "object": "text_completion", "created": created, "model": model, "choices": [choice]}
    delta: dict[str, Any] = {}
    if role:
        delta["role"] = "assistant"
    if text is not None:
        delta["content"] = text
    return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}]}


def usage_chunk(rid: str, url: str, model: str, created: int, usage: dict[str, Any]) -> dict[str, Any]:
    """The chunk `stream_options.include_usage` asks for: no choices, the request's `usage`."""
    obj = "text_completion" if url == COMPLETIONS else "chat.completion.chunk"
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": [], "usage": usage}
