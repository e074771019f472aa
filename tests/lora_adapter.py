"""A LoRA adapter for the bundled model, made here with peft, once per machine and recipe.

`adapter_set()` trains a rank-8 adapter on q/v projections for a few steps on one fixed
text (greedy, seeded: the same adapter every time), so that its greedy answers differ from
the base model's, and saves beside it the merged-weights model (peft's `merge_and_unload`,
float32, with the base's tokenizer and chat template): rows run with the adapter must answer
as the merged model does.  With `gguf=True` it also converts, with llama.cpp's own scripts
(`make llamacpp-convert`), the adapter to a GGUF adapter and the base and merged models to
float32 GGUFs, for the `llamacpp` engine.  Everything is kept under tokenmill's home
(`test-lora/<recipe key>`), built under a lock into a temporary folder and renamed into place.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

#: Bump when the recipe changes: the key names a new folder.
RECIPE = 1
RANK = 8
TRAIN_TEXT = ("Every answer is about the lighthouse keeper Marisol, who counts gulls at dawn. "
              "Marisol says: the gulls are twelve, the sea is grey, the lamp is lit.")
STEPS = 12
NAME = "marisol"


def _key(base: Path) -> str:
    import peft
    import torch
    import transformers

    st = (base / "model.safetensors").stat()
    parts = [RECIPE, RANK, TRAIN_TEXT, STEPS, peft.__version__, torch.__version__, transformers.__version__,
             st.st_size, st.st_mtime_ns]
    return hashlib.sha256(json.dumps(parts).encode()).hexdigest()[:16]


def _train(base: Path, out: Path) -> None:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(base)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    cfg = LoraConfig(r=RANK, lora_alpha=16, target_modules=["q_proj", "v_proj"], lora_dropout=0.0,
                     task_type="CAUSAL_LM")
    model = get_peft_model(model, cfg)
    ids = tok(TRAIN_TEXT, return_tensors="pt")["input_ids"]
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-3)
    model.train()
    for _ in range(STEPS):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
    model.eval()
    model.save_pretrained(out / "adapter")
    merged = model.merge_and_unload()
    merged.save_pretrained(out / "merged")
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json",
              "special_tokens_map.json"):
        if (base / f).is_file():
            shutil.copy(base / f, out / "merged" / f)


def converter_dir() -> Path:
    """llama.cpp's conversion scripts (`make llamacpp-convert`)."""
    from tokenmill.schemas.models import tokenmill_home

    return Path(os.environ.get("TOKENMILL_LLAMACPP_CONVERT") or tokenmill_home() / "llama.cpp" / "convert")


def _convert(base: Path, out: Path) -> None:
    conv = converter_dir()
    env = {k: v for k, v in os.environ.items() if k != "NO_LOCAL_GGUF"}  # the tree's own gguf-py, not the installed gguf
    run = [sys.executable]
    subprocess.run([*run, str(conv / "convert_lora_to_gguf.py"), "--base", str(base), "--outtype", "f32",
                    "--outfile", str(out / "adapter.gguf"), str(out / "adapter")],
                   check=True, capture_output=True, env=env, timeout=600)
    for name, folder in (("base", base), ("merged", out / "merged")):
        subprocess.run([*run, str(conv / "convert_hf_to_gguf.py"), "--outtype", "f32",
                        "--outfile", str(out / f"{name}.gguf"), str(folder)],
                       check=True, capture_output=True, env=env, timeout=600)


def adapter_set(base: str | Path, *, gguf: bool = False) -> Path:
    """The folder holding `adapter/` (peft), `merged/` (HF, float32) and with `gguf` also
    `adapter.gguf`, `base.gguf` and `merged.gguf` (float32), made once per recipe key."""
    import filelock

    from tokenmill.schemas.models import tokenmill_home

    base = Path(base)
    root = tokenmill_home() / "test-lora"
    root.mkdir(parents=True, exist_ok=True)
    done = root / _key(base)
    with filelock.FileLock(str(done) + ".lock"):
        if not (done / "merged" / "config.json").is_file():
            tmp = root / f".{done.name}.partial-{uuid.uuid4().hex[:8]}"
            try:
                _train(base, tmp)
                tmp.rename(done)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
        if gguf and not (done / "merged.gguf").is_file():
            tmp = root / f".{done.name}.gguf-{uuid.uuid4().hex[:8]}"
            tmp.mkdir()
            try:
                (tmp / "adapter").symlink_to(done / "adapter")
                (tmp / "merged").symlink_to(done / "merged")
                _convert(base, tmp)
                for f in ("adapter.gguf", "base.gguf", "merged.gguf"):  # merged.gguf last: it marks the set done
                    (tmp / f).rename(done / f)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
    return done
