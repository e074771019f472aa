"""Job spec and engine config.

One flat config object per concern, validated strictly at load (unknown keys,
wrong types and out-of-range values are rejected with the key path).  Engine
fields carry vLLM's own `EngineArgs` names so that a user who knows vLLM knows
these; anything else vLLM accepts goes through `engine.extra`.
"""

from __future__ import annotations

from tokenmill.schemas.errors import first_line

import hashlib
import json
import re
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ByteSize, ConfigDict, Field, ValidationError, field_validator, model_validator

from tokenmill.schemas.sampling import RowSampling

# Quantization methods that need a CUDA GPU; refused on CPU before the engine starts.
GPU_ONLY_QUANTIZATION = frozenset(
    {"fp8", "marlin", "gptq_marlin", "awq_marlin", "fbgemm_fp8", "modelopt", "bitsandbytes", "gguf"}
)


class SpecError(ValueError):
    """A job spec that cannot run: the message says which key and what was expected."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


def _one_of(*allowed: str):
    """A field validator refusing a string outside `allowed`, naming the choices and the value."""

    def check(v: str) -> str:
        if v not in allowed:
            raise ValueError(f"must be one of {sorted(allowed)}, got {v!r}")
        return v

    return check


#: The longest wait between two attempts of an `openai` engine request (its backoff's cap).
HTTP_BACKOFF_CAP_S = 30.0
#: EngineConfig keys of the `openai` engine (an OpenAI-compatible HTTP server): not vLLM `EngineArgs`.
HTTP_ENGINE_KEYS = frozenset({"kind", "base_url", "api_key_env", "max_in_flight", "request_timeout_s", "max_retries"})
#: Engine kinds driven over HTTP by the `openai` engine's client (requests carry the prompt's
#: text; latencies on the client's clock; retries per row): any server at `base_url`, or
#: the `llama-server` a `llamacpp` worker starts itself.
HTTP_KINDS = frozenset({"openai", "llamacpp"})


class EngineConfig(_Strict):
    """Arguments for `vllm.LLM`, named exactly as vLLM's `EngineArgs`; with `kind: openai`,
    the server an OpenAI-compatible HTTP engine talks to (`HTTP_ENGINE_KEYS`); with
    `kind: llamacpp`, the GGUF each worker's own `llama-server` runs."""

    kind: Literal["vllm", "openai", "llamacpp"] = "vllm"
    """`vllm`: vLLM in the worker process; `openai`: any OpenAI-compatible HTTP server at `base_url`;
    `llamacpp`: a `llama-server` (llama.cpp) started by each worker on a GGUF."""
    model: str = "smollm2-135m"
    """Short name from the models folder, or a path to a Hugging Face model folder; with
    `kind: openai`, the model name the server serves (as its /v1/models lists it); with
    `kind: llamacpp`, a `.gguf` file or a built-in short name (its bundled GGUF)."""
    tokenizer: str | None = None
    """With `kind: openai` or `llamacpp`: the local model folder or short name whose tokenizer counts and
    orders the prompts (default: `model`, when it is a local folder or a built-in short name;
    for a GGUF made by `tokenmill quantize`, the tokenizer noted beside it)."""
    base_url: str | None = None
    """`kind: openai`: the server's OpenAI API root, e.g. `http://10.0.0.5:8000/v1`."""
    api_key_env: str | None = None
    """`kind: openai`: the environment variable that holds the API key (read by each worker;
    the key itself is never in the spec).  Unset: no key is sent."""
    max_in_flight: int = Field(16, ge=1, le=4096)
    """`kind: openai`: requests each worker has open at once; `kind: llamacpp`: the server's
    parallel slots (`-np`), each holding `max_model_len` tokens."""
    request_timeout_s: float = Field(300.0, gt=0)
    """`kind: openai`: the longest one attempt of a request may take (and wait between bytes)."""
    max_retries: int = Field(3, ge=0, le=100)
    """`kind: openai`: retries of a request after a 429, a 5xx, a timeout, a dropped connection
    or a malformed response (exponential backoff with jitter); then the row is a dead letter."""
    dtype: str = "auto"
    """`auto`: on a CPU the faster of float32 and bfloat16 in this engine on this model, measured
    once per CPU (transforms/engines/dtype_probe.py); on a GPU the model's own dtype."""
    quantization: str | None = None
    kv_cache_dtype: str = "auto"
    enable_prefix_caching: bool = True
    max_num_seqs: int = Field(256, ge=1, le=65536)
    max_num_batched_tokens: int | None = Field(None, ge=16)
    max_model_len: int = Field(2048, ge=64)
    gpu_memory_utilization: float = Field(0.5, gt=0.0, le=1.0)
    kv_cache_memory_bytes: int | None = Field(None, ge=1)
    tensor_parallel_size: int = Field(1, ge=1)
    enforce_eager: bool = True
    speculative_config: dict[str, Any] | None = None
    seed: int = 0
    load_format: str = "auto"
    block_size: int | None = Field(None, ge=1)
    extra: dict[str, Any] = Field(default_factory=dict)
    """Passed through to `vllm.LLM` unchanged (any other `EngineArgs` field)."""

    def http_worst_case_s(self) -> float:
        """The longest one row may take on the `openai` engine: every attempt timing out,
        with the longest backoff between them."""
        return (self.max_retries + 1) * self.request_timeout_s + self.max_retries * HTTP_BACKOFF_CAP_S

    @field_validator("api_key_env")
    @classmethod
    def _key_env(cls, v: str | None) -> str | None:
        if v is not None and not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", v):
            raise ValueError(f"must name an environment variable (letters, digits, '_'), not hold a key; got {len(v)} characters")
        return v

    @field_validator("base_url")
    @classmethod
    def _base_url(cls, v: str | None) -> str | None:
        if v is not None and not re.match(r"https?://[^/\s]+", v):
            raise ValueError(f"must be an http:// or https:// URL, got {v!r}")
        return v.rstrip("/") if v is not None else v

    @model_validator(mode="after")
    def _kind_keys(self) -> "EngineConfig":
        if self.kind == "openai" and not self.base_url:
            raise ValueError("kind openai needs base_url (the server's OpenAI API root, e.g. http://HOST:8000/v1)")
        if self.kind != "openai" and (self.base_url or self.api_key_env):
            raise ValueError(f"base_url and api_key_env are for kind openai (a server you run); this engine is {self.kind}")
        return self

    @property
    def over_http(self) -> bool:
        """Whether the engine is driven over HTTP by the `openai` engine's client (`HTTP_KINDS`)."""
        return self.kind in HTTP_KINDS

    _dtype = field_validator("dtype")(_one_of("auto", "float32", "bfloat16", "float16", "half", "float"))
    _kv_dtype = field_validator("kv_cache_dtype")(_one_of("auto", "fp8", "fp8_e4m3", "fp8_e5m2", "bfloat16", "float16"))


class SamplingDefaults(RowSampling):
    """Job-wide sampling defaults; each input row may override the per-row keys
    (sampling.RowSampling); the keys below are job-wide only."""

    ignore_eos: bool = False
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
    max_inflight_batches: int = Field(2, ge=1, le=64)
    """Batches handed to the engine ahead of the one finishing (keeps the engine fed at batch tails)."""
    batch_timeout_s: float = Field(1800.0, gt=0)
    """The longest a batch may stay in the engine; past it the batch counts as hung
    and is retried by bisection until the row that hangs is an `engine_timeout` dead letter.
    Checked between engine steps and, for a step that never returns, by a watchdog
    that kills the engine (it is restarted)."""


class RunnerConfig(_Strict):
    runner: str = "DirectRunner"
    num_workers: int = Field(1, ge=1)
    worker_retries: int = Field(2, ge=0)
    """How many times a pipeline whose worker process died (kill -9, the OOM killer) is run
    again; each retry resumes from the database (multi-process DirectRunner; Dask reschedules
    a dead worker's tasks itself)."""
    pipeline_options: list[str] = Field(default_factory=list)
    """Extra Beam pipeline options, as command-line flags (`--environment_type=EXTERNAL`, ...)."""


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
    engine: EngineConfig = Field(default_factory=EngineConfig)
    sampling: SamplingDefaults = Field(default_factory=SamplingDefaults)
    batching: BatchingConfig = Field(default_factory=BatchingConfig)
    runner: RunnerConfig = Field(default_factory=RunnerConfig)
    reference_column: str | None = None
    """An input column with reference answers, copied to the outputs for quality checks."""
    price_per_hour: float | None = Field(None, ge=0)
    """One flat price (USD per device-hour) for every device of the job, a CPU worker counting
    as one device; `prices` is the per-model form (jobs/metrics/pricing.py)."""
    prices: dict[str, float] | None = None
    """Price table overrides, USD per hour: GPU model substrings (`h100`, `l4`), `cpu_vcpu`
    (per vCPU-hour), `cpu_gib` (per GiB-hour), or `cpu` (flat per CPU-worker-hour)."""

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
        e = self.engine
        if e.over_http:
            worst = e.http_worst_case_s()
            if worst >= self.batching.batch_timeout_s:
                raise ValueError(
                    f"engine: a row may take {worst:g} s over its {e.max_retries + 1} attempts "
                    f"(request_timeout_s {e.request_timeout_s:g} each, plus backoff), not under "
                    f"batching.batch_timeout_s {self.batching.batch_timeout_s:g}: lower request_timeout_s or "
                    "max_retries, or raise batch_timeout_s")
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
        payload = self.model_dump(mode="json", exclude={"job_id", "db", "runner", "name"}, exclude_defaults=True)
        digest = hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:12]
        return f"job-{digest}"


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
