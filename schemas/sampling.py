"""Sampling parameters: the keys an input row may set, declared once.

`RowSampling` names each per-row key with its type, range and meaning.  The
job spec's `sampling:` section (config.SamplingDefaults) extends it, row
validation (`validate_row_sampling`) checks a row against it, the CLI flags
and the OpenAI batch body mapping are derived from its fields, and
`request_sampling` builds the engine's sampling from it, and `request_keys` the keys an
engine's request carries.  Adding a key (vLLM's `SamplingParams` names) is an edit here
only: a field's `off` values (`json_schema_extra`) are the ones that leave the key out
of a request, so a server that does not know it is never sent it unless a job sets it.
"""

from __future__ import annotations

import json
import types
import typing
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic.fields import FieldInfo

#: The structured-output constraints (docs/REQUESTS.md): a row sets at most one, and a
#: row's constraint replaces the job's (`request_sampling`).
STRUCTURED_KEYS = ("response_format", "regex", "choice", "grammar")
#: The most alternatives per token `top_logprobs` may ask for (OpenAI's limit).
MAX_TOP_LOGPROBS = 20
#: The most samples one row may ask for (`n`).
MAX_SAMPLES = 64
#: The keys that ask for more than free text: each engine translates them
#: (transforms/engines/requests.py) rather than taking them as they are.
ANSWER_KEYS = (*STRUCTURED_KEYS, "logprobs", "top_logprobs")


class RowSampling(BaseModel):
    """Per-row sampling parameters, named as vLLM's `SamplingParams`."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, use_attribute_docstrings=True)

    max_tokens: int = Field(128, gt=0)
    """Most output tokens per row."""
    temperature: float = Field(0.0, ge=0.0, allow_inf_nan=False)
    """Sampling temperature (0 = greedy)."""
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    """Nucleus sampling top_p."""
    seed: int | None = None
    """Sampling seed."""
    stop: list[str] | None = None
    """Stop strings."""
    min_tokens: int | None = Field(None, ge=0, json_schema_extra={"off": [0]})
    """Fewest output tokens before an end-of-sequence token or a stop string may end the row."""
    top_k: int | None = Field(None, ge=-1, json_schema_extra={"off": [-1, 0]})
    """Sample from the k most likely tokens only (-1 or unset: all)."""
    response_format: dict[str, Any] | None = Field(None, json_schema_extra={"off": [{"type": "text"}]})
    """OpenAI's `response_format`: `{"type": "json_object"}` or `{"type": "json_schema", "json_schema":
    {"name": ..., "schema": {...}, "strict": true}}` (JSON text in a Parquet column or a flag)."""
    regex: str | None = None
    """Output constrained to match this regular expression."""
    choice: list[str] | None = None
    """Output constrained to one of these answers; each answer's probability is stored."""
    grammar: str | None = None
    """Output constrained to this grammar (GBNF; vLLM also takes EBNF and Lark)."""
    n: int = Field(1, ge=1, le=MAX_SAMPLES, json_schema_extra={"off": [1]})
    """Samples per row: each is an output row of its own (`sample` 0..n-1, with its own tokens
    and times; with a seed, sample i uses seed + i)."""
    logprobs: bool | None = Field(None, json_schema_extra={"off": [False]})
    """Store each output token's log-probability."""
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS, json_schema_extra={"off": [0]})
    """With logprobs, the most likely alternatives stored per token (0-20)."""

    @field_validator("response_format", mode="before")
    @classmethod
    def _format_from_text(cls, v: Any) -> Any:
        """A JSON text (a Parquet string column, a CLI flag) is read as its object."""
        if isinstance(v, (str, bytes, bytearray)):
            try:
                return json.loads(v)
            except ValueError as err:
                raise ValueError(f"response_format is not valid JSON: {err}") from None
        return v

    @field_validator("response_format")
    @classmethod
    def _format(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        if v is None:
            return v
        check_response_format(v)
        return v

    @field_validator("choice")
    @classmethod
    def _choices(cls, v: list[str] | None) -> list[str] | None:
        if v is not None and (len(set(v)) != len(v) or any(not c for c in v)):
            raise ValueError("choice must list distinct, non-empty answers")
        return v

    @field_validator("regex")
    @classmethod
    def _regex(cls, v: str | None) -> str | None:
        if v is not None:
            import re

            try:
                re.compile(v)
            except re.error as err:
                raise ValueError(f"regex does not compile: {err}") from None
        return v

    @model_validator(mode="after")
    def _one_constraint(self) -> "RowSampling":
        both = constraints_set(self.model_dump(include=set(STRUCTURED_KEYS)))
        if len(both) > 1:
            raise ValueError(one_constraint_message(both))
        return self


def constraints_set(values: dict[str, Any]) -> list[str]:
    """The structured-output keys `values` sets (at most one is allowed)."""
    return [k for k in STRUCTURED_KEYS if structured_kind({k: values.get(k)}) is not None]


def one_constraint_message(keys: list[str]) -> str:
    return f"set one structured-output key, not {' and '.join(keys)}"


def check_response_format(v: dict[str, Any]) -> None:
    """ValueError (one line) unless `v` is a response_format tokenmill serves: text,
    json_object, or json_schema with a schema that is itself valid (jsonschema's meta-schema)."""
    kind = v.get("type")
    if kind in ("text", "json_object"):
        return
    if kind != "json_schema":
        raise ValueError(f"response_format.type must be text, json_object or json_schema, got {kind!r}")
    spec = v.get("json_schema")
    schema = spec.get("schema") if isinstance(spec, dict) else None
    if not isinstance(schema, dict):
        raise ValueError("response_format json_schema needs json_schema.schema, an object")
    from jsonschema import SchemaError, validators

    try:
        validators.validator_for(schema).check_schema(schema)
    except SchemaError as err:
        raise ValueError(f"response_format json_schema.schema is not a valid JSON Schema: {err.message}") from None


def structured_kind(sampling: dict[str, Any]) -> str | None:
    """The structured-output constraint a request's sampling sets: "json_schema",
    "json_object", "regex", "choice" or "grammar"; None for free text."""
    fmt = sampling.get("response_format")
    if isinstance(fmt, dict) and fmt.get("type") in ("json_schema", "json_object"):
        return fmt["type"]
    for key in ("regex", "choice", "grammar"):
        if sampling.get(key):
            return key
    return None


class RowSamplingError(ValueError):
    """A per-row sampling value out of type or range; the message names the key and the value."""

    def __init__(self, key: str, value: Any, message: str):
        super().__init__(message)
        self.key, self.value = key, value


def _metadata(info: FieldInfo, name: str) -> Any:
    return next((getattr(m, name) for m in info.metadata if getattr(m, name, None) is not None), None)


def base_type(annotation: Any) -> Any:
    """`int | None` → int; `list[str] | None` → list[str]."""
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        return args[0] if len(args) == 1 else annotation
    return annotation


def is_str_list(tp: Any) -> bool:
    return typing.get_origin(tp) is list and typing.get_args(tp) == (str,)


def expected(info: FieldInfo) -> str:
    """What a field accepts, in words: `an integer > 0`, `in (0, 1]`, `>= 0`."""
    tp = base_type(info.annotation)
    if is_str_list(tp):
        return "a string or a list of strings"
    lo, hi = (_metadata(info, "gt"), True), (_metadata(info, "lt"), True)
    if lo[0] is None:
        lo = (_metadata(info, "ge"), False)
    if hi[0] is None:
        hi = (_metadata(info, "le"), False)
    if lo[0] is not None and hi[0] is not None:
        rng = f"in {'(' if lo[1] else '['}{lo[0]:g}, {hi[0]:g}{')' if hi[1] else ']'}"
    elif lo[0] is not None:
        rng = f"{'>' if lo[1] else '>='} {lo[0]:g}"
    elif hi[0] is not None:
        rng = f"{'<' if hi[1] else '<='} {hi[0]:g}"
    else:
        rng = ""
    if tp is int:
        return f"an integer {rng}".strip()
    return rng or ("a number" if tp is float else f"a {getattr(tp, '__name__', tp)}")


def _short(v: Any) -> str:
    s = repr(v)
    return s if len(s) <= 80 else s[:77] + "..."


def _normalized(value: Any, tp: Any) -> Any:
    """Parquet's shapes of a value made the model's: a float column holding whole numbers
    (a column with nulls) is an int column; one stop string is a list of one."""
    if tp is int and isinstance(value, float) and value.is_integer():
        return int(value)
    if is_str_list(tp):
        if isinstance(value, str):
            return [value]
        if isinstance(value, tuple):
            return list(value)
    return value


def validate_row_sampling(values: dict[str, Any], model: type[RowSampling] = RowSampling) -> dict[str, Any]:
    """The sampling keys a row sets, checked against `model` (strictly: no strings for numbers,
    no bools).  Missing keys are not filled in; an empty stop list counts as unset.
    Raises RowSamplingError for the first bad key."""
    out: dict[str, Any] = {}
    for key, info in model.model_fields.items():
        if key not in values:
            continue
        tp = base_type(info.annotation)
        value = _normalized(values[key], tp)
        if is_str_list(tp) and value == []:
            continue
        try:
            checked = model.__pydantic_validator__.validate_assignment(model.model_construct(), key, value, strict=True)
        except ValidationError as err:
            own = next((e["ctx"]["error"] for e in err.errors() if e["type"] == "value_error"), None)
            message = str(own) if own is not None else f"{key} must be {expected(info)}, got {_short(values[key])}"
            raise RowSamplingError(key, values[key], message) from None
        out[key] = getattr(checked, key)
    both = constraints_set(out)
    if len(both) > 1:
        raise RowSamplingError(both[1], out[both[1]], one_constraint_message(both))
    return out


def request_sampling(defaults: RowSampling | dict[str, Any], p: Any) -> dict[str, Any]:
    """The engine's sampling parameters for one request: the job's defaults (every field of
    `defaults`, job-only keys such as `ignore_eos` too; or their `model_dump()`, which a
    caller asking for every row's makes once), the row's overrides (`p.sampling`) over them,
    and the row's resolved `p.max_tokens`."""
    s = dict(defaults) if isinstance(defaults, dict) else defaults.model_dump()
    if structured_kind(p.sampling) is not None:  # the row's constraint replaces the job's
        s.update(dict.fromkeys(STRUCTURED_KEYS))
    s.update({k: v for k, v in p.sampling.items() if k != "max_tokens"})
    s["max_tokens"] = p.max_tokens
    return s



def sample_requests(sampling: dict[str, Any]) -> list[dict[str, Any]]:
    """One request's sampling per sample it asks for (`n`, which no engine is sent): sample i
    of a seeded row is seeded seed + i, so each sample is reproducible and they differ."""
    n = int(sampling.get("n") or 1)
    one = {k: v for k, v in sampling.items() if k != "n"}
    if n == 1:
        return [one]
    seed = one.get("seed")
    return [{**one, "seed": None if seed is None else seed + i} for i in range(n)]


def request_keys(sampling: dict[str, Any], model: type[BaseModel] = RowSampling) -> dict[str, Any]:
    """The sampling keys a request carries: each of `model`'s fields in `sampling` whose value
    is set (not None, an empty list or one of the field's `off` values)."""
    out: dict[str, Any] = {}
    for key, info in model.model_fields.items():
        value = sampling.get(key)
        extra = info.json_schema_extra if isinstance(info.json_schema_extra, dict) else {}
        off = extra.get("off")
        if value is None or value == [] or (isinstance(off, list) and any(
                type(value) is type(o) and value == o for o in off)):
            continue
        out[key] = value
    return out
