"""Where tokenmill keeps its files on this host (its home and models folders), and the error
for a model that is not there: the ground both schemas/models.py and schemas/model_sync.py
stand on."""

from __future__ import annotations

import json
import os
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator


class ModelNotFound(LookupError):
    pass


def tokenmill_home() -> Path:
    return Path(os.environ.get("TOKENMILL_HOME", Path.home() / ".cache" / "tokenmill"))


def models_dir() -> Path:
    return Path(os.environ.get("TOKENMILL_MODELS", tokenmill_home() / "models"))


def read_record(f: Path) -> dict[str, Any]:
    """A JSON record kept under tokenmill's home (a mapping); empty when missing or unreadable."""
    try:
        known = json.loads(f.read_text())
    except (OSError, ValueError):
        return {}
    return known if isinstance(known, dict) else {}


@contextmanager
def locked_record(f: Path) -> Iterator[dict[str, Any]]:
    """The record at `f` read under its file lock (`f`.lock, one writer at a time across
    processes), yielded to be changed in place, and written back whole (a temporary file then
    a rename: a reader never sees half of it) when it changed."""
    import filelock

    f.parent.mkdir(parents=True, exist_ok=True)
    with filelock.FileLock(str(f) + ".lock"):
        known = read_record(f)
        before = json.dumps(known, sort_keys=True)
        yield known
        if json.dumps(known, sort_keys=True) != before:
            tmp = f.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(known, indent=1, sort_keys=True))
            tmp.replace(f)
