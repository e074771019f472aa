"""Engines on a worker: the session protocol Generate drives (`protocol`), the one
entry point that gives a worker its session (`worker.worker_session`), one module
per engine kind (`vllm_session`; `openai_session`: an OpenAI-compatible HTTP server), the KV cache's size (`kv`), the CPU set-up, the
device checks, the GPU detector (`device`) and the per-process registry.

Nothing here imports vLLM or torch at import time: the CLI and the launcher
import these modules to check a job before any engine starts.
"""
