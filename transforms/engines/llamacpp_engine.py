"""The `llamacpp` engine, registered: a `llama-server` each worker starts on a GGUF, bound
to the worker's cores and driven with the `openai` engine's client (config and session:
llamacpp_session.LlamaCppConfig, LlamaCppSession)."""

from __future__ import annotations

import logging
from typing import Any, Callable

from tokenmill.transforms.engines.cpu import claim_cpu_slot
from tokenmill.transforms.engines.kinds import EngineCheck, EngineKind, local_tokenizer
from tokenmill.transforms.engines.kv import JobTokens
from tokenmill.transforms.engines.llamacpp_session import (
    LlamaCppConfig,
    LlamaCppSession,
    binary,
    build_info,
    gguf_file,
    tokenizer_name,
)
from tokenmill.transforms.engines.lora import adapter_problems
from tokenmill.transforms.engines.openai_engine import CLIENT_CLOCKS
from tokenmill.transforms.engines.protocol import EngineSession, EngineStartError

log = logging.getLogger(__name__)


class LlamaCppEngine(EngineKind[LlamaCppConfig]):
    kind = "llamacpp"
    config = LlamaCppConfig
    display_name = "llama.cpp llama-server"
    summary = "llamacpp (a llama-server each worker starts on the GGUF --model names)"
    takes_text = True
    # llama-server reports the prompt tokens it reused (usage.prompt_tokens_details.cached_tokens),
    # each slot keeping its last prompt
    prefix_cache_per_slot = True
    # the same client as the `openai` engine; its server's load is seen, since it starts it
    clocks = {**CLIENT_CLOCKS, "model_load_s": "worker wall clock: the llamacpp engine starting its llama-server "
                                               "until /health answers, then the client's server check"}
    packages = ("llama.cpp", "httpx")
    serves_lora = True  # GGUF adapters loaded at start, one turned on per request (`lora`)

    def __init__(self) -> None:
        #: group → the cores this process claimed for its llama-server
        self.cores: dict[str, list[int]] = {}

    def session_factory(self) -> Callable[..., EngineSession]:
        return LlamaCppSession

    def start_kwargs(self, cfg: LlamaCppConfig, model_path: str, *, workers: int, group: str,
                     job_tokens: JobTokens | None) -> dict[str, Any]:
        """When `workers` engines share the host, the first call for `group` claims this
        process's CPU slot; the server binds its cores (and no other engine's)."""
        if workers <= 1:
            return {}
        if group not in self.cores:
            slot, self.cores[group] = claim_cpu_slot(workers, group)
            log.info("CPU slot %d of %d for llama-server group %s, cores %s", slot, workers, group, self.cores[group])
        return {"cores": self.cores[group]}

    def preflight(self, cfg: LlamaCppConfig, *, on_gpu: bool) -> EngineCheck:
        """llama-server built, the GGUF there, a local tokenizer of the same model, each LoRA
        adapter a GGUF adapter file of a rank within `max_lora_rank`."""
        check = EngineCheck()
        for one in (lambda: gguf_file(cfg.model), lambda: binary("llama-server")):
            try:
                one()
            except EngineStartError as err:
                check.problems.append(str(err))
        try:
            name = tokenizer_name(cfg)
        except EngineStartError as err:
            check.problems.append(str(err))
            return check
        check.model_path = local_tokenizer(self.kind, name, check)
        check.problems += adapter_problems(cfg, gguf=True)
        return check

    def checkpoint(self, cfg: LlamaCppConfig, model_path: str | None) -> str | None:
        """The GGUF file (its bytes hold the weights, the tokenizer and the chat template)."""
        return str(gguf_file(cfg.model))

    def describe(self, cfg: LlamaCppConfig, model_path: str | None) -> str:
        return f"{cfg.model} on llama-server (tokenizer {model_path})"

    def versions(self) -> dict[str, str]:
        """httpx's version and the server's build (`llama-server --version`), when it is built."""
        out = super().versions()
        try:
            out["llama.cpp"] = build_info()["version"]
        except (EngineStartError, OSError):
            pass
        return out


ENGINE = LlamaCppEngine()
