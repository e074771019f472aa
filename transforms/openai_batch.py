"""An OpenAI Batch API input file read by the pipeline: planned (from the per-line index that
validation stored beside it, when there is one) and turned into rows.  The wire format itself,
a line's parsing and the output lines, is schemas/wire/openai/.

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
Planning notes each line's endpoint in its shard (`JsonlShard.endpoints`, from the stored
index), so a pass parses only its own lines: each line is parsed once by the pipeline,
whatever the number of passes.

`n` (samples per request) is the row key `n`: the request's samples are its output
rows, written back as one line with n choices.  Refused (`request.UNSUPPORTED`): `stream`,
`tools` (tools are not served).  A line
that is not a usable request (bad JSON, no custom_id, another method or endpoint, a
refused or misspelt body field) becomes a `bad_request` dead letter carrying the
line; it never fails the job.  A `/v1/responses` line is mapped onto the same chat row
(schemas/wire/openai/responses.py); one asking for what is not served (tools, reasoning, ...)
is a dead letter with the code `unsupported_parameter`.

The output files (`outputs.jsonl`, `errors.jsonl`, log-probabilities in OpenAI's
shape per endpoint) are written at export: jobs/lifecycle/openai_export.py.

A line may also be an Anthropic Message Batches request (`{custom_id, params}`, told apart
line by line: schemas/wire/formats.py), read into the same chat row; an input of them is
exported as Anthropic's `results.jsonl` (jobs/lifecycle/anthropic_export.py).  One input
holds one format or the other.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import AbstractSet, Any, Iterator

from tokenmill.schemas import records as R
from tokenmill.schemas.errors import first_line
from tokenmill.schemas.wire.formats import ENDPOINTS, MESSAGES, TASK_ENDPOINTS, peek
from tokenmill.schemas.wire.formats import parse_line as parse_request
from tokenmill.schemas.wire.lines import LineError, LineIndex, Unsupported, index_location, scan
from tokenmill.transforms.inputs import InputError, InputPlan, expand_input, open_input, planning_client, stat

JSONL_PATTERNS = ("*.jsonl", "*.jsonl.gz")
#: Lines per read shard by default (`batching.unit_lines`): small enough to spread a big file over workers.
SHARD_LINES = 2048
ERROR_KEY = "_error"  # (reason, message) of a line the reader could not make a row of
RAW_KEY = "_raw"
#: A line's code in `JsonlShard.endpoints` when it is blank, and when it names no endpoint
#: tokenmill serves (every pass reads it: a dead letter); else its endpoint's place in ENDPOINTS.
BLANK, UNKNOWN = " ", "?"


def endpoint_code(url: str | None) -> str:
    """A line's one-character code in `JsonlShard.endpoints` (None: a blank line)."""
    if url is None:
        return BLANK
    return str(ENDPOINTS.index(url)) if url in ENDPOINTS else UNKNOWN


def read_in_pass(code: str, urls: tuple[str, ...]) -> bool:
    """Whether the pass that answers `urls` reads a line of this code."""
    return code == UNKNOWN or (code != BLANK and ENDPOINTS[int(code)] in urls)


@dataclass(frozen=True)
class JsonlShard:
    """A run of lines of one file: `start_line` is 0-based, `offset` the byte offset
    of that line (None for compressed files, which are read from the start)."""

    file_index: int
    path: str
    start_line: int
    num_lines: int
    offset: int | None
    endpoints: str | None = None
    """For an input whose lines name more than one engine task: each line's endpoint, one
    character a line (`endpoint_code`), so a pass reads only its own task's lines; None when
    one pass reads every line."""

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
    task's pass (`line_row` gives None), a malformed one is a dead letter in any pass (where
    the shard notes each line's endpoint, `read_jsonl_shard` leaves a line naming another
    task's endpoint unread, malformed or not)."""

    models: tuple[str, ...] = ()
    urls: tuple[str, ...] = TASK_ENDPOINTS["generate"]
    adapters: tuple[str, ...] = ()
    """LoRA adapter names a body `model` may give (the row's `adapter`)."""


def scan_lines(path: str, client: Any = None) -> Iterator[tuple[int, int, bytes]]:
    """(line number, byte offset, line bytes) for every line of a file (s3:// on `client`,
    else `inputs.planning_client()`)."""
    with open_input(path, client, lines=True) as fh:
        yield from scan(fh)


def stored_index(path: str, client: Any = None) -> LineIndex | None:
    """The index validation stored beside an uncompressed input file (schemas/wire/lines.py),
    when there is one and it is that file's; None otherwise."""
    if path.endswith(".gz"):
        return None
    try:
        loc = index_location(path)
        found = stat(path, client)
        if found is None or stat(loc, client) is None:
            return None
        with open_input(loc, client) as fh:
            return LineIndex.from_bytes(fh.read(), found[0])
    except Exception:  # an index that cannot be read is only a missed shortcut: the file is read instead
        return None


def line_entries(path: str, client: Any = None) -> Iterator[tuple[int, str | None, str | None]]:
    """(byte offset, endpoint, body model) of every line of an input file, the endpoint None for
    a blank line and `?` for one that names none: from its stored index when it has one, else
    read from the file (streamed: a file of millions of lines is never held whole)."""
    idx = stored_index(path, client)
    if idx is not None:
        yield from zip(idx.offsets, idx.endpoints, idx.models)
        return
    for _, off, line in scan_lines(path, client):
        if line.strip():
            url, model, _ = peek(line)
            yield off, url, model
        else:
            yield off, None, None


def plan_jsonl(path: str, options: Any = None, shard_lines: int = SHARD_LINES) -> JsonlPlan:
    """Plan an OpenAI batch input (a .jsonl file, a folder of them or a glob) at construction.

    Counts the request lines (blank lines are not requests), cuts them into shards
    and tallies the endpoints and models, from each file's stored index where validation
    wrote one (`line_entries`); fails with InputError when there is no such file or it is
    not text."""
    client = planning_client(options) if path.startswith("s3://") else None
    files = expand_input(path, JSONL_PATTERNS, client)
    shards: list[JsonlShard] = []
    endpoints: dict[str, int] = {}
    models: dict[str, int] = {}
    total = 0
    for fi, f in enumerate(files):
        compressed = f.endswith(".gz")
        start = start_off = count = 0
        codes: list[str] = []
        try:
            for i, (off, url, model) in enumerate(line_entries(f, client)):
                if count == 0:  # the first line of a new shard
                    start, start_off, codes = i, off, []
                codes.append(endpoint_code(url))
                if url is not None:
                    total += 1
                    endpoints[url] = endpoints.get(url, 0) + 1
                    if model is not None:
                        models[model] = models.get(model, 0) + 1
                count += 1
                if count >= shard_lines and not compressed:
                    shards.append(JsonlShard(fi, f, start, count, start_off, "".join(codes)))
                    count = 0
        except (OSError, EOFError) as err:
            raise InputError(f"input file {f!r} cannot be read: {first_line(err)}") from None
        if count:
            shards.append(JsonlShard(fi, f, start, count, None if compressed else start_off, "".join(codes)))
    if endpoints.get(MESSAGES) and set(endpoints) - {MESSAGES, UNKNOWN}:  # one results format per job
        raise InputError(f"input {path!r} mixes Anthropic Message Batches requests and OpenAI batch lines; give "
                         "each its own job")
    plan = JsonlPlan(files=files, shards=shards, columns=["custom_id", "method", "url", "body"], total_rows=total,
                     endpoints=endpoints, models=models)
    if len(plan.tasks) < 2:  # one pass reads every line: its shards need not say whose each line is
        plan.shards = [replace(s, endpoints=None) for s in shards]
    return plan


# ---------------------------------------------------------------- lines → rows


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
    except LineError as err:  # a line asking for what is not served fails with its own code (`unsupported_parameter`)
        row[ERROR_KEY] = (err.code if isinstance(err, Unsupported) else R.BAD_REQUEST, str(err))
        row[RAW_KEY] = line.decode("utf-8", errors="replace").rstrip("\n")[:2000]
        cid = peek(line)[2]  # keep the custom_id when the line has one, so the error line can be matched
        if cid is not None:
            row["id"] = cid
        return row
    row["id"] = req.pop("custom_id")
    req.pop("url")
    req.pop("model")
    row.update(req)
    return row


def read_jsonl_shard(shard: JsonlShard, served: LineRules | None = None,
                     skip: AbstractSet[int] = frozenset(), client: Any = None) -> Iterator[dict[str, Any]]:
    """The rows of a run of lines but those whose line number is in `skip` (a rerun's done
    rows) and, where the shard notes each line's endpoint, those of another pass's task (not
    parsed: their own pass reads them); an s3:// file read on `client` (a worker's:
    host_model.s3_client_here)."""
    urls, codes = (served or LineRules()).urls, shard.endpoints
    if codes is not None and not any(read_in_pass(c, urls) for c in set(codes)):
        return  # no line of this pass's: the file is not opened
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
            if codes is not None and not read_in_pass(codes[k], urls):
                continue
            if line.strip() and first + k not in skip:
                row = line_row(line, shard.file_index, first + k, served)
                if row is not None:
                    yield row
