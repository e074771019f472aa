"""Job spec and engine config.

One flat config object per concern, validated strictly at load (unknown keys,
wrong types and out-of-range values are rejected with the key path).  `engine:`
is validated by the config model of the engine its `kind` names (each engine's
module declares its own keys; `EngineConfig` holds the ones every engine reads).
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Annotated, Any, Literal, get_args

from pydantic import (
    BaseModel,
    ByteSize,
    ConfigDict,
    Field,
    SerializeAsAny,
    ValidationError,
    WrapValidator,
    field_validator,
    model_validator,
)
from pydantic.fields import FieldInfo
from pydantic_core import PydanticCustomError

from tokenmill.schemas.engine_kinds import UnknownEngine, registered, registered_kinds
from tokenmill.schemas.errors import first_line
from tokenmill.schemas.sampling import RowSampling


class SpecError(ValueError):
    """A job spec that cannot run: the message says which key and what was expected."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


def one_of(*allowed: str):
    """A field validator refusing a string outside `allowed`, naming the choices and the value."""

    def check(v: str) -> str:
        if v not in allowed:
            raise ValueError(f"must be one of {sorted(allowed)}, got {v!r}")
        return v

    return check


#: How a job uses the result cache (`JobSpec.cache`).
CacheMode = Literal["read-write", "read", "off"]
CACHE_MODES: tuple[str, ...] = get_args(CacheMode)
#: Keys that steer how a job runs, not what it computes: left out of the derived job id, so a
#: rerun with a higher cap or another cache mode resumes the same job.
RUN_ONLY_KEYS = frozenset({"job_id", "db", "runner", "name", "cache", "max_cost", "max_hours"})

#: The engine a spec that names no `engine.kind` runs.
DEFAULT_ENGINE_KIND = "vllm"
Task = Literal["generate", "embed"]
#: A LoRA adapter's name (`EngineConfig.lora_adapters`, a row's `adapter`).
ADAPTER_NAME = r"[A-Za-z0-9][A-Za-z0-9._:/-]{0,127}"
#: What an engine does with a request: text out, or one vector per row (`EngineConfig.task`).
TASKS: tuple[str, ...] = get_args(Task)


class EngineConfig(_Strict):
    """The keys every engine reads; each engine's config model (its module under
    transforms/engines/, registered in schemas/engine_kinds.py) adds its own and fixes
    `kind`.  `JobSpec.engine` is validated by the model registered for its `kind`."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, use_attribute_docstrings=True)

    kind: str = Field(json_schema_extra={"flag": False})
    """Which engine runs the job: a registered kind (`tokenmill run --help` lists them)."""
    model: str = Field("smollm2-135m", json_schema_extra={"flag_help": (
        "Model short name or local HF folder (default smollm2-135m); with --engine openai, the name the server "
        "serves; with --engine llamacpp, a .gguf file or a short name.")})
    """Short name from the models folder, or a path to a Hugging Face model folder; for an engine
    that is not given the weights, the name it knows the model by (its own module says)."""
    tokenizer: str | None = Field(None, json_schema_extra={"flag_help": (
        "--engine openai or llamacpp: the local model folder or short name whose tokenizer counts and orders "
        "the prompts (default: --model, if it is a local folder).")})
    """The local model folder or short name whose tokenizer counts and orders the prompts
    (default: `model`, when it is a local folder or a built-in short name)."""
    max_num_seqs: int = Field(256, ge=1, le=65536, json_schema_extra={"flag_help": "Sequences in flight in the engine."})
    """The most sequences the engine runs at once."""
    max_num_batched_tokens: int | None = Field(None, ge=16, json_schema_extra={"flag": False})
    """The most tokens the engine processes in one step."""
    max_model_len: int = Field(2048, ge=64, json_schema_extra={"flag_help": "Context length the engine reserves."})
    """The longest prompt + output a request may have."""
    seed: int = Field(0, json_schema_extra={"flag": False})
    """The engine's random seed."""
    block_size: int | None = Field(None, ge=1, json_schema_extra={"flag": False})
    """The KV cache block size (prefix keys align to it); default: the engine's own."""
    extra: dict[str, Any] = Field(default_factory=dict, json_schema_extra={"flag": False})
    """Passed through to the engine unchanged (its module says how)."""
    task: Task = Field("generate", json_schema_extra={
        "flag_help": "generate (text out) or embed (one vector per row; docs/REQUESTS.md)."})
    """`generate`: text out; `embed`: one vector per row (vLLM's pooling runner on the same
    model folder, llama-server with --embeddings, an OpenAI-compatible server's /v1/embeddings)."""
    pooling: Literal["last", "mean", "cls"] | None = Field(None, json_schema_extra={
        "flag_help": "embed: how the tokens' states become one vector (default last; openai: the server's)."})
    """With `task: embed`, how the tokens' hidden states become the row's vector: `last` (the
    last token's, the default for a causal LM), `mean` or `cls`; the vector is L2-normalized.
    Unset for the `openai` engine: the server's own pooling."""

    lora_adapters: dict[str, str] = Field(default_factory=dict, json_schema_extra={"flag": False})
    """LoRA adapters a row may name in its `adapter` column (an OpenAI batch line: as its body's
    `model`): name → a local adapter folder (peft's `adapter_config.json` and weights) or an
    `s3://` URL of one (synced once per host, as a model URL is); `kind: llamacpp`: a GGUF
    adapter file; `kind: openai`: the name the server serves the adapter under (docs/REQUESTS.md)."""
    max_loras: int = Field(1, ge=1, le=64, json_schema_extra={"flag": False})
    """The most adapters one engine step runs together (vLLM's `max_loras`)."""
    max_lora_rank: int = Field(16, ge=1, le=512, json_schema_extra={"flag": False})
    """The highest adapter rank the engine reserves room for (vLLM's `max_lora_rank`); an
    adapter of a higher rank is refused before the job runs."""

    @field_validator("lora_adapters")
    @classmethod
    def _adapter_names(cls, v: dict[str, str]) -> dict[str, str]:
        for name, where in v.items():
            if not re.fullmatch(ADAPTER_NAME, name):
                raise ValueError(f"adapter names must be 1-128 letters, digits, '.', '_', ':', '/' or '-', got {name!r}")
            if not isinstance(where, str) or not where.strip():
                raise ValueError(f"adapter {name!r} needs a folder, file, URL or served name, got {where!r}")
        return v

    @model_validator(mode="after")
    def _pooling_embeds(self) -> "EngineConfig":
        if self.pooling is not None and self.task != "embed":
            raise ValueError("pooling is for task: embed")
        if self.lora_adapters and self.task != "generate":
            raise ValueError("lora_adapters are for task: generate")
        return self

    def embedding_pooling(self) -> str | None:
        """The pooling an embedding job runs with (None: a generate job, or the server's own)."""
        return None if self.task != "embed" else (self.pooling or "last")

    def batch_timeout_problem(self, batch_timeout_s: float) -> str | None:
        """Why one row could outlast `batching.batch_timeout_s` on this engine (one line), or
        None: an engine with its own per-request limits (retries, timeouts) says so."""
        return None


def engine_flag(info: FieldInfo) -> tuple[bool, str]:
    """Whether an engine config field is a CLI flag, and its help (`flag_help`, else its docstring)."""
    extra = info.json_schema_extra if isinstance(info.json_schema_extra, dict) else {}
    return extra.get("flag", True) is not False, str(extra.get("flag_help") or info.description or "")


def _engine_config(value: Any, handler: Any) -> Any:
    """`engine:` validated by the config model registered for its `kind` (default vllm)."""
    if isinstance(value, dict):
        kind = value.get("kind", DEFAULT_ENGINE_KIND)
        try:
            model = registered(kind).config if isinstance(kind, str) else None
        except UnknownEngine as err:
            model, message = None, str(err)
        else:
            message = f"must be a string naming a registered engine; registered: {', '.join(registered_kinds())}"
        if model is None:
            raise ValidationError.from_exception_data("EngineConfig", [{
                "type": PydanticCustomError("engine_kind", message), "loc": ("kind",), "input": kind}])
        return model.model_validate(value)
    return handler(value)


def _default_engine() -> EngineConfig:
    return registered(DEFAULT_ENGINE_KIND).config()


class SamplingDefaults(RowSampling):
    """Job-wide sampling defaults; each input row may override the per-row keys
    (sampling.RowSampling); the keys below are job-wide only."""

    ignore_eos: bool = Field(False, json_schema_extra={"off": [False]})
    """Generate max_tokens regardless of EOS."""


class BatchingConfig(_Strict):
    """How prompts are grouped and admitted to the engine."""

    ordering: Literal["prefix", "length", "none"] = "prefix"
    """`prefix`: shared-prefix groups together, sorted by token sequence;
    `length`: sorted by prompt length; `none`: input order."""
    token_budget: int | None = Field(None, ge=64)
    """Prompt + max output tokens admitted per batch. Default: enough to keep
    `max_num_seqs` sequences of the job's mean size in flight."""
    prefix_blocks: int = Field(4, ge=1, le=1024)
    """Leading KV blocks hashed into the prefix key that orders a unit's prompts (`ordering: prefix`)."""
    unit_bytes: ByteSize | None = Field(None, ge=1 << 16)
    """Prompt data per work unit (uncompressed input bytes; an integer or `64MiB`, `1GiB`): no process holds
    more than about one unit of prompts at a time, and a failed unit re-reads only itself.
    Default: sized from the machine (1/512 of its memory, 4-64 MiB), at most 8,192 rows."""
    unit_lines: int | None = Field(None, ge=1)
    """Lines per work unit of an OpenAI batch file (default 2,048): smaller units spread a batch over
    more workers, and a shared job over more replicas (`tokenmill serve` over PostgreSQL uses 256)."""
    max_inflight_batches: int = Field(2, ge=1, le=64)
    """Batches handed to the engine ahead of the one finishing (keeps the engine fed at batch tails)."""
    batch_timeout_s: float = Field(1800.0, gt=0)
    """The longest a batch may stay in the engine; past it the batch counts as hung
    and is retried by bisection until the row that hangs is an `engine_timeout` dead letter.
    Checked between engine steps and, for a step that never returns, by a watchdog
    that kills the engine (it is restarted)."""


class ImageConfig(_Strict):
    """Images in chat prompts (docs/REQUESTS.md, "Images"): a message's `image_url` parts, or one
    image per row in `column`; an image over a limit is its row's `bad_image` dead letter."""

    column: str | None = None
    """An input column holding one image per row (its bytes, or a data: URI, a path or an s3:// URL),
    placed first in the row's last user message; null cells: no image."""
    max_bytes: ByteSize = Field(ByteSize(8 << 20), ge=1)
    """The largest image file taken (an integer or `8MiB`)."""
    max_pixels: int = Field(4096 * 4096, ge=1)
    """The most pixels (width × height) an image may decode to."""


class RunnerConfig(_Strict):
    runner: str = "DirectRunner"
    num_workers: int | Literal["auto"] = 1
    """Worker processes, each running one engine (on a host with GPUs, on its own leased
    devices).  `auto` (DirectRunner): one engine per device group this host can lease
    (its visible GPUs // the engine's GPUs per engine); on a host without GPUs, or for an
    engine that needs none, what this host's finished jobs of the engine and model measured
    (transforms/engines/cpu_workers.py: the faster worker count, 1 where nothing is known)."""
    worker_retries: int = Field(2, ge=0)
    """How many times a pipeline whose worker process died (kill -9, the OOM killer) is run
    again; each retry resumes from the database (multi-process DirectRunner; Dask reschedules
    a dead worker's tasks itself)."""
    pipeline_options: list[str] = Field(default_factory=list)
    """Extra Beam pipeline options, as command-line flags (`--environment_type=EXTERNAL`, ...)."""
    lease_s: float | None = Field(None, gt=0)
    """Run the job shared: several processes (the replicas of `tokenmill serve`) run it at once,
    each work unit under a lease of this many seconds taken from the database and renewed while
    it runs, every commit fenced by it (schemas/storage/leases.py); a unit whose holder died is
    taken by another once its lease expires.  None: one run owns the job (the default)."""

    @field_validator("num_workers", mode="before")
    @classmethod
    def _num_workers(cls, v: Any) -> Any:
        if v == "auto":
            return v
        if isinstance(v, str) and v.strip().isdigit():
            v = int(v)
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError("must be a whole number >= 1 or 'auto'")
        return v

    def resolved_workers(self) -> int:
        """`num_workers` as a job runs it: `auto` is made a number first (jobs/lifecycle/preflight.resolve_workers)."""
        if self.num_workers == "auto":
            raise ValueError("runner.num_workers is still 'auto': resolve it (resolve_workers) before the job runs")
        return self.num_workers


class JobSpec(_Strict):
    """Everything a job needs; stored verbatim (credentials masked) in the jobs table."""

    job_id: str | None = None
    name: str | None = None
    input: str
    input_format: Literal["auto", "parquet", "openai-jsonl"] = "auto"
    output: str
    output_format: Literal["parquet", "openai-jsonl"] | None = None
    db: str | None = None
    s3_endpoint_url: str | None = None
    engine: Annotated[SerializeAsAny[EngineConfig], WrapValidator(_engine_config)] = Field(
        default_factory=_default_engine)
    """The engine and its keys (`kind` picks the config model; schemas/engine_kinds.py)."""
    sampling: SamplingDefaults = Field(default_factory=SamplingDefaults)
    batching: BatchingConfig = Field(default_factory=BatchingConfig)
    runner: RunnerConfig = Field(default_factory=RunnerConfig)
    reference_column: str | None = None
    """An input column with reference answers, copied to the outputs for quality checks."""
    images: ImageConfig = Field(default_factory=ImageConfig)
    """Images in chat prompts: an image column, and the limits on each image."""
    price_per_hour: float | None = Field(None, ge=0)
    """One flat price (USD per device-hour) for every device of the job, a CPU worker counting
    as one device; `prices` is the per-model form (jobs/metrics/pricing.py)."""
    prices: dict[str, float] | None = None
    """Price table overrides, USD per hour: GPU model substrings (`h100`, `l4`), `cpu_vcpu`
    (per vCPU-hour), `cpu_gib` (per GiB-hour), or `cpu` (flat per CPU-worker-hour)."""
    cache: CacheMode = "off"
    """The result cache across jobs (docs/CACHE.md): `read-write` serves a deterministic request
    (greedy, or a fixed seed) already answered by the same checkpoint, engine, dtype, quantization,
    KV dtype, rendered prompt and sampling from the cache and stores the new answers; `read` only
    serves; `off` neither."""
    max_cost: float | None = Field(None, gt=0)
    """A cap on the job's cost (USD, over all held time): a job whose estimate exceeds it does not
    start; a running job whose cost so far plus the rest's estimate crosses it stops cleanly, its
    finished rows kept, resumable with a higher cap (docs/ESTIMATE.md)."""
    max_hours: float | None = Field(None, gt=0)
    """A cap on the job's wall time (hours, all held time), enforced as `max_cost` is."""

    @field_validator("prices")
    @classmethod
    def _prices(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        if v is not None:
            bad = {k: p for k, p in v.items() if p < 0}
            if bad:
                raise ValueError(f"prices must be >= 0, got {bad}")
            v = {k.lower(): p for k, p in v.items()}
        return v

    @field_validator("job_id")
    @classmethod
    def _job_id(cls, v: str | None) -> str | None:
        if v is not None and not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,127}", v):
            raise ValueError(
                "must be 1-128 characters of letters, digits, '.', '_', ':' or '-', "
                f"starting with a letter or digit, got {v!r}"
            )
        return v

    @model_validator(mode="after")
    def _defaults(self) -> "JobSpec":
        if self.price_per_hour is not None and self.prices:
            raise ValueError("set price_per_hour (one flat price per device-hour) or prices (per device model), "
                             "not both")
        problem = self.engine.batch_timeout_problem(self.batching.batch_timeout_s)
        if problem:
            raise ValueError(f"engine: {problem}")
        if self.output_format is None:
            fmt = "openai-jsonl" if self.resolved_input_format() == "openai-jsonl" else "parquet"
            object.__setattr__(self, "output_format", fmt)
        return self

    def resolved_input_format(self) -> str:
        if self.input_format != "auto":
            return self.input_format
        return "openai-jsonl" if self.input.rstrip("/").endswith((".jsonl", ".jsonl.gz")) else "parquet"

    def derived_job_id(self) -> str:
        """A stable id from what defines the work, so rerunning the same spec resumes.

        Only keys set away from their defaults count, so a key that a later tokenmill adds
        (with a default) does not move the ids of the specs written before it."""
        if self.job_id:
            return self.job_id
        payload = self.model_dump(mode="json", exclude=set(RUN_ONLY_KEYS), exclude_defaults=True)
        digest = hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:12]
        return f"job-{digest}"

    def for_task(self, task: str) -> "JobSpec":
        """The spec of one pass of this job with its engine doing `task` (a batch file whose
        lines name both tasks runs a pass of each): the same engine keys, `pooling` kept for
        `embed` alone, and one sample per embedding row."""
        if task == self.engine.task:
            return self
        update: dict[str, Any] = {"engine": self.engine.model_copy(update={
            "task": task, "pooling": self.engine.pooling if task == "embed" else None})}
        if task == "embed":
            update["sampling"] = self.sampling.model_copy(update={"n": 1})
        return self.model_copy(update=update)


def format_validation_error(err: ValidationError, source: str = "job spec") -> str:
    """One line per problem: `key.path: what was expected (got ...)`."""
    parts = []
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"]) or "(root)"
        msg = e["msg"]
        if e["type"] == "extra_forbidden":
            msg = "unknown key"
        elif "input" in e and e["type"] != "missing" and e["loc"] and "api_key_env" not in e["loc"]:
            # (not the whole spec, for an error about it as a whole: it may hold a db password;
            # nor an api_key_env value that fails: most likely a key pasted in)
            msg = f"{msg} (got {e['input']!r})"
        parts.append(f"{loc}: {msg}")
    return f"invalid {source}: " + "; ".join(parts)


def load_spec(data: dict[str, Any], source: str = "job spec") -> JobSpec:
    try:
        return JobSpec.model_validate(data)
    except ValidationError as err:
        raise SpecError(format_validation_error(err, source)) from None


def read_spec_file(path: str | Path) -> dict[str, Any]:
    """The mapping a job spec YAML file holds (not yet validated); SpecError in one line otherwise."""
    import yaml

    name = str(path)
    if not Path(path).exists():
        raise SpecError(f"job spec {name!r} does not exist")
    try:
        with open(path) as fh:
            data = yaml.safe_load(fh)
    except OSError as err:
        raise SpecError(f"cannot read job spec {name!r}: {err.strerror}") from None
    except yaml.YAMLError as err:
        raise SpecError(f"job spec {name!r} is not valid YAML: {first_line(err)}") from None
    if data is None:  # an empty file: every key from flags or defaults
        return {}
    if not isinstance(data, dict):
        raise SpecError(f"job spec {name!r} must be a mapping of keys, got {type(data).__name__}")
    return data


def load_spec_file(path: str | Path) -> JobSpec:
    return load_spec(read_spec_file(path), source=f"job spec {Path(path).name}")
