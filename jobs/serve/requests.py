"""What a request to `tokenmill serve` may hold, bounded before it reaches the database or an
engine: ids, cursors, offsets, filters, an upload's `expires_after` and the body of `POST
/v1/batches`.  Whatever is out of range, longer than the column it is compared with or stored
in, or holds a control character (PostgreSQL refuses NUL in text) is refused as a 400 in
OpenAI's error shape naming the field (app.py's handler of `RequestValidationError`), never a
500.  A column's width is read from the column (schemas/tables.py), here for the API's schema
and in `storable` for the service."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from fastapi import Path, Query
from pydantic import BaseModel, ConfigDict, Field, StringConstraints
from sqlalchemy import Column

from tokenmill.jobs.serve.config import WINDOW_PATTERN
from tokenmill.jobs.serve.errors import ApiError
from tokenmill.schemas import tables as T
from tokenmill.schemas.wire.openai.request import ENDPOINTS


def length_of(column: Column) -> int | None:
    """The most characters a string column stores (None: unbounded)."""
    return getattr(column.type, "length", None)


def storable(value: str, column: Column, param: str) -> str:
    """`value` when `column` can store it: no longer than the column's length and without a NUL
    (PostgreSQL refuses both at the insert); else a 400 naming `param`."""
    most = length_of(column)
    if (most is not None and len(value) > most) or "\x00" in value:
        raise ApiError(400, f"{param} must be a string of at most {most} characters without NUL, got "
                            f"{len(value):,} characters", param=param, code="invalid_value")
    return value


#: No control characters: a string compared with or stored in a text column.
PRINTABLE = r"^[^\x00-\x1f\x7f]*$"
#: The width of the service's id columns (`api_files.id`, `api_batches.id`).
ID_CHARS = length_of(T.api_files.c.id)
#: The width of `jobs.id`: a job's page takes the id of any job, run by the service or not.
JOB_ID_CHARS = length_of(T.jobs.c.id)
#: The largest page offset: past any row a database here holds, inside every backend's integer.
MAX_OFFSET = 2**31 - 1
#: OpenAI's bounds of `output_expires_after.seconds` and of an upload's `expires_after[seconds]`:
#: one hour to 30 days.
OUTPUT_EXPIRY_S = (3600, 30 * 24 * 3600)
#: How long an uploaded `purpose=batch` file is kept when its upload gives no `expires_after` (OpenAI's 30 days).
BATCH_FILE_TTL_S = 30 * 24 * 3600
#: The form fields of an upload's `expires_after`, as the `openai` SDK sends them.
EXPIRES_ANCHOR, EXPIRES_SECONDS = "expires_after[anchor]", "expires_after[seconds]"

Text = Annotated[str, StringConstraints(pattern=PRINTABLE)]
ObjectId = Annotated[str, Path(min_length=1, max_length=ID_CHARS, pattern=PRINTABLE)]
"""A file's or a batch's id in a route's path."""
JobId = Annotated[str, Path(min_length=1, max_length=JOB_ID_CHARS, pattern=PRINTABLE)]
"""A job's id in the page's path."""
After = Annotated[str | None, Query(max_length=ID_CHARS, pattern=PRINTABLE)]
"""A list's cursor: the id of the last object of the page before."""
Purpose = Annotated[str | None, Query(max_length=length_of(T.api_files.c.purpose), pattern=PRINTABLE)]
"""A file list's filter (as wide as `api_files.purpose`)."""
Offset = Annotated[int, Query(ge=0, le=MAX_OFFSET)]
"""The page's row offset."""
JobStatus = Annotated[str | None, Query(max_length=length_of(T.jobs.c.status), pattern=PRINTABLE)]
"""The page's status filter."""


class OutputExpiresAfter(BaseModel):
    """OpenAI's `output_expires_after`: how long after its anchor a batch's output is kept."""

    model_config = ConfigDict(extra="forbid")

    anchor: Literal["created_at"]
    seconds: int = Field(ge=OUTPUT_EXPIRY_S[0], le=OUTPUT_EXPIRY_S[1])


class CreateBatch(BaseModel):
    """The body of `POST /v1/batches`, each field no longer than its column (schemas/tables.py);
    metadata as OpenAI bounds it (keys of 64 characters, values of 512; the number of keys,
    `limits.max_metadata_keys`, and `metadata.priority`, a 32-bit integer, are the service's
    checks: `service.priority_of` is the one place a priority is read)."""

    model_config = ConfigDict(extra="forbid")

    input_file_id: Annotated[Text, StringConstraints(min_length=1, max_length=ID_CHARS)]
    # what the service accepts, described for clients and the fuzzer; the service refuses the
    # rest with its own message (service.create_batch)
    endpoint: Annotated[Text, StringConstraints(max_length=length_of(T.api_batches.c.endpoint)),
                        Field(json_schema_extra={"enum": list(ENDPOINTS)})]
    completion_window: Annotated[Text, StringConstraints(max_length=length_of(T.api_batches.c.completion_window)),
                                 Field(json_schema_extra={"pattern": WINDOW_PATTERN})]
    metadata: dict[Annotated[str, StringConstraints(max_length=64)],
                   Annotated[str, StringConstraints(max_length=512)]] | None = None
    output_expires_after: OutputExpiresAfter | None = None


def upload_expiry(anchor: Any, seconds: Any) -> int:
    """How long an upload is kept, from its form's `expires_after[anchor]` and
    `expires_after[seconds]` (both, or neither: `BATCH_FILE_TTL_S`); a 400 naming the field
    when one is missing or out of OpenAI's bounds."""
    if anchor is None and seconds is None:
        return BATCH_FILE_TTL_S
    if anchor != "created_at":
        raise ApiError(400, f"expires_after[anchor] must be 'created_at', got {str(anchor)[:40]!r}",
                       param="expires_after.anchor", code="invalid_value")
    least, most = OUTPUT_EXPIRY_S
    text = seconds if isinstance(seconds, str) else ""
    if not (text.isascii() and text.isdigit() and len(text) <= 9 and least <= int(text) <= most):
        raise ApiError(400, f"expires_after[seconds] must be a whole number from {least} to {most}, got "
                            f"{text[:40]!r}", param="expires_after.seconds", code="invalid_value")
    return int(text)


def stored_filename(name: str | None, default: str = "upload.jsonl") -> str:
    """An upload's file name as it is stored: control characters dropped, cut to the width of
    `api_files.filename`."""
    kept = "".join(ch for ch in (name or "") if ch.isprintable())[:length_of(T.api_files.c.filename)]
    return kept or default


def describe_upload() -> dict[str, Any]:
    """The OpenAPI body of `POST /v1/files` (the route reads its form itself, bounded)."""
    return {"requestBody": {"required": True, "content": {"multipart/form-data": {"schema": {
        "type": "object", "required": ["purpose", "file"],
        "properties": {"purpose": {"type": "string", "enum": ["batch"]},
                       "file": {"type": "string", "format": "binary"},
                       EXPIRES_ANCHOR: {"type": "string", "enum": ["created_at"]},
                       EXPIRES_SECONDS: {"type": "integer", "minimum": OUTPUT_EXPIRY_S[0],
                                         "maximum": OUTPUT_EXPIRY_S[1]}}}}}}}


#: Request fields that are mappings of the client's own keys: an error inside one names the
#: field, never a key (a key is the client's data, and OpenAI's `param` is the field).
MAPPING_FIELDS = ("metadata",)


def error_param(loc: tuple | list) -> str:
    """OpenAI's `param` for a validation error at pydantic's `loc`: the field's dotted path, cut
    at a mapping field (`metadata`, not `metadata.<key>`)."""
    parts = [str(p) for p in loc if p != "body"]
    for i, part in enumerate(parts):
        if part in MAPPING_FIELDS:
            return ".".join(parts[: i + 1])
    return ".".join(parts)
