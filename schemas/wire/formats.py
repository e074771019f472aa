"""A batch input line in either wire format, told apart line by line: an Anthropic Message
Batches request (`{custom_id, params}`: anthropic/request.py) or an OpenAI batch request
(`{custom_id, method, url, body}`: openai/request.py).  What the pipeline reads a batch file
through (transforms/openai_batch.py): the endpoints a line may name (OpenAI's, then
Anthropic's `/v1/messages`), the ones each engine task answers, a line's fields and its peek."""

from __future__ import annotations

from typing import Any, Iterable

from tokenmill.schemas.wire.anthropic import request as anthropic
from tokenmill.schemas.wire.lines import LineError, LineIndex, scan
from tokenmill.schemas.wire.openai import request as openai_request

MESSAGES = anthropic.MESSAGES
#: Every endpoint a line may name, OpenAI's first (a line's code in a shard is its place here).
ENDPOINTS: tuple[str, ...] = (*openai_request.ENDPOINTS, MESSAGES)
#: The endpoints each engine task answers: Anthropic's Messages requests are chat, generated.
TASK_ENDPOINTS: dict[str, tuple[str, ...]] = {
    task: (*urls, MESSAGES) if task == "generate" else urls for task, urls in openai_request.TASK_ENDPOINTS.items()}


def line_fields(obj: Any) -> dict[str, Any]:
    """A decoded line's served fields, by its format (`request_fields` of either)."""
    if anthropic.is_message_line(obj):
        return anthropic.request_fields(obj)
    return openai_request.request_fields(obj)


def parse_line(line: str | bytes) -> dict[str, Any]:
    """One input line of either format → the request fields tokenmill serves (`custom_id`,
    `url`, `model`, `messages` or `prompt`, the sampling keys); LineError saying what is wrong."""
    return line_fields(openai_request.decode(line))


def peek(line: bytes) -> tuple[str, str | None, str | None]:
    """(endpoint, model, custom_id) of a line of either format that may not be a valid request:
    `?` for an endpoint it does not give (openai/request.py's `peek`)."""
    try:
        obj = openai_request.decode(line)
    except LineError:
        return "?", None, None
    if anthropic.is_message_line(obj):
        return anthropic.peek(obj)
    return openai_request.peek(line)


def index_lines(lines: Iterable[bytes]) -> LineIndex:
    """The index of a file's lines of either format, read without checking them."""
    idx = LineIndex()
    for _, offset, line in scan(lines):
        idx.add(offset, len(line), *_entry(line))
    return idx


def _entry(line: bytes) -> tuple[str | None, str | None, str | None]:
    """(custom_id, endpoint, model) of a line as `LineIndex.add` takes them; all None for a blank line."""
    if not line.strip():
        return None, None, None
    url, model, cid = peek(line)
    return cid, url, model
