"""The estimate's sample: how many rows, drawn how, and the file the sample job reads.

The usable rows are cut into prompt-length bands (quantiles of the input's own prompt
lengths), and the sample is drawn from each band in proportion to its rows (largest
remainder, at least one row a band), reproducibly from a seed; within a band the rows are
drawn uniformly without replacement.  The sampled rows are written, in input order, to a
Parquet file (a Parquet input: the rows' own columns and values, read from their row
groups) or a JSONL file (an OpenAI batch input: the rows' own lines).

Fill.  A sample smaller than the job's concurrency would measure the engine at a concurrency
the job never runs at (a step of 200 sequences costs more than a step of 20).  So the file
may end with filler rows: copies of the sampled rows, cycled, under ids of their own
(`FILL_ID`k), each asking FILL_TOKENS output tokens; the engine then runs as many sequences
at once as the job will, for a few steps, at little cost (their prompts' full KV blocks are
already cached).  Fillers are measured for the engine's step cost only, never for output
lengths.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

#: The default sample: SAMPLE_SHARE of the usable rows, at most MAX_SAMPLE_ROWS and at least
#: MIN_SAMPLE_ROWS (a tiny input is then sampled above the share, or run whole).
SAMPLE_SHARE = 0.10
MAX_SAMPLE_ROWS = 200
MIN_SAMPLE_ROWS = 8
#: Prompt-length bands at most, and the fewest sample rows a band should get.
MAX_BANDS = 4
ROWS_PER_BAND = 3
SEED = 0
#: Output tokens a filler row asks, and its id's prefix.
FILL_TOKENS = 16
FILL_ID = "estimate-fill-"


class SampleError(ValueError):
    """A sample that cannot be drawn or written; the message is one line."""


def default_sample_rows(usable: int) -> int:
    """The default sample size for `usable` rows (see the module constants)."""
    share = math.ceil(SAMPLE_SHARE * usable)
    return min(usable, max(MIN_SAMPLE_ROWS, min(MAX_SAMPLE_ROWS, share)))


def band_edges(lengths: np.ndarray, n_sample: int) -> np.ndarray:
    """Inner edges of the prompt-length bands: the lengths' quantiles, as many bands as
    the sample gives ROWS_PER_BAND rows each (at most MAX_BANDS); repeated edges merged."""
    k = max(1, min(MAX_BANDS, n_sample // ROWS_PER_BAND))
    if k == 1 or not len(lengths):
        return np.zeros(0)
    return np.unique(np.quantile(lengths, [i / k for i in range(1, k)], method="lower"))


def bands_of(lengths: np.ndarray, edges: np.ndarray) -> np.ndarray:
    """The band of each length: band i holds lengths in (edges[i-1], edges[i]]."""
    return np.searchsorted(edges, lengths, side="left")  # type: ignore[return-value]  # an array for an array


def allocate(counts: np.ndarray, n: int) -> np.ndarray:
    """`n` sample rows over bands of `counts` rows: proportional, largest remainder first, at
    least one a non-empty band when n allows, never more than a band holds."""
    counts = np.asarray(counts, dtype=np.int64)
    n = min(n, int(counts.sum()))
    if n <= 0:
        return np.zeros_like(counts)
    share = counts * n / counts.sum()
    out = np.floor(share).astype(np.int64)
    for i in np.argsort(-(share - out), kind="stable")[: n - int(out.sum())]:
        out[i] += 1
    while (counts > 0).sum() <= n and ((out == 0) & (counts > 0)).any():  # every band measured
        out[int(np.argmax(out))] -= 1
        out[int(np.argmax((out == 0) & (counts > 0)))] += 1
    return np.minimum(out, counts)


def draw(lengths: np.ndarray, n: int, seed: int = SEED) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(the drawn rows' indexes in input order, each row's band, the band edges) for a
    stratified sample of `n` of the rows whose prompt lengths are `lengths`."""
    edges = band_edges(lengths, n)
    band = bands_of(lengths, edges)
    counts = np.bincount(band, minlength=len(edges) + 1)
    take = allocate(counts, n)
    rng = np.random.default_rng(seed)
    picks = [rng.choice(np.flatnonzero(band == b), size=int(k), replace=False) for b, k in enumerate(take) if k]
    return np.sort(np.concatenate(picks)) if picks else np.zeros(0, dtype=np.int64), band, edges


def write_sample(plan, file_index: np.ndarray, row: np.ndarray, out_dir: Path, fill: int = 0) -> Path:
    """The rows at (file_index, row) of the input, in that order (input order), then `fill`
    filler rows, as the sample job's input file; SampleError (one line) when they cannot be
    written."""
    out_dir.mkdir(parents=True, exist_ok=True)
    if plan.format == "openai-jsonl":
        return _write_lines(plan, file_index, row, out_dir / "sample.jsonl", fill)
    return _write_parquet(plan, file_index, row, out_dir / "sample.parquet", fill)


def _write_parquet(plan, file_index: np.ndarray, row: np.ndarray, path: Path, fill: int) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    from tokenmill.transforms.files import open_file

    tables = []
    for sh in plan.shards:  # row groups in input order; each contributes its drawn rows
        here = row[(file_index == sh.file_index) & (row >= sh.first_row) & (row < sh.first_row + sh.num_rows)]
        if len(here):
            with open_file(sh.path) as fh:
                group = pq.ParquetFile(fh).read_row_group(sh.row_group)
            tables.append(group.take(pa.array(here - sh.first_row)))
    if not tables:
        raise SampleError("the sample drew no rows")
    table = pa.concat_tables(tables, promote_options="default")
    if fill:
        table = pa.concat_tables([_with_fill_keys(table, None), _with_fill_keys(
            table.take(pa.array(np.arange(fill) % table.num_rows)), table)], promote_options="default")
    pq.write_table(table, path)
    return path


def _with_fill_keys(t, real):
    """`t` with a `max_tokens` column (FILL_TOKENS for fillers, kept or null for the sampled
    rows, `real` None), fillers with ids of their own and no `min_tokens`."""
    import pyarrow as pa
    import pyarrow.compute as pc

    n = t.num_rows
    if real is None:
        mt = t.column("max_tokens") if "max_tokens" in t.column_names else pa.nulls(n, pa.int64())
        return _set(t, "max_tokens", mt.cast(pa.int64()))
    t = _set(t, "max_tokens", pa.array([FILL_TOKENS] * n, pa.int64()))
    if "min_tokens" in t.column_names:
        t = _set(t, "min_tokens", pa.nulls(n, t.schema.field("min_tokens").type))
    if "id" in t.column_names:
        kind = t.schema.field("id").type
        ids = (pa.array(np.arange(n) + int(pc.max(real.column("id")).as_py() or 0) + 1, kind)
               if pa.types.is_integer(kind) else pa.array([f"{FILL_ID}{k}" for k in range(n)]).cast(kind))
        t = _set(t, "id", ids)
    return t


def _set(t, name: str, values):
    i = t.column_names.index(name) if name in t.column_names else -1
    return t.set_column(i, name, values) if i >= 0 else t.append_column(name, values)


def _write_lines(plan, file_index: np.ndarray, row: np.ndarray, path: Path, fill: int) -> Path:
    import json

    from tokenmill.transforms.openai_batch import scan_lines

    lines: list[bytes] = []
    for fi, name in enumerate(plan.files):
        wanted = set(row[file_index == fi].tolist())
        lines += [line.rstrip(b"\n") for i, _, line in (scan_lines(name) if wanted else ()) if i in wanted]
    for k in range(fill):
        req = json.loads(lines[k % len(lines)])
        body = req.setdefault("body", {})
        body.pop("min_tokens", None)
        body.pop("max_completion_tokens", None)
        body["max_tokens"] = FILL_TOKENS
        req["custom_id"] = f"{FILL_ID}{k}"
        lines.append(json.dumps(req).encode())
    path.write_bytes(b"".join(line + b"\n" for line in lines))
    return path
