"""A test-only engine, registered from the tests (`register(ENGINE)`), that no product file
names: it answers each request with the prompt's text read back, one step after it was
added, counting the prompt's token ids and the words it sends back.

Its config adds one key (`prefix`, put before each answer) to the keys every engine reads;
it is sent each prompt's text (`takes_text`), so Tokenize keeps the text for it."""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import Field

from tokenmill.schemas.config import EngineConfig
from tokenmill.transforms.engines.kinds import EngineKind
from tokenmill.transforms.engines.protocol import Finished


class EchoConfig(EngineConfig):
    kind: Literal["echo"] = Field(json_schema_extra={"flag": False})
    prefix: str = "echo:"
    """The answer's first word."""


def source_text(source: Any) -> str:
    """A prompt's text, or its last message's."""
    return source[-1]["content"] if isinstance(source, list) else str(source)


class EchoSession:
    def __init__(self, cfg: EchoConfig, model_path: str = ""):
        self.cfg, self.model_path = cfg, model_path
        self.max_num_seqs = cfg.max_num_seqs
        self.requests: dict[str, tuple[float, list[int], str, dict[str, Any]]] = {}
        self.sampling_seen: list[dict[str, Any]] = []
        self.killed = self.shut = False

    def add(self, request_id: str, token_ids, sampling: dict[str, Any], *, source=None) -> None:
        if source is None:
            raise ValueError("the echo engine is sent text: this request has none")
        self.requests[request_id] = (time.time(), list(token_ids), source_text(source), dict(sampling))
        self.sampling_seen.append(dict(sampling))

    def step(self) -> list[Finished]:
        if self.killed:
            raise RuntimeError("the echo engine was killed")
        now = time.time()
        done = []
        for rid, (t0, ids, text, sampling) in list(self.requests.items()):
            words = [self.cfg.prefix, *text.split()][: int(sampling["max_tokens"])]
            done.append(Finished(
                request_id=rid, text=" ".join(words), finish_reason="stop", prompt_tokens=len(ids),
                output_tokens=len(words), cached_tokens=None, ttft_s=now - t0, tpot_s=None, e2e_s=now - t0,
                queue_s=None, finished_at=now))
        self.requests.clear()
        return done

    def num_unfinished(self) -> int:
        return len(self.requests)

    def abort(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self.requests.pop(rid, None)

    def alive(self) -> bool:
        return not self.killed

    def kill(self) -> None:
        self.killed = True

    def info(self) -> dict[str, Any]:
        return {"device": "cpu", "engine": "echo", "load_s": 0.0}

    def shutdown(self) -> None:
        self.shut = True


class EchoEngine(EngineKind[EchoConfig]):
    kind = "echo"
    config = EchoConfig
    display_name = "Echo (tests)"
    summary = "echo (reads each prompt back; tests only)"
    takes_text = True
    measures_prefix_cache = False
    clocks = {"ttft_s": "echo engine: answered at its first step"}

    def session_factory(self):
        return EchoSession


ENGINE = EchoEngine()
