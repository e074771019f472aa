"""`plan_input`: an input of either format planned at construction, without Beam (Parquet:
transforms/inputs.py; OpenAI batch JSONL: transforms/openai_batch.py)."""

from __future__ import annotations

from typing import Any

from tokenmill.transforms.inputs import InputPlan, plan_parquet
from tokenmill.transforms.openai_batch import SHARD_LINES, plan_jsonl


def plan_input(path: str, fmt: str = "parquet", options: Any = None, unit_lines: int | None = None) -> InputPlan:
    """The plan of the input at `path` in format `fmt` ("parquet" or "openai-jsonl"; a batch
    file cut into units of `unit_lines` lines, default `SHARD_LINES`); s3:// read with `options`
    (pipeline options; default: inputs.use_options'); InputError (one line) when it cannot be planned."""
    if fmt == "openai-jsonl":
        return plan_jsonl(path, options, unit_lines or SHARD_LINES)
    return plan_parquet(path, options)
