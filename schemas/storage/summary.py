"""A job's per-request figures summed, counted and ranked inside the database, so a
report, `status` or the job's own accounting reads a few numbers whatever the job's
size: no row leaves the database.

`RequestSummary.stats` gives what metrics need of the outputs table (`RequestStats`):
token sums, rows by count source, and each figure's mean, p50/p95/p99 and max, over the rows
this job's engine answered; the rows served from the result cache (`cached_from` set: no engine
time, no cost) are counted apart (`RequestStats.cache`) and in the rows answered.  The
percentiles are exact, numpy's default (linear) interpolation between the two ranked
values around each position; the database ranks them (`row_number()` over the
column), so nothing is sampled and the same job gives the same figures on SQLite and
PostgreSQL.  `extent` and `histogram` give the report's figures their bins and counts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import Float, Integer, and_, cast, func, select

from tokenmill.schemas import tables as T
from tokenmill.schemas.records import TOKEN_COUNT_SOURCES
from tokenmill.schemas.storage.database import SqlStore

#: The figures metrics give a distribution of (outputs columns), and the percentiles taken.
DIST_COLUMNS = ("prompt_tokens", "output_tokens", "ttft_s", "tpot_s", "e2e_s", "queue_s")
PERCENTILES = (50, 95, 99)
#: The most source jobs a job's cache figures name.
SOURCE_JOBS = 10


def empty_dist() -> dict[str, Any]:
    return {"mean": None, "p50": None, "p95": None, "p99": None, "max": None, "n": 0}


@dataclass
class RequestStats:
    """What a job's metrics take from its answered requests (accounting.job_metrics)."""

    n: int = 0
    """Output rows this job's engine answered: engine requests (a row's n samples are n; the
    rows served from the result cache are in `cache`)."""
    rows: int | None = None
    """Input rows answered (a row's samples once); None: the same as `n`."""
    prompt: int = 0
    output: int = 0
    cached: int = 0
    cached_known: bool = False
    """At least one row has a cached-token count (an engine that reports none: unknown, not zero)."""
    by_source: dict[str, dict[str, int]] = field(default_factory=dict)
    """Rows, prompt and output tokens by `token_count_source` name, in TOKEN_COUNT_SOURCES
    order ("unknown" first: a value this version does not know; "not_recorded" last)."""
    dists: dict[str, dict[str, Any]] = field(default_factory=dict)
    """DIST_COLUMNS → mean, p50, p95, p99, max and n (the rows with a value)."""
    mean_request_output_tok_per_s: float | None = None
    """Mean over answered requests with output and time of output_tokens / e2e_s."""
    checked: int = 0
    """Answered rows whose output was checked against a structured-output constraint (`valid` set)."""
    valid: int = 0
    """Of those, the rows whose output met it."""
    cache: dict[str, Any] = field(default_factory=lambda: cache_counts(0, 0, 0, 0, {}))
    """The rows served from the result cache (`cache_counts`): in `rows`, `checked` and `valid`,
    in none of the engine's figures above."""
    by_adapter: list[dict[str, Any]] = field(default_factory=list)
    """Per LoRA adapter (`adapter` None: the base model), base first then by name: input rows
    answered (`rows`, the cache's too, as `rows` above), and of the rows this job's engine
    answered the prompt and output tokens and the summed request time (`e2e_s`)."""
    percentile_error: dict[str, float] = field(default_factory=lambda: dict.fromkeys(DIST_COLUMNS, 0.0))
    """DIST_COLUMNS → the largest relative error of its percentiles: 0.0 where they are exact (ranked by
    the database, or exact bins), `merged.ALPHA` for times read from merged run summaries."""


def cache_counts(rows: int, samples: int, prompt: int, output: int, sources: dict[str, int]) -> dict[str, Any]:
    """What the result cache saved a job: input rows and output rows (samples) served, their
    prompt and output tokens, and the jobs whose engines computed them (samples each, most first)."""
    return {"rows": rows, "samples": samples, "prompt_tokens": prompt, "output_tokens": output, "source_jobs": sources}


def lerp_percentile(ranked: dict[int, float], n: int, q: float) -> float:
    """numpy's linear percentile `q` (0..100) of `n` sorted values of which `ranked` holds
    the ones at the positions `percentile_positions` named (0-based)."""
    virtual = (n - 1) * (q / 100)  # numpy's virtual index for method="linear"
    lo = min(max(math.floor(virtual), 0), n - 1)
    hi = min(lo + 1, n - 1) if virtual < n - 1 else n - 1
    t = virtual - lo
    a, b = ranked[lo], ranked[hi]
    diff = b - a
    return b - diff * (1 - t) if t >= 0.5 else a + diff * t  # numpy's _lerp


def percentile_positions(n: int, qs: tuple[float, ...] = PERCENTILES) -> set[int]:
    out = set()
    for q in qs:
        virtual = (n - 1) * (q / 100)
        lo = min(max(math.floor(virtual), 0), n - 1)
        out |= {lo, min(lo + 1, n - 1)}
    return out


class RequestSummary(SqlStore):
    """Aggregates over one job's outputs rows, computed by the database."""

    def stats(self, job_id: str) -> RequestStats:
        o = T.outputs
        job = o.c.job_id == job_id
        mine = and_(job, o.c.cached_from.is_(None))  # the engine's figures: the rows this job's engine answered
        with self.engine.connect() as conn:
            head = conn.execute(select(
                func.count(), func.coalesce(func.sum(o.c.prompt_tokens), 0), func.coalesce(func.sum(o.c.output_tokens), 0),
                func.coalesce(func.sum(o.c.cached_tokens), 0), func.count(o.c.cached_tokens),
                *[agg(o.c[c]) for c in DIST_COLUMNS for agg in (func.count, func.avg, func.max)],
            ).where(mine)).one()
            n, prompt, output, cached, cached_rows = (int(v or 0) for v in head[:5])
            dists = {}
            for i, c in enumerate(DIST_COLUMNS):
                count, mean, top = head[5 + 3 * i: 8 + 3 * i]
                dists[c] = self._dist(conn, job_id, c, int(count), mean, top) if count else empty_dist()
            per_req = conn.execute(select(func.avg(cast(o.c.output_tokens, Float) / o.c.e2e_s)).where(
                mine, o.c.e2e_s > 0, o.c.output_tokens > 0)).scalar()
            checked, valid, rows = conn.execute(select(
                func.count(o.c.valid), func.count().filter(o.c.valid.is_(True)), func.count().filter(o.c.sample == 0),
            ).where(job)).one()
            groups = conn.execute(select(o.c.token_count_source, func.count(), func.coalesce(func.sum(o.c.prompt_tokens), 0),
                                         func.coalesce(func.sum(o.c.output_tokens), 0))
                                  .where(mine).group_by(o.c.token_count_source)).all()
            served = self._served(conn, job_id)
            adapters = self._by_adapter(conn, job_id)
        return RequestStats(n=n, prompt=prompt, output=output, cached=cached, cached_known=cached_rows > 0,
                            by_source=sources_of(groups), dists=dists,
                            mean_request_output_tok_per_s=None if per_req is None else float(per_req),
                            checked=int(checked or 0), valid=int(valid or 0), rows=int(rows or 0), cache=served,
                            by_adapter=adapters)

    def _by_adapter(self, conn, job_id: str) -> list[dict[str, Any]]:
        """`RequestStats.by_adapter`: one GROUP BY over the job's outputs."""
        o = T.outputs.c
        engine = o.cached_from.is_(None)
        got = conn.execute(select(
            o.adapter, func.count().filter(o.sample == 0),
            func.coalesce(func.sum(o.prompt_tokens).filter(engine), 0),
            func.coalesce(func.sum(o.output_tokens).filter(engine), 0),
            func.coalesce(func.sum(o.e2e_s).filter(engine), 0.0),
        ).where(o.job_id == job_id).group_by(o.adapter)).all()
        out = [{"adapter": a, "rows": int(rows or 0), "prompt_tokens": int(p), "output_tokens": int(n),
                "request_s": float(t)} for a, rows, p, n, t in got]
        return sorted(out, key=lambda d: (d["adapter"] is not None, d["adapter"] or ""))

    def _served(self, conn, job_id: str) -> dict[str, Any]:
        """`cache_counts` of the job's rows served from the result cache."""
        o = T.outputs.c
        served = and_(o.job_id == job_id, o.cached_from.is_not(None))
        samples, rows, prompt, output = conn.execute(select(
            func.count(), func.count().filter(o.sample == 0), func.coalesce(func.sum(o.prompt_tokens), 0),
            func.coalesce(func.sum(o.output_tokens), 0)).where(served)).one()
        sources = conn.execute(select(o.cached_from, func.count()).where(served).group_by(o.cached_from)
                               .order_by(func.count().desc(), o.cached_from).limit(SOURCE_JOBS)).all()
        return cache_counts(int(rows or 0), int(samples or 0), int(prompt), int(output), {j: int(n) for j, n in sources})

    def _dist(self, conn, job_id: str, column: str, n: int, mean, top) -> dict[str, Any]:
        """Mean, max and numpy-exact percentiles of one column: the database ranks the
        values and returns only those at the positions the percentiles interpolate."""
        c = T.outputs.c[column]
        rank = func.row_number().over(order_by=c).label("rank")
        ranked = select(c.label("v"), rank).where(T.outputs.c.job_id == job_id, T.outputs.c.cached_from.is_(None),
                                                  c.is_not(None)).subquery()
        wanted = [p + 1 for p in percentile_positions(n)]
        got = {int(r) - 1: float(v) for r, v in conn.execute(
            select(ranked.c.rank, ranked.c.v).where(ranked.c.rank.in_(wanted))).all()}
        out = {f"p{q}": lerp_percentile(got, n, q) for q in PERCENTILES}
        return {"mean": float(mean), **out, "max": float(top), "n": n}

    def extent(self, job_id: str, column: str) -> tuple[float, float, int] | None:
        """Smallest and largest value of one outputs column over the rows the job's engine
        answered, and the rows with a value (None: no value)."""
        c = T.outputs.c[column]
        with self.engine.connect() as conn:
            lo, hi, n = conn.execute(select(func.min(c), func.max(c), func.count(c))
                                     .where(T.outputs.c.job_id == job_id, T.outputs.c.cached_from.is_(None))).one()
        return None if lo is None else (float(lo), float(hi), int(n))

    def histogram(self, job_id: str, column: str, lo: float, width: float, bins: int,
                  weight: str | None = None) -> list[float]:
        """Rows the job's engine answered (or the sum of `weight`) per bin of `bins` equal bins
        from `lo`, `width` wide, of one column; values past the last edge count in the last bin, as in
        numpy.histogram, and values below `lo` are left out."""
        c = T.outputs.c[column]
        index = (c - lo) / width
        # floor of a value >= 0: PostgreSQL rounds a float cast to integer, SQLite truncates it
        bucket = func.floor(index) if self.engine.dialect.name == "postgresql" else cast(index, Integer)
        amount = func.count() if weight is None else func.coalesce(func.sum(T.outputs.c[weight]), 0)
        out = [0.0] * bins
        with self.engine.connect() as conn:
            q = (select(bucket.label("b"), amount).where(and_(T.outputs.c.job_id == job_id, T.outputs.c.cached_from.is_(None),
                                                              c.is_not(None), c >= lo))
                 .group_by("b"))
            for b, v in conn.execute(q).all():
                out[min(int(b), bins - 1)] += float(v)
        return out


def sources_of(groups) -> dict[str, dict[str, int]]:
    """GROUP BY token_count_source rows → records' count_sources shape and order."""
    order = {s: i for i, s in enumerate(TOKEN_COUNT_SOURCES)}
    merged: dict[str, dict[str, int]] = {}
    for source, rows, prompt, output in groups:
        name = "not_recorded" if source is None else source if source in order else "unknown"
        d = merged.setdefault(name, {"rows": 0, "prompt": 0, "output": 0})
        d["rows"] += int(rows)
        d["prompt"] += int(prompt)
        d["output"] += int(output)
    rank = {"unknown": -1, **order, "not_recorded": len(order)}
    return {k: merged[k] for k in sorted(merged, key=rank.__getitem__)}
