"""Records that flow through the pipeline, and the Arrow schemas of what it writes."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa

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

REASONS = (
    EMPTY_PROMPT,
    BAD_PROMPT_TYPE,
    BAD_MESSAGES,
    BAD_SAMPLING,
    DUPLICATE_ID,
    INVALID_UTF8,
    PROMPT_TOO_LONG,
    BAD_REQUEST,
    ENGINE_ERROR,
    ENGINE_TIMEOUT,
)

ROLES = ("system", "user", "assistant", "tool", "developer")


@dataclass(slots=True)
class PromptRecord:
    """A validated input row."""

    id: str
    input_ref: str
    prompt: str | None = None
    messages: list[dict[str, str]] | None = None
    sampling: dict[str, Any] = field(default_factory=dict)
    reference: str | None = None


@dataclass(slots=True)
class TokenizedPrompt:
    """A prompt after the chat template and tokenizer, ready for the engine."""

    id: str
    input_ref: str
    token_ids: list[int]
    prefix_key: str
    max_tokens: int
    sampling: dict[str, Any] = field(default_factory=dict)
    reference: str | None = None

    @property
    def budget_tokens(self) -> int:
        return len(self.token_ids) + self.max_tokens


@dataclass(slots=True)
class FailedRecord:
    """A row that cannot be served, with a reason code and a human message."""

    input_ref: str
    id: str | None
    reason: str
    message: str
    raw: str | None = None


@dataclass(slots=True)
class Batch:
    batch_id: str
    prompts: list[TokenizedPrompt]

    @property
    def tokens(self) -> int:
        return sum(p.budget_tokens for p in self.prompts)


OUTPUT_SCHEMA = pa.schema(
    [
        ("job_id", pa.string()),
        ("id", pa.string()),
        ("input_ref", pa.string()),
        ("model", pa.string()),
        ("text", pa.string()),
        ("finish_reason", pa.string()),
        ("prompt_tokens", pa.int64()),
        ("output_tokens", pa.int64()),
        ("cached_tokens", pa.int64()),
        ("ttft_s", pa.float64()),
        ("tpot_s", pa.float64()),
        ("e2e_s", pa.float64()),
        ("queue_s", pa.float64()),
        ("reference", pa.string()),
    ]
)

DEAD_LETTER_SCHEMA = pa.schema(
    [
        ("job_id", pa.string()),
        ("input_ref", pa.string()),
        ("id", pa.string()),
        ("reason", pa.string()),
        ("message", pa.string()),
        ("raw", pa.string()),
    ]
)
