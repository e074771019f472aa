"""What `tokenmill quantize` may be asked, and the checks of a request before any weight is touched.

The schemes of both writers (compressed-tensors checkpoints, `quantize.py`; GGUF files for
the `llamacpp` engine, `gguf.py`), the methods each scheme takes and why a method does not
apply, the model-shape checks (group size against every quantized layer's input
dimension, GPTQ's Hessian rank), the errors a request raises, and the result both writers
return.  Imports nothing heavy, so the CLI checks a request in milliseconds.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

#: Scheme name → (compressed-tensors preset, needs a group size).
SCHEMES = {"w8a8-int8": ("W8A8", False), "w4a16": ("W4A16", True)}
DEFAULT_GROUP_SIZE = 128
#: Layers left in full precision: the output head is tied to the embeddings in
#: small models and is the layer most sensitive to rounding.
IGNORE = ("lm_head",)
#: GGUF scheme → llama-quantize's type name.
GGUF_SCHEMES = {"gguf-f16": "F16", "gguf-q8_0": "Q8_0", "gguf-q4_k_m": "Q4_K_M"}
#: Schemes whose llama.cpp quantizer weighs its rounding by an importance matrix.
IMATRIX_SCHEMES = ("gguf-q4_k_m",)
#: Why a GGUF scheme takes no importance matrix.
NO_IMATRIX = {
    "gguf-f16": "F16 rounds no weights to fewer bits: there is nothing for an importance matrix to weigh",
    "gguf-q8_0": "llama.cpp's Q8_0 quantizer ignores an importance matrix (quantize_q8_0: \"not used\")",
}
#: Scheme → the methods it takes (the first is the default).  SmoothQuant moves
#: activation outliers into the weights, which helps only where activations are
#: quantized (w8a8); AWQ protects salient weight channels of a weight-only scheme.
#: The gguf-* schemes take `rtn` (plain llama-quantize) and, where llama.cpp's
#: quantizer reads one, `imatrix` (llama-imatrix's importance matrix).
METHODS = {"w8a8-int8": ("rtn", "gptq", "smoothquant+gptq"), "w4a16": ("rtn", "gptq", "awq"),
           **{s: ("rtn", "imatrix") if s in IMATRIX_SCHEMES else ("rtn",) for s in GGUF_SCHEMES}}
WHY_NOT = {
    ("w8a8-int8", "awq"): "AWQ is for weight-only schemes (w4a16)",
    ("w4a16", "smoothquant+gptq"): "SmoothQuant smooths activations for int8 activation quantization, and w4a16 keeps activations in the model dtype",
    **{(s, "imatrix"): "imatrix is llama.cpp's importance matrix, for the gguf-* schemes" for s in SCHEMES},
    **{(s, m): f"{m} is llmcompressor's, for the compressed-tensors schemes (w8a8-int8, w4a16); a GGUF takes "
               f"rtn (plain llama-quantize){' or imatrix' if s in IMATRIX_SCHEMES else ''}"
       for s in GGUF_SCHEMES for m in ("gptq", "smoothquant+gptq", "awq")},
    **{(s, "imatrix"): why for s, why in NO_IMATRIX.items()},
}


class QuantizeError(ValueError):
    """A quantization request that cannot be carried out; the message is one line."""

    exit_usage = True


class QuantizeFailed(QuantizeError):
    """The calibration run itself failed (not the request); the message is one line."""

    exit_usage = False


@dataclass(frozen=True)
class CalibrationSet:
    """What a calibrated method quantizes on (`--calibration`, `--samples`, `--max-seq-len`)."""

    source: str | None = None
    """A job input (Parquet) or an earlier job's id."""
    samples: int | None = None
    """Prompts drawn (None: calibration.DEFAULT_SAMPLES)."""
    max_seq_len: int | None = None
    """Tokens per prompt at most (None: calibration.DEFAULT_MAX_SEQ_LEN)."""


@dataclass
class QuantizeResult:
    """What was written: the folder, the scheme, sizes before and after, and timings."""

    out: Path
    scheme: str
    group_size: int | None
    layers: int
    source_bytes: int
    weights_bytes: int
    seconds: float
    calibration_rows: int = 0
    notes: list[str] = field(default_factory=list)
    method: str = "rtn"
    prepare_s: float = 0.0
    """Drawing and tokenizing the calibration prompts (this process)."""
    run: dict[str, Any] | None = None
    """The calibration run (llmcompressor's process): wall_s, peak_rss_bytes, ..."""
    sha256: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return {
            "out": str(self.out), "scheme": self.scheme, "method": self.method, "group_size": self.group_size,
            "layers": self.layers, "prepare_s": self.prepare_s, "calibration_run": self.run, "sha256": self.sha256,
            "source_bytes": self.source_bytes, "weights_bytes": self.weights_bytes,
            "size_ratio": round(self.source_bytes / self.weights_bytes, 3) if self.weights_bytes else None,
            "seconds": round(self.seconds, 2), "calibration_rows": self.calibration_rows, "notes": self.notes,
        }


def check_scheme(scheme: str, group_size: int | None) -> int | None:
    """The group size this scheme will use (None for per-channel); raise on an unknown
    scheme or a group size given to a scheme that has none."""
    if scheme not in SCHEMES:
        raise QuantizeError(f"unknown scheme {scheme!r}; choose one of {sorted(SCHEMES) + sorted(GGUF_SCHEMES)}")
    grouped = SCHEMES[scheme][1]
    if not grouped:
        if group_size is not None:
            raise QuantizeError(f"scheme {scheme!r} is per-channel and takes no --group-size")
        return None
    g = DEFAULT_GROUP_SIZE if group_size is None else group_size
    if g < 1:
        raise QuantizeError(f"group size must be a positive integer, got {g}")
    return g


def check_method(scheme: str, method: str) -> None:
    """Raise unless `scheme` takes `method` (scheme already checked)."""
    allowed = METHODS[scheme]
    if method not in allowed:
        known = sorted({m for ms in METHODS.values() for m in ms})
        why = WHY_NOT.get((scheme, method)) or ("unknown method" if method not in known else "not offered")
        raise QuantizeError(f"method {method!r} does not apply to scheme {scheme!r} ({why}); "
                            f"{scheme} takes {' or '.join(allowed)}")


def linear_layers(config: dict[str, Any]) -> list[tuple[str, int, int]]:
    """(name, in_features, out_features) of each Linear layer a decoder-only
    Llama/Mistral/Qwen-style model has, from its `config.json` (no weights read).
    Names follow the Hugging Face modules (`model.layers.0.mlp.down_proj`)."""
    hidden = config["hidden_size"]
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or hidden // heads
    inter = config["intermediate_size"]
    out = []
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}"
        out += [
            (f"{p}.self_attn.q_proj", hidden, heads * head_dim),
            (f"{p}.self_attn.k_proj", hidden, kv_heads * head_dim),
            (f"{p}.self_attn.v_proj", hidden, kv_heads * head_dim),
            (f"{p}.self_attn.o_proj", heads * head_dim, hidden),
            (f"{p}.mlp.gate_proj", hidden, inter),
            (f"{p}.mlp.up_proj", hidden, inter),
            (f"{p}.mlp.down_proj", inter, hidden),
        ]
    return out


def hessian_rank_note(method: str, tokens: int, layers: list[tuple[str, int, int]]) -> str | None:
    """A note when GPTQ would calibrate on fewer tokens than a layer has input columns: its
    Hessian (Σ x xᵀ over the calibration tokens) is then rank-deficient for that layer, held
    invertible only by dampening.  Measured: SmoothQuant + GPTQ on the 60 eval questions'
    1,455 tokens (SmolLM2's down_proj takes 1,536) lost 11.7 points where 7,011 tokens of
    chat prompts lost 1.7 (docs/QUANTIZATION.md)."""
    if "gptq" not in method or not layers:
        return None
    name, widest, _ = max(layers, key=lambda x: x[1])
    if tokens >= widest:
        return None
    return (f"calibration has {tokens:,} tokens, fewer than the {widest:,} input columns of {name}: GPTQ's "
            f"Hessian for that layer cannot be full rank; more or longer prompts (--samples) calibrate it better")


def suggest_group_sizes(dims: list[int], limit: int = 3) -> list[int]:
    """Power-of-two group sizes (largest first, at least 16) that divide every dimension."""
    return [g for g in (256, 128, 64, 32, 16) if all(d % g == 0 for d in dims)][:limit]


def check_group_size(layers: list[tuple[str, int, int]], group_size: int) -> None:
    """Raise naming the first layer whose input dimension `group_size` does not divide."""
    for name, in_features, _ in layers:
        if in_features % group_size:
            fits = suggest_group_sizes(sorted({d for _, d, _ in layers}))
            hint = f"; try --group-size {' or '.join(map(str, fits))}" if fits else ""
            raise QuantizeError(
                f"group size {group_size} does not divide layer {name}'s input dimension {in_features}{hint}"
            )


def read_model_config(model_dir: Path) -> dict[str, Any]:
    """A full-precision decoder model's `config.json`; raise when it cannot be read, is already
    quantized, or lacks the sizes the layer checks need."""
    try:
        cfg = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError) as err:
        raise QuantizeError(f"cannot read {model_dir / 'config.json'}: {err}") from None
    if cfg.get("quantization_config"):
        method = cfg["quantization_config"].get("quant_method", "?")
        raise QuantizeError(f"model folder {str(model_dir)!r} is already quantized ({method}); start from the full-precision model")
    missing = [k for k in ("hidden_size", "num_attention_heads", "num_hidden_layers", "intermediate_size") if k not in cfg]
    if missing:
        raise QuantizeError(f"{model_dir / 'config.json'} lacks {missing}: not a decoder model tokenmill can quantize")
    return cfg
