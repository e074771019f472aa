"""The `openai` engine, registered: any OpenAI-compatible HTTP server at `base_url`
(config: openai_session.OpenAIConfig; session: openai_session.OpenAISession).

It is sent each prompt's text or messages; the job's own (local) tokenizer counts and
orders the prompts, and stands in for the server's counts when a server sends no
`usage` (the rows' `token_count_source` says so).
"""

from __future__ import annotations

from typing import Callable

from tokenmill.transforms.engines.kinds import EngineCheck, EngineKind, local_tokenizer
from tokenmill.transforms.engines.openai_session import OpenAIConfig, OpenAISession, check_server
from tokenmill.transforms.engines.protocol import EngineSession, EngineStartError

#: The figures this engine measures on the client's clock (the worker's HTTP call), network
#: and server queue included (shown beside the figures in reports).
CLIENT_CLOCKS: dict[str, str] = {
    "ttft_s": "client clock (worker, monotonic), HTTP engine: first streamed token - request sent",
    "tpot_s": "client clock (worker, monotonic), HTTP engine: (last streamed token - first) / (output tokens - 1)",
    "e2e_s": "client clock (worker, monotonic), HTTP engine: end of the stream - request sent (answered attempt)",
    "queue_s": "not measured by an HTTP engine (null): the server's queue is inside TTFT",
    "model_load_s": "worker wall clock: the openai engine's server check (/v1/models); the server's own load is not seen",
}


class OpenAIEngine(EngineKind[OpenAIConfig]):
    kind = "openai"
    config = OpenAIConfig
    display_name = "OpenAI-compatible server"
    summary = "openai (an OpenAI-compatible server at --base-url)"
    takes_text = True
    measures_prefix_cache = False
    clocks = CLIENT_CLOCKS
    packages = ("httpx",)

    def session_factory(self) -> Callable[..., EngineSession]:
        return OpenAISession

    def preflight(self, cfg: OpenAIConfig, *, on_gpu: bool) -> EngineCheck:
        """A local tokenizer (it counts and orders the prompts), the API key variable set,
        the server up and serving `engine.model` (/v1/models)."""
        check = EngineCheck()
        check.model_path = local_tokenizer(self.kind, cfg.tokenizer or cfg.model, check)
        try:
            check_server(cfg)
        except EngineStartError as err:
            check.problems.append(str(err))
        return check

    def describe(self, cfg: OpenAIConfig, model_path: str | None) -> str:
        return f"{cfg.model} at {cfg.base_url} (tokenizer {model_path})"


ENGINE = OpenAIEngine()
