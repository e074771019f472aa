"""The tune's sample: the rows drawn from the job's input, the rungs' sizes and files, and
the digest that makes a tune of changed rows a new tune."""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from tokenmill.jobs.modeltools.tune.common import TuneError
from tokenmill.transforms.inputs import InputError, open_input, plan_parquet

#: The smallest sample a rung runs on (a smaller one measures start-up, not serving).
MIN_RUNG_ROWS = 4


def rung_sizes(n_candidates: int, sample: int) -> list[int]:
    """Sample sizes of the halving's rungs, doubling up to `sample`: as many rungs as
    halvings take the candidates down to one (one rung for one candidate)."""
    if sample < 1:
        raise TuneError(f"--sample must be at least 1 row, got {sample}")
    rungs = max(1, math.ceil(math.log2(max(n_candidates, 1))))
    floor = min(MIN_RUNG_ROWS, sample)
    sizes = [max(floor, math.ceil(sample / 2 ** (rungs - 1 - i))) for i in range(rungs)]
    return sorted(set(sizes))


def draw_sample(spec, n: int, seed: int, out_dir: Path) -> tuple[Path, int]:
    """Draw `n` of the job input's rows (without replacement, reproducibly from `seed`) and
    write them, in drawn order, to `out_dir/sample.parquet`; a rung of m rows reads the
    first m (so every smaller sample is part of every larger one).  Only the row groups
    that hold drawn rows are read.  Returns (the file, its rows)."""

    if spec.resolved_input_format() != "parquet":
        raise TuneError(f"tune samples Parquet input; {spec.input!r} is {spec.resolved_input_format()}")
    try:
        plan = plan_parquet(spec.input)
    except InputError as err:
        raise TuneError(str(err)) from None
    if plan.total_rows == 0:
        raise TuneError(f"input {spec.input!r} has no rows to sample")
    n = min(n, plan.total_rows)
    picks = np.random.default_rng(seed).choice(plan.total_rows, size=n, replace=False)
    order: np.ndarray = np.empty(n, dtype=np.int64)
    tables, positions, start = [], [], 0
    rank = {int(g): i for i, g in enumerate(picks)}  # global row → position in the drawn order
    for sh in plan.shards:
        local = [g - start for g in sorted(rank) if start <= g < start + sh.num_rows]
        if local:
            with open_input(sh.path) as fh:
                t = pq.ParquetFile(fh).read_row_group(sh.row_group)
            tables.append(t.take(pa.array(local)))
            positions += [rank[start + i] for i in local]
        start += sh.num_rows
    table = pa.concat_tables(tables, promote_options="default")
    order[np.asarray(positions)] = np.arange(len(positions))
    table = table.take(pa.array(order))
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "sample.parquet"
    tmp = path.with_suffix(".tmp")
    pq.write_table(table, tmp)
    tmp.replace(path)
    return path, n


def rung_file(sample_path: Path, size: int) -> Path:
    """The first `size` rows of the sample, as a Parquet file beside it (written anew, so
    it always matches the sample)."""
    path = sample_path.with_name(f"sample-{size}.parquet")
    tmp = path.with_suffix(".tmp")
    pq.write_table(pq.read_table(sample_path).slice(0, size), tmp)
    tmp.replace(path)
    return path


def sample_digest(sample_path: Path) -> str:
    """A digest of the sampled rows' values: a tune of changed input rows is a new tune."""
    rows = pq.read_table(sample_path).to_pylist()
    return hashlib.sha256(json.dumps(rows, sort_keys=True, default=str).encode()).hexdigest()
