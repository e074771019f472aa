"""Engines on a worker: the session protocol Generate drives (`protocol`), the registered
engine objects (`kinds.EngineKind`: one per engine, found through the `tokenmill.engines`
entry points), the one entry point that gives a worker its session (`worker.worker_session`),
each engine's modules (`vllm_config`, `vllm_session`, `vllm_engine`; `openai_session`,
`openai_engine`: an OpenAI-compatible HTTP server; `llamacpp_session`, `llamacpp_engine`),
the KV cache's size (`kv`), the CPU set-up, the device checks, the GPU detector (`device`)
and the per-process session registry (`registry`).

Nothing here imports vLLM or torch at import time: the CLI and the launcher
import these modules to check a job before any engine starts.
"""
