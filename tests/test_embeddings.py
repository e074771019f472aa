"""Embedding jobs (`engine.task: embed`) on the bundled model, each engine against its own raw
API on the same inputs: vLLM's `LLM.embed`, llama-server's /v1/embeddings (the `llamacpp`
engine and the `openai` engine pointed at such a server), and an OpenAI batch file mixing
/v1/embeddings lines with chat, JSON-schema and log-probability lines (a pass per task),
every output line validated with the `openai` package's types."""

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
from tests.request_kinds import PERSON, PERSON_FORMAT
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


def _mixed_file(path: Path) -> Path:
    """An OpenAI batch file mixing every request kind: embeddings, chat, a JSON schema,
    log-probabilities on both endpoints, and two lines that are refused."""
    def chat(cid, **body):
        return {"custom_id": cid, "method": "POST", "url": "/v1/chat/completions", "body": {
            "model": "smollm2-135m", "messages": [{"role": "user", "content": "Name a colour."}], "max_tokens": 12, **body}}

    def emb(cid, text, **body):
        return {"custom_id": cid, "method": "POST", "url": "/v1/embeddings",
                "body": {"model": "smollm2-135m", "input": text, **body}}

    lines = [emb("e0", TEXTS[0]), chat("chat"), emb("e1", TEXTS[1]),
             chat("schema", max_tokens=64, messages=[{"role": "user", "content": "Alice is 31. Give her as JSON."}],
                  response_format=PERSON_FORMAT),
             chat("lp", logprobs=True, top_logprobs=2),
             {"custom_id": "comp", "method": "POST", "url": "/v1/completions",
              "body": {"model": "smollm2-135m", "prompt": "Once upon a time", "max_tokens": 6, "logprobs": 2}},
             emb("e2", TEXTS[2]), emb("b64", "x", encoding_format="base64"),
             chat("tools", tools=[{"type": "function", "function": {"name": "f"}}])]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def _check_mixed(out: Path, sqlite_url: str, job_id: str, want: dict[str, list[float]]) -> None:
    """Every output line of `_mixed_file` validated with the `openai` package's types, the
    vectors against `want` (by text), the refusals' reasons, one job of two passes."""
    import jsonschema
    from openai.types import Completion, CreateEmbeddingResponse
    from openai.types.chat import ChatCompletion

    lines = map(json.loads, (out / "outputs.jsonl").read_text().splitlines())
    outs = {o["custom_id"]: o["response"]["body"] for o in lines}
    assert list(outs) == ["e0", "chat", "e1", "schema", "lp", "comp", "e2"]  # input order, both passes in one file
    for cid in ("e0", "e1", "e2"):
        body = CreateEmbeddingResponse.model_validate(outs[cid])
        assert len(body.data[0].embedding) == HIDDEN and body.usage.prompt_tokens > 0
        assert 1 - _cosine(body.data[0].embedding, want["t" + cid[1:]]) < 1e-3, cid
    chat = {cid: ChatCompletion.model_validate(outs[cid]) for cid in ("chat", "schema", "lp")}
    assert chat["chat"].choices[0].message.content and chat["chat"].choices[0].logprobs is None
    schema = chat["schema"].choices[0]
    assert schema.finish_reason == "stop", schema
    jsonschema.validate(json.loads(schema.message.content), PERSON)
    lp = chat["lp"].choices[0].logprobs.content
    assert len(lp) == chat["lp"].usage.completion_tokens
    assert all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in lp), lp
    comp = Completion.model_validate(outs["comp"])
    assert len(comp.choices[0].logprobs.tokens) == comp.usage.completion_tokens == 6
    errors = {e["custom_id"]: e["error"]["message"] for e in map(json.loads, (out / "errors.jsonl").read_text().splitlines())}
    assert set(errors) == {"b64", "tools"} and "float vectors only" in errors["b64"] and "tools" in errors["tools"], errors
    m = S.JobStore(S.connect(sqlite_url)).get(job_id)["metrics"]
    assert m["engine"]["task"] == "generate+embed", m["engine"]
    assert m["answers"]["valid"] == m["answers"]["checked"] == 1, m["answers"]


@pytest.mark.llamacpp
def test_an_openai_batch_file_mixing_every_kind_round_trips_on_llamacpp(tmp_path, sqlite_url, embedding_server):
    spec = job_spec(_mixed_file(tmp_path / "in.jsonl"), tmp_path / "out", job_id="mixed-llama",
                    engine={"kind": "llamacpp", "task": "embed", "pooling": "last", "max_in_flight": 2,
                            "max_model_len": 1024})
    res = run_job(spec, db_url=sqlite_url)
    assert (res.succeeded, res.failed) == (7, 2), res
    _check_mixed(tmp_path / "out", sqlite_url, "mixed-llama", _direct(embedding_server))


@pytest.mark.engine
def test_an_openai_batch_file_mixing_every_kind_round_trips_on_vllm(tmp_path, sqlite_url):
    res = run_job(job_spec(_mixed_file(tmp_path / "in.jsonl"), tmp_path / "out", job_id="mixed-vllm",
                           engine=TEST_ENGINE), db_url=sqlite_url)
    assert (res.succeeded, res.failed) == (7, 2), res
    # the reference: the same texts as an embedding job, whose engine (the same config) is the
    # pass's own, reused; the test above checks that job's vectors against LLM.embed
    want = _job(tmp_path / "ref", sqlite_url, "mixed-vllm-ref", {**TEST_ENGINE, "task": "embed"})
    _check_mixed(tmp_path / "out", sqlite_url, "mixed-vllm", want)
