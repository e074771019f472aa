"""A job's request figures merged from per-run summaries, so a rerun counts only the rows it added.

Each run's answered requests are read once (by `ix_outputs_job_batch`: a run's batch ids start
with its run id) into a summary that adds up (`summarize`): counts and token sums, rows by count
source and by LoRA adapter, what the result cache served, and for each distribution column its
count, sum, max and a histogram.  The summary is stored in the run's row (`runs.summary`); a job's
`RequestStats` is the merge (`merge`) of its runs' summaries (`stats_of`), checked against the
database's row count: rows a summary does not know (deleted, retracted as duplicates, written by
no recorded run) make every run summarized again, and if that still does not add up, `None` (the
caller recounts from every row, `RequestSummary.stats`, exact).

What is exact and what is not (docs/ACCOUNTING.md, "Percentiles"): counts, token sums, means
(up to float summation order) and maxima are exact.  Token-count percentiles are exact (one bin per
integer value).  Time percentiles (ttft, tpot, e2e, queue) come from log bins
`(GAMMA**(i-1), GAMMA**i]` read at the bin's midpoint `2 GAMMA**i / (GAMMA + 1)`: each ranked value
is within `ALPHA` (0.1 %) of the true one, so numpy's linear percentile of them is too (a zero
is its own bin, exact).
"""

from __future__ import annotations

import math
from typing import Any, Iterable, Iterator, Mapping

import numpy as np
from sqlalchemy import func, select, update

from tokenmill.schemas import tables as T
from tokenmill.schemas.storage.database import SqlStore
from tokenmill.schemas.storage.reader import CHUNK_ROWS, run_range
from tokenmill.schemas.storage.summary import (
    DIST_COLUMNS,
    PERCENTILES,
    SOURCE_JOBS,
    RequestStats,
    cache_counts,
    empty_dist,
    lerp_percentile,
    percentile_positions,
    sources_of,
)

#: The largest relative error of a time percentile read from the merged summaries.
ALPHA = 0.001
GAMMA = (1 + ALPHA) / (1 - ALPHA)
#: Distribution columns binned exactly, one bin per integer value.
EXACT_COLUMNS = ("prompt_tokens", "output_tokens")
#: The outputs columns a summary reads.
READ = ("sample", "cached_from", "prompt_tokens", "output_tokens", "cached_tokens", "token_count_source",
        "valid", "adapter", "ttft_s", "tpot_s", "e2e_s", "queue_s")
#: The summaries' name of the rows stored before the count source was recorded (`summary.sources_of`: None).
NOT_RECORDED = "not_recorded"
#: What `RequestStats.percentile_error` says of summaries merged this way.
MERGED_ERROR = {**{c: 0.0 for c in EXACT_COLUMNS}, **{c: ALPHA for c in DIST_COLUMNS if c not in EXACT_COLUMNS}}


def _bins(column: str, vals: np.ndarray) -> dict[str, int]:
    """A column's values as bin → count (keys are strings: the summary is stored as JSON)."""
    if column in EXACT_COLUMNS:
        values, counts = np.unique(vals.astype(np.int64), return_counts=True)
        return {str(int(v)): int(c) for v, c in zip(values, counts)}
    out: dict[str, int] = {}
    zero = int((vals == 0).sum())
    if zero:
        out["z"] = zero
    for sign, sel in (("+", vals > 0), ("-", vals < 0)):
        if sel.any():
            idx, counts = np.unique(np.ceil(np.log(np.abs(vals[sel])) / math.log(GAMMA)).astype(np.int64),
                                    return_counts=True)
            out.update({f"{sign}{int(i)}": int(c) for i, c in zip(idx, counts)})
    return out


def _value(key: str) -> float:
    """A bin's value: the integer itself, zero, or a log bin's midpoint (within ALPHA of any value in it)."""
    if key == "z":
        return 0.0
    if key[0] in "+-":
        v = 2 * GAMMA ** int(key[1:]) / (GAMMA + 1)
        return v if key[0] == "+" else -v
    return float(key)


def _groups(keys: list[str], sel: np.ndarray, weights: Mapping[str, np.ndarray]) -> dict[str, dict[str, Any]]:
    """Sums of `weights` (NaN as 0) by key over the selected rows: key → name → sum (ints but `request_s`)."""
    if not sel.any():
        return {}
    names, inverse = np.unique(np.array(keys, dtype=object)[sel], return_inverse=True)
    out: dict[str, dict[str, Any]] = {str(k): {} for k in names}
    for w, vals in weights.items():
        sums = np.bincount(inverse, weights=np.nan_to_num(vals[sel]), minlength=len(names))
        for k, v in zip(names, sums):
            out[str(k)][w] = float(v) if w == "request_s" else int(round(v))
    return out


def _column(rows: Mapping[str, list[Any]], name: str) -> np.ndarray:
    return np.array([np.nan if v is None else v for v in rows[name]], dtype=float)


def summarize(chunks: Iterable[Mapping[str, list[Any]]]) -> dict[str, Any]:
    """One summary of output rows given as chunks of columns (`READ`)."""
    total: dict[str, Any] = {}
    for rows in chunks:
        total = merge(total, _summary(rows))
    return total


def _summary(rows: Mapping[str, list[Any]]) -> dict[str, Any]:
    engine = np.array([c is None for c in rows["cached_from"]], dtype=bool)
    first = np.array([s == 0 for s in rows["sample"]], dtype=bool)
    prompt, output, cached = (_column(rows, c) for c in ("prompt_tokens", "output_tokens", "cached_tokens"))
    s: dict[str, Any] = {
        "n": int(engine.sum()), "rows": int(first.sum()),
        "prompt": int(np.nansum(prompt[engine])), "output": int(np.nansum(output[engine])),
        "cached": int(np.nansum(cached[engine])), "cached_rows": int(np.isfinite(cached[engine]).sum()),
        "checked": sum(v is not None for v in rows["valid"]), "valid": sum(v is True for v in rows["valid"]),
    }
    e2e = _column(rows, "e2e_s")
    zero = np.zeros(len(engine))
    sources = [NOT_RECORDED if v is None else v for v in rows["token_count_source"]]
    s["by_source"] = _groups(sources, engine, {"rows": engine.astype(float), "prompt": prompt, "output": output})
    s["adapters"] = _groups([a or "" for a in rows["adapter"]], np.ones(len(engine), dtype=bool),
                            {"rows": first.astype(float), "prompt": np.where(engine, prompt, zero),
                             "output": np.where(engine, output, zero), "request_s": np.where(engine, e2e, zero)})
    served_from = _groups([c or "" for c in rows["cached_from"]], ~engine, {"n": (~engine).astype(float)})
    sources_n = {k: int(v["n"]) for k, v in served_from.items()}
    served = ~engine
    s["cache"] = {"samples": int(served.sum()), "rows": int((served & first).sum()),
                  "prompt": int(np.nansum(prompt[served])), "output": int(np.nansum(output[served])), "sources": sources_n}
    dists = {}
    for c in DIST_COLUMNS:
        vals = _column(rows, c)[engine]
        vals = vals[np.isfinite(vals)]
        dists[c] = {"n": int(vals.size), "sum": float(vals.sum()), "max": float(vals.max()) if vals.size else None,
                    "hist": _bins(c, vals)}
    s["dists"] = dists
    ok = engine & (e2e > 0) & (output > 0)
    s["per_req"] = {"n": int(ok.sum()), "sum": float((output[ok] / e2e[ok]).sum())}
    return s


def merge(a: Mapping[str, Any], b: Mapping[str, Any]) -> dict[str, Any]:
    """Two summaries as one: numbers add, `max` takes the larger, nested maps merge key by key."""
    out = dict(a)
    for k, v in b.items():
        if k not in out or out[k] is None:
            out[k] = v
        elif isinstance(v, Mapping):
            out[k] = merge(out[k], v)
        elif v is None:
            continue
        else:
            out[k] = max(out[k], v) if k == "max" else out[k] + v
    return out


def _dist(d: Mapping[str, Any] | None) -> dict[str, Any]:
    if not d or not d["n"]:
        return empty_dist()
    n, top = int(d["n"]), float(d["max"])
    ranked_bins = sorted(((_value(k), c) for k, c in d["hist"].items()), key=lambda vc: vc[0])
    wanted, got, seen = sorted(percentile_positions(n)), {}, 0
    it = iter(ranked_bins)
    value, count = next(it)
    for pos in wanted:
        while pos >= seen + count:
            seen += count
            value, count = next(it)
        got[pos] = min(value, top)  # a bin's midpoint may pass the column's largest value
    return {"mean": float(d["sum"]) / n, **{f"p{q}": lerp_percentile(got, n, q) for q in PERCENTILES},
            "max": top, "n": n}


def stats_of(s: Mapping[str, Any]) -> RequestStats:
    """`RequestStats` of a (merged) summary; its percentiles' error is `MERGED_ERROR`."""
    if not s:
        return RequestStats(rows=0, percentile_error=MERGED_ERROR)
    groups = [(None if k == NOT_RECORDED else k, d["rows"], d["prompt"], d["output"]) for k, d in s["by_source"].items()]
    per = s["per_req"]
    cache = s["cache"]
    top = dict(sorted(cache["sources"].items(), key=lambda kv: (-kv[1], kv[0]))[:SOURCE_JOBS])
    adapters = sorted(({"adapter": k or None, "rows": int(a["rows"]), "prompt_tokens": int(a["prompt"]),
                        "output_tokens": int(a["output"]), "request_s": float(a["request_s"])}
                       for k, a in s["adapters"].items()), key=lambda d: (d["adapter"] is not None, d["adapter"] or ""))
    return RequestStats(n=int(s["n"]), rows=int(s["rows"]), prompt=int(s["prompt"]), output=int(s["output"]),
                        cached=int(s["cached"]), cached_known=s["cached_rows"] > 0, by_source=sources_of(groups),
                        dists={c: _dist(s["dists"].get(c)) for c in DIST_COLUMNS},
                        mean_request_output_tok_per_s=per["sum"] / per["n"] if per["n"] else None,
                        checked=int(s["checked"]), valid=int(s["valid"]),
                        cache=cache_counts(int(cache["rows"]), int(cache["samples"]), int(cache["prompt"]),
                                           int(cache["output"]), top),
                        by_adapter=adapters, percentile_error=MERGED_ERROR)


class RunSummaries(SqlStore):
    """Each run's summary of its answered requests, and the job's merged from them."""

    def run_rows(self, job_id: str, run_id: str, names: Iterable[str] = READ) -> Iterator[dict[str, list[Any]]]:
        """The columns `names` of one run's output rows, in chunks of CHUNK_ROWS (by `ix_outputs_job_batch`)."""
        o, names = T.outputs.c, list(names)
        lo, hi = run_range(run_id)
        q = select(*(o[n] for n in names)).where(o.job_id == job_id, o.batch_id >= lo, o.batch_id < hi)
        with self.engine.connect() as conn:
            for part in conn.execution_options(stream_results=True, yield_per=CHUNK_ROWS).execute(q).partitions(
                    CHUNK_ROWS):
                yield dict(zip(names, map(list, zip(*part))))

    def merged(self, job_id: str) -> RequestStats | None:
        """The job's `RequestStats` merged from its runs' summaries (a run without one is summarized
        and stored now); None when even fresh summaries do not add up to the job's output rows."""
        with self.engine.connect() as conn:
            rows = int(conn.execute(select(func.count()).select_from(T.outputs)
                                    .where(T.outputs.c.job_id == job_id)).scalar() or 0)
            runs = conn.execute(select(T.runs.c.run_id, T.runs.c.summary).where(T.runs.c.job_id == job_id)
                                .order_by(T.runs.c.started_at, T.runs.c.run_id)).all()
        for fresh in (False, True):
            total: dict[str, Any] = {}
            for run_id, stored in runs:
                if stored is None or fresh:
                    stored = summarize(self.run_rows(job_id, run_id))
                    self._save(job_id, run_id, stored)
                total = merge(total, stored)
            if not total:  # no run has a row: the recount of nothing costs nothing
                return None
            if int(total.get("n", 0)) + int((total.get("cache") or {}).get("samples", 0)) == rows:
                return stats_of(total)
        return None

    def _save(self, job_id: str, run_id: str, summary: dict[str, Any]) -> None:
        with self.engine.begin() as conn:
            conn.execute(update(T.runs).where(T.runs.c.job_id == job_id, T.runs.c.run_id == run_id)
                         .values(summary=summary))
