"""The KV cache's size: the one formula, and the KV cache a job needs.

KV cache bytes = 2 (K and V) × layers × kv_heads × head_dim × sequence_length ×
batch × bytes_per_element.  `kv_heads` is the number of key/value heads, not
query heads: grouped-query (GQA) and multi-query (MQA) attention store
`query_heads / kv_heads` times less than full multi-head attention would.

`kv-plan` (jobs/modeltools/kvplan.py), the engine's sizing from the job
(`size_for_job`) and the engine's report (`VllmSession.info`) all use these.
Nothing here imports torch or vLLM.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Iterable

#: Bytes per element by dtype name (model dtype or kv_cache_dtype).
DTYPE_BYTES = {
    "float32": 4, "float": 4, "fp32": 4,
    "bfloat16": 2, "float16": 2, "half": 2, "bf16": 2, "fp16": 2,
    "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1, "int8": 1,
}

#: Sizing from the job asks for this much more than the blocks the job holds at once:
#: room for the prefix cache to keep shared blocks and for the engine's own bookkeeping.
HEADROOM = 1.25


class KvError(ValueError):
    """A size that cannot be worked out (missing config keys, unknown dtype); one line."""


def elem_bytes(name: str, what: str = "dtype") -> int:
    """Bytes per element of a dtype name (`torch.` prefix allowed)."""
    try:
        return DTYPE_BYTES[str(name).replace("torch.", "")]
    except KeyError:
        raise KvError(f"unknown {what} {name!r}; one of {sorted(DTYPE_BYTES)}") from None


#: The config keys `attention_shape` reads.
SHAPE_KEYS = ("num_hidden_layers", "num_attention_heads", "hidden_size", "num_key_value_heads", "head_dim")


def attention_shape(cfg: dict[str, Any]) -> dict[str, int]:
    """layers, query heads, kv heads and head dim from a Hugging Face (text) config."""
    try:
        layers = int(cfg["num_hidden_layers"])
        heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
    except KeyError as err:
        raise KvError(f"config.json lacks {err.args[0]!r}: not a decoder model kv-plan understands") from None
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    head_dim = int(cfg.get("head_dim") or hidden // heads)
    return {"layers": layers, "query_heads": heads, "kv_heads": kv_heads, "head_dim": head_dim}


def bytes_per_token(shape: dict[str, int], elem: int, *, heads: str = "kv_heads") -> int:
    """KV bytes one token takes in every layer: 2 × layers × kv_heads × head_dim × elem
    (`heads="query_heads"`: what full multi-head attention would take)."""
    return 2 * shape["layers"] * shape[heads] * shape["head_dim"] * elem


def text_config(model_path: str | Path) -> dict[str, Any]:
    """A model folder's config.json (its `text_config` for multimodal models)."""
    cfg = json.loads((Path(model_path) / "config.json").read_text())
    return cfg.get("text_config") or cfg


@dataclass(frozen=True)
class JobTokens:
    """The work an engine is started for: its rows' sequence sizes (prompt tokens +
    max_tokens each)."""

    max_seq_tokens: int
    """The largest prompt + max_tokens among the rows."""
    total_seq_tokens: int
    """The sum of prompt + max_tokens over the rows."""
    rows: int = 0
    """How many rows (0: not known, taken as many)."""

    @classmethod
    def of(cls, seq_tokens: Iterable[int]) -> JobTokens:
        """From each row's prompt + max_tokens."""
        sizes = list(seq_tokens)
        return cls(max_seq_tokens=max(sizes, default=0), total_seq_tokens=sum(sizes), rows=len(sizes))

    @classmethod
    def capacity(cls, max_num_seqs: int, max_model_len: int) -> JobTokens:
        """The most an engine can hold at once: `max_num_seqs` sequences of `max_model_len`."""
        return cls(max_seq_tokens=max_model_len, total_seq_tokens=max_num_seqs * max_model_len, rows=max_num_seqs)

    def held_blocks(self, max_num_seqs: int, max_model_len: int, block_size: int) -> int:
        """The KV blocks this work can hold at once: a sequence takes whole blocks, so at most
        its sequences at once (`max_num_seqs`, or fewer rows) of the longest row's blocks, and
        at most its tokens at once in blocks plus one partly filled block a sequence."""
        seqs = min(self.rows, max_num_seqs) if self.rows > 0 else max_num_seqs
        per_seq = math.ceil(min(max(self.max_seq_tokens, 0), max_model_len) / block_size)
        return min(seqs * per_seq, math.ceil(self.held_at_once(max_num_seqs, max_model_len) / block_size) + seqs)

    def held_at_once(self, max_num_seqs: int, max_model_len: int) -> int:
        """The tokens this work can have in an engine at once: every row, or `max_num_seqs`
        rows of the largest size (at most `max_model_len`), whichever is less."""
        longest = min(max(self.max_seq_tokens, 0), max_model_len)
        return min(max(self.total_seq_tokens, 0), max_num_seqs * longest)


@dataclass(frozen=True)
class KvSizing:
    """The KV cache chosen for a job, and why (the engine reports it)."""

    bytes: int
    tokens: int
    """Tokens the bytes hold (whole blocks, the engine's null block included)."""
    source: str
    """`job` (the job's tokens), `floor` (one max_model_len sequence) or `ceiling` (the default share)."""
    wanted_tokens: int
    """min(total_seq_tokens, max_num_seqs × max_seq_tokens): what the job can hold at once."""
    floor_tokens: int
    """One max_model_len sequence plus the null block: vLLM refuses to start with less."""
    ceiling_bytes: int | None
    reason: str

    def as_info(self) -> dict[str, Any]:
        return asdict(self)


def size_for_job(job: JobTokens, *, per_token: int, block_size: int, max_num_seqs: int, max_model_len: int,
                 ceiling_bytes: int | None = None, headroom: float = HEADROOM) -> KvSizing:
    """The KV cache for `job`: the blocks it holds at once × `headroom`; never less than
    one `max_model_len` sequence plus vLLM's null block (vLLM refuses to start
    otherwise); never more than `ceiling_bytes` (then exactly the ceiling).

    What the job holds is counted in whole blocks (`JobTokens.held_blocks`).  Counted in
    tokens, a job of short rows on 128-token CPU blocks got room for fewer sequences than
    `max_num_seqs` (23 of 32 for 73-token rows), and generated that much slower."""
    if per_token < 1 or block_size < 1:
        raise KvError(f"per_token and block_size must be positive, got {per_token} and {block_size}")
    longest = min(max(job.max_seq_tokens, 0), max_model_len)
    wanted = job.held_at_once(max_num_seqs, max_model_len)
    held = job.held_blocks(max_num_seqs, max_model_len, block_size)
    blocks = math.ceil(held * headroom)
    floor_blocks = math.ceil(max_model_len / block_size)
    source, reason = "job", (f"{held} blocks of {block_size} at once (sequences of at most {longest} tokens in whole "
                             f"blocks, {wanted} tokens at once) × {headroom:g} headroom")
    if blocks < floor_blocks:
        blocks = floor_blocks
        source, reason = "floor", f"one max_model_len ({max_model_len}) sequence; the job needs less ({wanted} tokens)"
    blocks += 1  # the null block vLLM's block pool holds back
    size = blocks * block_size * per_token
    if ceiling_bytes is not None and size > ceiling_bytes:
        return KvSizing(ceiling_bytes, ceiling_bytes // per_token // block_size * block_size, "ceiling", wanted,
                        (floor_blocks + 1) * block_size, ceiling_bytes,
                        f"the job wants {size} bytes, more than the default share")
    return KvSizing(size, blocks * block_size, source, wanted, (floor_blocks + 1) * block_size, ceiling_bytes, reason)
