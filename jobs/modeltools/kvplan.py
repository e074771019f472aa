"""Size the KV cache and the weights of a model before a job, from its own config.json.

The KV formula (2 × layers × kv_heads × head_dim × sequence_length × batch ×
bytes_per_element) lives in `tokenmill.transforms.engines.kv`, which the
engine also sizes its cache with; this module plans with it and adds the
weights.

Nothing here loads torch or vLLM; a plan takes milliseconds.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tokenmill.transforms.engines.kv import (
    KvError,
    attention_shape,
    bytes_per_token,
    elem_bytes,
    text_config,
)

#: Weight bits per element for the quantization schemes tokenmill writes.
SCHEME_WEIGHT_BITS = {"w8a8-int8": 8, "w4a16": 4}


#: A plan that cannot be made (missing config keys, unknown dtype); one line.
PlanError = KvError


def load_config(model: str) -> tuple[dict[str, Any], Path]:
    """A model's config.json by short name or folder (weights need not be present)."""
    from tokenmill.schemas.models import ModelNotFound, resolve_model

    try:
        folder = resolve_model(model, need_weights=False)
    except ModelNotFound as err:
        raise PlanError(str(err)) from None
    return text_config(folder), folder


def parameter_counts(cfg: dict[str, Any]) -> dict[str, int]:
    """Parameters of a Llama-style decoder: the Linear layers of the blocks (what
    weight quantization shrinks) and the rest (embeddings, norms, untied head)."""
    s = attention_shape(cfg)
    hidden, inter, vocab = int(cfg["hidden_size"]), int(cfg.get("intermediate_size", 4 * cfg["hidden_size"])), int(cfg.get("vocab_size", 0))
    qd, kvd = s["query_heads"] * s["head_dim"], s["kv_heads"] * s["head_dim"]
    per_layer_linear = hidden * qd + 2 * hidden * kvd + qd * hidden + 3 * hidden * inter
    linear = s["layers"] * per_layer_linear
    other = vocab * hidden * (1 if cfg.get("tie_word_embeddings", False) else 2) + (2 * s["layers"] + 1) * hidden
    return {"linear": linear, "other": other, "total": linear + other}


def weights_bytes(cfg: dict[str, Any], dtype: str, scheme: str | None = None, group_size: int = 128) -> int:
    """Bytes of weights in memory: `dtype` for everything, or with `scheme` the
    block Linear layers at the scheme's bits plus their scales (one per output
    channel for w8a8, one per group for w4a16) and the rest in `dtype`."""
    elem = elem_bytes(dtype, "dtype")
    p = parameter_counts(cfg)
    if scheme is None:
        return p["total"] * elem
    if scheme not in SCHEME_WEIGHT_BITS:
        raise PlanError(f"unknown scheme {scheme!r}; one of {sorted(SCHEME_WEIGHT_BITS)}")
    q = p["linear"] * SCHEME_WEIGHT_BITS[scheme] // 8
    s = attention_shape(cfg)
    hidden, inter = int(cfg["hidden_size"]), int(cfg.get("intermediate_size", 4 * cfg["hidden_size"]))
    qd, kvd = s["query_heads"] * s["head_dim"], s["kv_heads"] * s["head_dim"]
    outs = s["layers"] * (qd + 2 * kvd + hidden + 2 * inter + hidden)
    scales = outs if scheme == "w8a8-int8" else p["linear"] // group_size
    return q + scales * elem + p["other"] * elem


def scheme_of(cfg: dict[str, Any]) -> tuple[str | None, int]:
    """The tokenmill scheme name of a compressed-tensors checkpoint's config (or None)."""
    qc = cfg.get("quantization_config") or {}
    for g in (qc.get("config_groups") or {}).values():
        w = g.get("weights") or {}
        a = g.get("input_activations") or {}
        if w.get("num_bits") == 8 and a.get("num_bits") == 8:
            return "w8a8-int8", 0
        if w.get("num_bits") == 4 and not a:
            return "w4a16", int(w.get("group_size") or 128)
    return None, 128


def plan(cfg: dict[str, Any], *, max_model_len: int, batch: int = 1, kv_cache_dtype: str = "auto",
         dtype: str = "auto", memory: int | None = None, scheme: str | None = None,
         group_size: int | None = None) -> dict[str, Any]:
    """The KV cache and weights plan (a JSON-ready dict).

    `dtype` auto means the checkpoint's own dtype; `kv_cache_dtype` auto means the
    model dtype.  With `memory` (bytes for the KV cache) the plan also gives the
    largest batch of `max_model_len`-token sequences and the tokens that fit."""
    if max_model_len < 1 or batch < 1:
        raise PlanError(f"max_model_len and batch must be positive, got {max_model_len} and {batch}")
    s = attention_shape(cfg)
    model_dtype = str(cfg.get("dtype") or cfg.get("torch_dtype") or "bfloat16") if dtype == "auto" else dtype
    kv_dtype = model_dtype if kv_cache_dtype == "auto" else kv_cache_dtype
    elem = elem_bytes(kv_dtype, "kv_cache_dtype")
    elem_bytes(model_dtype, "dtype")
    per_token = bytes_per_token(s, elem)
    mha_per_token = bytes_per_token(s, elem, heads="query_heads")
    found_scheme, found_group = scheme_of(cfg)
    scheme = scheme or found_scheme
    g = group_size or found_group or 128
    out: dict[str, Any] = {
        **s,
        "attention": "MHA" if s["kv_heads"] == s["query_heads"] else ("MQA" if s["kv_heads"] == 1 else "GQA"),
        "dtype": model_dtype,
        "kv_cache_dtype": kv_dtype,
        "bytes_per_element": elem,
        "kv_bytes_per_token": per_token,
        "max_model_len": max_model_len,
        "batch": batch,
        "kv_cache_bytes": per_token * max_model_len * batch,
        "mha_kv_bytes_per_token": mha_per_token,
        "mha_kv_cache_bytes": mha_per_token * max_model_len * batch,
        "gqa_saving": round(mha_per_token / per_token, 3),
        "parameters": parameter_counts(cfg),
        "weights_bytes": {
            model_dtype: weights_bytes(cfg, model_dtype),
            **{d: weights_bytes(cfg, d) for d in ("float32", "bfloat16") if d != model_dtype},
            **{sc: weights_bytes(cfg, model_dtype, sc, g) for sc in SCHEME_WEIGHT_BITS},
        },
        "scheme": scheme,
    }
    out["weights_bytes_this_run"] = weights_bytes(cfg, model_dtype, scheme, g)
    if memory is not None:
        out["memory"] = memory
        out["max_tokens_in_memory"] = memory // per_token
        out["max_batch_in_memory"] = memory // (per_token * max_model_len)
        out["fits"] = out["kv_cache_bytes"] <= memory
    return out


def compare_with_engine(p: dict[str, Any], info: dict[str, Any]) -> dict[str, Any]:
    """Set a plan against what vLLM reported at start (a job's `workers.engine_info`):
    the capacity in tokens and in `max_model_len` sequences, and whether the
    per-token size matches."""
    tokens = int(info.get("kv_cache_tokens") or 0)
    per_token = info.get("kv_bytes_per_token")
    return {
        "engine_kv_cache_tokens": tokens,
        "engine_kv_cache_bytes": info.get("kv_cache_bytes"),
        "engine_kv_bytes_per_token": per_token,
        "engine_dtype": info.get("dtype"),
        "engine_kv_cache_dtype": info.get("kv_cache_dtype"),
        "engine_max_model_len": info.get("max_model_len"),
        "engine_max_sequences_at_max_len": tokens // p["max_model_len"] if p["max_model_len"] else None,
        "plan_batch_fits_engine": p["kv_cache_bytes"] <= tokens * p["kv_bytes_per_token"],
        "bytes_per_token_match": per_token == p["kv_bytes_per_token"],
    }


def engine_info_for_job(eng, job_id: str) -> dict[str, Any] | None:
    """The first worker's `engine_info` of a job, or None when the job has none."""
    from tokenmill.schemas import storage as S

    return S.MetricsReader(eng).engine_info(job_id)


def parse_bytes(text: str) -> int:
    """`4294967296`, `4GiB`, `512MiB`, `2G` → bytes, through pydantic's ByteSize.  Units are
    binary as they always were here: a bare `K`/`M`/`G`/`T` (with or without `B`) means
    KiB/MiB/GiB/TiB (ByteSize alone would read `2G` as 2×10⁹).  ValueError otherwise."""
    import re

    from pydantic import ByteSize, TypeAdapter, ValidationError

    binary = re.sub(r"(?i)^\s*([\d.]+)\s*([kmgt])b?\s*$", lambda m: f"{m[1]}{m[2].upper()}iB", text or "")
    try:
        return int(TypeAdapter(ByteSize).validate_python(binary))
    except ValidationError:
        raise ValueError(f"not a byte count: {text!r}") from None


def format_bytes(n: float | None) -> str:
    """`1.5 GiB`, `512 B` (binary units); `-` for None."""
    from pydantic import ByteSize

    return "-" if n is None else ByteSize(int(n)).human_readable(separator=" ")


def format_plan(p: dict[str, Any]) -> str:
    """Human-readable plan (the CLI's default output)."""
    lines = [
        f"attention: {p['attention']} — {p['layers']} layers, {p['query_heads']} query heads, "
        f"{p['kv_heads']} kv heads, head_dim {p['head_dim']}",
        f"KV cache ({p['kv_cache_dtype']}, {p['bytes_per_element']} B/elem): {format_bytes(p['kv_bytes_per_token'])} per token "
        f"= 2 × {p['layers']} × {p['kv_heads']} × {p['head_dim']} × {p['bytes_per_element']}",
        f"  {p['batch']} × {p['max_model_len']} tokens: {format_bytes(p['kv_cache_bytes'])} "
        f"(full multi-head would need {format_bytes(p['mha_kv_cache_bytes'])}: {p['attention']} saves {p['gqa_saving']}×)",
    ]
    if "memory" in p:
        lines.append(
            f"  in {format_bytes(p['memory'])}: {p['max_tokens_in_memory']:,} tokens, "
            f"largest batch at {p['max_model_len']} tokens = {p['max_batch_in_memory']:,}"
            + ("" if p["fits"] else f" (batch {p['batch']} does NOT fit)")
        )
    w = p["weights_bytes"]
    lines.append("weights: " + ", ".join(f"{k} {format_bytes(v)}" for k, v in w.items())
                 + f"; this run ({p['scheme'] or p['dtype']}): {format_bytes(p['weights_bytes_this_run'])}")
    if "engine" in p:
        e = p["engine"]
        lines.append(
            f"vLLM at start of the job: {e['engine_kv_cache_tokens']:,} KV tokens ({format_bytes(e['engine_kv_cache_bytes'])}, "
            f"{e['engine_kv_cache_dtype']}), {format_bytes(e['engine_kv_bytes_per_token'])}/token "
            f"({'matches' if e['bytes_per_token_match'] else 'differs from'} this plan), "
            f"{e['engine_max_sequences_at_max_len']:,} sequences of {p['max_model_len']} tokens; "
            f"batch {p['batch']} {'fits' if e['plan_batch_fits_engine'] else 'does NOT fit'}"
        )
    return "\n".join(lines)
