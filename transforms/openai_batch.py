"""The OpenAI Batch API file format: JSONL requests in, JSONL responses and errors out.

Input, one request per line (blank lines are skipped, as OpenAI and vLLM do)::

    {"custom_id": "q1", "method": "POST", "url": "/v1/chat/completions",
     "body": {"model": "smollm2-135m", "messages": [...], "max_tokens": 64}}

Each line becomes the same row dict the Parquet reader yields (a run of lines is a
work unit, read by read.ReadPrompts): `id` = custom_id, `messages` or `prompt`, and
the per-row sampling keys of schemas/sampling.RowSampling read under their own names
(`max_completion_tokens` read as `max_tokens`, `BODY_NAMES`), so Validate, dedup and
the rest of the pipeline are unchanged.  Served beyond free text:

- `response_format` (text, json_object, json_schema), passed on as the row's key;
  Validate checks it (a `bad_sampling` dead letter when it is not one of those).
- vLLM's `structured_outputs` object: its `regex`, `choice` and `grammar` become the
  row keys of the same name, `json` (a schema) a json_schema `response_format` and
  `json_object: true` a json_object one; one constraint per request, and no other
  key in it (its options such as `whitespace_pattern` are not served).
- Log-probabilities, as each endpoint names them: chat's `logprobs: true` with
  `top_logprobs: k` (0-20, OpenAI's rule that it needs `logprobs: true`); the legacy
  completions' `logprobs: k` (an integer 0-5; 0 is the sampled token's alone), read as
  `logprobs=True, top_logprobs=k`.  The other endpoint's spelling is refused.

A file may mix endpoints: the job runs one pass per engine task its lines name
(`JsonlPlan.tasks`: chat and completions lines with the engine generating, then
`/v1/embeddings` lines with the same engine config as `task: embed`), each pass
reading its own task's lines (`LineRules`), into one job and one pair of output files.

`n` (samples per request) is the row key `n`: the request's samples are its output
rows, written back as one line with n choices.  Refused (`UNSUPPORTED`): `stream`,
`tools` (tools are not served).  A line
that is not a usable request (bad JSON, no custom_id, another method or endpoint, a
refused or misspelt body field) becomes a `bad_request` dead letter carrying the
line; it never fails the job.

The output files (`outputs.jsonl`, `errors.jsonl`, log-probabilities in OpenAI's
shape per endpoint) are written by the launcher at export:
jobs/lifecycle/openai_export.py.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import AbstractSet, Any, Callable, Iterator

from tokenmill.schemas import records as R
from tokenmill.schemas.config import TASKS
from tokenmill.schemas.errors import first_line
from tokenmill.schemas.sampling import STRUCTURED_KEYS, RowSampling, structured_kind
from tokenmill.transforms.inputs import InputError, InputPlan, expand_input, open_input, planning_client

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
EMBEDDINGS = "/v1/embeddings"
ENDPOINTS = (CHAT, COMPLETIONS, EMBEDDINGS)
#: The endpoints each engine task serves: a batch file's lines are answered one pass per task they name.
TASK_ENDPOINTS = {"generate": (CHAT, COMPLETIONS), "embed": (EMBEDDINGS,)}
assert tuple(TASK_ENDPOINTS) == TASKS  # every task has its endpoints, in the order the passes run
JSONL_PATTERNS = ("*.jsonl", "*.jsonl.gz")
#: Lines per read shard: small enough to spread a big file over workers.
SHARD_LINES = 2048
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
ERROR_KEY = "_error"  # (reason, message) of a line the reader could not make a row of
RAW_KEY = "_raw"


@dataclass(frozen=True)
class JsonlShard:
    """A run of lines of one file: `start_line` is 0-based, `offset` the byte offset
    of that line (None for compressed files, which are read from the start)."""

    file_index: int
    path: str
    start_line: int
    num_lines: int
    offset: int | None

    @property
    def key(self) -> str:
        return f"{self.file_index}.{self.start_line}"

    @property
    def rows(self) -> range:
        """The line numbers (the rows' `input_row`) of this run."""
        return range(self.start_line, self.start_line + self.num_lines)


@dataclass
class JsonlPlan(InputPlan[JsonlShard]):
    format: str = "openai-jsonl"
    endpoints: dict[str, int] = field(default_factory=dict)
    """Request lines per `url` seen at planning (malformed lines count under `?`)."""
    models: dict[str, int] = field(default_factory=dict)
    """Request lines per body `model`."""
    served_models: tuple[str, ...] = ()
    """Names the job's engine answers to (set by the job runner); a line whose body names
    another model is a `bad_request` dead letter, as the OpenAI API answers 404.  Empty: any."""
    task: str = "generate"
    """The engine task of the pass now running (set by the job runner, one pass per task the
    lines name: `tasks`): the endpoints whose lines this pass answers."""
    adapters: tuple[str, ...] = ()
    """The job's LoRA adapter names (`engine.lora_adapters`, set by the job runner): a line whose
    body `model` names one runs with that adapter, as vLLM's server serves them."""

    @property
    def tasks(self) -> list[str]:
        """The engine tasks the lines' endpoints name (TASK_ENDPOINTS' order: generate, then
        embed), as counted at planning; empty when no line names an endpoint tokenmill serves."""
        return [t for t, urls in TASK_ENDPOINTS.items() if any(self.endpoints.get(u) for u in urls)]

    def rules(self) -> "LineRules":
        return LineRules(self.served_models, TASK_ENDPOINTS[self.task], self.adapters)


@dataclass(frozen=True)
class LineRules:
    """What one pass of a job serves of the lines it reads: the model names (empty: any) and
    the endpoints of its task; a well-formed line to another task's endpoint is left for that
    task's pass (`line_row` gives None), a malformed one is a dead letter in any pass."""

    models: tuple[str, ...] = ()
    urls: tuple[str, ...] = TASK_ENDPOINTS["generate"]
    adapters: tuple[str, ...] = ()
    """LoRA adapter names a body `model` may give (the row's `adapter`)."""


def scan_lines(path: str, client: Any = None) -> Iterator[tuple[int, int, bytes]]:
    """(line number, byte offset, line bytes) for every line of a file (s3:// on `client`,
    else `inputs.planning_client()`)."""
    with open_input(path, client, lines=True) as fh:
        offset = 0
        for i, line in enumerate(fh):
            yield i, offset, line
            offset += len(line)


def plan_jsonl(path: str, options: Any = None) -> JsonlPlan:
    """Plan an OpenAI batch input (a .jsonl file, a folder of them or a glob) at construction.

    Counts the request lines (blank lines are not requests), cuts them into shards
    and tallies the endpoints and models; fails with InputError when there is no
    such file or it is not text."""
    client = planning_client(options) if path.startswith("s3://") else None
    files = expand_input(path, JSONL_PATTERNS, client)
    shards: list[JsonlShard] = []
    endpoints: dict[str, int] = {}
    models: dict[str, int] = {}
    total = 0
    for fi, f in enumerate(files):
        compressed = f.endswith(".gz")
        start = start_off = count = 0
        try:
            for i, off, line in scan_lines(f, client):
                if count == 0:  # the first line of a new shard
                    start, start_off = i, off
                if line.strip():
                    total += 1
                    url, model = peek_request(line)
                    endpoints[url] = endpoints.get(url, 0) + 1
                    if model is not None:
                        models[model] = models.get(model, 0) + 1
                count += 1
                if count >= SHARD_LINES and not compressed:
                    shards.append(JsonlShard(fi, f, start, count, start_off))
                    count = 0
        except (OSError, EOFError) as err:
            raise InputError(f"input file {f!r} cannot be read: {first_line(err)}") from None
        if count:
            shards.append(JsonlShard(fi, f, start, count, None if compressed else start_off))
    return JsonlPlan(files=files, shards=shards, columns=["custom_id", "method", "url", "body"], total_rows=total,
                     endpoints=endpoints, models=models)


def peek_request(line: bytes) -> tuple[str, str | None]:
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
    for key, (bad, why) in UNSUPPORTED.items():
        if key in body and bad(body[key]):
            raise LineError(f"body.{key}={_short(body[key])} is not supported in batch jobs: {why}")
    out["url"] = url
    out["model"] = body.get("model")
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


def _short(v: Any) -> str:
    s = repr(v)
    return s if len(s) <= 80 else s[:77] + "..."


def line_row(line: bytes, file_index: int, line_no: int, served: LineRules | None = None) -> dict[str, Any] | None:
    """The row dict Validate expects (the Parquet reader's shape) for one input line; None for a
    well-formed request to another task's endpoint (its own pass reads it)."""
    row: dict[str, Any] = {"_row": line_no, "_file_index": file_index}
    rules = served or LineRules()
    try:
        req = parse_request(line)
        if req["model"] in rules.adapters:
            req["adapter"] = req["model"]
        elif rules.models and req["model"] is not None and req["model"] not in rules.models:
            raise LineError(f"body.model {req['model']!r} is not served by this job (it serves {rules.models[0]!r})")
        if req["url"] not in rules.urls:
            return None
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


def read_jsonl_shard(shard: JsonlShard, served: LineRules | None = None,
                     skip: AbstractSet[int] = frozenset(), client: Any = None) -> Iterator[dict[str, Any]]:
    """The rows of a run of lines but those whose line number is in `skip` (a rerun's done
    rows); an s3:// file read on `client` (a worker's: host_model.s3_client_here)."""
    with open_input(shard.path, client, lines=True) as fh:
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
            if line.strip() and first + k not in skip:
                row = line_row(line, shard.file_index, first + k, served)
                if row is not None:
                    yield row
