"""`/v1/responses` batches and file expiry end to end: one real `tokenmill serve` on loopback (the
real engine on the bundled model, the files store a local folder), driven by the real `openai`
SDK.  A Responses batch (a plain string, message items, instructions, a JSON schema) completes,
every body a `Response` of the SDK's own types, its greedy texts a chat batch's over the same
prompts and `tokenmill run`'s over the same file; what is not served fails its own line; an
uploaded or output file past its expiry answers 404 and its bytes and row are gone.  (The same
expiry on an S3 files store: tests/test_serve_files_s3.py.)"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import openai
import pytest
from openai.types.chat import ChatCompletion
from openai.types.responses import Response
from sqlalchemy import select, update

from tests.conftest import TEST_ENGINE
from tests.serve_server import ROOT, Server, jsonl, lines_of, wait_for
from tokenmill.schemas import storage as S
from tokenmill.schemas import tables as T

pytestmark = pytest.mark.engine

MODEL = "smollm2-135m"
SCHEMA = {"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]}
#: Each case: (custom_id, the Responses body's own fields, the chat messages and extra fields they mean).
CASES = [
    ("plain", {"input": "What is the capital of France?"},
     [{"role": "user", "content": "What is the capital of France?"}], {}),
    ("items", {"input": [{"type": "message", "role": "user", "content": [
        {"type": "input_text", "text": "Name a "}, {"type": "input_text", "text": "colour."}]}]},
     [{"role": "user", "content": "Name a colour."}], {}),
    ("turns", {"input": [{"role": "user", "content": "Count to three."},
                         {"type": "message", "role": "assistant",
                          "content": [{"type": "output_text", "text": "1, 2, 3.", "annotations": []}]},
                         {"role": "user", "content": "And to five?"}]},
     [{"role": "user", "content": "Count to three."}, {"role": "assistant", "content": "1, 2, 3."},
      {"role": "user", "content": "And to five?"}], {}),
    ("instructions", {"instructions": "Answer in one word.", "input": "What colour is the sky?"},
     [{"role": "system", "content": "Answer in one word."}, {"role": "user", "content": "What colour is the sky?"}], {}),
    ("json", {"input": "Answer in JSON: what is 2+2?", "max_output_tokens": 48,  # room for the whole object
              "text": {"format": {"type": "json_schema", "name": "answer", "schema": SCHEMA, "strict": True}}},
     [{"role": "user", "content": "Answer in JSON: what is 2+2?"}],
     {"max_tokens": 48,
      "response_format": {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA, "strict": True}}}),
]
MAX_TOKENS = 12


def responses_line(cid: str, **body) -> dict:
    return {"custom_id": cid, "method": "POST", "url": "/v1/responses",
            "body": {"model": MODEL, "max_output_tokens": MAX_TOKENS, "temperature": 0, **body}}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve-responses")
    cfg = {"db": f"sqlite:///{root / 'serve.db'}", "files": str(root / "files"), "work": str(root / "runs"),
           "models": {MODEL: {"engine": dict(TEST_ENGINE), "sampling": {"max_tokens": 16}}}, "sweep_s": 1}
    srv = Server(root, cfg).start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def alice(server):
    return server.client(server.make_key("alice")["key"])


def _upload(client, path: Path, **kw):
    with open(path, "rb") as fh:
        return client.files.create(file=fh, purpose="batch", **kw)


@pytest.fixture(scope="module")
def served(server, alice, tmp_path_factory):
    """The Responses batch (its result files kept 2 hours) and the chat batch over the same
    prompts, each run to its end: the input file, the batches and their output lines by custom_id."""
    tmp = tmp_path_factory.mktemp("responses-batch")
    rpath = jsonl(tmp / "responses.jsonl", [responses_line(cid, **body) for cid, body, _, _ in CASES]
                  + [responses_line("short", input="Write a long story about a cat.", max_output_tokens=2)])
    cpath = jsonl(tmp / "chat.jsonl", [{"custom_id": cid, "method": "POST", "url": "/v1/chat/completions",
                                        "body": {"model": MODEL, "messages": msgs, "max_tokens": MAX_TOKENS,
                                                 "temperature": 0, **extra}} for cid, _, msgs, extra in CASES])
    rb = alice.batches.create(input_file_id=_upload(alice, rpath).id, endpoint="/v1/responses", completion_window="24h",
                              output_expires_after={"anchor": "created_at", "seconds": 7200})
    cb = alice.batches.create(input_file_id=_upload(alice, cpath).id, endpoint="/v1/chat/completions",
                              completion_window="24h")
    rb, cb = wait_for(alice, rb.id), wait_for(alice, cb.id)
    return {"path": rpath, "responses": rb, "chat": cb,
            "r": {x["custom_id"]: x for x in lines_of(alice, rb.output_file_id)},
            "c": {x["custom_id"]: x for x in lines_of(alice, cb.output_file_id)}}


def test_a_responses_batch_completes_each_body_a_response_with_a_chat_batchs_greedy_text(served):
    rb, cb = served["responses"], served["chat"]
    assert rb.status == "completed" and rb.endpoint == "/v1/responses" and rb.error_file_id is None, rb
    assert cb.status == "completed", cb
    assert set(served["r"]) == {cid for cid, *_ in CASES} | {"short"}
    assert (rb.request_counts.completed, rb.request_counts.failed) == (len(CASES) + 1, 0)
    for cid, line in served["r"].items():
        body = line["response"]["body"]
        r = Response.model_validate(body)  # the SDK's own type
        assert "output_text" not in body and r.object == "response" and r.model == MODEL
        assert r.usage is not None and r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
        assert r.usage.output_tokens_details.reasoning_tokens == 0
        if cid == "short":
            assert r.status == "incomplete" and r.incomplete_details is not None
            assert r.incomplete_details.reason == "max_output_tokens" and r.usage.output_tokens == 2
            continue
        chat = ChatCompletion.model_validate(served["c"][cid]["response"]["body"])
        assert r.output_text == chat.choices[0].message.content, cid  # the same prompt, the same greedy answer
        assert r.usage.input_tokens == chat.usage.prompt_tokens, cid
        assert r.status == ("incomplete" if chat.choices[0].finish_reason == "length" else "completed"), cid
    assert json.loads(served["r"]["json"]["response"]["body"]["output"][0]["content"][0]["text"])["answer"]


def test_a_batchs_output_expires_after_sets_its_result_files_expiry(alice, served):
    out = alice.files.retrieve(served["responses"].output_file_id)
    assert out.purpose == "batch_output" and out.expires_at == out.created_at + 7200
    chat_out = alice.files.retrieve(served["chat"].output_file_id)
    assert chat_out.expires_at is None  # none asked: kept until deleted


def test_tokenmill_run_of_a_responses_batch_file_gives_the_served_answers(served, tmp_path):
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "tokenmill.jobs.cli", "run", "--input", str(served["path"]), "--output", str(out),
           "--db", f"sqlite:///{tmp_path / 'run.db'}", "--max-tokens", "16",
           "--max-num-seqs", str(TEST_ENGINE["max_num_seqs"]), "--max-model-len", str(TEST_ENGINE["max_model_len"]),
           "--gpu-memory-utilization", str(TEST_ENGINE["gpu_memory_utilization"]), "--dtype", TEST_ENGINE["dtype"]]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ran = {x["custom_id"]: x for x in map(json.loads, (out / "outputs.jsonl").read_text().splitlines())}
    assert set(ran) == set(served["r"]) and not (out / "errors.jsonl").read_text().strip()
    for cid, line in ran.items():
        r = Response.model_validate(line["response"]["body"])
        assert r.output_text == Response.model_validate(served["r"][cid]["response"]["body"]).output_text, cid


REFUSED = {
    "tools": {"tools": [{"type": "function", "name": "f", "parameters": {"type": "object", "properties": {}}}]},
    "previous": {"previous_response_id": "resp_0123"},
    "reasoning": {"reasoning": {"effort": "high"}},
    "reasoning_item": {"input": [{"type": "reasoning", "id": "rs_1", "summary": []},
                                 {"role": "user", "content": "Hi"}]},
    "stream": {"stream": True},
    "background": {"background": True},
}


def test_refused_parts_fail_their_own_lines_and_the_rest_of_the_batch_completes(alice, tmp_path):
    lines = [responses_line("ok", input="Say hello.")]
    lines += [responses_line(cid, **{"input": "Say hello.", **body}) for cid, body in REFUSED.items()]
    b = wait_for(alice, alice.batches.create(input_file_id=_upload(alice, jsonl(tmp_path / "r.jsonl", lines)).id,
                                             endpoint="/v1/responses", completion_window="24h").id)
    assert b.status == "completed" and b.errors is None, b
    assert (b.request_counts.total, b.request_counts.completed, b.request_counts.failed) == (7, 1, 6)
    out, err = lines_of(alice, b.output_file_id), lines_of(alice, b.error_file_id)
    assert [x["custom_id"] for x in out] == ["ok"]
    Response.model_validate(out[0]["response"]["body"])
    assert {x["custom_id"] for x in err} == set(REFUSED)
    assert {x["error"]["code"] for x in err} == {"unsupported_parameter"}
    by_id = {x["custom_id"]: x["error"]["message"] for x in err}
    for cid, field in (("tools", "body.tools"), ("previous", "body.previous_response_id"),
                       ("reasoning", "body.reasoning"), ("reasoning_item", "body.input[0]"),
                       ("stream", "body.stream"), ("background", "body.background")):
        assert field in by_id[cid], (cid, by_id[cid])


def _expire(server, file_id: str) -> None:
    """The file's stored expiry set in the past, as an hour's wait would leave it."""
    with S.connect(server.config["db"]).begin() as conn:
        conn.execute(update(T.api_files).where(T.api_files.c.id == file_id).values(expires_at=time.time() - 1))


def _swept(server, file_id: str, path: Path, timeout: float = 120) -> bool:
    """Whether, within `timeout` s, the file's bytes and its row are gone (the sweep runs every second here)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        with S.connect(server.config["db"]).connect() as conn:
            row = conn.execute(select(T.api_files.c.id).where(T.api_files.c.id == file_id)).first()
        if row is None and not path.exists():
            return True
        time.sleep(0.5)
    return False


def test_an_upload_past_its_expires_after_answers_404_and_its_bytes_and_row_are_gone(server, alice, served, tmp_path):
    path = jsonl(tmp_path / "x.jsonl", [responses_line("x", input="hi")])
    f = _upload(alice, path, expires_after={"anchor": "created_at", "seconds": 3600})
    assert f.expires_at == f.created_at + 3600
    kept = _upload(alice, path)
    assert kept.expires_at == kept.created_at + 30 * 86400  # a batch file's default: 30 days
    for seconds in (60, 2592001):
        with pytest.raises(openai.BadRequestError) as err:
            _upload(alice, path, expires_after={"anchor": "created_at", "seconds": seconds})
        assert err.value.body["param"] == "expires_after.seconds"
    files = Path(server.config["files"])
    assert (files / f"{f.id}.jsonl").exists()
    out_id = served["responses"].output_file_id
    for file_id in (f.id, out_id):
        _expire(server, file_id)
    for file_id in (f.id, out_id):
        for call in (alice.files.retrieve, alice.files.content, alice.files.delete):
            with pytest.raises(openai.NotFoundError):
                call(file_id)
        assert file_id not in {x.id for x in alice.files.list()}
        assert _swept(server, file_id, files / f"{file_id}.jsonl"), file_id
    with pytest.raises(openai.NotFoundError):  # nor can a batch be made over it
        alice.batches.create(input_file_id=f.id, endpoint="/v1/responses", completion_window="24h")
    assert alice.files.retrieve(kept.id).id == kept.id and (files / f"{kept.id}.jsonl").exists()
