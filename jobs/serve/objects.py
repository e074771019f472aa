"""The objects the service returns, each checked against the `openai` package's own type before
it leaves (a field renamed or missing fails there, and in the tests).  Their shapes are the wire
format's (schemas/wire/openai/objects.py); this module only checks them."""

from __future__ import annotations

from typing import Any

from openai.types import Batch, FileDeleted, FileObject

from tokenmill.schemas.wire.openai import objects as W
from tokenmill.schemas.wire.openai.objects import ENDED, batch_status, error_body, page, usage_of

__all__ = ["ENDED", "batch_object", "batch_status", "error_body", "file_deleted", "file_object", "page", "usage_of"]


def file_object(f: dict[str, Any]) -> dict[str, Any]:
    return FileObject.model_validate(W.file_object(f)).model_dump(mode="json")


def file_deleted(file_id: str) -> dict[str, Any]:
    return FileDeleted.model_validate(W.file_deleted(file_id)).model_dump(mode="json")


def batch_object(b: dict[str, Any], counts: dict[str, int] | None = None) -> dict[str, Any]:
    """A batch row as OpenAI's `Batch` (W.batch_object), validated."""
    return Batch.model_validate(W.batch_object(b, counts)).model_dump(mode="json")
