"""Anthropic's Message Batches input: one request per line, as `POST /v1/messages/batches` takes
them in its `requests` list (and as `tokenmill run` reads a JSONL file of them)::

    {"custom_id": "q1", "params": {"model": "smollm2-135m", "max_tokens": 64,
                                   "messages": [{"role": "user", "content": "Hello"}]}}

Two levels of check, as Anthropic's API has them:

- `check_request`: what a batch needs before it may be created (the custom_id, `params` an
  object naming a `model`, `max_tokens` and `messages`).  A fault here refuses the whole
  create with 400 `invalid_request_error`, and nothing runs.
- `request_fields`: the rest of a request's params, read into the same row the OpenAI chat
  path makes (`system` → a system message; `messages` with text and image blocks, an image as
  an OpenAI `image_url` part, which Validate reads: transforms/images.py; `max_tokens`,
  `temperature`, `top_p`, `top_k`, `stop_sequences` → `stop`).  What the engine cannot do
  (`tools`, `tool_choice`, `thinking`, `stream`, a tool or document block, a field not served)
  raises LineError; the pipeline makes it that line's dead letter, so its result is `errored`
  with an `invalid_request_error` and the batch goes on."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from tokenmill.schemas.wire.lines import LineError
from tokenmill.schemas.wire.lines import short as _short

MESSAGES = "/v1/messages"
#: Anthropic's rule for a request's custom_id.
CUSTOM_ID = re.compile(r"[a-zA-Z0-9_-]{1,64}")
#: The most requests and bytes one batch may hold (Anthropic's limits).
MAX_REQUESTS = 100_000
MAX_BYTES = 256 * 1024 * 1024
#: A create refused: the code of its LineError (Anthropic's error type).
REFUSED = "invalid_request_error"
#: The Messages sampling fields served → the row key each becomes (schemas/sampling.RowSampling).
SAMPLING = {"max_tokens": "max_tokens", "temperature": "temperature", "top_p": "top_p", "top_k": "top_k",
            "stop_sequences": "stop"}
#: The other Messages fields read: the model, the prompt, and what changes no answer.
READ = ("model", "messages", "system", "metadata", "service_tier", "stream")
#: Fields the engine cannot serve, when set: what the line's error says.
UNSERVED = {"tools": "tools (tool use) are not served", "tool_choice": "tool_choice needs tools, which are not served",
            "thinking": "extended thinking is not served", "mcp_servers": "MCP servers are not served",
            "container": "containers are not served", "context_management": "context management is not served"}
ROLES = ("user", "assistant")
#: Anthropic's temperature range (narrower than RowSampling's).
MAX_TEMPERATURE = 1.0


@dataclass(frozen=True)
class MessageRequest:
    """One request's envelope: its custom_id, the model its params name and the params."""

    custom_id: str
    model: str
    params: dict[str, Any]


def is_message_line(obj: Any) -> bool:
    """Whether a decoded line is an Anthropic batch request (`params`, and no OpenAI `url`/`body`)."""
    return isinstance(obj, dict) and "params" in obj and "url" not in obj and "body" not in obj


def _at(where: str, key: str) -> str:
    return f"{where}.{key}" if where else key


def _refuse(where: str, message: str) -> LineError:
    return LineError(f"{where}: {message}", code=REFUSED, param=where)


def check_request(obj: Any, where: str = "") -> MessageRequest:
    """What a batch needs of a request before it is created: a custom_id as Anthropic allows it,
    `params` an object with a string `model`, an integer `max_tokens` >= 1 and a non-empty
    `messages` list.  Raises LineError (code `invalid_request_error`, `param` the field's path
    under `where`, e.g. `requests.3.params.max_tokens`)."""
    if not isinstance(obj, dict):
        raise _refuse(where or "request", f"must be an object, got {type(obj).__name__}")
    cid = obj.get("custom_id")
    if not isinstance(cid, str) or not CUSTOM_ID.fullmatch(cid):
        raise _refuse(_at(where, "custom_id"), f"must be 1-64 characters of letters, digits, '_' or '-', got "
                                               f"{_short(cid)}")
    extra = sorted(set(obj) - {"custom_id", "params"})
    if extra:
        raise _refuse(_at(where, extra[0]), "Extra inputs are not permitted")
    params = obj.get("params")
    at = _at(where, "params")
    if not isinstance(params, dict):
        raise _refuse(at, f"Field required (an object: a Messages request), got {_short(params)}")
    for key in ("model", "max_tokens", "messages"):
        if params.get(key) is None:
            raise _refuse(f"{at}.{key}", "Field required")
    model, max_tokens, messages = params["model"], params["max_tokens"], params["messages"]
    if not isinstance(model, str) or not model:
        raise _refuse(f"{at}.model", f"must be a model name, got {_short(model)}")
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise _refuse(f"{at}.max_tokens", f"must be an integer >= 1, got {_short(max_tokens)}")
    if not isinstance(messages, list) or not messages:
        raise _refuse(f"{at}.messages", f"must be a non-empty list of messages, got {_short(messages)}")
    return MessageRequest(cid, model, params)


def request_fields(obj: Any) -> dict[str, Any]:
    """A decoded request → the fields tokenmill serves (the keys transforms/openai_batch.py makes
    a row of): `custom_id`, `url` (`MESSAGES`), `model`, `messages`, `prompt` (None) and the
    sampling keys.  Raises LineError saying what is wrong or not served."""
    req = check_request(obj)
    p = req.params
    for key, value in p.items():
        if key in UNSERVED and _set(key, value):
            raise LineError(f"params.{key}: {UNSERVED[key]}", param=f"params.{key}")
        if key not in UNSERVED and key not in READ and key not in SAMPLING:
            raise LineError(f"params.{key}: not a Messages request field tokenmill serves", param=f"params.{key}")
    if p.get("stream"):
        raise LineError("params.stream: a batch's results are written to its results file, not streamed",
                        param="params.stream")
    messages: list[dict[str, Any]] = []
    if p.get("system") is not None:
        messages.append({"role": "system", "content": _text(p["system"], "params.system")})
    for i, m in enumerate(p["messages"]):
        where = f"params.messages.{i}"
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise LineError(f"{where}: must be an object with role 'user' or 'assistant', got {_short(m)}",
                            param=where)
        messages.append({"role": m["role"], "content": _content(m.get("content"), f"{where}.content")})
    out: dict[str, Any] = {"custom_id": req.custom_id, "url": MESSAGES, "model": req.model, "messages": messages,
                           "prompt": None}
    for key, row_key in SAMPLING.items():
        if p.get(key) is not None:
            out[row_key] = p[key]
    _check_sampling(out)
    return out


def _set(key: str, value: Any) -> bool:
    """Whether an unserved field asks for what it names (`thinking: {type: disabled}` and an
    empty `tools` list ask for nothing)."""
    if key == "thinking" and isinstance(value, dict) and value.get("type") == "disabled":
        return False
    return value is not None and value != [] and value != {}


def _text(value: Any, where: str) -> str:
    """`system`: a string, or a list of text blocks (joined)."""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(b, dict) and b.get("type") == "text" and isinstance(b.get("text"), str)
                                       for b in value):
        return "".join(b["text"] for b in value)
    raise LineError(f"{where}: must be a string or a list of text blocks, got {_short(value)}", param=where)


def _content(content: Any, where: str) -> str | list[dict[str, Any]]:
    """A message's content: a string, or blocks; text blocks alone are joined into one string, a
    list with images is kept as OpenAI parts (`text`, `image_url`) for Validate to read."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list) or not content:
        raise LineError(f"{where}: must be a string or a non-empty list of content blocks, got {_short(content)}",
                        param=where)
    parts: list[dict[str, Any]] = []
    for j, block in enumerate(content):
        at = f"{where}.{j}"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text" and isinstance(block.get("text"), str):
            parts.append({"type": "text", "text": block["text"]})
        elif kind == "image":
            parts.append({"type": "image_url", "image_url": {"url": _image_url(block.get("source"), f"{at}.source")}})
        else:
            raise LineError(f"{at}: only text and image blocks are served, got {_short(block)}", param=at)
    if all(p["type"] == "text" for p in parts):
        return "".join(p["text"] for p in parts)
    return parts


def _image_url(source: Any, where: str) -> str:
    """An image block's source as the URL an `image_url` part holds: base64 data as a data: URI,
    an http(s) URL as it is (Validate answers that images are not fetched from the web)."""
    kind = source.get("type") if isinstance(source, dict) else None
    if kind == "base64" and isinstance(source.get("media_type"), str) and isinstance(source.get("data"), str):
        return f"data:{source['media_type']};base64,{source['data']}"
    if kind == "url" and isinstance(source.get("url"), str) and source["url"][:8].lower().startswith(
            ("http://", "https://")):
        return source["url"]
    raise LineError(f"{where}: must be a base64 source (media_type, data) or an http(s) url source, got "
                    f"{_short(source)}", param=where)


def _check_sampling(out: dict[str, Any]) -> None:
    """The types Anthropic gives its sampling fields, and its temperature range (the other ranges
    are RowSampling's, checked by Validate)."""
    t = out.get("temperature")
    if t is not None and (isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 <= t <= MAX_TEMPERATURE):
        raise LineError(f"params.temperature: must be a number in [0, 1], got {_short(t)}", param="params.temperature")
    stop = out.get("stop")
    if stop is not None and (not isinstance(stop, list) or not all(isinstance(s, str) for s in stop)):
        raise LineError(f"params.stop_sequences: must be a list of strings, got {_short(stop)}",
                        param="params.stop_sequences")


def peek(obj: Any) -> tuple[str, str | None, str | None]:
    """(endpoint, model, custom_id) of a decoded request line that may not be valid: None for a
    model or custom_id it does not give as a string."""
    params = obj.get("params") if isinstance(obj, dict) else None
    model = params.get("model") if isinstance(params, dict) else None
    cid = obj.get("custom_id") if isinstance(obj, dict) else None
    return MESSAGES, model if isinstance(model, str) else None, cid if isinstance(cid, str) and cid else None
