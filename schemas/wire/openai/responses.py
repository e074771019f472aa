"""A `/v1/responses` batch line's body mapped onto the chat row every other generate line
becomes, so the pipeline, the result cache, resume, the estimate and the report serve it as
they serve chat (docs/RESPONSES.md)::

    {"custom_id": "r1", "method": "POST", "url": "/v1/responses",
     "body": {"model": "smollm2-135m", "instructions": "Be brief.", "input": "Hello",
              "max_output_tokens": 64}}

Served: `input` (a string, a user message; or a list of message items: `{"role", "content"}`
with `type` absent or `message`, the content a string or a list of `input_text` parts, an
assistant's `output_text` parts, `input_image` parts given by `image_url`), `instructions` (a
system message first), `max_output_tokens` (the row's `max_tokens`), `temperature`, `top_p`,
`text.format` (`text`; `json_object`; `json_schema` with `name`, `schema`, `strict`: the row's
`response_format`).  Fields that do not change the answer (`metadata`, `user`, `store`, ...) are
read and left.  What the engine cannot do (`tools`, `previous_response_id`, `reasoning`,
reasoning or tool items in `input`, `stream`, `background`, any field not named here) raises
`Unsupported`: that line fails with the code `unsupported_parameter` when the batch runs, and
the batch goes on.  A body that is not a request at all (an `input` that is neither a string
nor a list, a message without a role) raises `LineError`, as a bad chat line does.

The answer's body, a Responses object, is built by response.py (`responses_body`)."""

from __future__ import annotations

import json
from typing import Any

from tokenmill.schemas.errors import first_line
from tokenmill.schemas.wire.lines import LineError, Unsupported
from tokenmill.schemas.wire.lines import short as _short

#: Body fields read into the row (each below), by their Responses name → the row's key.
SAMPLING = {"max_output_tokens": "max_tokens", "temperature": "temperature", "top_p": "top_p"}
#: Body fields that leave the answer as it is: read and left (OpenAI stores, bills or routes by them).
IGNORED = ("model", "metadata", "user", "store", "safety_identifier", "prompt_cache_key", "prompt_cache_retention",
           "service_tier", "parallel_tool_calls")
#: Fields served only at their default (absent, null, false, empty or the value named), each with
#: why another value is refused.
DEFAULT_ONLY: dict[str, tuple[tuple[Any, ...], str]] = {
    "tools": ((), "tools (function calling, built-in tools) are not served"),
    "tool_choice": (("none", "auto"), "tools are not served"),
    "max_tool_calls": ((), "tools are not served"),
    "previous_response_id": ((), "responses are not stored: send the whole conversation in `input`"),
    "conversation": ((), "conversations are not stored: send the whole conversation in `input`"),
    "prompt": ((), "stored prompt templates are not served"),
    "reasoning": ((), "the served models have no reasoning settings"),
    "stream": ((), "the answers are written to the output file"),
    "stream_options": ((), "the answers are written to the output file"),
    "background": ((), "a batch line already runs in the background"),
    "include": ((), "no extra output items are served"),
    "truncation": (("disabled",), "an input longer than the model's context is refused, not cut"),
    "top_logprobs": ((0,), "log-probabilities are served on /v1/chat/completions lines"),
}
#: The roles a message item may have (OpenAI's `EasyInputMessage`).
ROLES = ("user", "assistant", "system", "developer")
#: `text.format` types served, and the `response_format` each becomes.
FORMATS = ("text", "json_object", "json_schema")


def _is_default(value: Any, defaults: tuple[Any, ...]) -> bool:
    return value is None or value is False or value == [] or value == {} or value in defaults


def responses_fields(body: dict[str, Any]) -> dict[str, Any]:
    """A Responses body → the row's `messages` and sampling keys (`prompt` None).  Raises
    LineError for a body that is not a Responses request, Unsupported (a LineError) for one
    asking for what is not served, after the whole body was checked, so a malformed line is
    never let through as merely unsupported."""
    refused: list[Unsupported] = []
    for key, value in body.items():
        if key in SAMPLING or key in IGNORED or key in ("input", "instructions", "text"):
            continue
        if key in DEFAULT_ONLY:
            defaults, why = DEFAULT_ONLY[key]
            if not _is_default(value, defaults):
                refused.append(Unsupported(f"body.{key}={_short(value, 60)} is not served: {why}", param=f"body.{key}"))
        else:
            refused.append(Unsupported(f"body.{key} is not a /v1/responses field tokenmill serves", param=f"body.{key}"))
    messages = _messages(body.get("input"), refused)
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise LineError(f"body.instructions must be a string, got {_short(instructions)}",
                            param="body.instructions")
        messages.insert(0, {"role": "system", "content": instructions})
    out: dict[str, Any] = {"messages": messages, "prompt": None}
    for name, key in SAMPLING.items():
        if body.get(name) is not None:
            out[key] = body[name]
    fmt = _text_format(body.get("text"), refused)
    if fmt is not None:
        out["response_format"] = fmt
    if refused:
        raise refused[0]
    return out


def _messages(value: Any, refused: list[Unsupported]) -> list[dict[str, Any]]:
    """`input` as chat messages: a string is one user message; a list's message items each a
    message (a string content, or its parts joined; with an image, the parts in chat's shape)."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise LineError(f"body.input must be a string or a non-empty list of message items, got {_short(value)}",
                        param="body.input")
    messages = []
    for i, item in enumerate(value):
        where = f"body.input[{i}]"
        if not isinstance(item, dict):
            raise LineError(f"{where} must be an object, got {_short(item)}", param=where)
        kind = item.get("type", "message")
        if not isinstance(kind, str):
            raise LineError(f"{where}.type must be a string, got {_short(kind)}", param=f"{where}.type")
        if kind != "message":
            why = "reasoning items are not served" if kind == "reasoning" else "only message items are served"
            refused.append(Unsupported(f"{where} is a {_short(kind, 40)} item: {why}", param=where))
            continue
        role = item.get("role")
        if role not in ROLES:
            raise LineError(f"{where}.role must be one of {list(ROLES)}, got {_short(role)}", param=f"{where}.role")
        messages.append({"role": role, "content": _content(item.get("content"), f"{where}.content", refused)})
    return messages


def _content(content: Any, where: str, refused: list[Unsupported]) -> Any:
    """A message item's content as chat's: a string, its text parts joined, or (with an image)
    chat's parts, `input_image` as `image_url` (transforms/images.py reads it)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise LineError(f"{where} must be a string or a list of parts, got {_short(content)}", param=where)
    parts: list[dict[str, Any]] = []
    for j, part in enumerate(content):
        at = f"{where}[{j}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if not isinstance(part, dict) or not isinstance(kind, str):
            raise LineError(f"{at} must be an object with a type, got {_short(part)}", param=at)
        if kind in ("input_text", "output_text"):
            if not isinstance(part.get("text"), str):
                raise LineError(f"{at}.text must be a string, got {_short(part.get('text'))}", param=f"{at}.text")
            parts.append({"type": "text", "text": part["text"]})
        elif kind == "input_image" and isinstance(part.get("image_url"), str):
            parts.append({"type": "image_url", "image_url": {"url": part["image_url"]}})
        elif kind == "input_image":
            refused.append(Unsupported(f"{at}: an input_image is served by its image_url (a data: URI, a path or an "
                                       "s3:// URL), not by file_id", param=at))
        else:
            refused.append(Unsupported(f"{at}: {_short(kind, 40)} parts are not served (input_text, output_text and "
                                       "input_image are)", param=at))
    if any(p["type"] == "image_url" for p in parts):
        return parts
    return "".join(p["text"] for p in parts)


def _text_format(text: Any, refused: list[Unsupported]) -> dict[str, Any] | None:
    """`text.format` as the row's `response_format` (None: plain text)."""
    if text is None:
        return None
    if not isinstance(text, dict):
        raise LineError(f"body.text must be an object, got {_short(text)}", param="body.text")
    for key, value in text.items():
        if key == "verbosity" and value not in (None, "medium"):
            refused.append(Unsupported(f"body.text.verbosity={_short(value)} is not served", param="body.text.verbosity"))
        elif key not in ("format", "verbosity"):
            refused.append(Unsupported(f"body.text.{key} is not served", param=f"body.text.{key}"))
    fmt = text.get("format")
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind not in FORMATS:
        raise LineError(f"body.text.format must be an object whose type is one of {list(FORMATS)}, got {_short(fmt)}",
                        param="body.text.format")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    schema = fmt.get("schema")
    if isinstance(schema, str):  # as chat's structured_outputs.json takes it
        try:
            schema = json.loads(schema)
        except ValueError as err:
            raise LineError(f"body.text.format.schema is not valid JSON: {first_line(err)}",
                            param="body.text.format.schema") from None
    if not isinstance(schema, dict):
        raise LineError(f"body.text.format.schema must be a JSON schema object, got {_short(schema)}",
                        param="body.text.format.schema")
    name = fmt.get("name", "response")
    if not isinstance(name, str) or not name:
        raise LineError(f"body.text.format.name must be a non-empty string, got {_short(name)}",
                        param="body.text.format.name")
    spec: dict[str, Any] = {"name": name, "schema": schema}
    if fmt.get("strict") is not None:
        spec["strict"] = fmt["strict"]
    if isinstance(fmt.get("description"), str):
        spec["description"] = fmt["description"]
    return {"type": "json_schema", "json_schema": spec}
