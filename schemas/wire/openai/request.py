"""OpenAI's batch input: one request per line (blank lines are skipped, as OpenAI and vLLM do)::

    {"custom_id": "q1", "method": "POST", "url": "/v1/chat/completions",
     "body": {"model": "smollm2-135m", "messages": [...], "max_tokens": 64}}

`decode` is the one place a line's JSON is read; `request_line` checks its envelope into a
typed `RequestLine`; `parse_request` gives the fields tokenmill serves of it (the row keys
transforms/openai_batch.py reads), raising `LineError` saying what is wrong.  What is served
and refused, field by field, is described in transforms/openai_batch.py; a `/v1/responses`
body is mapped onto the same chat row by responses.py."""


from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Callable, Iterable

from tokenmill.schemas.config import TASKS
from tokenmill.schemas.errors import first_line
from tokenmill.schemas.sampling import (
    STRUCTURED_KEYS,
    RowSampling,
    RowSamplingError,
    base_type,
    structured_kind,
    validate_row_sampling,
)
from tokenmill.schemas.wire.lines import LineError, LineIndex, scan
from tokenmill.schemas.wire.lines import short as _short
from tokenmill.schemas.wire.openai.responses import SAMPLING as RESPONSES_SAMPLING
from tokenmill.schemas.wire.openai.responses import responses_fields

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
EMBEDDINGS = "/v1/embeddings"
RESPONSES = "/v1/responses"
#: Appended to only: an endpoint's place here is its code in a shard's line codes (transforms/openai_batch.py).
ENDPOINTS = (CHAT, COMPLETIONS, EMBEDDINGS, RESPONSES)
#: The endpoints each engine task serves: a batch file's lines are answered one pass per task they name.
TASK_ENDPOINTS = {"generate": (CHAT, COMPLETIONS, RESPONSES), "embed": (EMBEDDINGS,)}
assert tuple(TASK_ENDPOINTS) == TASKS  # every task has its endpoints, in the order the passes run
#: Body fields that would change what a response means and that tokenmill does not serve:
#: when the value is refused, and what the refusal adds.
UNSUPPORTED: dict[str, tuple[Callable[[Any], bool], str]] = {
    "stream": (lambda v: bool(v), "the answers are written to the output file"),
    "tools": (lambda v: bool(v), "tools (function calling) are not served"),
}
#: The sampling keys each endpoint spells its own way (read by `_logprob_keys`, not by name).
LOGPROB_KEYS = ("logprobs", "top_logprobs")
#: The most alternatives per token the legacy completions endpoint's `logprobs` asks for (OpenAI's limit).
MAX_COMPLETION_LOGPROBS = 5
#: vLLM's `structured_outputs` keys named as a row's structured-output key (`json` and
#: `json_object` become a `response_format`, `_structured_outputs`).
SO_ROW_KEYS = tuple(k for k in STRUCTURED_KEYS if k != "response_format")
#: Body names of a sampling key where the API has more than one (the first present wins);
#: every other RowSampling key is read under its own name.
BODY_NAMES = {"max_tokens": ("max_completion_tokens", "max_tokens")}
#: OpenAI's bounds where they are narrower than RowSampling's (which holds the rest: `n` 1-64,
#: `top_p` in (0, 1], `max_tokens` > 0, `top_logprobs` 0-20): (least, most) of a body field.
OPENAI_BOUNDS: dict[str, tuple[float, float]] = {"temperature": (0.0, 2.0), "seed": (-2**63, 2**63 - 1)}
#: The numeric sampling keys, checked when a file is validated (`check_sampling`).
NUMERIC_KEYS = tuple(k for k, f in RowSampling.model_fields.items() if base_type(f.annotation) in (int, float))


@dataclass(frozen=True)
class RequestLine:
    """One request line's envelope: who it is (`custom_id`), where it goes (`method`, `url`),
    the model its body names (None when it names none) and the body itself."""

    custom_id: str
    method: str
    url: str
    model: Any
    body: dict[str, Any]


def decode(line: str | bytes) -> Any:
    """A line's JSON value; LineError (code `invalid_json_line`) when it is not JSON."""
    try:
        return json.loads(line)
    except (ValueError, UnicodeDecodeError) as err:
        raise LineError(f"line is not valid JSON: {first_line(err)}", code="invalid_json_line",
                        detail=str(err)) from None


def request_line(obj: Any) -> RequestLine:
    """A decoded line's envelope checked: a JSON object with a custom_id, POST, a served
    endpoint and an object body.  Raises LineError naming the first fault."""
    if not isinstance(obj, dict):
        raise LineError(f"line must be a JSON object, got {type(obj).__name__}", code="invalid_json_line")
    cid = obj.get("custom_id")
    if not isinstance(cid, str) or not cid:
        raise LineError(f"custom_id must be a non-empty string, got {_short(cid)}", param="custom_id")
    method = obj.get("method", "POST")
    if method != "POST":
        raise LineError(f"method must be POST, got {_short(method)}", code="invalid_method", param="method")
    url = obj.get("url")
    if url not in ENDPOINTS:
        raise LineError(f"url must be one of {list(ENDPOINTS)}, got {_short(url)}", code="invalid_url", param="url")
    body = obj.get("body")
    if not isinstance(body, dict):
        raise LineError(f"body must be an object, got {_short(body)}", param="body")
    return RequestLine(cid, method, url, body.get("model"), body)


def parse_request(line: str | bytes) -> dict[str, Any]:
    """One input line → the request fields tokenmill serves: `custom_id`, `url`, `model`,
    `messages` or `prompt`, and the sampling keys.  Raises LineError saying what is wrong."""
    return request_fields(decode(line))


def request_fields(obj: Any) -> dict[str, Any]:
    """`parse_request` of a line already decoded."""
    req = request_line(obj)
    body, url = req.body, req.url
    if url == RESPONSES:  # its own body, mapped onto a chat row (responses.py)
        return {"custom_id": req.custom_id, "url": url, "model": req.model, **responses_fields(body)}
    for key, (bad, why) in UNSUPPORTED.items():
        if key in body and bad(body[key]):
            raise LineError(f"body.{key}={_short(body[key])} is not supported in batch jobs: {why}")
    out: dict[str, Any] = {"custom_id": req.custom_id, "url": url, "model": req.model}
    if url == EMBEDDINGS:
        return {**out, **_embedding_input(body)}
    if url == CHAT:
        msgs = body.get("messages")
        if not isinstance(msgs, list):
            raise LineError(f"body.messages must be a list for {CHAT}, got {_short(msgs)}")
        out["messages"] = [
            {**m, "content": _content_text(m.get("content"), f"body.messages[{i}]")} if isinstance(m, dict) else m
            for i, m in enumerate(msgs)
        ]
        out["prompt"] = None
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if not isinstance(prompt, str):
            raise LineError(f"body.prompt must be a string for {COMPLETIONS}, got {_short(prompt)}")
        out["prompt"] = prompt
        out["messages"] = None
    for key in RowSampling.model_fields:
        if key in LOGPROB_KEYS:
            continue
        value = next((body[k] for k in BODY_NAMES.get(key, (key,)) if body.get(k) is not None), None)
        if value is not None:
            out[key] = value
    out.update(_logprob_keys(body, url))
    so = _structured_outputs(body.get("structured_outputs"))
    if so:
        named = structured_kind(out)
        if named is not None:
            raise LineError(f"body.structured_outputs and body.{'response_format' if named.startswith('json') else named} "
                            f"both set a structured output; set one")
        out.update(so)
    return out


def check_sampling(fields: dict[str, Any]) -> None:
    """The numeric sampling values of a request's fields (`request_fields`) in range, as OpenAI
    refuses them before a batch runs: RowSampling's bounds, and OpenAI's narrower ones
    (`OPENAI_BOUNDS`).  Raises LineError naming the body field (as the line's endpoint names
    it) and the value."""
    names = {row: body for body, row in RESPONSES_SAMPLING.items()} if fields.get("url") == RESPONSES else {}
    try:
        validate_row_sampling({k: fields[k] for k in NUMERIC_KEYS if k in fields})
    except RowSamplingError as err:
        name = names.get(err.key, err.key)
        raise LineError(f"body.{name}: {err}", code="invalid_value", param=f"body.{name}") from None
    for key, (least, most) in OPENAI_BOUNDS.items():
        value = fields.get(key)
        if value is not None and not least <= value <= most:
            raise LineError(f"body.{key}: {key} must be in [{least:g}, {most:g}], got {_short(value)}",
                            code="invalid_value", param=f"body.{key}")


def peek(line: bytes) -> tuple[str, str | None, str | None]:
    """(url, body model, custom_id) of a line that may not be a valid request: `?` for a url it
    does not give, None for a model or custom_id it does not give as a string."""
    try:
        obj = decode(line)
        body = obj.get("body") if isinstance(obj, dict) else None
        model = body.get("model") if isinstance(body, dict) else None
        cid = obj.get("custom_id")
        return (str(obj.get("url", "?")), model if isinstance(model, str) else None,
                cid if isinstance(cid, str) and cid else None)
    except (LineError, AttributeError):
        return "?", None, None


def index_lines(lines: Iterable[bytes]) -> LineIndex:
    """The index of a file's lines, read without checking them (a file no validation indexed:
    `tokenmill run` of a batch file)."""
    idx = LineIndex()
    for _, offset, line in scan(lines):
        if line.strip():
            url, model, cid = peek(line)
            idx.add(offset, len(line), cid, url, model)
        else:
            idx.add(offset, len(line))
    return idx


def _content_text(content: Any, where: str) -> Any:
    """OpenAI lets content be a list of parts; text parts are joined, a list with `image_url`
    parts is kept whole (Validate reads its images: transforms/images.py), others refused."""
    if isinstance(content, list) and any(isinstance(p, dict) and p.get("type") == "image_url" for p in content):
        return content
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise LineError(f"{where}.content[{j}]: only text parts are supported, got {_short(part)}")
            texts.append(part["text"])
        return "".join(texts)
    return content


def _embedding_input(body: dict[str, Any]) -> dict[str, Any]:
    """An /v1/embeddings body's one text input as the row's prompt (float vectors, the model's
    own dimension: other encodings, `dimensions` and several inputs per line are refused)."""
    text = body.get("input")
    if isinstance(text, list) and len(text) == 1 and isinstance(text[0], str):
        text = text[0]
    if not isinstance(text, str):
        raise LineError(f"body.input must be one string for {EMBEDDINGS} (a line per input), got {_short(text)}")
    if body.get("encoding_format") not in (None, "float"):
        raise LineError(f"body.encoding_format={_short(body['encoding_format'])} is not served: float vectors only")
    if body.get("dimensions") is not None:
        raise LineError("body.dimensions is not served: vectors have the model's own dimension")
    return {"prompt": text, "messages": None}


def _logprob_keys(body: dict[str, Any], url: str) -> dict[str, Any]:
    """The row's `logprobs` and `top_logprobs` from a body, as its endpoint spells them
    (OpenAI's rules): chat `logprobs: true|false` and `top_logprobs: k`, which needs
    `logprobs: true` when k > 0; completions `logprobs: k`, an integer 0-5."""
    lp, top = body.get("logprobs"), body.get("top_logprobs")
    if url == CHAT:
        if lp is not None and not isinstance(lp, bool):
            raise LineError(f"body.logprobs must be true, false or null for {CHAT}, got {_short(lp)} "
                            f"(body.top_logprobs asks for the alternatives per token)")
        if top is not None and top != 0 and lp is not True:
            raise LineError(f"body.top_logprobs={_short(top)} needs body.logprobs: true")
        return {k: v for k, v in (("logprobs", lp), ("top_logprobs", top)) if v is not None}
    if top is not None:
        raise LineError(f"body.top_logprobs is not a {COMPLETIONS} field: there body.logprobs, an integer "
                        f"0-{MAX_COMPLETION_LOGPROBS}, asks for the alternatives per token")
    if lp is None:
        return {}
    if isinstance(lp, bool) or not isinstance(lp, int) or not 0 <= lp <= MAX_COMPLETION_LOGPROBS:
        raise LineError(f"body.logprobs must be an integer 0-{MAX_COMPLETION_LOGPROBS} or null for {COMPLETIONS} "
                        f"(the alternatives per token), got {_short(lp)}")
    return {"logprobs": True, "top_logprobs": lp}


def _structured_outputs(so: Any) -> dict[str, Any]:
    """vLLM's `structured_outputs` body object → the row's structured-output key (at most one)."""
    if so is None:
        return {}
    if not isinstance(so, dict):
        raise LineError(f"body.structured_outputs must be an object, got {_short(so)}")
    out: dict[str, Any] = {}
    for key, value in so.items():
        if value is None or (key == "json_object" and value is False):
            continue
        if key in SO_ROW_KEYS:
            out[key] = value
        elif key == "json":
            schema = value
            if isinstance(value, str):
                try:
                    schema = json.loads(value)
                except ValueError as err:
                    raise LineError(f"body.structured_outputs.json is not valid JSON: {first_line(err)}") from None
            out[key] = {"type": "json_schema", "json_schema": {"name": "schema", "schema": schema}}
        elif key == "json_object":
            out[key] = {"type": "json_object"}
        else:
            raise LineError(f"body.structured_outputs.{key} is not supported in batch jobs "
                            f"(served: {', '.join(('json', 'json_object', *SO_ROW_KEYS))})")
    if len(out) > 1:
        raise LineError(f"body.structured_outputs sets {' and '.join(out)}; set one")
    return {("response_format" if k.startswith("json") else k): v for k, v in out.items()}


