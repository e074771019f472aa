"""One engine per session factory per worker process: loaded once, reused across
bundles and pipelines, stopped when the process exits."""

from __future__ import annotations

import json
import threading
from typing import Any, Callable

from tokenmill.schemas.config import DEFAULT_ENGINE_KIND, EngineConfig
from tokenmill.transforms.engines.kinds import engine_of
from tokenmill.transforms.engines.protocol import EngineSession

SessionFactory = Callable[..., EngineSession]

#: factory → (the config key its session was made for, the session, the start keywords it was made with and the
#: work it was made for: `for_work`)
_SESSIONS: dict[SessionFactory, tuple[str, EngineSession, tuple[str, dict[str, Any]]]] = {}
# Re-entrant: a factory may itself take a session from the registry (a test wrapper
# around the process's real engine).
_LOCK = threading.RLock()
#: What each session this process makes is wrapped in (None: nothing): a `tokenmill serve` engine
#: process shares its engine with online requests (`share_sessions`, engines/shared_session.py).
_WRAP: Callable[[EngineSession], EngineSession] | None = None


def share_sessions(wrap: Callable[[EngineSession], EngineSession] | None) -> None:
    """Wrap every session this process makes from now on in `wrap(session)` (None: stop)."""
    global _WRAP
    _WRAP = wrap


def default_factory() -> SessionFactory:
    """The default engine's session factory (importing it does not import the engine's library)."""
    return engine_of(DEFAULT_ENGINE_KIND).session_factory()


def factory_for(cfg: EngineConfig) -> SessionFactory:
    """The session factory of the engine `cfg.kind` names."""
    return engine_of(cfg.kind).session_factory()


def _config_key(cfg: EngineConfig, model_path: str) -> str:
    return json.dumps([model_path, cfg.model_dump(mode="json")], sort_keys=True)


def get_session(cfg: EngineConfig, model_path: str, factory: SessionFactory | None = None, *, for_work: str = "",
                **start) -> EngineSession:
    """The process's session of `factory` (default: its engine's) for this config, made once and
    reused across bundles and pipelines.  A session of the same factory with another
    config, or a dead one, is shut down and replaced; sessions of other factories are
    untouched (so test fakes never displace the real engine).  `start`: keywords for
    the factory when a session is made (the work it is started for); they are not
    part of the config a session is reused for.  `for_work` names that work (a job run),
    kept with the session (`started_with`)."""
    factory = factory or factory_for(cfg)
    key = _config_key(cfg, model_path)
    with _LOCK:
        held = _SESSIONS.get(factory)
        if held is not None and held[0] == key and held[1].alive():
            return held[1]
        if held is not None:
            del _SESSIONS[factory]
            held[1].shutdown()
        s = factory(cfg, model_path, **start)
        if _WRAP is not None:
            s = _WRAP(s)
        _SESSIONS[factory] = (key, s, (for_work, dict(start)))
        _register_atexit()
        return s


def started_with(cfg: EngineConfig, model_path: str, factory: SessionFactory) -> tuple[str, dict[str, Any]] | None:
    """The work (`for_work`) and the start keywords of the process's live session of `factory`
    for this config (None: there is none), so its engine's start policy can tell whether new
    work outgrew it."""
    with _LOCK:
        held = _SESSIONS.get(factory)
        if held is None or held[0] != _config_key(cfg, model_path) or not held[1].alive():
            return None
        return held[2][0], dict(held[2][1])


def drop_session(cfg: EngineConfig, model_path: str, factory: SessionFactory | None = None) -> None:
    """Shut down the process's session of `factory` if it was made for this config."""
    factory = factory or factory_for(cfg)
    with _LOCK:
        held = _SESSIONS.get(factory)
        if held is None or held[0] != _config_key(cfg, model_path):
            return
        del _SESSIONS[factory]
    held[1].shutdown()


def sessions() -> list[EngineSession]:
    """The sessions this process holds now, oldest first (for tests and benchmarks to inspect)."""
    with _LOCK:
        return [s for _, s, _ in _SESSIONS.values()]


def shutdown_all(*, keep_default: bool = False) -> None:
    """Shut down every session of this process; with `keep_default`, all but the
    default factory's (tests stop their fakes and keep the real engine loaded)."""
    keep = default_factory() if keep_default else None
    with _LOCK:
        for factory in [f for f in _SESSIONS if f is not keep]:
            _SESSIONS.pop(factory)[1].shutdown()


_ATEXIT = False


def _register_atexit() -> None:
    # vLLM's engine core is a non-daemonic multiprocessing child, which
    # multiprocessing's own exit handler joins for ever: the engines must stop
    # before it runs.  Exit handlers run last registered first, and multiprocessing
    # registers its handler when `multiprocessing.util` is first imported, so it is
    # imported here first: a session made before anything imported it (a fake in the
    # tests) left ours to run after it, and the interpreter hung at exit.
    global _ATEXIT
    if not _ATEXIT:
        import atexit
        import multiprocessing.util  # noqa: F401  (registers multiprocessing's exit handler before ours)

        atexit.register(_shutdown_at_exit)
        _ATEXIT = True


def _shutdown_at_exit() -> None:
    # At interpreter exit the handlers' streams (pytest's capture, a closed pipe)
    # may already be gone; vLLM's shutdown messages must not print logging errors.
    import logging

    logging.raiseExceptions = False
    shutdown_all()
