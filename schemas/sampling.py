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

import types
import typing
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from pydantic.fields import FieldInfo


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
        except ValidationError:
            raise RowSamplingError(key, values[key], f"{key} must be {expected(info)}, got {_short(values[key])}") from None
        out[key] = getattr(checked, key)
    return out


def request_sampling(defaults: RowSampling, p: Any) -> dict[str, Any]:
    """The engine's sampling parameters for one request: the job's defaults (every field of
    `defaults`, job-only keys such as `ignore_eos` too), the row's overrides (`p.sampling`)
    over them, and the row's resolved `p.max_tokens`."""
    s = defaults.model_dump()
    s.update({k: v for k, v in p.sampling.items() if k != "max_tokens"})
    s["max_tokens"] = p.max_tokens
    return s



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
