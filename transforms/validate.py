"""Validate: a raw row dict becomes a PromptRecord or a FailedRecord with a reason.

Nothing is dropped silently: every problem a single row can have is a dead
letter with a reason code (schemas/records.py) and a message that says what
was wrong and what was given.
"""

from __future__ import annotations

import json
import math
from typing import Any, Collection

import apache_beam as beam

from tokenmill.schemas import records as R
from tokenmill.schemas.records import FailedRecord, PromptRecord
from tokenmill.schemas.sampling import RowSampling, RowSamplingError, validate_row_sampling
from tokenmill.transforms.chunks import MapRows, with_dead
from tokenmill.transforms.images import ContentError, ImageRules, column_image, parse_content, with_column_image

RAW_LIMIT = 2000
#: The input column (an OpenAI batch line: its body `model` naming an adapter) that picks a row's LoRA adapter.
ADAPTER_COLUMN = "adapter"


class RowError(ValueError):
    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


def _text(value: Any, what: str) -> str:
    """bytes/str → str; invalid UTF-8 and non-strings raise RowError."""
    if isinstance(value, (bytes, bytearray)):
        try:
            return bytes(value).decode("utf-8")
        except UnicodeDecodeError as err:
            raise RowError(R.INVALID_UTF8, f"{what} is not valid UTF-8 (byte {err.start})") from None
    if isinstance(value, str):
        return value
    raise RowError(R.BAD_PROMPT_TYPE, f"{what} must be a string, got {type(value).__name__}")


def _is_missing(v: Any) -> bool:
    return v is None or (isinstance(v, float) and math.isnan(v))


def parse_messages(value: Any, images: list[bytes] | None = None,
                   rules: ImageRules | None = None) -> list[dict[str, Any]]:
    """Chat turns; a content may be a list of OpenAI parts (text, and `image_url` with `rules`:
    each image's bytes appended to `images`, transforms/images.py)."""
    if isinstance(value, (bytes, bytearray, str)):
        text = _text(value, "messages")
        try:
            value = json.loads(text)
        except json.JSONDecodeError as err:
            raise RowError(R.BAD_MESSAGES, f"messages is not valid JSON: {err.msg} at position {err.pos}") from None
    if not isinstance(value, (list, tuple)) or not value:
        raise RowError(R.BAD_MESSAGES, f"messages must be a non-empty list of {{role, content}}, got {_short(value)}")
    out = []
    for i, m in enumerate(value):
        if not isinstance(m, dict):
            raise RowError(R.BAD_MESSAGES, f"messages[{i}] must be an object with role and content, got {_short(m)}")
        role = m.get("role")
        role = None if role is None else _text(role, f"messages[{i}].role")
        if role is None or role not in R.ROLES:
            raise RowError(R.BAD_MESSAGES, f"messages[{i}].role must be one of {list(R.ROLES)}, got {role!r}")
        if _is_missing(m.get("content")):
            raise RowError(R.BAD_MESSAGES, f"messages[{i}] has no content")
        if isinstance(m["content"], (list, tuple)) and rules is not None and images is not None:
            content, got = parse_content(list(m["content"]), f"messages[{i}]", rules)
            out.append({"role": role, "content": content})
            images += got
            continue
        try:
            content = _text(m.get("content"), f"messages[{i}].content")
        except RowError as err:
            if err.reason == R.BAD_PROMPT_TYPE:
                raise RowError(R.BAD_MESSAGES, str(err)) from None
            raise
        out.append({"role": role, "content": content})
    if all(isinstance(m["content"], str) and not m["content"].strip() for m in out):
        raise RowError(R.EMPTY_PROMPT, "all messages have empty content")
    return out


def _short(v: Any) -> str:
    s = repr(v)
    return s if len(s) <= 80 else s[:77] + "..."


def parse_sampling(row: dict[str, Any], model: type[RowSampling] = RowSampling) -> dict[str, Any]:
    """Per-row overrides of the keys `model` declares; values it refuses (as vLLM would)
    are dead letters here, the message naming the key and the value."""
    values: dict[str, Any] = {}
    for key in model.model_fields:
        if key not in row or _is_missing(row[key]):
            continue
        v = row[key]
        if isinstance(v, (bytes, bytearray)):
            v = _text(v, key)
        elif isinstance(v, (list, tuple)):  # stop strings may come as bytes too
            v = [_text(s, key) if isinstance(s, (bytes, bytearray)) else s for s in v]
        values[key] = v
    try:
        return validate_row_sampling(values, model)
    except RowSamplingError as err:
        raise RowError(R.BAD_SAMPLING, str(err)) from None


def raw_repr(row: dict[str, Any]) -> str:
    def enc(v):
        if isinstance(v, (bytes, bytearray)):
            return bytes(v).decode("utf-8", errors="replace")
        return v

    clean = {k: enc(v) for k, v in row.items() if not k.startswith("_")}
    s = json.dumps(clean, default=str, ensure_ascii=False)
    return s if len(s) <= RAW_LIMIT else s[: RAW_LIMIT - 3] + "..."


def used_columns(columns: list[str], reference_column: str | None = None, image_column: str | None = None) -> list[str]:
    """The columns of a Parquet input a job reads (in the input's order): those
    `validate_row` looks at (id, prompt, messages, adapter, the per-row sampling keys, the
    reference column, the image column).  The others are never read from storage, and a dead
    letter's `raw` shows only these."""
    keys = {"id", "prompt", "messages", ADAPTER_COLUMN, *RowSampling.model_fields,
            *([reference_column] if reference_column else []), *([image_column] if image_column else [])}
    return [c for c in columns if c in keys]


def parse_adapter(row: dict[str, Any], adapters: Collection[str]) -> str | None:
    """The LoRA adapter a row names (its `adapter` column; null or empty: the base model);
    a name the job did not declare in `engine.lora_adapters` is the row's `unknown_adapter`."""
    v = row.get(ADAPTER_COLUMN)
    if _is_missing(v):
        return None
    name = _text(v, ADAPTER_COLUMN).strip()
    if not name:
        return None
    if name not in adapters:
        declared = ", ".join(sorted(adapters)) or "none"
        raise RowError(R.UNKNOWN_ADAPTER, f"adapter {_short(name)} is not declared in engine.lora_adapters "
                                          f"(declared: {declared})")
    return name


def row_id(row: dict[str, Any]) -> str:
    v = row.get("id")
    if _is_missing(v):
        return f"row-{row['_file_index']}-{row['_row']}"
    if isinstance(v, (bytes, bytearray)):
        return bytes(v).decode("utf-8", errors="replace")
    if isinstance(v, float) and v.is_integer():
        v = int(v)
    return str(v)


def validate_row(row: dict[str, Any], reference_column: str | None = None,
                 adapters: Collection[str] = (), images: ImageRules | None = None) -> PromptRecord | FailedRecord:
    """`adapters`: the names a row's `adapter` may take (the job's `engine.lora_adapters`);
    `images`: how the job takes images (None: a message content must be text)."""
    ref = {"input_file": row["_file_index"], "input_row": row["_row"]}
    rid = row_id(row)
    if "_error" in row:  # the reader could not make a request of it (a malformed OpenAI batch line)
        reason, message = row["_error"]
        return FailedRecord(**ref, id=rid, reason=reason, message=message, raw=row.get("_raw"))
    try:
        prompt = messages = None
        pictures: list[bytes] = []
        if not _is_missing(row.get("messages")):
            messages = parse_messages(row["messages"], pictures, images)
        elif "prompt" in row and not _is_missing(row.get("prompt")):
            v = row["prompt"]
            if not isinstance(v, (str, bytes, bytearray)):
                raise RowError(R.BAD_PROMPT_TYPE, f"prompt must be a string, got {type(v).__name__}: {_short(v)}")
            prompt = _text(v, "prompt")
            if not prompt.strip():
                raise RowError(R.EMPTY_PROMPT, "prompt is empty")
        else:
            raise RowError(R.EMPTY_PROMPT, "prompt is null" if "prompt" in row else "messages is null")
        column = images.column if images else None
        image = column_image(row.get(column), column, images) if images and column else None
        if image is not None and column:
            if messages is None:
                raise RowError(R.BAD_IMAGE, f"{column}: a prompt row has no place for an image (give messages)")
            messages, pictures = with_column_image(messages, pictures, image, column)
        sampling = parse_sampling(row)
        adapter = parse_adapter(row, adapters)
        reference = None
        if reference_column and not _is_missing(row.get(reference_column)):
            reference = _text(row[reference_column], reference_column)
        return PromptRecord(id=rid, **ref, prompt=prompt, messages=messages, sampling=sampling, reference=reference,
                            adapter=adapter, images=tuple(pictures))
    except (RowError, ContentError) as err:
        return FailedRecord(**ref, id=rid, reason=err.reason, message=str(err), raw=raw_repr(row))


class ValidateFn(MapRows):
    def __init__(self, reference_column: str | None = None, adapters: Collection[str] = (),
                 images: ImageRules | None = None):
        self._ref = reference_column
        self._adapters = frozenset(adapters)
        self._images = images

    def map_row(self, row):
        return validate_row(row, self._ref, self._adapters, self._images)


class Validate(beam.PTransform):
    """Chunks of row dicts → chunks of PromptRecords (main) and FailedRecords (tag `dead`);
    `adapters`: the LoRA adapter names the job declares; `images`: how it takes images."""

    def __init__(self, reference_column: str | None = None, adapters: Collection[str] = (),
                 images: ImageRules | None = None):
        super().__init__()
        self._fn = ValidateFn(reference_column, adapters, images)

    def expand(self, chunks):
        return chunks | with_dead(self._fn, "ValidateRows")
