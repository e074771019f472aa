"""Which engine kinds exist: one registered object per engine, keyed by its kind.

The built-in engines are found through the `tokenmill.engines` entry points (setup.cfg:
`vllm = tokenmill.transforms.engines.vllm_engine:ENGINE`, ...), loaded on first use, so
a plugin package adds an engine by declaring one; a test registers its own with
`register`.  Of an engine object, the job spec needs only its `kind` and its `config`
model (`JobSpec.engine` is validated by it); the rest of its contract is
`tokenmill.transforms.engines.kinds.EngineKind`.
"""

from __future__ import annotations

import threading
from importlib.metadata import entry_points
from typing import Any, Protocol

#: The entry-point group the built-in engines (and plugins) are declared in.
ENTRY_POINT_GROUP = "tokenmill.engines"


class Registered(Protocol):
    """What the job spec reads of an engine object."""

    kind: str
    config: type


class UnknownEngine(LookupError):
    """No engine is registered under this kind; the message names the registered ones."""


_ENGINES: dict[str, Any] = {}
_LOADED = False
_LOCK = threading.RLock()


def _load_entry_points() -> None:
    global _LOADED
    with _LOCK:
        if _LOADED:
            return
        _LOADED = True
        for ep in entry_points(group=ENTRY_POINT_GROUP):
            if ep.name not in _ENGINES:
                obj = ep.load()
                _ENGINES.setdefault(obj.kind, obj)


def register(engine: Any) -> Any:
    """Add (or replace) the engine object for `engine.kind`; returns it."""
    _load_entry_points()
    with _LOCK:
        _ENGINES[engine.kind] = engine
    return engine


def unregister(kind: str) -> None:
    """Forget a registered kind (a test's own engine, after the test)."""
    with _LOCK:
        _ENGINES.pop(kind, None)


def registered(kind: str) -> Any:
    """The engine object registered for `kind`; UnknownEngine (one line) otherwise."""
    _load_entry_points()
    try:
        return _ENGINES[kind]
    except KeyError:
        raise UnknownEngine(f"unknown engine kind {kind!r}; registered: {', '.join(registered_kinds())}") from None


def registered_kinds() -> list[str]:
    """Every registered kind, in the order registered (the entry points' order first)."""
    _load_entry_points()
    return list(_ENGINES)
