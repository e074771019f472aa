"""Where tokenmill keeps its files on this host (its home and models folders), and the error
for a model that is not there: the ground both schemas/models.py and schemas/model_sync.py
stand on."""

from __future__ import annotations

import os
from pathlib import Path


class ModelNotFound(LookupError):
    pass


def tokenmill_home() -> Path:
    return Path(os.environ.get("TOKENMILL_HOME", Path.home() / ".cache" / "tokenmill"))


def models_dir() -> Path:
    return Path(os.environ.get("TOKENMILL_MODELS", tokenmill_home() / "models"))
