"""The keys of the engines driven over HTTP (`openai`, and `llamacpp` through its own
server): the client's requests in flight, time limits and retries (`HttpClientConfig`), and
`kind: openai`'s server, API key variable and counting (`OpenAIConfig`).  The client is
openai_session.py."""

from __future__ import annotations

import os
import re
from typing import Literal

from pydantic import Field, field_validator, model_validator

from tokenmill.schemas.config import EngineConfig
from tokenmill.transforms.engines.protocol import EngineStartError

#: The longest wait between two attempts of a request (the backoff's cap).
BACKOFF_CAP_S = 30.0


class HttpClientConfig(EngineConfig):
    """The keys of an engine driven over HTTP by this module's client (this engine, and
    `llamacpp` through its own server): requests in flight, their time limit and retries."""

    max_in_flight: int = Field(16, ge=1, le=4096, json_schema_extra={"flag": False})
    """Requests each worker has open at once (for `llamacpp`: the server's parallel slots, `-np`,
    each holding `max_model_len` tokens)."""
    request_timeout_s: float = Field(300.0, gt=0, json_schema_extra={"flag": False})
    """The longest one attempt of a request may take (and wait between bytes)."""
    max_retries: int = Field(3, ge=0, le=100, json_schema_extra={"flag": False})
    """Retries of a request after a 429, a 5xx, a timeout, a dropped connection or a malformed
    response (exponential backoff with jitter); then the row is a dead letter."""

    def http_worst_case_s(self) -> float:
        """The longest one row may take: every attempt timing out, with the longest backoff between them."""
        return (self.max_retries + 1) * self.request_timeout_s + self.max_retries * BACKOFF_CAP_S

    def batch_timeout_problem(self, batch_timeout_s: float) -> str | None:
        worst = self.http_worst_case_s()
        if worst < batch_timeout_s:
            return None
        return (f"a row may take {worst:g} s over its {self.max_retries + 1} attempts "
                f"(request_timeout_s {self.request_timeout_s:g} each, plus backoff), not under "
                f"batching.batch_timeout_s {batch_timeout_s:g}: lower request_timeout_s or "
                "max_retries, or raise batch_timeout_s")


class OpenAIConfig(HttpClientConfig):
    """`engine:` for `kind: openai`: any OpenAI-compatible HTTP server at `base_url`.  `model`
    is the name the server serves (as its /v1/models lists it)."""

    kind: Literal["openai"] = Field(json_schema_extra={"flag": False})
    base_url: str | None = Field(None, json_schema_extra={
        "flag_help": "--engine openai: the server's API root, e.g. http://HOST:8000/v1."})
    """The server's OpenAI API root, e.g. `http://10.0.0.5:8000/v1`."""
    api_key_env: str | None = Field(None, json_schema_extra={
        "metavar": "VAR", "flag_help": "--engine openai: the environment variable holding the API key (never the key)."})
    """The environment variable that holds the API key (read by each worker; the key itself
    is never in the spec).  Unset: no key is sent."""

    token_count: Literal["auto", "server", "tokenizer", "estimate"] = Field("auto", json_schema_extra={
        "flag_help": "--engine openai: how prompts are counted before they are sent: auto (the "
                     "tokenizer when given, else the server's /tokenize, else the model as a local folder, "
                     "else an estimate), server, tokenizer or estimate."})
    """How the prompts are counted (and ordered, and batched) before they are sent
    (transforms/counting.py): `auto` uses `tokenizer` when it is set, else the server's own
    `/tokenize` when it has one, else `model` as a local tokenizer folder, else an estimate
    (one token per 4 bytes of text); `server`, `tokenizer` and `estimate` insist on one.
    The server's `usage` counts still win where it sends them."""

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
    def _servers_pooling(self) -> "OpenAIConfig":
        if self.pooling is not None:
            raise ValueError("kind openai embeds with the server's own pooling: leave pooling unset")
        return self

    @model_validator(mode="after")
    def _needs_base_url(self) -> "OpenAIConfig":
        if not self.base_url:
            raise ValueError("kind openai needs base_url (the server's OpenAI API root, e.g. http://HOST:8000/v1)")
        return self


def api_key(cfg: OpenAIConfig) -> str | None:
    """The API key from the variable `cfg.api_key_env` names (None when it names none);
    EngineStartError when that variable is not set."""
    if not cfg.api_key_env:
        return None
    key = os.environ.get(cfg.api_key_env)
    if not key:
        raise EngineStartError(f"engine.api_key_env names {cfg.api_key_env}, which is not set in this environment")
    return key


