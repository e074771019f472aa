"""The per-job figures (jobs/metrics/catalog.py): each declared once, each found in a real
job's metrics, and rendered by report, compare, status and the run summary as before."""

import re

import pytest
from click.testing import CliRunner

from tests.conftest import write_parquet
from tests.fakes import FakeSession
from tests.helpers import job_spec
from tokenmill.jobs.cli import run as RUN
from tokenmill.jobs.lifecycle.runner import JobResult, run_job
from tokenmill.jobs.metrics import report as R
from tokenmill.jobs.metrics.accounting import JobTerms, JobWork, job_metrics
from tokenmill.jobs.metrics.catalog import BY_NAME, FIGURES, VIEWS, shown_in, values
from tokenmill.schemas import storage as S


def _has_path(m, path: str) -> bool:
    cur = m
    for part in path.split("."):
        if not isinstance(cur, dict) or part not in cur:
            return False
        cur = cur[part]
    return True


@pytest.fixture(scope="module")
def real_metrics(tmp_path_factory, model_path):
    """A finished fake-engine job's stored metrics, priced, with one dead letter."""
    tmp = tmp_path_factory.mktemp("figures")
    rows = [{"id": str(i), "prompt": f"question {i}"} for i in range(6)] + [{"id": "bad", "prompt": None}]
    spec = job_spec(write_parquet(tmp / "in.parquet", rows), tmp / "out", job_id="figs", price_per_hour=1.0,
                    sampling={"max_tokens": 4})
    return run_job(spec, db_url=f"sqlite:///{tmp / 'f.db'}", session_factory=FakeSession).metrics


def test_every_declared_figure_is_in_a_real_jobs_metrics(real_metrics):
    missing = [f"{f.name}: {f.path}" for f in FIGURES if not _has_path(real_metrics, f.path)]
    assert not missing, missing  # a renamed path in accounting.job_metrics fails here


def test_each_figure_is_declared_once_and_shown_somewhere():
    assert len(BY_NAME) == len(FIGURES)
    in_report = {n for _, lines in (*R.SECTIONS, R.COST_SECTION) for line in lines if not callable(line)
                 for n in re.findall(r"\{(\w+)\}", line[1])}
    assert in_report <= set(BY_NAME)
    named_in_code = {"checkpoint", "dtype", "failure_rate_by_reason", "retries_by_reason", "gpu_utilization",
                     "per_run", "per_worker", "cost_basis", "units_taken_over", "rows_refused",
                     "rows_admitted_not_committed"}  # report.py's varying lines read these by name
    shown = {f.name for view in VIEWS for f in shown_in(view)} | in_report | named_in_code
    assert shown == set(BY_NAME)
    for view, entries in VIEWS.items():
        keys = [k for k, _ in entries]
        assert len(keys) == len(set(keys)), view


def _metrics():
    rows = [{"prompt_tokens": 10 + i, "output_tokens": 5 * (i + 1), "cached_tokens": 4, "ttft_s": 0.1 * (i + 1),
             "tpot_s": 0.01 + 0.0001 * i, "e2e_s": 1.0 * (i + 1), "queue_s": 0.001 * i,
             "token_count_source": "engine" if i % 3 else "local_tokenizer+stream_chunks"} for i in range(6)]
    batches = [{"batch_id": "r1-0.0-a-0", "worker": "h:1", "started_at": 100.0, "finished_at": 110.0, "requests": 3,
                "tail_s": 1.0, "output_tokens": 30, "prompt_tokens": 33, "retries": {"timeout": 2}},
               {"batch_id": "r2-0.0-a-1", "worker": "h:2", "started_at": 200.0, "finished_at": 215.0, "requests": 3,
                "tail_s": 3.0, "output_tokens": 75, "prompt_tokens": 42, "retries": {"http_503": 1}}]
    workers = [{"worker": "h:1", "run_id": "r1", "load_s": 30.0, "peak_rss_bytes": 2_000_000_000, "device_type": "cpu",
                "cpu_count": 8, "device_model": "Xeon", "started_at": 90.0, "updated_at": 112.0,
                "measure": {"window_s": 20.0, "peak_tree_rss_bytes": 3_000_000_000, "tree_cores_busy_mean": 3.5},
                "engine_info": {"kv_cache_bytes": 1 << 30, "kv_cache_tokens": 65536, "weights_file_bytes": 270_000_000,
                                "dtype": "bfloat16", "max_num_batched_tokens": 8192}},
               {"worker": "g:1", "run_id": "r2", "load_s": 40.0, "peak_rss_bytes": 3_000_000_000, "device_type": "cpu",
                "cpu_count": 4, "started_at": 190.0, "updated_at": 220.0, "measure": {"window_s": 25.0}}]
    runs = [{"run_id": "r1", "started_at": 80.0, "finished_at": None, "seen_at": 115.0},
            {"run_id": "r2", "started_at": 180.0, "finished_at": 230.0}]
    util = {"peak_process_tree_rss_bytes": 9_000_000_000, "cpu_util_pct_mean": 55.5, "cpu_util_pct_max": 99.0,
            "samples": 10, "gpus": None}
    return job_metrics(JobWork(rows, batches, workers, failed_by_reason={"empty_prompt": 1, "prompt_too_long": 1},
                               runs=runs),
                       JobTerms(total=8, engine_config={"max_num_seqs": 32}, token_budget=4096, price_per_hour=3.6,
                                job_wall_s=150.0, utilization=util, hardware={"device_type": "cpu", "cpu_count": 8}))


def _data(jid, m):
    job = {"id": jid, "status": "succeeded", "model": "smol", "hardware": {"device": "cpu", "device_type": "cpu"},
           "versions": {}, "total": 8, "succeeded": 6, "failed": 2, "metrics": m}
    return {"job": R.job_info(job), "metrics": m, "metrics_source": "stored", "requests": []}


def _lines(text: str) -> list[str]:
    return [line.rstrip() for line in text.splitlines()]


def test_the_report_prints_each_figure_in_its_unit_as_before():
    out = _lines(R.format_report(_data("j", _metrics())))
    for line in [
        "  failed                          2 (25.0%)",
        "  failed: empty_prompt            1 (12.5%)",
        "  retried attempts (HTTP engine)  http_503 1, timeout 2",
        "  max_num_batched_tokens        8,192",
        "  batches (mean requests each)  2 (3.00)",
        "  generation wall                                          25.00 s",
        "  tokens prompt / output / cached                          75 / 105 / 24",
        "  rows by token-count source (…+stream_chunks: estimates)  engine 4, local_tokenizer+stream_chunks 2",
        "  prefix cache hit rate (cached ÷ prompt tokens)           32.0%",
        "  KV cache (engine reported)              1.0 GiB (65,536 tokens)",
        "  CPU utilization mean / max (all cores)  55.5% / 99.0%",
        "  run r1 (did not finish)  model load 30.00 s, generation 10.00 s, 30 output tokens (3.00 tok/s), held 35.00 s",
        "  price                                                    $7.2000/hour for all workers (job spec price_per_hour)",
        "  per 1M output tokens: generation only / all held time    $95.2381 / $809.5238",
        "  per successful request: generation only / all held time  $0.001667 / $0.0142",
    ]:
        assert line in out, line


def test_compare_rows_and_their_order_are_the_compare_view():
    m = _metrics()
    rows = R.compare_metrics(m, m)
    assert [r["metric"] for r in rows] == [f.path for f in shown_in("compare")]
    assert rows[0] == {"metric": "requests.succeeded", "label": "succeeded requests", "a": 6, "b": 6,
                       "ratio_b_over_a": 1.0, "better": "same", "direction": "higher"}
    out = _lines(R.format_compare(_data("a", m), _data("b", m)))
    for line in ["TTFT p95                                     575.0 ms   575.0 ms  1.00×  =",
                 "KV cache                                      1.0 GiB    1.0 GiB  1.00×",
                 "USD per successful request                  $0.001667  $0.001667  1.00×  =",
                 "USD per successful request (all held time)    $0.0142    $0.0142  1.00×  ="]:
        assert line in out, line


def test_status_and_the_run_summary_keep_their_keys_and_lines(monkeypatch):
    m = _metrics()
    job = {**_data("j", m)["job"], "name": None, "metrics": m, "started_at": None, "finished_at": None}
    st = RUN.job_status(job)
    assert list(st)[:11] == ["id", "name", "status", "model", "total", "succeeded", "failed", "output_tok_per_s",
                             "cost_per_1m_output_tokens", "started_at", "finished_at"]
    assert list(st)[14:] == list(values("status", m))
    assert st["rows_by_token_count_source"] == {"local_tokenizer+stream_chunks": 2, "engine": 4}
    assert st["cost_basis"] == "generation only" and st["nvml_errors"] is None and st["gpus"] == 0

    class Store:
        def __init__(self, eng):
            pass

        def get(self, job_id):
            return dict(job)

    class NoEstimates:
        def __init__(self, eng):
            pass

        def latest(self, job_id):
            return None

    monkeypatch.setattr(S, "JobStore", Store)
    monkeypatch.setattr(S, "EstimateStore", NoEstimates)
    monkeypatch.setattr(RUN, "connect", lambda url: None)
    out = _lines(CliRunner().invoke(RUN.status, ["j"], catch_exceptions=False).output)
    for line in ["                      ttft_p95_s: 0.575", "              failures_by_reason: empty_prompt: 1, prompt_too_long: 1",
                 "     cost_per_successful_request: 0.001667", "                            gpus: 0"]:
        assert line in out, line

    s = JobResult(job_id="j", status="succeeded", total=8, succeeded=6, failed=2, resumed=False, wall_s=151.234,
                  metrics=m, files={"outputs": "/o"}).summary()
    assert set(s) == {"job_id", "status", "rows_in", "succeeded", "failed", "prompt_tokens", "output_tokens",
                      "total_tokens", "wall_s", "model_load_s", "generation_wall_s", "output_tok_per_s",
                      "total_tok_per_s", "prefix_cache_hit_rate", "cost_per_1m_output_tokens",
                      "cost_held_per_1m_output_tokens", "outputs", "dtype_auto", "note", "task", "requests_per_s",
                      "cost_per_1m_total_tokens", "cost_held_per_1m_total_tokens", "cache_mode", "cache_rows",
                      "cache_samples", "cache_prompt_tokens", "cache_output_tokens"}  # `run --json`
    assert _lines(RUN.format_summary(s))[1:6] == [
        "  rows in 8 / succeeded 6 / failed 2",
        "  tokens: prompt 75, output 105, total 180",
        "  wall 151.2 s (model load 70.0 s, generation 25.0 s)",
        "  output 4.2 tok/s, total 7.2 tok/s (over generation wall time); prefix cache hit rate 32.0%",
        "  cost $95.2381 per 1M output tokens over generation only, $809.5238 over all held time (start-up, load, export)",
    ]
