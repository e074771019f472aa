"""Records that flow through the pipeline, and the rows it stores.

`OutputRow`, `DeadLetterRow` and `BatchStats` are each declared once here; the
database tables (schemas/tables.py), the inserts and the exported files'
Arrow schemas all follow from their fields.  Adding an output column is one
field here plus its migration.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from functools import cache
from typing import Any, ClassVar, Iterable, Iterator, Sequence

import pyarrow as pa


def format_ref(input_file: int, input_row: int) -> str:
    """The user-visible `input_ref` of a row, "<file index>:<row>": the one place it is formatted."""
    return f"{input_file}:{input_row}"


def duplicate_message(rid: str, first: tuple[int, int]) -> str:
    """A `duplicate_id` dead letter's message: which row of the input holds the id."""
    return f"duplicate id {rid!r}: the row at {format_ref(*first)} came first"


class _FromInput:
    """A record that knows where in the input it came from (`input_file`, `input_row`)."""

    __slots__ = ()
    input_file: int
    input_row: int

    @property
    def input_ref(self) -> str:
        return format_ref(self.input_file, self.input_row)

    @property
    def input_order(self) -> tuple[int, int]:
        return (self.input_file, self.input_row)


# Dead-letter reason codes: one name each, stable (they are columns in reports).
EMPTY_PROMPT = "empty_prompt"
BAD_PROMPT_TYPE = "bad_prompt_type"
BAD_MESSAGES = "bad_messages"
BAD_SAMPLING = "bad_sampling"
DUPLICATE_ID = "duplicate_id"
INVALID_UTF8 = "invalid_utf8"
PROMPT_TOO_LONG = "prompt_too_long"
BAD_REQUEST = "bad_request"
ENGINE_ERROR = "engine_error"
ENGINE_TIMEOUT = "engine_timeout"
# The `openai` engine (an HTTP server), after its retries: one code per cause.
RATE_LIMITED = "rate_limited"
SERVER_ERROR = "server_error"
REQUEST_TIMEOUT = "request_timeout"
CONNECTION_DROPPED = "connection_dropped"
BAD_RESPONSE = "bad_response"
UNKNOWN_ADAPTER = "unknown_adapter"  # a row names a LoRA adapter the job did not declare (engine.lora_adapters)
BAD_IMAGE = "bad_image"  # an image that cannot be read or decoded, or over images.max_bytes or max_pixels
REMOTE_IMAGE = "remote_image"  # an image given as an http(s) URL: nothing is fetched from the web
UNSUPPORTED_PARAMETER = "unsupported_parameter"  # a batch line asks for what is not served (wire/lines.Unsupported)

ROLES = ("system", "user", "assistant", "tool", "developer")

# Where an output row's token counts came from (`OutputRow.token_count_source`), named
# "<prompt count>+<output count>" where the two differ; stable (columns in files and metrics).
TOKENS_BY_ENGINE = "engine"
"""Both counts are the engine's own: vLLM's request output (prompt and generated token
ids), or an HTTP server's `usage` (prompt_tokens, completion_tokens; llama-server's too)."""
TOKENS_BY_LOCAL_TOKENIZER_AND_STREAM_CHUNKS = "local_tokenizer+stream_chunks"
"""The HTTP server sent no `usage`: prompt_tokens is the length of the token ids the
Tokenize step made with the job's own tokenizer and chat template (the server's may
differ), output_tokens the number of streamed chunks that carried text (a server that
puts several tokens in a chunk makes it an undercount).  Both are estimates."""
TOKENS_BY_SERVER_TOKENIZER_AND_STREAM_CHUNKS = "server_tokenizer+stream_chunks"
"""The HTTP server sent no `usage`, but has a `/tokenize`: prompt_tokens is what the
server's own tokenizer (and chat template) counted in the Tokenize step, output_tokens
the streamed text chunks (an estimate, as above)."""
TOKENS_BY_ESTIMATE_AND_STREAM_CHUNKS = "estimate+stream_chunks"
"""The HTTP server sent no `usage`, has no `/tokenize`, and the job was given no local
tokenizer: prompt_tokens is estimated from the text's length (transforms/counting.py,
one token per 4 bytes of UTF-8), output_tokens the streamed text chunks."""
#: Appended to only: a source's position is its code in the metrics (_CODES).
TOKEN_COUNT_SOURCES = (TOKENS_BY_ENGINE, TOKENS_BY_LOCAL_TOKENIZER_AND_STREAM_CHUNKS,
                       TOKENS_BY_SERVER_TOKENIZER_AND_STREAM_CHUNKS, TOKENS_BY_ESTIMATE_AND_STREAM_CHUNKS)


@dataclass(slots=True)
class PromptRecord(_FromInput):
    """A validated input row."""

    id: str
    input_file: int
    input_row: int
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None  # a content is text, or with images a list of parts
    sampling: dict[str, Any] = field(default_factory=dict)
    reference: str | None = None
    adapter: str | None = None
    """The LoRA adapter the row asks for (a name in `engine.lora_adapters`); None: the base model."""
    images: tuple[bytes, ...] = ()  # the row's images' file bytes, in the prompt's order (transforms/images.py)


@dataclass(slots=True)
class TokenizedPrompt(_FromInput):
    """A prompt after the chat template and tokenizer, ready for the engine."""

    id: str
    input_file: int
    input_row: int
    token_ids: Sequence[int]  # array("i") from Tokenize (4 bytes a token); any int sequence is accepted
    prefix_key: str
    max_tokens: int
    sampling: dict[str, Any] = field(default_factory=dict)
    reference: str | None = None
    source: str | list[dict[str, Any]] | None = None
    """The prompt as the row gave it (its text, or its chat messages), kept only for an
    engine that takes text rather than token ids (the `openai` engine)."""
    samples: int = 1  # the row's `n`: its requests in the engine (one prompt, shared by prefix caching)
    adapter: str | None = None
    """The LoRA adapter the row's requests run with (`PromptRecord.adapter`); None: the base model."""
    images: tuple[bytes, ...] = ()  # `PromptRecord.images`: sent with the token ids (one placeholder token each)
    image_tokens: int = 0  # the tokens the engine makes of the images beyond their placeholders

    @property
    def budget_tokens(self) -> int:
        return len(self.token_ids) + self.image_tokens + self.max_tokens * self.samples


@dataclass(slots=True)
class FailedRecord(_FromInput):
    """A row that cannot be served, with a reason code and a human message."""

    input_file: int
    input_row: int
    id: str | None
    reason: str
    message: str
    raw: str | None = None


@dataclass(slots=True)
class Chunk:
    """The unit of work as it moves through the pipeline: the records of one planned
    slice of the input (`unit`: its key), carried together so that no step holds more
    than one slice of prompt data and each step does one lookup per slice.

    When a job has fewer units than its workers can share, each unit is run as
    `parts` work items: every part reads and tokenizes the whole unit, orders it
    the same way, and keeps its own contiguous segment (`part`) of that order, so
    prefix groups stay together and only part 0 reports the unit's dead letters."""

    unit: str
    items: list[Any]
    part: int = 0
    parts: int = 1
    lease: Any = None
    """A shared job's lease on the unit (`storage.Lease`: holder and epoch), which every commit
    of the unit's batches shows (fencing); None outside shared jobs."""

    def with_items(self, items: list[Any]) -> "Chunk":
        return Chunk(self.unit, items, self.part, self.parts, self.lease)


@dataclass(slots=True)
class Batch:
    batch_id: str
    prompts: list[TokenizedPrompt]

    @property
    def tokens(self) -> int:
        return sum(p.budget_tokens for p in self.prompts)


# ---------------------------------------------------------------- stored rows

#: An embedding as exported: float32 values (a fixed-size list of the job's dimension in the files).
EMBEDDING_TYPE = pa.list_(pa.float32())

_TOKEN = pa.struct([("token", pa.string()), ("logprob", pa.float64())])
#: An output's log-probabilities as exported: per output token, its text, its log-probability
#: and the most likely alternatives at that position (`top_logprobs`, most likely first).
LOGPROBS_TYPE = pa.list_(pa.struct([*_TOKEN, ("top_logprobs", pa.list_(_TOKEN))]))
#: A `choice` row's answers with their probabilities (transforms/answers.py).
CHOICE_PROBS_TYPE = pa.list_(pa.struct([("choice", pa.string()), ("prob", pa.float64())]))


def column(sql: str, *, key: bool = False, required: bool = False, export: bool = True, metric: bool = False,
           arrow: pa.DataType | None = None, default: Any = dataclasses.MISSING):
    """A record field that is also a table column.

    `sql` is "text", "int", "bigint", "float", "bool", "json", "bytes" or "str:<length>"; `key` makes it
    part of the primary key, `required` NOT NULL (both must be given; other fields default to
    None); `export` puts it in the exported files; `metric` makes it one of METRIC_COLUMNS;
    `arrow` is a json column's type in the exported files (else its JSON text); `default`: a
    key's value when none is given."""
    meta = {"sql": sql, "key": key, "required": required, "export": export, "metric": metric, "arrow": arrow}
    if default is not dataclasses.MISSING:
        return field(default=default, metadata=meta)
    return field(metadata=meta) if key or required else field(default=None, metadata=meta)


@cache
def field_names(record: type) -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(record))


@dataclass(slots=True, kw_only=True)
class StoredRow:
    """A row of one database table; its fields are the table's columns.  Every stored
    row belongs to a job, and its job id leads its primary key."""

    TABLE: ClassVar[str] = ""
    job_id: str = column("str:128", key=True)

    def as_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in field_names(type(self))}  # type: ignore[arg-type]  # a record class is hashable


@dataclass(kw_only=True)
class RequestFigures:
    """What an engine measured of one answered request: its text, how it ended, its token
    counts and times.  The engine's finished-request record (transforms/engines/protocol.py
    `Finished`) and the stored output row (`OutputRow`) are both this record, so a figure is
    declared once and passes from one to the other as it is.

    Not slotted: `OutputRow` combines it with its slotted key fields (two slotted bases
    cannot be combined)."""

    text: str | None = column("text")
    finish_reason: str | None = column("str:32")
    prompt_tokens: int | None = column("int", metric=True)
    output_tokens: int | None = column("int", metric=True)
    cached_tokens: int | None = column("int", metric=True)
    token_count_source: str | None = column("str:64", metric=True)
    """Where prompt_tokens and output_tokens came from: one of TOKEN_COUNT_SOURCES; null in
    rows stored before revision 0006 (not recorded)."""
    ttft_s: float | None = column("float", metric=True)
    tpot_s: float | None = column("float", metric=True)
    e2e_s: float | None = column("float", metric=True)
    queue_s: float | None = column("float", metric=True)
    finished_at: float | None = column("float", export=False)
    embedding: bytes | None = column("bytes", arrow=EMBEDDING_TYPE)
    """An embedding job's vector: float32 little-endian bytes (`embedding_values`), exported as
    a list of floats; None for a generate job."""
    logprobs: list[dict[str, Any]] | None = column("json", arrow=LOGPROBS_TYPE)
    """Per output token: {"token", "logprob", "top_logprobs": [{"token", "logprob"}, ...]}, for
    a row that asked for `logprobs` (the engine's own figures, docs/REQUESTS.md); else None."""
    stop_sequence: str | None = column("text", export=False)
    """The stop string that ended the text (vLLM's `stop_reason` when it is a string), so an
    Anthropic result says `stop_sequence`; None when the end of sequence or `max_tokens` ended it,
    or the engine does not say (llama-server)."""

    def figures(self) -> dict[str, Any]:
        """This record's request figures alone (a `Finished` carries more), as keywords for `OutputRow`."""
        return {k: getattr(self, k) for k in field_names(RequestFigures)}


@dataclass(slots=True, kw_only=True)
class OutputKey(StoredRow):
    """Which request an output row answers: its id, its input position, the model that answered."""

    id: str = column("str:512", key=True)
    input_file: int = column("int", required=True)
    input_row: int = column("int", required=True)
    sample: int = column("int", key=True, default=0)
    """Which of the row's `n` samples this is (0 for a row that asked for one)."""
    model: str | None = column("str:512")
    adapter: str | None = column("str:128")
    """The LoRA adapter that answered (its name in `engine.lora_adapters`); None: the base model."""


@dataclass(slots=True, kw_only=True)
class OutputRow(RequestFigures, OutputKey):
    """One answered request (table `outputs`, files outputs.parquet / outputs.jsonl): its key,
    the engine's figures (`RequestFigures`), then what the worker adds."""

    TABLE = "outputs"
    reference: str | None = column("text")
    valid: bool | None = column("bool")
    """A structured row's output met its constraint (a JSON schema, JSON, the regex, one of
    the choices); None for free text and grammars (transforms/answers.py)."""
    invalid_reason: str | None = column("text")
    """Why a structured output did not meet its constraint (one line), else None."""
    parsed: Any = column("json")
    """A JSON row's output as JSON (exported as its JSON text), when it parses."""
    choice_probs: list[dict[str, Any]] | None = column("json", arrow=CHOICE_PROBS_TYPE)
    """A `choice` row's answers, each with its probability (None: not measured)."""
    cached_from: str | None = column("str:128")
    """Served from the result cache: the job whose engine computed this answer (its figures
    are that run's; no engine time of this job); None for an answer this job's engine gave."""
    batch_id: str | None = column("str:64", export=False)
    worker: str | None = column("str:128", export=False)


@dataclass(slots=True, kw_only=True)
class DeadLetterRow(StoredRow):
    """One row that could not be served (table `dead_letters`, files dead_letters.parquet / errors.jsonl)."""

    TABLE = "dead_letters"
    input_file: int = column("int", key=True)
    input_row: int = column("int", key=True)
    id: str | None = column("str:512")
    reason: str = column("str:64", required=True)
    message: str = column("text", required=True)
    raw: str | None = column("text")
    created_at: float | None = column("float", export=False)


@dataclass(slots=True, kw_only=True)
class BatchStats(StoredRow):
    """Figures of one finished engine batch (table `batches`)."""

    TABLE = "batches"
    batch_id: str = column("str:64", key=True)
    worker: str | None = column("str:128")
    requests: int | None = column("int")
    prompt_tokens: int | None = column("int")
    output_tokens: int | None = column("int")
    cached_tokens: int | None = column("int")
    started_at: float | None = column("float")
    finished_at: float | None = column("float")
    tail_s: float | None = column("float")
    engine_idle_s: float | None = column("float")
    retries: dict[str, int] | None = column("json")
    """Retried attempts of the batch's requests by the failed attempt's reason code (an HTTP
    engine's retries, counted whether the row was answered in the end or dead-lettered);
    None for an engine that does not retry (vLLM in process)."""


@dataclass(slots=True, kw_only=True)
class WorkerRow(StoredRow):
    """One worker process of a job (table `workers`): what its engine says of itself, its
    counters, and what it measured of its devices (transforms/engines/meter.py `reading()`
    gives the device_type..measure fields; docs/ACCOUNTING.md)."""

    TABLE = "workers"
    REFRESHED: ClassVar[tuple[str, ...]] = ("engine_info", "updated_at", "run_id", "device_type", "device_model",
                                            "device_count", "cpu_count", "nvml_error", "measure")
    """What a worker's second row overwrites (a restarted engine, or the same process in a later run)."""
    worker: str = column("str:128", key=True)
    hostname: str | None = column("str:256")
    pid: int | None = column("int")
    device: str | None = column("str:256")
    load_s: float | None = column("float")
    engine_info: dict[str, Any] | None = column("json")
    peak_rss_bytes: int | None = column("bigint")
    admitted_rows: int | None = column("bigint")
    generated_rows: int | None = column("bigint")
    generated_tokens: int | None = column("bigint")
    started_at: float | None = column("float")
    updated_at: float | None = column("float")
    run_id: str | None = column("str:64")
    device_type: str | None = column("str:16")
    device_model: str | None = column("str:256")
    device_count: int | None = column("int")
    cpu_count: int | None = column("int")
    nvml_error: str | None = column("text")
    measure: dict[str, Any] | None = column("json")

    def refreshed(self) -> dict[str, Any]:
        """The REFRESHED columns of this row."""
        return {k: getattr(self, k) for k in self.REFRESHED}


#: Per-request figures that reports and metrics read: every output column but the
#: texts, the input position and what all of a job's rows share.
REQUEST_COLUMNS = tuple(
    f.name for f in dataclasses.fields(OutputRow)
    if f.name not in ("job_id", "model", "adapter", "text", "reference", "input_file", "input_row", "logprobs", "parsed",
                      "choice_probs", "embedding")
)

#: The per-request figures that metrics sum, count and take percentiles of, read as one
#: float per row (`metric_values`): the numbers, and `token_count_source` as its index in
#: TOKEN_COUNT_SOURCES.
METRIC_COLUMNS = tuple(f.name for f in dataclasses.fields(RequestFigures) if f.metadata["metric"])
_CODES = {"token_count_source": {s: float(i) for i, s in enumerate(TOKEN_COUNT_SOURCES)}}

#: An answer as the result cache keeps it (`result_cache.answer`, transforms/cache.py): what the
#: engine answered and counted, never where or when it ran (times, batch, worker, prefix-cache hits).
CACHED_COLUMNS = ("text", "finish_reason", "prompt_tokens", "output_tokens", "token_count_source", "embedding",
                  "logprobs", "valid", "invalid_reason", "parsed", "choice_probs", "stop_sequence")


def metric_values(column: str, values: Iterable[Any]) -> Iterator[float]:
    """Rows' values of a METRIC_COLUMNS column as floats: None → NaN, and a coded
    column's value as its index (-1 for a value this version does not know)."""
    nan = float("nan")
    codes = _CODES.get(column)
    if codes is None:
        return (nan if v is None else v for v in values)
    return (nan if v is None else codes.get(v, -1.0) for v in values)


def embedding_bytes(values: Any) -> bytes:
    """A vector as the `embedding` column stores it (float32, little-endian)."""
    import numpy as np

    return np.asarray(values, dtype="<f4").tobytes()


def embedding_array(blob: bytes):
    """The `embedding` column's bytes as a float32 array (ValueError: not float32 values)."""
    import numpy as np

    return np.frombuffer(blob, dtype="<f4")


def embedding_values(blob: bytes) -> list[float]:
    """The `embedding` column's bytes as floats."""
    return embedding_array(blob).tolist()
