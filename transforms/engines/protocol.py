"""What Generate needs from an engine: the session protocol and its finished-request record.

Each engine implements `EngineSession` and is registered as an `EngineKind`
(kinds.py); Generate knows no engine.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, Sequence

from tokenmill.schemas import records as R


class EngineStartError(RuntimeError):
    """The engine cannot start with this config (said before any batch is sent)."""


@dataclass(slots=True, kw_only=True)
class Finished(R.RequestFigures):
    """One finished request: its figures (`RequestFigures`: text, token counts and times
    from the engine's own output, which become the output row's as they are) and what
    Generate needs besides.

    A request the engine gave up on (the `openai` engine, after its retries) is finished
    with `error_reason` (a dead-letter reason code, schemas/records.py) and `error` (one
    line); Generate makes it that row's dead letter.  A figure the engine cannot
    measure (prefix-cache hits, queue time over HTTP) is None, never a guess."""

    request_id: str
    output_token_ids: list[int] = field(default_factory=list)
    error_reason: str | None = None
    error: str | None = None
    retries: dict[str, int] | None = None
    """Attempts retried before this one ended, by the failed attempt's reason code (an HTTP
    engine's); None where the engine does not retry."""
    token_count_source: str | None = R.TOKENS_BY_ENGINE
    """Where `prompt_tokens` and `output_tokens` came from (records.TOKEN_COUNT_SOURCES): the
    engine's own counts unless the engine says otherwise (an HTTP server without `usage`)."""


class EngineSession(Protocol):
    """Everything Generate calls on an engine; tests pass a fake with the same methods.

    A session factory is called as `factory(cfg, model_path, **start)`: the job's engine
    config (its engine's config model), the local folder Tokenize read, and the start
    keywords its engine's `EngineKind.start_kwargs` gave (none for a test double).

    An engine that streams (vLLM) also takes `priority=` (lower runs first) and `stream=True`
    in `add`, and keeps `progress`: each streamed request's text and output tokens so far, as
    of the last step (what `SharedSession` hands an online request step by step)."""

    max_num_seqs: int
    """The most requests the engine runs at once (Generate admits the next batch below it)."""

    def add(self, request_id: str, token_ids: Sequence[int], sampling: dict[str, Any], *, source: Any = None) -> None:
        """Queue one request; raises for a request the engine rejects (that row only).

        An engine that takes text (`EngineKind.takes_text`) is also given `source=` the
        prompt as the row wrote it (its text, or its chat messages); Generate passes it
        only when Tokenize kept it (`TokenizedPrompt.source`), so token-id engines get None.
        A row that names a LoRA adapter is added with `adapter=` its name (a key of the
        config's `lora_adapters`; only an engine that `serves_lora` is given one), and a row
        with images with `images=` their file bytes in the prompt's order, one placeholder token
        each in `token_ids` (only an engine that `takes_images` is given them)."""
        ...

    def step(self) -> list[Finished]:
        """Run one engine step; the requests that finished in it.  Raises when the engine failed."""
        ...

    def num_unfinished(self) -> int:
        """Requests added and neither finished nor aborted."""
        ...

    def abort(self, request_ids: list[str]) -> None:
        """Forget these requests (unknown ids are ignored)."""
        ...

    def alive(self) -> bool:
        """False once the engine died: the session must be replaced."""
        ...

    def kill(self) -> None:
        """Stop the engine at once, from another thread, so that a `step()` blocked in it raises."""
        ...

    def info(self) -> dict[str, Any]:
        """What the engine runs with (device, load_s, KV cache size...), recorded per worker;
        `weights_path`: the checkpoint folder or file it loaded, for an engine that loads local
        weights (its quantization record, if `tokenmill quantize` wrote one, is kept too)."""
        ...

    def shutdown(self) -> None:
        """Release the engine; the session is not used afterwards."""
        ...

