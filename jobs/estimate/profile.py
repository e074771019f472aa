"""The input as the job's engine will see it: every row read, validated and tokenized the way
the job does it (its reader, `validate_row`, `tokenize_record` with the job's own counter,
chat template, `max_model_len`, `max_tokens` and `n`), before any engine work.

What is kept per usable row is small (its place, prompt tokens, max_tokens, samples and the
hashes of its leading full KV blocks), so the whole input is profiled up to
`PROFILE_MAX_ROWS` rows; a larger input is profiled on a reproducible random subset of that
many rows (read in full, tokenized only where drawn), and its totals are scaled up.
Rows the job would dead-letter before the engine (bad rows, prompts too long, duplicate ids)
are counted by reason and cost no engine time.
"""

from __future__ import annotations

import hashlib
import random
import time
from array import array
from dataclasses import dataclass, field
from typing import Any, Collection, Iterable

import numpy as np

#: Rows tokenized at most; a larger input is profiled on a reproducible subset of this many.
PROFILE_MAX_ROWS = 200_000
#: Leading full KV blocks hashed per row (the prefix cache's reach the estimate models).
MAX_BLOCKS = 64
SEED = 0


@dataclass
class InputProfile:
    """The usable rows' figures in input order (arrays of one entry per row)."""

    total_rows: int
    """The input's rows (the plan's count)."""
    read_rows: int
    """Rows profiled: all of them, or the subset of a large input."""
    file_index: np.ndarray
    row: np.ndarray
    prompt_tokens: np.ndarray
    max_tokens: np.ndarray
    samples: np.ndarray
    blocks: list[tuple[int, ...]]
    """Each row's chain of leading full KV block hashes (block i's hash covers blocks 0..i)."""
    prefix_keys: list[str]
    dead: dict[str, int] = field(default_factory=dict)
    """Profiled rows the job would dead-letter before the engine, by reason code."""
    seconds: float = 0.0
    """Time spent reading, validating and tokenizing."""
    counted_by: str = ""

    @property
    def usable(self) -> int:
        return len(self.prompt_tokens)

    @property
    def sampled(self) -> bool:
        return self.read_rows < self.total_rows

    @property
    def scale(self) -> float:
        """Input rows per profiled row (1 when the whole input was tokenized)."""
        return self.total_rows / self.read_rows if self.read_rows else 1.0

    def budget_tokens(self) -> np.ndarray:
        """Each row's batch budget, as `TokenizedPrompt.budget_tokens` counts it."""
        return self.prompt_tokens + self.max_tokens * self.samples

    def describe(self) -> dict[str, Any]:
        p = self.prompt_tokens
        q = (lambda x: int(np.percentile(p, x))) if len(p) else (lambda x: None)
        return {"rows_tokenized": self.read_rows, "usable_rows": self.usable, "sampled": self.sampled,
                "dead_before_engine": dict(sorted(self.dead.items())), "seconds": round(self.seconds, 2),
                "counted_by": self.counted_by,
                "prompt_tokens": {"min": q(0), "p50": q(50), "p95": q(95), "max": q(100),
                                  "mean": float(p.mean()) if len(p) else None}}


def block_chain(ids, block_size: int, limit: int = MAX_BLOCKS) -> tuple[int, ...]:
    """Hashes of a prompt's leading full blocks, each over every block up to it (how vLLM's
    prefix cache keys a block): two prompts share cached blocks as far as their chains agree."""
    out, prev = [], b""
    for k in range(min(len(ids) // block_size, limit)):
        prev = hashlib.blake2b(prev + array("i", ids[k * block_size:(k + 1) * block_size]).tobytes(),
                               digest_size=8).digest()
        out.append(int.from_bytes(prev, "little"))
    return tuple(out)


class Profiler:
    """Row dicts (as the job's reader gives them) → the profile's columns."""

    def __init__(self, encoder, *, max_model_len: int, default_max_tokens: int, block_size: int,
                 prefix_blocks: int, default_samples: int, reference_column: str | None = None,
                 adapters: Collection[str] = ()):
        from tokenmill.transforms.tokenize import RecordRules  # Beam's: imported when a profile is made

        self.encoder, self.block_size, self.reference_column = encoder, block_size, reference_column
        self.adapters = frozenset(adapters)
        self.rules = RecordRules(max_model_len=max_model_len, default_max_tokens=default_max_tokens,
                                 block_size=block_size, prefix_blocks=prefix_blocks, default_samples=default_samples)
        self.cols: dict[str, list] = {k: [] for k in ("file_index", "row", "prompt", "max_tokens", "samples")}
        self.blocks: list[tuple[int, ...]] = []
        self.keys: list[str] = []
        self.dead: dict[str, int] = {}
        self.ids: set[str] = set()

    def add(self, row: dict[str, Any]) -> None:
        from tokenmill.schemas.records import DUPLICATE_ID, FailedRecord, TokenizedPrompt
        from tokenmill.transforms.tokenize import tokenize_record
        from tokenmill.transforms.validate import validate_row

        valid = validate_row(row, self.reference_column, self.adapters)
        rec: TokenizedPrompt | FailedRecord
        if isinstance(valid, FailedRecord):
            rec = valid
        elif valid.id in self.ids:  # the job keeps an id's first row (transforms/dedup.py)
            rec = FailedRecord(valid.input_file, valid.input_row, valid.id, DUPLICATE_ID, "")
        else:
            self.ids.add(valid.id)
            rec = tokenize_record(self.encoder, valid, self.rules)
        if isinstance(rec, FailedRecord):
            self.dead[rec.reason] = self.dead.get(rec.reason, 0) + 1
            return
        c = self.cols
        c["file_index"].append(rec.input_file)
        c["row"].append(rec.input_row)
        c["prompt"].append(len(rec.token_ids))
        c["max_tokens"].append(rec.max_tokens)
        c["samples"].append(rec.samples)
        self.blocks.append(block_chain(rec.token_ids, self.block_size))
        self.keys.append(rec.prefix_key)

    def profile(self, total_rows: int, read_rows: int, seconds: float, counted_by: str) -> InputProfile:
        arr = {k: np.asarray(v, dtype=np.int64) for k, v in self.cols.items()}
        return InputProfile(total_rows=total_rows, read_rows=read_rows, file_index=arr["file_index"], row=arr["row"],
                            prompt_tokens=arr["prompt"], max_tokens=arr["max_tokens"], samples=arr["samples"],
                            blocks=self.blocks, prefix_keys=self.keys, dead=self.dead, seconds=seconds,
                            counted_by=counted_by)


def subset_positions(total: int, limit: int = PROFILE_MAX_ROWS, seed: int = SEED) -> set[int] | None:
    """Read positions of a large input's profile subset (None: every row)."""
    return None if total <= limit else set(random.Random(seed).sample(range(total), limit))


def profile_rows(rows: Iterable[dict[str, Any]], profiler: Profiler, *, total_rows: int,
                 counted_by: str = "", limit: int = PROFILE_MAX_ROWS) -> InputProfile:
    """Profile the row dicts (the input in reading order), all of them or a reproducible subset
    of `limit` when the input has more rows."""
    chosen = subset_positions(total_rows, limit)
    t0, read = time.monotonic(), 0
    for pos, row in enumerate(rows):
        if chosen is None or pos in chosen:
            profiler.add(row)
            read += 1
    return profiler.profile(total_rows, read, time.monotonic() - t0, counted_by)


def profile_input(spec, plan, counter, block_size: int) -> InputProfile:
    """Profile the job's input (its plan, as the preflight made it) with the job's counter."""
    from tokenmill.transforms.read import read_unit
    from tokenmill.transforms.validate import used_columns

    columns = used_columns(plan.columns, spec.reference_column) if plan.format == "parquet" else None
    served = plan.rules() if hasattr(plan, "rules") else None

    def rows():
        for shard in plan.shards:
            yield from read_unit(shard, columns, served)

    profiler = Profiler(counter.open(), max_model_len=spec.engine.max_model_len,
                        default_max_tokens=0 if spec.engine.task == "embed" else spec.sampling.max_tokens,
                        block_size=block_size, prefix_blocks=spec.batching.prefix_blocks,
                        default_samples=spec.sampling.n, reference_column=spec.reference_column,
                        adapters=spec.engine.lora_adapters)
    return profile_rows(rows(), profiler, total_rows=plan.total_rows, counted_by=counter.describe())
