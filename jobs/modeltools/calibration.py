"""The calibration set of a calibrated quantization: the job's own prompts, token ids and all.

`--calibration` names a job input (a Parquet file, folder or glob, or an OpenAI batch
JSONL) or the id of an earlier job, whose stored spec says where its input is.  The
rows go through the job's own reading (`transforms/read.py`), validation
(`transforms/validate.py`) and chat template (`transforms/tokenize.py: encode`, with
the tokenizer of the model being quantized), so a calibration prompt is token for
token what the job sends the engine.

Drawing is reproducible (a fixed seed): a pool of at most `pool_rows` rows is drawn
from the whole input, its usable prompts are sorted by token length and cut into
`samples` equal strata, and one prompt is drawn from each stratum, so short and long
prompts are represented as the job has them.  Rows the job itself would dead-letter,
prompts longer than `max_seq_len` and exact duplicates are not usable; too few usable
rows is an error naming how many were dropped for what.
"""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tokenmill.schemas.errors import first_line

DEFAULT_SAMPLES = 64
DEFAULT_MAX_SEQ_LEN = 1024
#: Fewer calibration prompts than this give the Hessian (GPTQ) and the activation ranges
#: (SmoothQuant) too few tokens to mean anything.
MIN_SAMPLES = 8
SEED = 0


class CalibrationError(ValueError):
    """A calibration set that cannot be built; the message is one line."""


@dataclass
class CalibrationSet:
    """The drawn prompts (token ids) and where they came from."""

    source: str
    """What --calibration named (a path or a job id)."""
    kind: str
    """'file' or 'job'."""
    input: str
    """The input path read (the job's input for a job id)."""
    input_rows: int
    pool_rows: int
    usable_rows: int
    token_ids: list[list[int]]
    dropped: dict[str, int] = field(default_factory=dict)
    job_model: str | None = None
    seed: int = SEED
    max_seq_len: int = DEFAULT_MAX_SEQ_LEN

    def describe(self) -> dict[str, Any]:
        lens = sorted(len(t) for t in self.token_ids)
        return {
            "source": self.source, "kind": self.kind, "input": self.input, "input_rows": self.input_rows,
            "pool_rows": self.pool_rows, "usable_rows": self.usable_rows, "samples": len(self.token_ids),
            "dropped": self.dropped, "seed": self.seed, "max_seq_len": self.max_seq_len, "job_model": self.job_model,
            "tokens": sum(lens),
            "prompt_tokens": {"min": lens[0], "median": lens[len(lens) // 2], "max": lens[-1]} if lens else None,
        }


def resolve_source(source: str, db_url: str | None = None) -> tuple[str, str, str, str | None]:
    """(kind, input path, input format, the job's model) for a path or an earlier job's id."""
    from tokenmill.transforms.inputs import expand_input

    looks_like_path = "/" in source or source.endswith((".parquet", ".jsonl", ".jsonl.gz")) or Path(source).exists()
    if looks_like_path:
        if "://" not in source and not any(ch in source for ch in "*?[") and not Path(source).exists():
            raise CalibrationError(f"calibration input {source!r} does not exist")
        fmt = "openai-jsonl" if source.rstrip("/").endswith((".jsonl", ".jsonl.gz")) else "parquet"
        try:
            if not expand_input(source, ("*.jsonl", "*.jsonl.gz") if fmt == "openai-jsonl" else ("*.parquet",)):
                raise CalibrationError(f"calibration input {source!r} matches no files")
        except CalibrationError:
            raise
        except Exception as err:
            raise CalibrationError(f"calibration input {source!r}: {first_line(err)}") from None
        return "file", source, fmt, None
    from tokenmill.schemas import storage as S
    from tokenmill.schemas.config import JobSpec
    from tokenmill.schemas.db import default_db_url

    url = db_url or default_db_url()
    try:
        job = S.JobStore(S.connect(url)).get(source)
    except Exception as err:
        raise CalibrationError(f"calibration {source!r}: not a file, and the job database cannot be read: {first_line(err)}") from None
    if job is None:
        raise CalibrationError(f"calibration {source!r} is neither an existing file nor a job id in the job database")
    try:
        spec = JobSpec.model_validate(job["spec"])
    except Exception as err:
        raise CalibrationError(f"job {source!r}: its stored spec cannot be read: {first_line(err)}") from None
    return "job", spec.input, spec.resolved_input_format(), spec.engine.model


def _pool_positions(total: int, pool_rows: int, seed: int) -> set[int] | None:
    """Row positions (over the whole input, in reading order) of the pool; None = all rows."""
    if total <= pool_rows:
        return None
    return set(random.Random(seed).sample(range(total), pool_rows))


def stratified(items: list[tuple[int, Any]], n: int, seed: int) -> list[Any]:
    """`n` of `items` ((length, item) pairs), one drawn from each of `n` consecutive
    length strata of (nearly) equal size, reproducibly; all of them when n ≥ len(items)."""
    items = sorted(items, key=lambda x: x[0])
    if n >= len(items):
        return [it for _, it in items]
    rng = random.Random(seed)
    out = []
    for k in range(n):
        lo, hi = k * len(items) // n, (k + 1) * len(items) // n
        out.append(items[rng.randrange(lo, hi)][1])
    return out


def build(source: str, model_path: str, *, samples: int = DEFAULT_SAMPLES, max_seq_len: int = DEFAULT_MAX_SEQ_LEN,
          db_url: str | None = None, seed: int = SEED, pool_rows: int | None = None) -> CalibrationSet:
    """Draw `samples` calibration prompts from `source` as the job would tokenize them for
    `model_path`; CalibrationError (one line) when the set cannot be made."""
    from tokenmill.schemas.records import FailedRecord
    from tokenmill.transforms.counting import encode, load_tokenizer
    from tokenmill.transforms.read import InputError, plan_input, read_unit
    from tokenmill.transforms.validate import validate_row

    if samples < MIN_SAMPLES:
        raise CalibrationError(f"--samples {samples} is too few to calibrate on; use at least {MIN_SAMPLES}")
    if max_seq_len < 1:
        raise CalibrationError(f"--max-seq-len must be a positive integer, got {max_seq_len}")
    kind, path, fmt, job_model = resolve_source(source, db_url)
    try:
        plan = plan_input(path, fmt)
    except InputError as err:
        raise CalibrationError(f"calibration {source!r}: {err}") from None
    except Exception as err:  # pyarrow on a file that is not Parquet, for example
        raise CalibrationError(f"calibration {source!r}: cannot read {path!r}: {first_line(err)}") from None
    pool_rows = pool_rows or max(8 * samples, 2048)
    chosen = _pool_positions(plan.total_rows, pool_rows, seed)
    tok = load_tokenizer(str(model_path))
    dropped: Counter[str] = Counter()
    seen: set[tuple[int, ...]] = set()
    usable: list[tuple[int, list[int]]] = []
    pos = 0
    pooled = 0
    for unit in plan.shards:
        try:
            rows = read_unit(unit)
        except Exception as err:
            raise CalibrationError(f"calibration {source!r}: cannot read {path!r}: {first_line(err)}") from None
        for row in rows:
            here, pos = pos, pos + 1
            if chosen is not None and here not in chosen:
                continue
            pooled += 1
            rec = validate_row(row)
            if isinstance(rec, FailedRecord):
                dropped[rec.reason] += 1
                continue
            try:
                ids = encode(tok, rec)
            except Exception:  # the job dead-letters it the same way (tokenize_record)
                dropped["chat_template_failed"] += 1
                continue
            if len(ids) > max_seq_len:
                dropped["longer_than_max_seq_len"] += 1
                continue
            key = tuple(ids)
            if key in seen:
                dropped["duplicate"] += 1
                continue
            seen.add(key)
            usable.append((len(ids), ids))
    if len(usable) < samples:
        why = ", ".join(f"{n} {r.replace('_', ' ')}" for r, n in sorted(dropped.items())) or "none dropped"
        longer = dropped.get("longer_than_max_seq_len", 0)
        hint = f"; raise --max-seq-len (now {max_seq_len})" if longer else ""
        if len(usable) >= MIN_SAMPLES:
            hint += f"; or lower --samples to {len(usable)}"
        raise CalibrationError(
            f"calibration {source!r} has {len(usable)} usable rows of {pooled} read ({why}); "
            f"--samples {samples} needs {samples}{hint}")
    picked = stratified(usable, samples, seed)
    return CalibrationSet(source=source, kind=kind, input=path, input_rows=plan.total_rows, pool_rows=pooled,
                          usable_rows=len(usable), token_ids=picked, dropped=dict(dropped), job_model=job_model, seed=seed,
                          max_seq_len=max_seq_len)
