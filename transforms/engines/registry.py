"""One engine per worker process: loaded once, reused across bundles and pipelines,
stopped when the process exits."""

from __future__ import annotations

import json
import threading

from tokenmill.schemas.config import EngineConfig
from tokenmill.transforms.engines.protocol import EngineSession

_SESSIONS: dict[str, EngineSession] = {}
_LOCK = threading.Lock()


def session_key(cfg: EngineConfig, model_path: str, factory=None) -> str:
    kind = "vllm" if factory is None else f"{getattr(factory, '__module__', '')}.{getattr(factory, '__qualname__', repr(factory))}"
    return json.dumps([kind, model_path, cfg.model_dump(mode="json")], sort_keys=True)


def get_session(cfg: EngineConfig, model_path: str, factory=None) -> EngineSession:
    """The process's engine for this config, loaded once and reused across bundles and
    pipelines.  A real engine with a different config replaces the previous real one
    (one engine per worker process); fakes for tests never displace it."""
    key = session_key(cfg, model_path, factory)
    with _LOCK:
        s = _SESSIONS.get(key)
        if s is not None and s.alive():
            return s
        if s is not None:
            _SESSIONS.pop(key).shutdown()
        if factory is None:
            for k in [k for k in _SESSIONS if k.startswith('["vllm"')]:
                _SESSIONS.pop(k).shutdown()
        if factory is None:
            from tokenmill.transforms.engines.vllm_session import VllmSession as factory
        s = factory(cfg, model_path)
        _SESSIONS[key] = s
        _register_atexit()
        return s


_ATEXIT = False


def _register_atexit() -> None:
    # vLLM's engine core is a child process: stop it when the worker exits, or
    # the interpreter waits on it forever at shutdown.
    global _ATEXIT
    if not _ATEXIT:
        import atexit

        atexit.register(_shutdown_at_exit)
        _ATEXIT = True


def _shutdown_at_exit() -> None:
    # At interpreter exit the handlers' streams (pytest's capture, a closed pipe)
    # may already be gone; vLLM's shutdown messages must not print logging errors.
    import logging

    logging.raiseExceptions = False
    shutdown_all()


def drop_session(cfg: EngineConfig, model_path: str, factory=None) -> None:
    with _LOCK:
        s = _SESSIONS.pop(session_key(cfg, model_path, factory), None)
    if s is not None:
        s.shutdown()


def shutdown_all() -> None:
    with _LOCK:
        for k in list(_SESSIONS):
            _SESSIONS.pop(k).shutdown()
