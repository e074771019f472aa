"""OpenAI batch files: requests in, OpenAI batch output and error lines out.

Every output line is checked against vLLM's own `BatchRequestOutput` model, and
greedy answers are compared with `vllm.entrypoints.launchers.run_batch` on the
same input file (real engine)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import TEST_ENGINE
from tests.fakes import FakeSession
from tests.helpers import job_spec
from tokenmill.jobs.lifecycle.runner import run_job
from tokenmill.transforms.openai_batch import LineError, line_row, parse_request, plan_jsonl
from tokenmill.transforms.validate import validate_row


def chat_line(cid, content, model="smollm2-135m", **body):
    return {"custom_id": cid, "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": model, "messages": [{"role": "user", "content": content}], **body}}


def completion_line(cid, prompt, model="smollm2-135m", **body):
    return {"custom_id": cid, "method": "POST", "url": "/v1/completions",
            "body": {"model": model, "prompt": prompt, **body}}


def write_jsonl(path: Path, lines) -> Path:
    path.write_text("".join((ln if isinstance(ln, str) else json.dumps(ln)) + "\n" for ln in lines))
    return path


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()]


def validate_with_vllm(line: dict) -> None:
    """vLLM's BatchRequestOutput; its body union lacks CompletionResponse in this vLLM
    (its run_batch serves only chat for text), so completion bodies are checked with
    vLLM's CompletionResponse and the envelope with BatchRequestOutput."""
    from vllm.entrypoints.launchers.run_batch import BatchRequestOutput
    from vllm.entrypoints.openai.completion.protocol import CompletionResponse

    body = (line.get("response") or {}).get("body")
    if body and body.get("object") == "text_completion":
        CompletionResponse.model_validate(body)
        line = {**line, "response": {**line["response"], "body": None}}
    BatchRequestOutput.model_validate(line)


# ---------------------------------------------------------------- parsing


def test_chat_line_maps_body_fields_to_row_keys():
    row = line_row(json.dumps(chat_line("a", "hi", max_tokens=5, temperature=0.7, top_p=0.9, seed=3, stop=["\n"])).encode(),
                   0, 7)
    assert row["id"] == "a" and (row["_file_index"], row["_row"]) == (0, 7)
    assert row["messages"] == [{"role": "user", "content": "hi"}] and row["prompt"] is None
    assert (row["max_tokens"], row["temperature"], row["top_p"], row["seed"], row["stop"]) == (5, 0.7, 0.9, 3, ["\n"])
    rec = validate_row(row)
    assert rec.sampling == {"max_tokens": 5, "temperature": 0.7, "top_p": 0.9, "seed": 3, "stop": ["\n"]}


def test_completion_line_and_text_parts_and_max_completion_tokens():
    req = parse_request(json.dumps(completion_line("b", ["once"], max_completion_tokens=9)))
    assert req["prompt"] == "once" and req["max_tokens"] == 9
    parts = chat_line("c", [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}])
    assert parse_request(json.dumps(parts))["messages"][0]["content"] == "ab"


@pytest.mark.parametrize(
    "line, says",
    [
        ("{not json", "not valid JSON"),
        (json.dumps({"method": "POST", "url": "/v1/chat/completions", "body": {}}), "custom_id"),
        (json.dumps({**chat_line("x", "hi"), "url": "/v1/embeddings"}), "url must be one of"),
        (json.dumps({**chat_line("x", "hi"), "method": "GET"}), "method must be POST"),
        (json.dumps(chat_line("x", "hi", n=2)), "body.n=2 is not supported"),
        (json.dumps(completion_line("x", 5)), "body.prompt must be a string"),
    ],
)
def test_malformed_lines_raise_with_the_reason(line, says):
    with pytest.raises(LineError, match=says):
        parse_request(line)


def test_malformed_line_becomes_a_bad_request_dead_letter_keeping_custom_id():
    row = line_row(json.dumps({**chat_line("keep-me", "hi"), "url": "/v1/moderations"}).encode(), 0, 2)
    rec = validate_row(row)
    assert rec.reason == "bad_request" and rec.id == "keep-me" and "url must be one of" in rec.message
    assert "/v1/moderations" in rec.raw


def test_plan_counts_request_lines_not_blank_ones(tmp_path):
    p = write_jsonl(tmp_path / "in.jsonl", [chat_line("a", "x"), "", completion_line("b", "y"), "{bad"])
    plan = plan_jsonl(str(p))
    assert plan.total_rows == 3
    assert plan.endpoints == {"/v1/chat/completions": 1, "/v1/completions": 1, "?": 1}


# ---------------------------------------------------------------- a whole job (fake engine)


def test_job_writes_one_output_or_error_line_per_input_line(tmp_path, sqlite_url):
    lines = [
        chat_line("chat-1", "hello", max_tokens=3),
        completion_line("comp-1", "Once upon a time", max_tokens=2),
        chat_line("other-model", "hi", model="gpt-4o"),
        "{broken json",
        {**chat_line("wrong-url", "hi"), "url": "/v1/embeddings"},
        chat_line("chat-1", "a duplicate custom_id"),
        chat_line("bad-temp", "hi", temperature=-1),
        "",
        chat_line("chat-2", "again", max_tokens=4),
    ]
    inp = write_jsonl(tmp_path / "batch.jsonl", lines)
    spec = job_spec(inp, tmp_path / "out", job_id="oa")
    res = run_job(spec, db_url=sqlite_url, session_factory=FakeSession)
    assert (res.total, res.succeeded, res.failed) == (8, 3, 5)
    assert res.status == "partial"
    outs = read_jsonl(tmp_path / "out" / "outputs.jsonl")
    errs = read_jsonl(tmp_path / "out" / "errors.jsonl")
    for line in outs + errs:
        validate_with_vllm(line)
    by_id = {o["custom_id"]: o for o in outs}
    assert set(by_id) == {"chat-1", "comp-1", "chat-2"}
    chat = by_id["chat-1"]["response"]["body"]
    assert chat["object"] == "chat.completion" and chat["model"] == "smollm2-135m"
    assert chat["choices"][0]["message"]["role"] == "assistant"
    assert chat["usage"]["completion_tokens"] == 3  # the line's max_tokens, honoured
    assert chat["usage"]["total_tokens"] == chat["usage"]["prompt_tokens"] + 3
    comp = by_id["comp-1"]["response"]["body"]
    assert comp["object"] == "text_completion" and comp["model"] == "smollm2-135m" and comp["usage"]["completion_tokens"] == 2
    assert by_id["chat-2"]["response"]["body"]["usage"]["completion_tokens"] == 4
    codes = sorted((e["custom_id"], e["error"]["code"], e["response"]["status_code"]) for e in errs)
    assert codes == [
        ("bad-temp", "bad_sampling", 400),
        ("chat-1", "duplicate_id", 400),
        ("other-model", "bad_request", 400),
        ("row-0-3", "bad_request", 400),  # no custom_id: the 0-based line is named
        ("wrong-url", "bad_request", 400),
    ]
    assert len({o["id"] for o in outs + errs}) == len(outs) + len(errs)
    manifest = json.loads((tmp_path / "out" / "_SUCCESS.json").read_text())
    assert (manifest["format"], manifest["outputs"], manifest["dead_letters"]) == ("openai-jsonl", 3, 5)
    assert "not served by this job" in next(e for e in errs if e["custom_id"] == "other-model")["error"]["message"]


def test_rerun_resumes_and_export_is_identical(tmp_path, sqlite_url):
    inp = write_jsonl(tmp_path / "b.jsonl", [chat_line(f"q{i}", f"question {i}", max_tokens=2) for i in range(5)])
    spec = job_spec(inp, tmp_path / "out", job_id="oa-resume")
    run_job(spec, db_url=sqlite_url, session_factory=FakeSession)
    first = (tmp_path / "out" / "outputs.jsonl").read_text()
    FakeSession.instances.clear()
    res = run_job(spec, db_url=sqlite_url, session_factory=FakeSession)
    assert res.resumed and res.succeeded == 5
    assert all(not s.added for s in FakeSession.instances)  # nothing generated twice
    assert (tmp_path / "out" / "outputs.jsonl").read_text() == first


# ---------------------------------------------------------------- real engine vs vLLM's run_batch


@pytest.mark.engine
def test_greedy_outputs_equal_vllm_run_batch(tmp_path, sqlite_url, model_path):
    questions = ["What is the capital of France?", "Name a primary color.", "Say hello in Spanish.",
                 "What is 2 + 2?", "Write one word about the sea."]
    lines = [chat_line(f"q{i}", q, model=model_path, max_tokens=16, temperature=0.0) for i, q in enumerate(questions)]
    lines.append(chat_line("sys", "Who are you?", model=model_path, max_tokens=12, temperature=0.0))
    lines[-1]["body"]["messages"].insert(0, {"role": "system", "content": "You are a terse pirate."})
    inp = write_jsonl(tmp_path / "in.jsonl", lines)

    spec = job_spec(inp, tmp_path / "out", job_id="oa-engine", engine=TEST_ENGINE)
    res = run_job(spec, db_url=sqlite_url)
    assert res.status == "succeeded", res
    ours = {o["custom_id"]: o for o in read_jsonl(tmp_path / "out" / "outputs.jsonl")}
    for o in ours.values():
        validate_with_vllm(o)

    # vLLM's own batch runner, same engine args (it starts its own engine in a child process).
    out = tmp_path / "vllm_out.jsonl"
    cmd = [sys.executable, "-m", "vllm.entrypoints.launchers.run_batch", "-i", str(inp), "-o", str(out),
           "--model", model_path, "--dtype", "float32", "--max-model-len", str(TEST_ENGINE["max_model_len"]),
           "--max-num-seqs", str(TEST_ENGINE["max_num_seqs"]), "--enforce-eager", "--seed", "0",
           "--gpu-memory-utilization", str(TEST_ENGINE["gpu_memory_utilization"])]
    env = {**os.environ, "VLLM_LOGGING_LEVEL": "WARNING"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    theirs = {o["custom_id"]: o for o in read_jsonl(out)}
    assert set(theirs) == set(ours)
    for cid, t in theirs.items():
        validate_with_vllm(t)
        tb, ob = t["response"]["body"], ours[cid]["response"]["body"]
        assert ob["choices"][0]["message"]["content"] == tb["choices"][0]["message"]["content"], cid
        assert ob["choices"][0]["finish_reason"] == tb["choices"][0]["finish_reason"], cid
        assert ob["usage"]["prompt_tokens"] == tb["usage"]["prompt_tokens"], cid
        assert ob["usage"]["completion_tokens"] == tb["usage"]["completion_tokens"], cid
        assert ob["model"] == tb["model"] == model_path


def test_an_exported_body_says_when_its_usage_is_an_estimate():
    from tokenmill.jobs.lifecycle.openai_export import response_body
    from tokenmill.transforms.openai_batch import CHAT

    row = {"job_id": "j", "id": "r1", "prompt_tokens": 3, "output_tokens": 4, "text": "hi", "finish_reason": "stop"}
    assert "token_count_source" not in response_body({**row, "token_count_source": "engine"}, CHAT, "m")["usage"]
    est = response_body({**row, "token_count_source": "local_tokenizer+stream_chunks"}, CHAT, "m")["usage"]
    assert est["token_count_source"] == "local_tokenizer+stream_chunks" and est["total_tokens"] == 7
