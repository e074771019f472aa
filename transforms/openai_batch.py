"""The OpenAI Batch API file format: JSONL requests in, JSONL responses and errors out.

Input, one request per line (blank lines are skipped, as OpenAI and vLLM do)::

    {"custom_id": "q1", "method": "POST", "url": "/v1/chat/completions",
     "body": {"model": "smollm2-135m", "messages": [...], "max_tokens": 64}}

Each line becomes the same row dict the Parquet reader yields (`id` = custom_id,
`messages` or `prompt`, and the per-row sampling keys `max_tokens`,
`temperature`, `top_p`, `seed`, `stop`), so Validate, dedup and the rest of the
pipeline are unchanged.  A line that is not a usable request (bad JSON, no
custom_id, another method or endpoint, unsupported body fields) becomes a
`bad_request` dead letter carrying the line; it never fails the job.

Output (jobs/export.py calls `output_lines` and `dead_letter_lines` on rows
from the database): one line per input line, matched by `custom_id`, in the
OpenAI batch output format that vLLM's `BatchRequestOutput` model describes.
Successful requests go to `outputs.jsonl` with a `chat.completion` or
`text_completion` body and `usage`; failed ones to `errors.jsonl` with
`response.status_code` and `error: {code, message}`.  The endpoint and the
model name of each request are read back from the input file at export time
(`RequestIndex`), so the database needs no column for them.
"""

from __future__ import annotations

import hashlib
import json
from array import array
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator

import apache_beam as beam

from tokenmill.schemas import records as R
from tokenmill.transforms.read import InputError, InputPlan, expand_input
from tokenmill.schemas.errors import first_line

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
ENDPOINTS = (CHAT, COMPLETIONS)
JSONL_PATTERNS = ("*.jsonl", "*.jsonl.gz")
#: Lines per read shard: small enough to spread a big file over workers.
SHARD_LINES = 2048
#: Body fields that would change what a response means and that tokenmill does not serve.
UNSUPPORTED = {
    "n": lambda v: v not in (None, 1),
    "stream": lambda v: bool(v),
    "logprobs": lambda v: bool(v),
    "tools": lambda v: bool(v),
    "response_format": lambda v: v not in (None, {"type": "text"}),
}
ERROR_KEY = "_error"  # (reason, message) of a line the reader could not make a row of
RAW_KEY = "_raw"
STATUS_BY_REASON = {R.ENGINE_ERROR: 500, R.ENGINE_TIMEOUT: 500}


@dataclass(frozen=True)
class JsonlShard:
    """A run of lines of one file: `start_line` is 0-based, `offset` the byte offset
    of that line (None for compressed files, which are read from the start)."""

    file_index: int
    path: str
    start_line: int
    num_lines: int
    offset: int | None


@dataclass
class JsonlPlan(InputPlan):
    format: str = "openai-jsonl"
    endpoints: dict[str, int] = field(default_factory=dict)
    """Request lines per `url` seen at planning (malformed lines count under `?`)."""
    models: dict[str, int] = field(default_factory=dict)
    """Request lines per body `model`."""
    served_models: tuple[str, ...] = ()
    """Names the job's engine answers to (set by the job runner); a line whose body names
    another model is a `bad_request` dead letter, as the OpenAI API answers 404.  Empty: any."""


def _open(path: str):
    from apache_beam.io.filesystem import CompressionTypes as C
    from apache_beam.io.filesystems import FileSystems

    kind = C.GZIP if path.endswith(".gz") else C.UNCOMPRESSED
    return FileSystems.open(path, compression_type=kind)


def _scan(path: str) -> Iterator[tuple[int, int, bytes]]:
    """(line number, byte offset, line bytes) for every line of a file."""
    with _open(path) as fh:
        offset = 0
        for i, line in enumerate(fh):
            yield i, offset, line
            offset += len(line)


def plan_jsonl(path: str) -> JsonlPlan:
    """Plan an OpenAI batch input (a .jsonl file, a folder of them or a glob) at construction.

    Counts the request lines (blank lines are not requests), cuts them into shards
    and tallies the endpoints and models; fails with InputError when there is no
    such file or it is not text."""
    files = expand_input(path, JSONL_PATTERNS)
    shards: list[JsonlShard] = []
    endpoints: dict[str, int] = {}
    models: dict[str, int] = {}
    total = 0
    for fi, f in enumerate(files):
        compressed = f.endswith(".gz")
        start = start_off = None
        count = 0
        try:
            for i, off, line in _scan(f):
                if start is None:
                    start, start_off = i, off
                if line.strip():
                    total += 1
                    url, model = _peek(line)
                    endpoints[url] = endpoints.get(url, 0) + 1
                    if model is not None:
                        models[model] = models.get(model, 0) + 1
                count += 1
                if count >= SHARD_LINES and not compressed:
                    shards.append(JsonlShard(fi, f, start, count, start_off))
                    start, count = None, 0
        except (OSError, EOFError) as err:
            raise InputError(f"input file {f!r} cannot be read: {first_line(err)}") from None
        if count:
            shards.append(JsonlShard(fi, f, start, count, None if compressed else start_off))
    return JsonlPlan(files=files, shards=shards, columns=["custom_id", "method", "url", "body"], total_rows=total,
                     endpoints=endpoints, models=models)


def _peek(line: bytes) -> tuple[str, str | None]:
    try:
        obj = json.loads(line)
        body = obj.get("body") if isinstance(obj, dict) else None
        model = body.get("model") if isinstance(body, dict) else None
        return str(obj.get("url", "?")), (model if isinstance(model, str) else None)
    except (ValueError, AttributeError):
        return "?", None


# ---------------------------------------------------------------- lines → rows


class LineError(ValueError):
    pass


def _content_text(content: Any, where: str) -> Any:
    """OpenAI lets content be a list of parts; text parts are joined, others refused."""
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise LineError(f"{where}.content[{j}]: only text parts are supported, got {_short(part)}")
            texts.append(part["text"])
        return "".join(texts)
    return content


def parse_request(line: str | bytes) -> dict[str, Any]:
    """One input line → the request fields tokenmill serves: `custom_id`, `url`, `model`,
    `messages` or `prompt`, and the sampling keys.  Raises LineError saying what is wrong."""
    try:
        obj = json.loads(line)
    except (ValueError, UnicodeDecodeError) as err:
        raise LineError(f"line is not valid JSON: {first_line(err)}") from None
    if not isinstance(obj, dict):
        raise LineError(f"line must be a JSON object, got {type(obj).__name__}")
    cid = obj.get("custom_id")
    if not isinstance(cid, str) or not cid:
        raise LineError(f"custom_id must be a non-empty string, got {_short(cid)}")
    out: dict[str, Any] = {"custom_id": cid}
    if obj.get("method", "POST") != "POST":
        raise LineError(f"method must be POST, got {_short(obj.get('method'))}")
    url = obj.get("url")
    if url not in ENDPOINTS:
        raise LineError(f"url must be one of {list(ENDPOINTS)}, got {_short(url)}")
    body = obj.get("body")
    if not isinstance(body, dict):
        raise LineError(f"body must be an object, got {_short(body)}")
    for key, bad in UNSUPPORTED.items():
        if key in body and bad(body[key]):
            raise LineError(f"body.{key}={_short(body[key])} is not supported in batch jobs")
    out["url"] = url
    out["model"] = body.get("model")
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
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    if max_tokens is not None:
        out["max_tokens"] = max_tokens
    for key in ("temperature", "top_p", "seed", "stop"):
        if body.get(key) is not None:
            out[key] = body[key]
    return out


def _short(v: Any) -> str:
    s = repr(v)
    return s if len(s) <= 80 else s[:77] + "..."


def line_row(line: bytes, file_index: int, line_no: int, served_models: tuple[str, ...] = ()) -> dict[str, Any]:
    """The row dict Validate expects (the Parquet reader's shape) for one input line."""
    row: dict[str, Any] = {"_row": line_no, "_file_index": file_index}
    try:
        req = parse_request(line)
        if served_models and req["model"] is not None and req["model"] not in served_models:
            raise LineError(f"body.model {req['model']!r} is not served by this job (it serves {served_models[0]!r})")
    except LineError as err:
        row[ERROR_KEY] = (R.BAD_REQUEST, str(err))
        row[RAW_KEY] = line.decode("utf-8", errors="replace").rstrip("\n")[:2000]
        try:  # keep the custom_id when the line has one, so the error line can be matched
            cid = json.loads(line).get("custom_id")
            if isinstance(cid, str) and cid:
                row["id"] = cid
        except Exception:
            pass
        return row
    row["id"] = req.pop("custom_id")
    req.pop("url")
    req.pop("model")
    row.update(req)
    return row


def read_jsonl_shard(shard: JsonlShard, served_models: tuple[str, ...] = ()) -> Iterator[dict[str, Any]]:
    with _open(shard.path) as fh:
        first = shard.start_line
        if shard.offset is not None:
            fh.seek(shard.offset)
        else:
            for _ in range(first):
                fh.readline()
        for k in range(shard.num_lines):
            line = fh.readline()
            if not line:
                break
            if line.strip():
                yield line_row(line, shard.file_index, first + k, served_models)


class ReadJsonlShardFn(beam.DoFn):
    def __init__(self, served_models: tuple[str, ...] = ()):
        self._served = tuple(served_models)

    def process(self, shard: JsonlShard):
        yield from read_jsonl_shard(shard, self._served)


class ReadOpenAIBatch(beam.PTransform):
    """Planned JSONL shards → row dicts (malformed lines carry an `_error` for Validate)."""

    def __init__(self, plan: JsonlPlan):
        super().__init__()
        self._plan = plan

    def expand(self, pbegin):
        return (
            pbegin
            | "Shards" >> beam.Create(self._plan.shards, reshuffle=False)
            | "Spread" >> beam.Reshuffle()
            | "ReadLines" >> beam.ParDo(ReadJsonlShardFn(getattr(self._plan, "served_models", ())))
        )


# ---------------------------------------------------------------- rows → output lines


class RequestIndex:
    """Endpoint and model of every input line, by (file index, line), in a few bytes per line.

    Built from the job's input at export time; rows whose input cannot be read
    again fall back to a chat completion under the row's own model name."""

    def __init__(self) -> None:
        self._kind: dict[int, array] = {}  # file index → per line: 0 unknown, 1 chat, 2 completion
        self._model: dict[int, array] = {}  # file index → per line: index into _models
        self._models: list[str | None] = [None]

    @classmethod
    def from_input(cls, source: str | None) -> "RequestIndex":
        idx = cls()
        if not source:
            return idx
        try:
            files = expand_input(source, JSONL_PATTERNS)
        except InputError:
            return idx
        names: dict[str | None, int] = {None: 0}
        for fi, f in enumerate(files):
            kinds, models = array("B"), array("I")
            for _, _, line in _scan(f):
                url, model = _peek(line) if line.strip() else ("?", None)
                kinds.append(1 if url == CHAT else 2 if url == COMPLETIONS else 0)
                if model not in names:
                    names[model] = len(idx._models)
                    idx._models.append(model)
                models.append(names[model])
            idx._kind[fi], idx._model[fi] = kinds, models
        return idx

    def lookup(self, f: int, line: int) -> tuple[str, str | None]:
        try:
            kind = self._kind[f][line]
            return (COMPLETIONS if kind == 2 else CHAT), self._models[self._model[f][line]]
        except (KeyError, IndexError):
            return CHAT, None


def _ids(job_id: str, custom_id: str) -> tuple[str, str]:
    """Stable ids, so exporting the same job twice writes the same file."""
    h = hashlib.sha256(f"{job_id}\0{custom_id}".encode()).hexdigest()[:24]
    return f"batch_req_{h}", f"tokenmill-{h}"


def response_body(row: dict[str, Any], url: str, model: str | None) -> dict[str, Any]:
    """A `chat.completion` or `text_completion` body with `usage` for one output row."""
    _, rid = _ids(row["job_id"], row["id"])
    prompt, completion = int(row.get("prompt_tokens") or 0), int(row.get("output_tokens") or 0)
    usage: dict[str, Any] = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
    if row.get("cached_tokens") is not None:
        usage["prompt_tokens_details"] = {"cached_tokens": int(row["cached_tokens"])}
    common = {"created": int(row.get("finished_at") or 0), "model": model or row.get("model") or "", "usage": usage}
    finish = row.get("finish_reason") or "stop"
    if url == COMPLETIONS:
        choice = {"index": 0, "text": row.get("text") or "", "logprobs": None, "finish_reason": finish}
        return {"id": f"cmpl-{rid}", "object": "text_completion", "choices": [choice], **common}
    choice = {
        "index": 0,
        "message": {"role": "assistant", "content": row.get("text") or ""},
        "logprobs": None,
        "finish_reason": finish,
    }
    return {"id": f"chatcmpl-{rid}", "object": "chat.completion", "choices": [choice], **common}


def output_lines(chunks: Iterable[list[dict[str, Any]]], source: str | None = None) -> Iterator[list[str]]:
    """Chunks of output rows → chunks of OpenAI batch output lines (one per row).

    `source` is the job's input (file, folder or glob); it tells each row's endpoint
    and the model name its request asked for."""
    index = RequestIndex.from_input(source)
    for rows in chunks:
        out = []
        for r in rows:
            url, model = index.lookup(r["input_file"], r["input_row"])
            line_id, request_id = _ids(r["job_id"], r["id"])
            out.append(json.dumps({
                "id": line_id,
                "custom_id": r["id"],
                "response": {"status_code": 200, "request_id": request_id, "body": response_body(r, url, model)},
                "error": None,
            }, ensure_ascii=False))
        yield out


def dead_letter_lines(chunks: Iterable[list[dict[str, Any]]]) -> Iterator[list[str]]:
    """Chunks of dead-letter rows → chunks of error lines (`error: {code, message}`)."""
    for rows in chunks:
        out = []
        for r in rows:
            ref = R.format_ref(r["input_file"], r["input_row"])
            cid = r.get("id") or f"line-{ref}"
            line_id, request_id = _ids(r["job_id"], f"{cid}\0{ref}")
            out.append(json.dumps({
                "id": line_id,
                "custom_id": cid,
                "response": {"status_code": STATUS_BY_REASON.get(r["reason"], 400), "request_id": request_id, "body": None},
                "error": {"code": r["reason"], "message": r["message"]},
            }, ensure_ascii=False))
        yield out
