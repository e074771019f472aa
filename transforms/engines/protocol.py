"""What Generate needs from an engine: the session protocol and its finished-request record.

A second engine (llama.cpp, an OpenAI-compatible server) implements
`EngineSession` and plugs in through the session factory; Generate knows no engine.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

class EngineStartError(RuntimeError):
    """The engine cannot start with this config (said before any batch is sent)."""


@dataclass(slots=True)
class Finished:
    """One finished request, with token counts and times from the engine's own output."""

    request_id: str
    text: str
    finish_reason: str | None
    prompt_tokens: int
    output_tokens: int
    cached_tokens: int
    ttft_s: float | None
    tpot_s: float | None
    e2e_s: float | None
    queue_s: float | None
    finished_at: float
    output_token_ids: list[int] = field(default_factory=list)


class EngineSession(Protocol):
    """What Generate needs from an engine; tests pass a fake with the same methods."""

    max_num_seqs: int

    def add(self, request_id: str, token_ids: list[int], sampling: dict[str, Any]) -> None: ...
    def step(self) -> list[Finished]: ...
    def num_unfinished(self) -> int: ...
    def abort(self, request_ids: list[str]) -> None: ...
    def alive(self) -> bool: ...
    def info(self) -> dict[str, Any]: ...
    def shutdown(self) -> None: ...

