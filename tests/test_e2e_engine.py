"""End to end with the real vLLM engine on the real model (SmolLM2-135M-Instruct)."""

import json
import os
import subprocess
import sys

import pyarrow.parquet as pq
import pytest

from bench.datasets import SYSTEM_PROMPTS
from tests.conftest import TEST_ENGINE, write_parquet
from tests.helpers import job_spec
from tokenmill.jobs.lifecycle.runner import run_job
from tokenmill.schemas import storage as S

pytestmark = pytest.mark.engine


def rows():
    out = [
        {"id": "capital", "messages": [{"role": "user", "content": "What is the capital of France?"}], "prompt": None},
        {"id": "plain", "prompt": "The three primary colors are", "messages": None},
    ]
    for i, q in enumerate(["My tent leaks.", "My order never arrived.", "I was charged twice.", "The zipper broke."]):
        out.append({
            "id": f"support-{i}",
            "messages": [{"role": "system", "content": SYSTEM_PROMPTS["support"]}, {"role": "user", "content": q}],
            "prompt": None,
        })
    return out


def test_real_job_answers_sensibly_and_reconciles(tmp_path, sqlite_url, model_path):
    inp = write_parquet(tmp_path / "in.parquet", rows())
    spec = job_spec(inp, tmp_path / "out", job_id="e2e", engine=TEST_ENGINE,
                    sampling={"max_tokens": 24, "temperature": 0.0})
    res = run_job(spec, db_url=sqlite_url)
    assert res.status == "succeeded", res
    assert (res.total, res.succeeded, res.failed) == (6, 6, 0)
    out = {r["id"]: r for r in pq.read_table(tmp_path / "out" / "outputs.parquet").to_pylist()}
    assert "Paris" in out["capital"]["text"]
    for r in out.values():
        assert 0 < r["output_tokens"] <= 24
        assert r["prompt_tokens"] >= 5
        assert r["e2e_s"] > 0 and r["ttft_s"] > 0 and r["ttft_s"] <= r["e2e_s"]
        assert r["finish_reason"] in ("stop", "length")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_path)
    assert out["plain"]["prompt_tokens"] == len(tok("The three primary colors are")["input_ids"])
    # greedy chat output equals vLLM's own chat() answer would need a second engine; the
    # shared 143-token system prompt must at least hit the prefix cache (128-token blocks on CPU)
    support = [r for k, r in out.items() if k.startswith("support")]
    assert sum(r["cached_tokens"] for r in support) >= 128
    eng = S.connect(sqlite_url)
    job = S.JobStore(eng).get("e2e")
    assert job["status"] == "succeeded" and job["total"] == job["succeeded"] == 6
    m = job["metrics"]
    assert m["tokens"]["output"] == sum(r["output_tokens"] for r in out.values())
    assert m["throughput"]["output_tok_per_s"] > 0 and m["throughput"]["model_load_s"] is not None
    assert 0 < m["prefix_cache"]["hit_rate"] < 1
    assert m["memory"]["kv_cache_bytes"] > 0


def test_cli_run_keeps_the_terminal_to_stages_and_the_summary_and_the_engine_output_in_its_log(
        tmp_path, sqlite_url, model_path):
    # `dtype: auto` (the default): the first such job on a machine measures it, in the log too
    inp = write_parquet(tmp_path / "in.parquet", rows()[:2])
    cmd = [
        sys.executable, "-m", "tokenmill.jobs.cli", "run", "--input", str(inp), "--output", str(tmp_path / "o"),
        "--db", sqlite_url, "--job-id", "cli-e2e", "--max-tokens", "8", "--max-num-seqs", "8",
        "--max-model-len", "512", "--gpu-memory-utilization", "0.3",
    ]
    env = {**os.environ, "VLLM_LOGGING_LEVEL": "WARNING", "TOKENMILL_LOG_DIR": str(tmp_path / "logs")}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "job cli-e2e: succeeded" in proc.stdout
    assert "rows in 2 / succeeded 2 / failed 0" in proc.stdout
    assert "output" in proc.stdout and "tok/s" in proc.stdout
    terminal = proc.stdout + proc.stderr
    assert len(terminal.splitlines()) <= 40, terminal
    for noise in ("WARNING", "Warning", "force killing", "leaked semaphore", "Traceback", "it/s]"):
        assert noise not in terminal, terminal
    assert "· checked: 2 input rows" in proc.stderr and "· exported" in proc.stderr
    assert "  dtype " in proc.stdout  # the dtype auto chose, and why
    logs = list((tmp_path / "logs" / "cli-e2e").glob("*.log"))
    assert len(logs) == 1 and f"log: {logs[0]}" in proc.stdout
    text = logs[0].read_text()
    assert "WARNING" in text  # the engine did log, into the job's log file


def test_cli_run_json_keeps_stdout_clean_of_engine_logs(tmp_path, sqlite_url, model_path):
    # With vLLM warnings on (as `make` set VLLM_LOGGING_LEVEL=WARNING), stdout must still be one JSON document.
    inp = write_parquet(tmp_path / "in.parquet", rows()[:2])
    cmd = [
        sys.executable, "-m", "tokenmill.jobs.cli", "run", "--input", str(inp), "--output", str(tmp_path / "o"),
        "--db", sqlite_url, "--job-id", "cli-json", "--max-tokens", "4", "--max-num-seqs", "8",
        "--max-model-len", "512", "--gpu-memory-utilization", "0.3", "--json", "--dtype", "float32",
    ]
    env = {k: v for k, v in os.environ.items() if k != "VLLM_LOGGING_STREAM"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600,
                          env={**env, "VLLM_LOGGING_LEVEL": "WARNING", "TOKENMILL_LOG_DIR": str(tmp_path / "logs")})
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout)
    assert (summary["status"], summary["rows_in"], summary["succeeded"]) == ("succeeded", 2, 2)
    assert "WARNING" not in proc.stderr and "WARNING" in open(summary["log"]).read()  # the engine did log


def test_cli_run_verbose_keeps_the_engine_output_on_the_terminal(tmp_path, sqlite_url, model_path):
    inp = write_parquet(tmp_path / "in.parquet", rows()[:1])
    cmd = [
        sys.executable, "-m", "tokenmill.jobs.cli", "-v", "run", "--input", str(inp), "--output", str(tmp_path / "o"),
        "--db", sqlite_url, "--job-id", "cli-verbose", "--max-tokens", "4", "--max-num-seqs", "8",
        "--max-model-len", "512", "--gpu-memory-utilization", "0.3", "--dtype", "float32",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "TOKENMILL_LOG_DIR": str(tmp_path / "logs")})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "INFO" in proc.stderr and "job cli-verbose: succeeded" in proc.stdout
    assert not (tmp_path / "logs").exists()


def test_per_row_min_tokens_reaches_the_engine(tmp_path, sqlite_url):
    """`min_tokens` (a key declared only in schemas/sampling.py) holds the real engine to a
    minimum: the same short-answer prompt stops early without it and runs on with it."""
    q = [{"role": "user", "content": "What is the capital of France?"}]
    inp = write_parquet(tmp_path / "in.parquet", [
        {"id": "free", "messages": json.dumps(q), "min_tokens": None},
        {"id": "held", "messages": json.dumps(q), "min_tokens": 20},
        {"id": "bad", "messages": json.dumps(q), "min_tokens": -1},
    ])
    spec = job_spec(inp, tmp_path / "out", job_id="min-tokens", engine=TEST_ENGINE, sampling={"max_tokens": 24})
    res = run_job(spec, db_url=sqlite_url)
    out = {r["id"]: r for r in pq.read_table(tmp_path / "out" / "outputs.parquet").to_pylist()}
    dead = pq.read_table(tmp_path / "out" / "dead_letters.parquet").to_pylist()
    assert res.status == "partial" and [(d["id"], d["reason"]) for d in dead] == [("bad", "bad_sampling")]
    assert out["free"]["output_tokens"] < 20 and out["free"]["finish_reason"] == "stop"
    assert out["held"]["output_tokens"] >= 20
