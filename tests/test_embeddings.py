"""Embedding jobs (`engine.task: embed`) on the bundled model, each engine against its own raw
API on the same inputs: vLLM's `LLM.embed`, llama-server's /v1/embeddings (the `llamacpp`
engine and the `openai` engine pointed at such a server), and an OpenAI batch file of
/v1/embeddings lines written back as `CreateEmbeddingResponse` bodies."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import httpx
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.conftest import TEST_ENGINE, write_parquet
from tests.helpers import job_spec
from tokenmill.jobs.lifecycle.runner import run_job
from tokenmill.schemas import storage as S

TEXTS = ["The cat sat on the mat.", "A kitten rested on the rug.", "Stock markets fell sharply today.",
         "def add(a, b): return a + b", "Paris is the capital of France.", "Bonjour, comment allez-vous ?"]
HIDDEN = 576  # SmolLM2-135M's hidden size: the vectors' dimension


def _rows():
    return [{"id": f"t{i}", "prompt": t} for i, t in enumerate(TEXTS)]


def _cosine(a, b) -> float:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


def _job(tmp_path, sqlite_url, job_id, engine) -> dict[str, list[float]]:
    tmp_path.mkdir(parents=True, exist_ok=True)
    inp = write_parquet(tmp_path / "in.parquet", _rows())
    res = run_job(job_spec(inp, tmp_path / "out", job_id=job_id, engine=engine), db_url=sqlite_url)
    assert res.status == "succeeded" and res.succeeded == len(TEXTS), res
    from tokenmill.jobs.cli.run import format_summary

    said = format_summary(res.summary())  # the run summary speaks of input tokens and rows, not output
    assert "rows/s (over generation wall time; embeddings: no output tokens" in said and "output 0.0 tok/s" not in said, said
    table = pq.read_table(tmp_path / "out" / "outputs.parquet")
    assert table.schema.field("embedding").type == pa.list_(pa.float32(), HIDDEN)
    out = {r["id"]: r for r in table.to_pylist()}
    for r in out.values():
        assert r["text"] is None and r["output_tokens"] == 0 and r["prompt_tokens"] > 0, r
        assert abs(np.linalg.norm(r["embedding"]) - 1.0) < 1e-3  # L2-normalized
    m = S.JobStore(S.connect(sqlite_url)).get(job_id)["metrics"]
    assert m["tokens"]["output"] == 0 and m["latency_s"]["tpot"]["n"] == 0  # no decode: no TPOT
    assert m["throughput"]["total_tok_per_s"] > 0 and m["throughput"]["requests_per_s"] > 0
    return {k: r["embedding"] for k, r in out.items()}


@pytest.mark.engine
def test_an_embedding_job_on_vllm_matches_llm_embed(tmp_path, sqlite_url, model_path):
    got = _job(tmp_path, sqlite_url, "embed-vllm", {**TEST_ENGINE, "task": "embed", "pooling": "last"})
    from vllm import LLM

    ref = LLM(model=model_path, runner="pooling", convert="embed", pooler_config={"pooling_type": "LAST"},
              dtype=TEST_ENGINE["dtype"], max_model_len=TEST_ENGINE["max_model_len"], enforce_eager=True,
              kv_cache_memory_bytes=256 << 20)
    try:
        want = {f"t{i}": o.outputs.embedding for i, o in enumerate(ref.embed(TEXTS))}
    finally:
        ref.llm_engine.engine_core.shutdown()
    for k in got:
        assert 1 - _cosine(got[k], want[k]) < 1e-3, k
    # the vectors tell texts apart: the two cat sentences are nearer each other than the market news
    assert _cosine(got["t0"], got["t1"]) > _cosine(got["t0"], got["t2"])


@pytest.fixture
def embedding_server(tmp_path):
    """llama-server on the bundled GGUF with --embeddings and last-token pooling, started here."""
    from tokenmill.schemas.models import bundled_gguf
    from tokenmill.transforms.engines.llamacpp_session import bin_dir, free_port, wait_until_answers

    port = free_port()
    log = tmp_path / "embed-server.log"
    threads = str(len(os.sched_getaffinity(0)))
    with log.open("wb") as f:
        proc = subprocess.Popen([str(Path(bin_dir()) / "llama-server"), "-m", str(bundled_gguf()), "--host", "127.0.0.1",
                                 "--port", str(port), "-np", "1", "-c", "1024", "-ub", "1024", "-b", "1024", "-t", threads,
                                 "--embeddings", "--pooling", "last", "--alias", "smollm2-135m", "--no-webui"],
                                stdout=f, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_until_answers(proc, f"{base}/health", 120, "llama-server", lambda: log.read_text()[-2000:])
        yield base
    finally:
        proc.kill()
        proc.wait(10)


def _direct(base: str) -> dict[str, list[float]]:
    out = {}
    for i, t in enumerate(TEXTS):
        ans = httpx.post(f"{base}/v1/embeddings", json={"input": t, "model": "smollm2-135m"}, timeout=60).json()
        out[f"t{i}"] = ans["data"][0]["embedding"]
    return out


@pytest.mark.llamacpp
def test_embedding_jobs_on_llama_server_and_the_openai_engine_match_the_servers_endpoint(
        tmp_path, sqlite_url, embedding_server):
    want = _direct(embedding_server)
    own = _job(tmp_path / "own", sqlite_url, "embed-llama", {"kind": "llamacpp", "task": "embed", "pooling": "last",
                                                             "max_in_flight": 2, "max_model_len": 1024})
    remote = _job(tmp_path / "remote", sqlite_url, "embed-oai", {
        "kind": "openai", "task": "embed", "base_url": f"{embedding_server}/v1", "model": "smollm2-135m",
        "tokenizer": "smollm2-135m", "max_in_flight": 2, "max_model_len": 1024})
    for k in want:
        assert 1 - _cosine(own[k], want[k]) < 1e-3, k
        assert 1 - _cosine(remote[k], want[k]) < 1e-3, k


@pytest.mark.llamacpp
def test_an_openai_batch_file_of_embeddings_lines_round_trips(tmp_path, sqlite_url, embedding_server):
    from openai.types import CreateEmbeddingResponse

    lines = [{"custom_id": f"e{i}", "method": "POST", "url": "/v1/embeddings",
              "body": {"model": "smollm2-135m", "input": t}} for i, t in enumerate(TEXTS[:3])]
    lines.append({"custom_id": "chat", "method": "POST", "url": "/v1/chat/completions",
                  "body": {"model": "smollm2-135m", "messages": [{"role": "user", "content": "hi"}]}})
    lines.append({"custom_id": "b64", "method": "POST", "url": "/v1/embeddings",
                  "body": {"model": "smollm2-135m", "input": "x", "encoding_format": "base64"}})
    inp = tmp_path / "in.jsonl"
    inp.write_text("".join(json.dumps(line) + "\n" for line in lines))
    spec = job_spec(inp, tmp_path / "out", job_id="embed-batch",
                    engine={"kind": "llamacpp", "task": "embed", "max_in_flight": 2, "max_model_len": 1024})
    res = run_job(spec, db_url=sqlite_url)
    assert (res.succeeded, res.failed) == (3, 2), res
    want = _direct(embedding_server)
    outs = [json.loads(x) for x in (tmp_path / "out" / "outputs.jsonl").read_text().splitlines()]
    assert [o["custom_id"] for o in outs] == ["e0", "e1", "e2"]
    for o in outs:
        body = CreateEmbeddingResponse.model_validate(o["response"]["body"])
        assert len(body.data[0].embedding) == HIDDEN and body.usage.prompt_tokens > 0
        assert 1 - _cosine(body.data[0].embedding, want["t" + o["custom_id"][1:]]) < 1e-3
    errors = {json.loads(x)["custom_id"]: json.loads(x)["error"] for x in (tmp_path / "out" / "errors.jsonl").read_text().splitlines()}
    assert "need a job of their own with engine task: generate" in errors["chat"]["message"], errors
    assert "float vectors only" in errors["b64"]["message"], errors
