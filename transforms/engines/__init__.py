"""Engines on a worker: the session protocol Generate drives, one module per engine
kind, the CPU set-up, the device checks and the per-process registry.

Nothing here imports vLLM or torch at import time: the CLI and the launcher
import these modules to check a job before any engine starts.
"""
