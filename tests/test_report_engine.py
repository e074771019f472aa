"""`tokenmill report` on a job run by the real engine, stored in PostgreSQL."""

import json

import pytest

from tests.conftest import TEST_ENGINE, write_parquet
from tests.helpers import cli, job_spec
from tokenmill.jobs.lifecycle.runner import run_job

pytestmark = pytest.mark.engine


def test_report_of_a_real_engine_job_on_postgresql(pg_url, tmp_path, model_path):
    """The real engine fills every per-request clock, and the report carries them."""
    prompts = ["What is the capital of France?", "Name three colors.", "Count to five.", "Say hello in Spanish."]
    inp = write_parquet(tmp_path / "in.parquet", [{"id": str(i), "prompt": p} for i, p in enumerate(prompts)]
                        + [{"id": "empty", "prompt": ""}])
    spec = job_spec(inp, tmp_path / "o", job_id="real", engine=TEST_ENGINE,
                    sampling={"max_tokens": 16, "temperature": 0.0})
    assert run_job(spec, db_url=pg_url).status == "partial"
    res = cli("report", "real", "--db", pg_url, "--out", tmp_path, "--json", catch_exceptions=False)
    assert res.exit_code == 0, res.output
    m = json.loads(res.output)["metrics"]
    for key in ("ttft", "tpot", "e2e"):
        d = m["latency_s"][key]
        # TPOT needs two output tokens; a one-token answer has none
        assert d["n"] == 4 or (key == "tpot" and d["n"] >= 1), (key, d)
        assert 0 < d["p50"] <= d["p95"] <= d["p99"] <= d["max"], (key, d)
    assert m["latency_s"]["ttft"]["p99"] <= m["latency_s"]["e2e"]["max"]
    assert m["throughput"]["model_load_s"] > 0 and m["throughput"]["output_tok_per_s"] > 0
    assert m["memory"]["kv_cache_bytes"] > 0 and m["memory"]["peak_worker_rss_bytes"] > 0
    assert m["utilization"]["samples"] >= 1 and m["utilization"]["cpu_util_pct_max"] > 0
    assert m["failures"]["by_reason"] == {"empty_prompt": 1}
    assert m["cost"]["per_1m_output_tokens"] > 0
    page = (tmp_path / "report-real.html").read_text()
    assert "Latency per request" in page and "Output tokens over time" in page
