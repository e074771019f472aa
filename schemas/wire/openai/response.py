"""OpenAI's batch output: one line per request, in the format vLLM's `BatchRequestOutput`
describes.  A request that ran gets `response.status_code` 200 and a `chat.completion`,
`text_completion`, Responses `response` or embedding `list` body with `usage` (and its
log-probabilities in that endpoint's `logprobs` shape when it asked); one that failed gets its
status code and `error: {code, message}`; one that never ran (`unanswered_line`) an error and
no response.  Line ids are derived from the job and the custom_id, so exporting twice writes the same file."""

from __future__ import annotations

import hashlib
import json
from typing import Any, Iterable, Iterator

from tokenmill.schemas import records as R
from tokenmill.schemas.wire.openai.request import COMPLETIONS, EMBEDDINGS, RESPONSES

STATUS_BY_REASON = {R.ENGINE_ERROR: 500, R.ENGINE_TIMEOUT: 500}


def _ids(job_id: str, custom_id: str) -> tuple[str, str]:
    """Stable ids, so exporting the same job twice writes the same file."""
    h = hashlib.sha256(f"{job_id}\0{custom_id}".encode()).hexdigest()[:24]
    return f"batch_req_{h}", f"tokenmill-{h}"


def _token(token: str, logprob: float) -> dict[str, Any]:
    return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8"))}


def chat_logprobs(tokens: list[dict[str, Any]] | None) -> dict[str, Any] | None:
    """A row's log-probabilities (records.LOGPROBS_TYPE) as a chat choice's `logprobs`."""
    if tokens is None:
        return None
    return {"content": [{**_token(t["token"], t["logprob"]),
                         "top_logprobs": [_token(a["token"], a["logprob"]) for a in t.get("top_logprobs") or ()]}
                        for t in tokens],
            "refusal": None}


def completion_logprobs(tokens: list[dict[str, Any]] | None) -> dict[str, Any] | None:
    """A row's log-probabilities as a legacy completion choice's `logprobs`: parallel lists,
    the alternatives as {token: logprob}, and each token's character offset in the text."""
    if tokens is None:
        return None
    offsets, at = [], 0
    for t in tokens:
        offsets.append(at)
        at += len(t["token"])
    return {"tokens": [t["token"] for t in tokens],
            "token_logprobs": [t["logprob"] for t in tokens],
            "top_logprobs": [{a["token"]: a["logprob"] for a in t.get("top_logprobs") or ()} for t in tokens],
            "text_offset": offsets}


def response_body(rows: dict[str, Any] | list[dict[str, Any]], url: str, model: str | None) -> dict[str, Any]:
    """A `chat.completion` or `text_completion` body with `usage` for one request: its output
    row, or its n samples' rows (one choice each, `index` the sample; the prompt counted
    once, the completions summed, as OpenAI counts `n`), with log-probabilities in the
    endpoint's shape where a row has them (a structured row's text is its JSON or
    constrained text, as OpenAI returns it)."""
    samples = [rows] if isinstance(rows, dict) else rows
    row = samples[0]
    if url == EMBEDDINGS or row.get("embedding") is not None:
        return embedding_body(row, model)
    if url == RESPONSES:
        return responses_body(row, model)
    _, rid = _ids(row["job_id"], row["id"])
    prompt = int(row.get("prompt_tokens") or 0)
    completion = sum(int(r.get("output_tokens") or 0) for r in samples)
    usage: dict[str, Any] = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
    if row.get("cached_tokens") is not None:
        usage["prompt_tokens_details"] = {"cached_tokens": int(row["cached_tokens"])}
    if row.get("token_count_source") not in (None, "engine"):  # estimates say so (records.TOKEN_COUNT_SOURCES)
        usage["token_count_source"] = row["token_count_source"]
    created = int(max(r.get("finished_at") or 0 for r in samples))
    common = {"created": created, "model": model or row.get("model") or "", "usage": usage}
    if url == COMPLETIONS:
        choices = [{"index": r.get("sample") or 0, "text": r.get("text") or "",
                    "logprobs": completion_logprobs(r.get("logprobs")), "finish_reason": r.get("finish_reason") or "stop"}
                   for r in samples]
        return {"id": f"cmpl-{rid}", "object": "text_completion", "choices": choices, **common}
    choices = [{
        "index": r.get("sample") or 0,
        "message": {"role": "assistant", "content": r.get("text") or ""},
        "logprobs": chat_logprobs(r.get("logprobs")),
        "finish_reason": r.get("finish_reason") or "stop",
    } for r in samples]
    return {"id": f"chatcmpl-{rid}", "object": "chat.completion", "choices": choices, **common}


def responses_body(row: dict[str, Any], model: str | None) -> dict[str, Any]:
    """A Responses object (`object: response`) for one answered `/v1/responses` line: one
    assistant `message` item holding one `output_text` part; `status` `incomplete` (reason
    `max_output_tokens`) when the answer stopped at the token limit; `usage` in the Responses
    API's names.  The request's own settings (temperature, instructions, ...) are not echoed:
    the output row does not hold them, and the SDK's type leaves them optional."""
    _, rid = _ids(row["job_id"], row["id"])
    prompt, output = int(row.get("prompt_tokens") or 0), int(row.get("output_tokens") or 0)
    usage: dict[str, Any] = {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": int(row.get("cached_tokens") or 0), "cache_write_tokens": 0},
        "output_tokens": output, "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": prompt + output}
    if row.get("token_count_source") not in (None, "engine"):  # estimates say so, as a chat body's usage does
        usage["token_count_source"] = row["token_count_source"]
    cut = row.get("finish_reason") == "length"
    status = "incomplete" if cut else "completed"
    created = int(row.get("finished_at") or 0)
    text: dict[str, Any] = {"type": "output_text", "text": row.get("text") or "", "annotations": [], "logprobs": []}
    return {"id": f"resp_{rid}", "object": "response", "created_at": created, "status": status,
            "completed_at": None if cut else created, "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if cut else None,
            "model": model or row.get("model") or "",
            "output": [{"type": "message", "id": f"msg_{rid}", "status": status, "role": "assistant",
                        "content": [text]}],
            "parallel_tool_calls": False, "tool_choice": "none", "tools": [], "usage": usage}


def embedding_body(row: dict[str, Any], model: str | None) -> dict[str, Any]:
    """A `list` of one `embedding` (float values) with `usage`, for an embedding row."""
    prompt = int(row.get("prompt_tokens") or 0)
    vector = R.embedding_values(row["embedding"]) if row.get("embedding") is not None else []
    return {"object": "list", "model": model or row.get("model") or "",
            "data": [{"object": "embedding", "index": 0, "embedding": vector}],
            "usage": {"prompt_tokens": prompt, "total_tokens": prompt}}


def by_request(chunks: Iterable[list[dict[str, Any]]]) -> Iterator[list[list[dict[str, Any]]]]:
    """Chunks of output rows in input order → chunks of requests, each its rows (a row's
    samples together, also where a chunk ends between them)."""
    held: list[dict[str, Any]] = []
    for rows in chunks:
        out: list[list[dict[str, Any]]] = []
        for r in rows:
            if held and (held[0]["input_file"], held[0]["input_row"]) != (r["input_file"], r["input_row"]):
                out.append(held)
                held = []
            held.append(r)
        if out:
            yield out
    if held:
        yield [held]


def output_line(samples: list[dict[str, Any]], url: str, model: str | None) -> str:
    """The output line of one request that ran: its rows (its samples) answered at `url` under
    the model name its request gave."""
    r = samples[0]
    line_id, request_id = _ids(r["job_id"], r["id"])
    return json.dumps({
        "id": line_id,
        "custom_id": r["id"],
        "response": {"status_code": 200, "request_id": request_id, "body": response_body(samples, url, model)},
        "error": None,
    }, ensure_ascii=False)


def error_line(r: dict[str, Any]) -> str:
    """The error line of one dead-letter row (`error: {code, message}`); a row without a
    custom_id is named by its line (`line-<ref>`)."""
    ref = R.format_ref(r["input_file"], r["input_row"])
    cid = r.get("id") or f"line-{ref}"
    line_id, request_id = _ids(r["job_id"], f"{cid}\0{ref}")
    return json.dumps({
        "id": line_id,
        "custom_id": cid,
        "response": {"status_code": STATUS_BY_REASON.get(r["reason"], 400), "request_id": request_id, "body": None},
        "error": {"code": r["reason"], "message": r["message"]},
    }, ensure_ascii=False)


def unanswered_line(job_id: str, custom_id: str, code: str, message: str) -> str:
    """The error line of a request that never ran (OpenAI's `batch_cancelled`, `batch_expired`):
    no response, the error's code and message."""
    line_id, _ = _ids(job_id, custom_id)
    return json.dumps({"id": line_id, "custom_id": custom_id, "response": None,
                       "error": {"code": code, "message": message}}, ensure_ascii=False)
