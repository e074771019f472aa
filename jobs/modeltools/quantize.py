"""Write quantized checkpoints that vLLM loads directly (compressed-tensors format).

Round-to-nearest (RTN) quantization of every Linear layer except `lm_head`, with
scales computed from the weights themselves, using the `compressed-tensors`
library (a vLLM dependency) for the schemes, the packing and the `config.json`
`quantization_config` block, so the checkpoint is the same format llmcompressor
writes and vLLM's `compressed-tensors` loader reads.

Schemes (the `gguf-*` schemes for the `llamacpp` engine are in `gguf.py`):

- `w8a8-int8`: int8 weights, symmetric, one scale per output channel; int8
  activations quantized dynamically per token at run time (no calibration).
- `w4a16`: int4 weights, symmetric, one scale per group of `group_size` input
  columns; activations stay in the model dtype.

Everything that can be checked is checked before weights are touched (scheme,
model folder, weights present, group size against every quantized layer's input
dimension), so bad input fails in seconds with one line.
"""

from __future__ import annotations

from tokenmill.schemas.errors import first_line

import json
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

#: Scheme name → (compressed-tensors preset, needs a group size).
SCHEMES = {"w8a8-int8": ("W8A8", False), "w4a16": ("W4A16", True)}
DEFAULT_GROUP_SIZE = 128
#: Layers left in full precision: the output head is tied to the embeddings in
#: small models and is the layer most sensitive to rounding.
IGNORE = ("lm_head",)


class QuantizeError(ValueError):
    """A quantization request that cannot be carried out; the message is one line."""


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

    def as_dict(self) -> dict[str, Any]:
        return {
            "out": str(self.out), "scheme": self.scheme, "group_size": self.group_size, "layers": self.layers,
            "source_bytes": self.source_bytes, "weights_bytes": self.weights_bytes,
            "size_ratio": round(self.source_bytes / self.weights_bytes, 3) if self.weights_bytes else None,
            "seconds": round(self.seconds, 2), "calibration_rows": self.calibration_rows, "notes": self.notes,
        }


def check_scheme(scheme: str, group_size: int | None) -> int | None:
    """The group size this scheme will use (None for per-channel); raise on an unknown
    scheme or a group size given to a scheme that has none."""
    from tokenmill.jobs.modeltools.gguf import GGUF_SCHEMES

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


def load_calibration(path: str) -> int:
    """Rows of a job input Parquet usable as calibration prompts (checked, counted).

    The RTN schemes here need no calibration (weight scales come from the weights,
    w8a8 activation scales are dynamic), so the prompts are only validated and
    counted; calibration-based algorithms (GPTQ, SmoothQuant, AWQ) need
    llmcompressor, which has no release compatible with the installed vLLM
    (docs/QUANTIZATION.md)."""
    import pyarrow.parquet as pq

    p = Path(path)
    if not p.is_file():
        raise QuantizeError(f"calibration file {path!r} does not exist")
    try:
        schema = pq.read_schema(p)
    except Exception as err:  # pyarrow raises several types for a non-Parquet file
        raise QuantizeError(f"calibration file {path!r} is not Parquet: {first_line(err)}") from None
    if "prompt" not in schema.names and "messages" not in schema.names:
        raise QuantizeError(f"calibration file {path!r} has no 'prompt' or 'messages' column (columns: {schema.names})")
    return pq.read_metadata(p).num_rows


def _scheme(scheme: str, group_size: int | None):
    from compressed_tensors.quantization import preset_name_to_scheme

    s = preset_name_to_scheme(SCHEMES[scheme][0], ["Linear"])
    if group_size is not None:
        s.weights.group_size = group_size
    return s


def _set_weight_qparams(module, store_dtype) -> None:
    """Round-to-nearest scales from the weight's own range (per channel or per group),
    rounded to the dtype they are stored in, so the integer weights are computed
    against exactly the scale the checkpoint carries."""
    import torch
    from compressed_tensors.quantization import QuantizationStrategy
    from compressed_tensors.quantization.utils import calculate_qparams

    args = module.quantization_scheme.weights
    w = module.weight.detach().to(torch.float32)
    if args.strategy == QuantizationStrategy.GROUP:
        w = w.reshape(w.shape[0], w.shape[1] // args.group_size, args.group_size)
        lo, hi = w.amin(dim=-1), w.amax(dim=-1)
    elif args.strategy == QuantizationStrategy.CHANNEL:
        lo, hi = w.amin(dim=1, keepdim=True), w.amax(dim=1, keepdim=True)
    else:  # pragma: no cover - only the presets above are offered
        raise QuantizeError(f"unsupported weight strategy {args.strategy}")
    scale, zp = calculate_qparams(lo, hi, args)
    with torch.no_grad():
        module.weight_scale.data = scale.reshape(module.weight_scale.shape).to(store_dtype).to(torch.float32)
        if hasattr(module, "weight_zero_point"):
            module.weight_zero_point.data = zp.reshape(module.weight_zero_point.shape).to(module.weight_zero_point.dtype)


def _weights_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.glob("*.safetensors"))


def quantize(model: str, scheme: str, out: str | Path, *, group_size: int | None = None,
             calibration: str | None = None, force: bool = False) -> QuantizeResult:
    """Quantize `model` (short name or folder) with `scheme` into `out`, a model folder
    vLLM loads with no extra flags (its `config.json` carries the quantization config).

    Raises QuantizeError (one line) before touching weights for an unknown scheme, a
    folder without weights, an existing output folder (unless `force`), or a group
    size that does not divide some quantized layer's input dimension.

    A `gguf-*` scheme writes a GGUF file for the `llamacpp` engine instead (`gguf.quantize_gguf`)."""
    from tokenmill.jobs.modeltools.gguf import GGUF_SCHEMES, quantize_gguf
    from tokenmill.schemas.models import ModelNotFound, resolve_model

    if scheme in GGUF_SCHEMES:
        if group_size is not None or calibration:
            raise QuantizeError(f"scheme {scheme!r} (llama-quantize) takes no --group-size or --calibration")
        return quantize_gguf(model, scheme, out, force=force)
    g = check_scheme(scheme, group_size)
    try:
        src = resolve_model(model)
    except ModelNotFound as err:
        raise QuantizeError(str(err)) from None
    cfg = read_model_config(src)
    layers = linear_layers(cfg)
    if g is not None:
        check_group_size(layers, g)
    out = Path(out)
    if out.is_file():
        raise QuantizeError(f"--out {str(out)!r} is a file; scheme {scheme} writes a model folder")
    if out.exists() and any(out.iterdir()):
        if not force:
            raise QuantizeError(f"output folder {str(out)!r} is not empty (use --force to replace it)")
        shutil.rmtree(out)
    rows = load_calibration(calibration) if calibration else 0

    t0 = time.perf_counter()
    import torch
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config
    from compressed_tensors.quantization.utils import is_module_quantized
    from transformers import AutoModelForCausalLM, AutoTokenizer

    # fp32 master weights: scales are computed at full precision, then stored in the
    # checkpoint's own dtype
    net = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32)
    qcfg = QuantizationConfig(config_groups={"group_0": _scheme(scheme, g)}, ignore=list(IGNORE))
    apply_quantization_config(net, qcfg)
    quantized = [m for _, m in net.named_modules() if is_module_quantized(m)]
    if not quantized:
        raise QuantizeError(f"no Linear layers to quantize in {str(src)!r}")
    src_dtype = getattr(torch, str(cfg.get("dtype") or cfg.get("torch_dtype") or "bfloat16"), torch.bfloat16)
    for m in quantized:
        _set_weight_qparams(m, src_dtype)
    # integer weights are computed in fp32 (w / scale in bf16 would be off by up to a
    # whole step for large ratios); only then does the rest go back to the source dtype
    compressor = ModelCompressor.from_pretrained_model(net)
    compressor.compress_model(net)
    net.to(src_dtype)
    out.mkdir(parents=True, exist_ok=True)
    net.save_pretrained(str(out))
    compressor.update_config(str(out))
    AutoTokenizer.from_pretrained(str(src)).save_pretrained(str(out))
    for extra in ("chat_template.jinja", "generation_config.json"):
        if (src / extra).is_file() and not (out / extra).exists():
            shutil.copy2(src / extra, out / extra)
    (out / "TOKENMILL_QUANTIZED.json").write_text(json.dumps(
        {"source": str(src), "scheme": scheme, "group_size": g, "method": "rtn", "calibration_rows": rows}, indent=2))
    res = QuantizeResult(out=out, scheme=scheme, group_size=g, layers=len(quantized),
                         source_bytes=_weights_bytes(src), weights_bytes=_weights_bytes(out),
                         seconds=time.perf_counter() - t0, calibration_rows=rows)
    if rows:
        res.notes.append(f"calibration prompts checked ({rows} rows) but not used: {scheme} is round-to-nearest")
    return res
