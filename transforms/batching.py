"""Batch: order one work unit's prompts and pack them into token-budgeted batches.

With continuous batching, padding costs nothing; what costs is repeated
prefill of shared prefixes and idle engine time at batch tails.  So:

* inside a unit, prompts are ordered (`prefix`: by prefix key, then LoRA adapter,
  then token sequence, which puts prompts that share a system prompt or document next
  to each other, back to back on one engine, one adapter's together; `length`: longest first; `none`:
  input order);
* the ordered stream is cut into batches by a token budget (prompt tokens +
  max output tokens), not by request count.  A prefix group larger than a unit
  spans units, so it is spread over workers a unit at a time (docs/ARCHITECTURE.md).
"""

from __future__ import annotations

import math
from typing import Iterable

import apache_beam as beam

from tokenmill.schemas.records import Batch, Chunk, TokenizedPrompt
from tokenmill.transforms.chunks import over_chunks


def order_prompts(prompts: list[TokenizedPrompt], ordering: str) -> list[TokenizedPrompt]:
    if ordering == "prefix":
        # within a prefix group, one adapter's rows together (an engine's prefix cache is per
        # adapter, so this costs no sharing), then by token sequence
        return sorted(prompts, key=lambda p: (p.prefix_key, p.adapter or "", p.token_ids))
    if ordering == "length":
        return sorted(prompts, key=lambda p: (-len(p.token_ids), p.input_ref))
    if ordering == "none":
        return sorted(prompts, key=lambda p: p.input_order)
    raise ValueError(f"ordering must be one of prefix, length, none; got {ordering!r}")


def default_token_budget(prompts: list[TokenizedPrompt], max_num_seqs: int) -> int:
    """Enough tokens to keep `max_num_seqs` sequences of this shard's mean size in flight."""
    if not prompts:
        return max_num_seqs
    mean = sum(p.budget_tokens for p in prompts) / len(prompts)
    return max(1, math.ceil(mean * max_num_seqs))


def pack(prompts: Iterable[TokenizedPrompt], token_budget: int, batch_prefix: str = "b") -> list[Batch]:
    """Cut an ordered stream into batches of at most `token_budget` tokens (a prompt
    larger than the budget alone still gets a batch of its own)."""
    batches: list[Batch] = []
    cur: list[TokenizedPrompt] = []
    used = 0
    for p in prompts:
        if cur and used + p.budget_tokens > token_budget:
            batches.append(Batch(f"{batch_prefix}{len(batches)}", cur))
            cur, used = [], 0
        cur.append(p)
        used += p.budget_tokens
    if cur:
        batches.append(Batch(f"{batch_prefix}{len(batches)}", cur))
    return batches


def plan_batches(
    prompts: list[TokenizedPrompt],
    *,
    ordering: str,
    token_budget: int | None,
    max_num_seqs: int,
    batch_prefix: str = "b",
) -> list[Batch]:
    ordered = order_prompts(prompts, ordering)
    budget = token_budget or default_token_budget(ordered, max_num_seqs)
    return pack(ordered, budget, batch_prefix)


def segment(ordered: list[TokenizedPrompt], part: int, parts: int) -> list[TokenizedPrompt]:
    """Contiguous segment `part` of `parts` of an ordered unit, balanced by budget tokens:
    prefix groups stay whole but at the parts-1 cuts, and a group larger than a part's
    share is spread over parts in batch-sized runs."""
    if parts <= 1:
        return ordered
    total = sum(p.budget_tokens for p in ordered)
    lo, hi = total * part / parts, total * (part + 1) / parts
    out, at = [], 0
    for p in ordered:
        mid = at + p.budget_tokens / 2  # a prompt belongs to the part its middle falls in
        if lo <= mid < hi:
            out.append(p)
        at += p.budget_tokens
    return out


class TakePartFn(beam.DoFn):
    """Chunk of a whole unit's prompts → this work item's segment of its ordering."""

    def __init__(self, ordering: str):
        self._ordering = ordering

    def process(self, chunk: Chunk):
        mine = segment(order_prompts(chunk.items, self._ordering), chunk.part, chunk.parts)
        if mine:
            yield chunk.with_items(mine)


class TakePart(beam.PTransform):
    def __init__(self, ordering: str):
        super().__init__()
        self._ordering = ordering

    def expand(self, chunks):
        return chunks | over_chunks(TakePartFn(self._ordering), "OwnSegment")
