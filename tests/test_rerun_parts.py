"""Reruns cost what is missing: the export is a folder of parts, a rerun adds a part for the rows it
answered and keeps the earlier ones; the job's metrics merge per-run summaries.

A rerun that finds an earlier part missing or changed, or rows gone from the database behind the
export, writes the whole export again; the metrics of a job run in two halves equal a recount from
every row (counts and sums exactly, time percentiles within `merged.ALPHA`)."""

from __future__ import annotations

import json
import random
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow.dataset as ds
import pytest
from sqlalchemy import delete

from tests.conftest import write_parquet
from tests.fakes import FakeSession
from tests.helpers import job_spec
from tokenmill.jobs.lifecycle.runner import run_job
from tokenmill.jobs.metrics.accounting import JobTerms
from tokenmill.jobs.metrics.figures import stored_metrics
from tokenmill.schemas import storage as S
from tokenmill.schemas import tables as T
from tokenmill.schemas.storage.merged import ALPHA, merge, stats_of, summarize
from tokenmill.schemas.storage.summary import DIST_COLUMNS

ROWS = 200


class CancellingSession(FakeSession):
    """A fake engine whose fifth step asks for the job to be cancelled, as `tokenmill cancel` does."""

    db_url = ""

    def step(self):
        if self.steps == 4:
            S.JobStore(S.connect(self.db_url)).request_cancel("halves")
        time.sleep(0.01)
        return super().step()


@pytest.fixture
def halves(tmp_path, sqlite_url, monkeypatch):
    """A job cancelled part way (its export: the rows answered so far), and its spec."""
    monkeypatch.setattr(CancellingSession, "db_url", sqlite_url)
    inp = write_parquet(tmp_path / "in.parquet", [{"id": f"r{i:03d}", "prompt": f"question {i}"} for i in range(ROWS)])
    spec = job_spec(inp, tmp_path / "out", job_id="halves", engine={"max_num_seqs": 4}, sampling={"max_tokens": 4},
                    batching={"token_budget": 64, "ordering": "none"})
    first = run_job(spec, db_url=sqlite_url, session_factory=CancellingSession)
    assert first.status == "cancelled" and 0 < first.succeeded < ROWS
    return spec, first


def manifest(out) -> dict:
    return json.loads((out / "_SUCCESS.json").read_text())


def parts(out) -> dict[str, int]:
    return {p.name: p.stat().st_mtime_ns for p in (out / "outputs.parquet").iterdir()}


def every_id_once(path) -> None:
    ids = pd.read_parquet(path)["id"].tolist()
    assert sorted(ids) == [f"r{i:03d}" for i in range(ROWS)]
    assert ds.dataset(path, format="parquet").to_table().num_rows == ROWS


def test_a_rerun_adds_a_part_for_the_rows_it_answered_and_keeps_the_earlier_one(halves, sqlite_url):
    spec, first = halves
    out = Path(spec.output)
    before = parts(out)
    assert len(before) == 1
    res = run_job(spec, db_url=sqlite_url, session_factory=FakeSession)
    assert res.status == "succeeded"
    after = parts(out)
    assert {k: v for k, v in after.items() if k in before} == before  # the first run's part untouched
    m = manifest(out)
    got = m["parts"]["outputs"]
    assert [p["file"] for p in got] == sorted(after) and len(got) == 2
    assert [p["rows"] for p in got] == [first.succeeded, ROWS - first.succeeded]
    assert m["written"]["outputs"] == ROWS - first.succeeded and m["outputs"] == ROWS
    every_id_once(res.files["outputs"])  # the printed path, read whole by pandas and pyarrow.dataset


def test_a_rerun_that_finds_a_part_changed_exports_everything_again(halves, sqlite_url):
    spec, first = halves
    out = Path(spec.output)
    part = next((out / "outputs.parquet").glob("part-*.parquet"))
    part.write_bytes(part.read_bytes()[:-8])  # cut short
    res = run_job(spec, db_url=sqlite_url, session_factory=FakeSession)
    m = manifest(out)
    assert res.status == "succeeded" and len(m["parts"]["outputs"]) == 1 and m["written"]["outputs"] == ROWS
    every_id_once(res.files["outputs"])


def test_rows_gone_from_the_database_behind_the_export_make_the_rerun_export_everything(halves, sqlite_url):
    spec, first = halves
    out = Path(spec.output)
    with S.connect(sqlite_url).begin() as c:  # what bench/rerun.py does to make a job 90% done
        gone = c.execute(delete(T.outputs).where(T.outputs.c.job_id == "halves", T.outputs.c.input_row % 10 == 0)).rowcount
    assert gone
    res = run_job(spec, db_url=sqlite_url, session_factory=FakeSession)
    m = manifest(out)
    assert res.status == "succeeded" and len(m["parts"]["outputs"]) == 1 and m["written"]["outputs"] == ROWS
    every_id_once(res.files["outputs"])


def _close(merged, exact, rel: float) -> None:
    if exact is None or merged is None:
        assert merged == exact
    else:
        assert abs(merged - exact) <= rel * abs(exact) + 1e-12


def test_a_job_run_in_two_halves_gets_a_from_scratch_recounts_figures(halves, sqlite_url):
    spec, _ = halves
    res = run_job(spec, db_url=sqlite_url, session_factory=FakeSession)
    eng = S.connect(sqlite_url)
    exact = stored_metrics(eng, "halves", JobTerms(total=ROWS, engine_config=spec.engine.model_dump(mode="json"),
                                                          cache_mode=spec.cache))
    m = res.metrics
    assert m["requests"] == exact["requests"] and m["tokens"] == exact["tokens"] and m["cache"] == exact["cache"]
    assert m["answers"] == exact["answers"]
    assert exact["percentiles"]["relative_error_max"] == dict.fromkeys(DIST_COLUMNS, 0.0)
    bound = m["percentiles"]["relative_error_max"]
    assert bound["prompt_tokens"] == 0 and bound["e2e_s"] == ALPHA
    for section, key, column in [("lengths", "prompt_tokens", "prompt_tokens"), ("lengths", "output_tokens", "output_tokens"),
                                 ("latency_s", "ttft", "ttft_s"), ("latency_s", "e2e", "e2e_s"),
                                 ("latency_s", "tpot", "tpot_s"), ("latency_s", "queue", "queue_s")]:
        a, b = m[section][key], exact[section][key]
        assert a["n"] == b["n"] and a["max"] == b["max"]
        _close(a["mean"], b["mean"], 1e-9)
        for q in ("p50", "p95", "p99"):
            _close(a[q], b[q], bound[column])


def test_merged_summaries_of_any_split_match_numpy_within_the_bound():
    rnd = random.Random(53)
    n = 5000
    cols = {
        "sample": [0] * n, "cached_from": [None if rnd.random() < 0.9 else "other" for _ in range(n)],
        "prompt_tokens": [rnd.randint(1, 900) for _ in range(n)], "output_tokens": [rnd.randint(0, 64) for _ in range(n)],
        "cached_tokens": [rnd.choice([None, 0, 16]) for _ in range(n)], "token_count_source": ["engine"] * n,
        "valid": [rnd.choice([None, True, False]) for _ in range(n)], "adapter": [rnd.choice([None, "a"]) for _ in range(n)],
        "ttft_s": [rnd.lognormvariate(-3, 1.5) for _ in range(n)], "tpot_s": [rnd.choice([None, rnd.random()]) for _ in range(n)],
        "e2e_s": [rnd.expovariate(0.5) for _ in range(n)], "queue_s": [rnd.choice([0.0, rnd.random() / 100]) for _ in range(n)],
    }
    cuts = sorted(rnd.sample(range(1, n), 7))
    chunks = [{k: v[a:b] for k, v in cols.items()} for a, b in zip([0, *cuts], [*cuts, n])]
    merged = stats_of(merge(summarize(chunks[:3]), summarize(chunks[3:])))
    whole = stats_of(summarize([cols]))  # the split does not matter (but for float summation order)
    for c in DIST_COLUMNS:
        assert merged.dists[c] == pytest.approx(whole.dists[c], rel=1e-12)
    for a, b in zip(merged.by_adapter, whole.by_adapter, strict=True):
        assert {**a, "request_s": pytest.approx(b["request_s"], rel=1e-12)} == b
    assert (merged.n, merged.rows, merged.prompt, merged.output, merged.by_source, merged.cache) == \
        (whole.n, whole.rows, whole.prompt, whole.output, whole.by_source, whole.cache)
    engine = [c is None for c in cols["cached_from"]]
    for c in DIST_COLUMNS:
        vals = np.array([v for v, e in zip(cols[c], engine) if e and v is not None], dtype=float)
        d = merged.dists[c]
        assert d["n"] == vals.size and d["max"] == vals.max()
        for q in (50, 95, 99):
            _close(d[f"p{q}"], float(np.percentile(vals, q)), merged.percentile_error[c])
    assert merged.prompt == sum(p for p, e in zip(cols["prompt_tokens"], engine) if e)
    assert merged.cache["samples"] == n - sum(engine)
