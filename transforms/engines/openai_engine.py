"""The `openai` engine, registered: any OpenAI-compatible HTTP server at `base_url`
(config: openai_session.OpenAIConfig; session: openai_session.OpenAISession).

It is sent each prompt's text or messages.  The Tokenize step counts and orders the
prompts the way `engine.token_count` says (`token_counter`: a local tokenizer, the
server's own /tokenize, or a stated estimate); that count stands in for the server's
when a server sends no `usage` (the rows' `token_count_source` says which).
"""

from __future__ import annotations

from typing import Any, Callable

from tokenmill.schemas.models import ModelNotFound, resolve_model
from tokenmill.transforms.counting import TokenCounter, probe_server, server_root
from tokenmill.transforms.engines.kinds import EngineCheck, EngineKind
from tokenmill.transforms.engines.kv import JobTokens
from tokenmill.transforms.engines.openai_config import OpenAIConfig, api_key
from tokenmill.transforms.engines.openai_session import OpenAISession, check_server
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


def token_counter(cfg: OpenAIConfig, local: Callable[[str], str | None]) -> TokenCounter:
    """How Tokenize counts this job's prompts (`cfg.token_count`; see OpenAIConfig);
    `local(name)` is the local tokenizer folder `name` resolves to, or None.
    EngineStartError (one line) when the way asked for is not there."""
    how = cfg.token_count
    if how == "tokenizer" or (how == "auto" and cfg.tokenizer):
        path = local(cfg.tokenizer or cfg.model)
        if path is None:
            raise EngineStartError(f"engine.token_count {how}: no local tokenizer {cfg.tokenizer or cfg.model!r} "
                                   "(set engine.tokenizer to a local model folder or short name)")
        return TokenCounter.local(path, model=cfg.tokenizer or cfg.model)
    if how in ("auto", "server"):
        root = server_root(cfg.base_url or "")
        style = probe_server(root, cfg.model, api_key(cfg))
        if style is not None:
            return TokenCounter("server", root=root, model=cfg.model, style=style, api_key_env=cfg.api_key_env)
        if how == "server":
            raise EngineStartError(f"engine.token_count server: {root}/tokenize does not answer with token ids "
                                   "(vLLM, SGLang and llama-server have one); use auto, tokenizer or estimate")
        path = local(cfg.model)
        if path is not None:
            return TokenCounter.local(path, model=cfg.model)
    return TokenCounter("estimate")



def _local(name: str) -> str | None:
    try:
        return str(resolve_model(name, need_weights=False))
    except ModelNotFound:
        return None


class OpenAIEngine(EngineKind[OpenAIConfig]):
    kind = "openai"
    config = OpenAIConfig
    display_name = "OpenAI-compatible server"
    summary = "openai (an OpenAI-compatible server at --base-url)"
    takes_text = True
    measures_prefix_cache = False
    local_weights = False  # the server's: its answers are never cached (docs/CACHE.md)
    serves_lora = True  # an adapter's served name sent as the request's `model`
    clocks = CLIENT_CLOCKS
    packages = ("httpx",)

    def __init__(self) -> None:
        #: (engine config, model path) → the rows' token_count_source without `usage`
        self.count_sources: dict[tuple[str, str], str] = {}

    def session_factory(self) -> Callable[..., EngineSession]:
        return OpenAISession

    def start_kwargs(self, cfg: OpenAIConfig, model_path: str, *, workers: int, group: str,
                     job_tokens: JobTokens | None) -> dict[str, Any]:
        """The rows' token_count_source without `usage`: how Tokenize counted (the same
        choice the launcher made, `model_path` being the local tokenizer it found, if any)."""
        key = (cfg.model_dump_json(), model_path)
        if key not in self.count_sources:  # asked once per worker and job, not once a batch
            self.count_sources[key] = token_counter(cfg, lambda name: model_path or None).row_source
        return {"count_source": self.count_sources[key]}

    def preflight(self, cfg: OpenAIConfig, *, on_gpu: bool) -> EngineCheck:
        """The API key variable set, the server up and serving `engine.model` (/v1/models),
        and a way to count the prompts (`token_counter`)."""
        check = EngineCheck()
        try:
            check_server(cfg)
            check.counter = token_counter(cfg, _local)
            check.model_path = check.counter.model_path or ""
        except EngineStartError as err:
            check.problems.append(str(err))
        return check

    def adapter_paths(self, cfg: OpenAIConfig) -> dict[str, str]:
        """None here: the server holds the adapters (its answers are never cached)."""
        return {}

    def describe(self, cfg: OpenAIConfig, model_path: str | None) -> str:
        return f"{cfg.model} at {cfg.base_url} ({token_counter(cfg, lambda name: model_path or None).describe()})"


ENGINE = OpenAIEngine()
