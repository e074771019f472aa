"""`tokenmill report`, `jobs` and `status`: what a person and a machine read about a job."""

import json
import logging
import re

import pytest
from sqlalchemy import select

from tests.conftest import write_parquet
from tests.fakes import FakeSession
from tests.helpers import assert_one_line_error, cli, job_spec
from tokenmill.jobs.lifecycle.runner import run_job
from tokenmill.jobs.metrics import report as R
from tokenmill.schemas import storage as S
from tokenmill.schemas import tables as T
from tokenmill.schemas.records import OutputRow

N = 40


def _run(tmp, db, job_id, max_tokens, **spec):
    rows = [{"id": str(i), "prompt": f"question {i} " * (1 + i % 6)} for i in range(N)] + [{"id": "bad", "prompt": None}]
    inp = write_parquet(tmp / f"{job_id}.parquet", rows)
    return run_job(job_spec(inp, tmp / f"out-{job_id}", job_id=job_id, sampling={"max_tokens": max_tokens}, **spec),
                   db_url=db, session_factory=FakeSession)


@pytest.fixture(scope="module")
def jobs_db(tmp_path_factory, model_path):
    """Two finished fake-engine jobs (A: 4 tokens per answer, B: 8) with one dead letter each."""
    tmp = tmp_path_factory.mktemp("report")
    db = f"sqlite:///{tmp / 'r.db'}"
    _run(tmp, db, "job-a", 4)
    _run(tmp, db, "job-b", 8, price_per_hour=1.0)
    return db


def invoke(*args):
    return cli(*args, catch_exceptions=False)


def test_report_prints_the_serving_table_and_writes_a_self_contained_html(jobs_db, tmp_path):
    res = invoke("report", "job-a", "--db", jobs_db, "--out", tmp_path)
    assert res.exit_code == 0, res.output
    out = res.output
    for part in ("TTFT", "TPOT", "E2E", "p99", "output tok/s", "total (prompt + output) tok/s", "requests/s",
                 "model load", "prefix cache hit rate", "max_num_seqs", "failed: empty_prompt", "1 (2.4%)",
                 "per 1M output tokens: generation only / all held time", "per 1M total tokens",
                 "per successful request", "CPU utilization", "Workers (measured where the engine runs)", "vCPU",
                 "vllm", "wall clock", "monotonic"):
        assert part in out, part
    html_path = tmp_path / "report-job-a.html"
    assert f"HTML report: {html_path}" in out
    page = html_path.read_text()
    assert not re.search(r"<script[^>]+src=[\"']https?:", page)  # plotly.js is embedded: opens offline
    assert "Plotly.newPlot" in page and len(page) > 1_000_000
    for title in ("Latency per request", "Output tokens over time", "Cost", "Failed rows by reason",
                  "TTFT (ms)", "TPOT (ms)", "E2E (ms)"):  # fake-engine latencies are sub-second
        assert title in page, title


def test_report_json_carries_metrics_job_description_and_html_path(jobs_db, tmp_path):
    res = invoke("report", "job-b", "--db", jobs_db, "--out", tmp_path, "--json")
    assert res.exit_code == 0, res.output
    d = json.loads(res.output)
    assert d["job"]["id"] == "job-b" and d["job"]["status"] == "partial"
    assert d["job"]["device_type"] == "cpu" and d["job"]["versions"]["tokenmill"]
    m = d["metrics"]
    assert m["requests"] == {"total": N + 1, "succeeded": N, "failed": 1, "samples": N}
    assert m["tokens"]["output"] == N * 8
    assert m["failures"]["by_reason"] == {"empty_prompt": 1}
    assert m["cost"]["price_per_hour"] == 1.0 and m["cost"]["price_source"] == "job spec price_per_hour"
    assert m["utilization"]["samples"] >= 1 and m["utilization"]["gpus"] is None
    assert set(m["clocks"]) >= {"ttft_s", "tpot_s", "e2e_s"}
    assert d["html"] == str(tmp_path / "report-job-b.html")
    assert "requests" not in d  # per-request rows stay in the database


def test_compare_puts_two_jobs_side_by_side_with_ratios(jobs_db, tmp_path):
    res = invoke("report", "job-a", "--compare", "job-b", "--db", jobs_db, "--out", tmp_path, "--json")
    assert res.exit_code == 0, res.output
    d = json.loads(res.output)
    assert d["a"]["job"]["id"] == "job-a" and d["b"]["job"]["id"] == "job-b" and d["ratio"] == "B / A"
    rows = {r["metric"]: r for r in d["rows"]}
    assert rows["requests.succeeded"]["ratio_b_over_a"] == 1.0 and rows["requests.succeeded"]["better"] == "same"
    assert rows["failures.rate"]["a"] == pytest.approx(1 / (N + 1))
    page = (tmp_path / "compare-job-a-vs-job-b.html").read_text()
    assert "A: job-a" in page and "B ÷ A" in page and "Plotly.newPlot" in page
    res = invoke("report", "job-a", "--compare", "job-b", "--db", jobs_db, "--no-html")
    assert res.exit_code == 0 and "B/A" in res.output and "TTFT p99" in res.output
    assert "HTML report" not in res.output


def test_unknown_job_is_a_one_line_error(jobs_db):
    for args in (["report", "nope"], ["report", "job-a", "--compare", "nope"], ["status", "nope"]):
        res = cli(*args, "--db", jobs_db, *(["--no-html"] if args[0] == "report" else []))
        assert res.exit_code == 1
        assert res.output.strip() == "error: no job with id 'nope'"


def test_report_on_unreachable_database_masks_the_password():
    res = cli("report", "x", "--db", "postgresql+psycopg2://bob:s3cret@127.0.0.1:1/nodb")
    assert_one_line_error(res, 1, alone=True)
    assert res.output.startswith("error: cannot use database") and "s3cret" not in res.output


def test_jobs_and_status_show_counts_tok_s_and_cost(jobs_db):
    res = invoke("jobs", "--db", jobs_db, "--json")
    rows = {r["id"]: r for r in json.loads(res.output)}
    assert set(rows) == {"job-a", "job-b"}
    assert rows["job-b"]["succeeded"] == N and rows["job-b"]["output_tok_per_s"] > 0
    assert rows["job-b"]["cost_per_1m_output_tokens"] > 0
    res = invoke("status", "job-a", "--db", jobs_db, "--json")
    st = json.loads(res.output)
    assert st["status"] == "partial" and st["reconciled"] is True and st["failed"] == 1
    assert st["failures_by_reason"] == {"empty_prompt": 1}
    assert st["ttft_p50_s"] > 0 and st["tpot_p50_s"] == pytest.approx(0.001)  # FakeSession's fixed TPOT
    assert st["cost_per_1m_total_tokens"] > 0 and st["cost_basis"] == "generation only"
    # all the time the job held its devices (start-up, load, export) costs more than generation alone
    assert st["cost_held_per_1m_output_tokens"] > st["cost_per_1m_output_tokens"] > 0
    assert st["cost_held_basis"].startswith("all held time") and st["runs"] == 1 and st["nvml_errors"] is None
    assert st["ttft_p95_s"] >= st["ttft_p50_s"] and st["tpot_p95_s"] == pytest.approx(0.001)
    assert st["e2e_p95_s"] <= st["e2e_p99_s"] and st["failure_rate"] == pytest.approx(1 / (N + 1))
    res = invoke("status", "job-a", "--db", jobs_db)
    assert "ttft_p99_s" in res.output and "failures_by_reason: empty_prompt: 1" in res.output


def test_report_of_a_running_job_computes_metrics_from_committed_rows(sqlite_url, tmp_path):
    eng = S.connect(sqlite_url)
    S.JobStore(eng).claim("live", {"spec": {"input": "x"}, "hardware": {"device_type": "cpu"}, "total": 10,
                                        "engine_config": {"max_num_seqs": 4}})
    S.ResultWriter(eng).insert_rows(OutputRow, [
        OutputRow(job_id="live", id=str(i), input_file=0, input_row=i, prompt_tokens=5, output_tokens=7,
                                    ttft_s=0.1, e2e_s=0.5, finished_at=100.0 + i).as_dict() for i in range(3)])
    res = invoke("report", "live", "--db", sqlite_url, "--out", tmp_path, "--json")
    d = json.loads(res.output)
    assert d["metrics_source"].startswith("computed now") and "running" in d["metrics_source"]
    assert d["metrics"]["requests"]["succeeded"] == 3 and d["metrics"]["tokens"]["output"] == 21
    assert (tmp_path / "report-live.html").exists()


def test_scrub_masks_passwords_in_any_url_string():
    d = R.scrub({"a": ["postgresql://u:pw1@h/db", {"b": "see mysql+pymysql://root:pw2@x:3306/y now"}], "n": 3})
    assert "pw1" not in json.dumps(d) and "pw2" not in json.dumps(d)
    assert d["a"][0] == "postgresql://u:***@h/db" and d["n"] == 3


def test_database_password_never_reaches_jobs_table_report_or_logs(pg_url, tmp_path, model_path, caplog):
    """A real PostgreSQL URL with a password (trust auth accepts and ignores it)."""
    url = pg_url.replace("://postgres@", "://postgres:hunter2secret@")
    assert "hunter2secret" in url
    caplog.set_level(logging.DEBUG)
    rows = [{"id": str(i), "prompt": f"q {i}"} for i in range(5)]
    inp = write_parquet(tmp_path / "in.parquet", rows)
    spec = job_spec(inp, tmp_path / "o", job_id="pw", db=url, sampling={"max_tokens": 2})
    assert run_job(spec, session_factory=FakeSession).status == "succeeded"
    eng = S.connect(url)
    with eng.connect() as conn:
        row = dict(conn.execute(select(T.jobs).where(T.jobs.c.id == "pw")).mappings().one())
    stored = json.dumps(row, default=str)
    assert "hunter2secret" not in stored and "postgres:***@" in stored  # the spec keeps the masked URL
    for args in (["report", "pw", "--out", tmp_path, "--json"], ["report", "pw", "--out", tmp_path], ["status", "pw"],
                 ["jobs"], ["db", "upgrade"]):
        res = invoke(*args, "--db", url)
        assert res.exit_code == 0, res.output
        assert "hunter2secret" not in res.output
    assert "hunter2secret" not in (tmp_path / "report-pw.html").read_text()
    assert "hunter2secret" not in caplog.text

