"""The `openai` engine against vLLM's own OpenAI server (`python -m vllm.entrypoints.openai.api_server`)
on the test model, started by the test and stopped after it."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import pyarrow.parquet as pq
import pytest

from tests.conftest import TEST_ENGINE, write_parquet
from tests.helpers import job_spec
from tokenmill.jobs.lifecycle.runner import run_job
from tokenmill.schemas.records import PromptRecord
from tokenmill.transforms.counting import encode, load_tokenizer

pytestmark = pytest.mark.engine

SERVED = "smollm2-served"


@pytest.fixture(scope="module")
def vllm_server(tmp_path_factory):
    from tokenmill.schemas.models import resolve_model
    from tokenmill.transforms.engines.cpu import cpu_runtime_env

    model = str(resolve_model("smollm2-135m"))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # the in-process engine's CPU set-up (allocators, threads) where the environment sets none
    env = {**cpu_runtime_env(), **os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}
    log = tmp_path_factory.mktemp("vllm") / "server.log"
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
           "--served-model-name", SERVED, "--host", "127.0.0.1", "--port", str(port),
           "--dtype", TEST_ENGINE["dtype"], "--max-model-len", str(TEST_ENGINE["max_model_len"]),
           "--max-num-seqs", "8", "--enforce-eager"]
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    base = f"http://127.0.0.1:{port}/v1"
    try:
        deadline = time.time() + 600
        while True:
            if proc.poll() is not None:
                pytest.fail(f"vLLM's server exited {proc.returncode}: {log.read_text()[-2000:]}")
            try:
                if httpx.get(f"{base}/models", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.time() > deadline:
                pytest.fail(f"vLLM's server did not answer within 600 s: {log.read_text()[-2000:]}")
            time.sleep(2)
        yield base, model
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


def test_a_job_through_vllms_own_openai_server(vllm_server, tmp_path, sqlite_url):
    base, model = vllm_server
    rows = [
        {"id": "chat", "messages": '[{"role": "user", "content": "What is the capital of France?"}]', "prompt": None},
        {"id": "raw", "messages": None, "prompt": "The three primary colors are"},
        *({"id": f"c{i}", "messages": f'[{{"role": "user", "content": "Count to {i}."}}]', "prompt": None}
          for i in range(6)),
    ]
    inp = write_parquet(tmp_path / "in.parquet", rows)
    spec = job_spec(inp, tmp_path / "out", job_id="oai-vllm", sampling={"max_tokens": 16, "temperature": 0.0},
                    engine={"kind": "openai", "base_url": base, "model": SERVED, "tokenizer": "smollm2-135m",
                            "max_in_flight": 4, "max_model_len": TEST_ENGINE["max_model_len"]})
    res = run_job(spec, db_url=sqlite_url)
    assert res.status == "succeeded" and (res.succeeded, res.failed) == (8, 0), res
    out = {r["id"]: r for r in pq.read_table(tmp_path / "out" / "outputs.parquet").to_pylist()}
    assert "paris" in out["chat"]["text"].lower(), out["chat"]["text"]
    tok = load_tokenizer(model)
    for r in out.values():
        src = next(x for x in rows if x["id"] == r["id"])

        rec = PromptRecord(id=r["id"], input_file=0, input_row=0, prompt=src["prompt"],
                           messages=json.loads(src["messages"]) if src["messages"] else None)
        # the server's usage counts the same prompt tokenmill counted (same template, same tokenizer)
        assert r["prompt_tokens"] == len(encode(tok, rec)), r
        assert 0 < r["output_tokens"] <= 16 and r["ttft_s"] > 0 and r["e2e_s"] >= r["ttft_s"]
        assert r["queue_s"] is None
    # greedy: the same answer as the server gives to the same request sent directly
    direct = httpx.post(f"{base}/chat/completions", timeout=120, json={
        "model": SERVED, "messages": [{"role": "user", "content": "What is the capital of France?"}],
        "max_tokens": 16, "temperature": 0.0}).json()
    assert direct["choices"][0]["message"]["content"] == out["chat"]["text"]


def test_a_server_model_not_on_local_disk_is_counted_by_the_servers_own_tokenize(vllm_server, tmp_path, sqlite_url):
    """`--engine openai --model smollm2-served` with no `--tokenizer`, as a new user tries it:
    the preflight finds the server's /tokenize and the job counts with it, token for token
    what the local tokenizer of the same model makes."""
    from tokenmill.jobs.lifecycle.preflight import preflight

    base, model = vllm_server
    rows = [{"id": "chat", "messages": '[{"role": "user", "content": "Name a colour."}]', "prompt": None},
            {"id": "raw", "messages": None, "prompt": "One, two, three,"}]
    inp = write_parquet(tmp_path / "in.parquet", rows)
    spec = job_spec(inp, tmp_path / "out", job_id="oai-vllm-tok", sampling={"max_tokens": 8, "temperature": 0.0},
                    engine={"kind": "openai", "base_url": base, "model": SERVED, "max_in_flight": 2,
                            "max_model_len": TEST_ENGINE["max_model_len"]})
    pf = preflight(spec)
    assert pf.problems == [] and (pf.counter.source, pf.counter.style) == ("server", "vllm"), pf.problems
    tok, server_count = load_tokenizer(model), pf.counter.open()
    for src in rows:
        rec = PromptRecord(id=src["id"], input_file=0, input_row=0, prompt=src["prompt"],
                           messages=json.loads(src["messages"]) if src["messages"] else None)
        assert server_count.encode(rec) == encode(tok, rec), src["id"]
    res = run_job(spec, db_url=sqlite_url)
    assert res.status == "succeeded" and (res.succeeded, res.failed) == (2, 0), res
    out = pq.read_table(tmp_path / "out" / "outputs.parquet").to_pylist()
    assert {r["token_count_source"] for r in out} == {"engine"}  # vLLM's usage still wins


def test_structured_outputs_and_logprobs_through_vllms_own_server(vllm_server, tmp_path, sqlite_url):
    """The mixed request kinds (tests/request_kinds.py) through the `openai` engine: the
    standard response_format and logprobs, and vLLM's structured_outputs for a choice."""
    from tests import request_kinds as K
    from tokenmill.schemas import storage as S

    base, _ = vllm_server
    inp = write_parquet(tmp_path / "in.parquet", K.rows())
    spec = job_spec(inp, tmp_path / "out", job_id="oai-kinds", sampling={"temperature": 0.0},
                    engine={"kind": "openai", "base_url": base, "model": SERVED, "tokenizer": "smollm2-135m",
                            "max_in_flight": 4, "max_model_len": TEST_ENGINE["max_model_len"]})
    res = run_job(spec, db_url=sqlite_url)
    assert res.failed == len(K.REFUSED), res
    K.check_answers(*K.outputs(tmp_path / "out"), S.JobStore(S.connect(sqlite_url)).get("oai-kinds")["metrics"])
