"""OpenAI batch files: requests in, OpenAI batch output and error lines out.

Every output line is checked against vLLM's own `BatchRequestOutput` model, and
greedy answers are compared with `vllm.entrypoints.launchers.run_batch` on the
same input file (real engine)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from openai.types.chat import ChatCompletion

from tests.conftest import TEST_ENGINE
from tests.fakes import FakeSession
from tests.helpers import job_spec
from tokenmill.jobs.lifecycle.runner import run_job
from tokenmill.schemas.wire.lines import LineError
from tokenmill.schemas.wire.openai.request import parse_request
from tokenmill.transforms.openai_batch import line_row, plan_jsonl, read_jsonl_shard
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
        (json.dumps({**chat_line("x", "hi"), "url": "/v1/moderations"}), "url must be one of"),
        (json.dumps({**chat_line("x", "hi"), "method": "GET"}), "method must be POST"),
        (json.dumps(chat_line("x", "hi", stream=True)), "body.stream=True is not supported"),
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


# ---------------------------------------------------------------- structured outputs and log-probabilities

PERSON = {"type": "json_schema", "json_schema": {"name": "person", "strict": True, "schema": {
    "type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}}}
MSG = [{"role": "user", "content": "hi"}]


def test_a_file_of_request_kinds_reads_as_rows_and_refusals(tmp_path):
    lines = [
        chat_line("plain", "hi", max_tokens=4),
        chat_line("schema", "hi", response_format=PERSON),
        chat_line("lp", "hi", logprobs=True, top_logprobs=3),
        completion_line("comp-lp", "Once", logprobs=2),
        completion_line("comp-lp0", "Once", logprobs=0),
        chat_line("so-choice", "hi", structured_outputs={"choice": ["yes", "no"]}),
        chat_line("so-json", "hi", structured_outputs={"json": {"type": "object"}}),
        chat_line("so-regex", "hi", structured_outputs={"regex": "[0-9]+", "json_object": False}),
        chat_line("n3", "hi", n=3),
        chat_line("tools", "hi", tools=[{"type": "function", "function": {"name": "f"}}]),
        chat_line("so-bad", "hi", structured_outputs={"whitespace_pattern": " "}),
    ]
    plan = plan_jsonl(str(write_jsonl(tmp_path / "kinds.jsonl", lines)))
    rows = {r["id"]: r for shard in plan.shards for r in read_jsonl_shard(shard)}
    base = {"_file_index": 0, "messages": MSG, "prompt": None}
    comp = {"_file_index": 0, "messages": None, "prompt": "Once"}
    assert {k: rows[k] for k in list(rows)[:9]} == {
        "plain": {**base, "_row": 0, "id": "plain", "max_tokens": 4},
        "schema": {**base, "_row": 1, "id": "schema", "response_format": PERSON},
        "lp": {**base, "_row": 2, "id": "lp", "logprobs": True, "top_logprobs": 3},
        "comp-lp": {**comp, "_row": 3, "id": "comp-lp", "logprobs": True, "top_logprobs": 2},
        "comp-lp0": {**comp, "_row": 4, "id": "comp-lp0", "logprobs": True, "top_logprobs": 0},
        "so-choice": {**base, "_row": 5, "id": "so-choice", "choice": ["yes", "no"]},
        "so-json": {**base, "_row": 6, "id": "so-json", "response_format": {
            "type": "json_schema", "json_schema": {"name": "schema", "schema": {"type": "object"}}}},
        "so-regex": {**base, "_row": 7, "id": "so-regex", "regex": "[0-9]+"},
        "n3": {**base, "_row": 8, "id": "n3", "n": 3},
    }
    errors = {k: r["_error"] for k, r in rows.items() if "_error" in r}
    assert set(errors) == {"tools", "so-bad"} and {e[0] for e in errors.values()} == {"bad_request"}
    assert "tools (function calling) are not served" in errors["tools"][1]
    assert errors["so-bad"][1].startswith("body.structured_outputs.whitespace_pattern is not supported")

    # through Validate: the request kinds reach the row's sampling, the refusals are dead letters
    recs = {k: validate_row(r) for k, r in rows.items()}
    assert recs["schema"].sampling == {"response_format": PERSON}
    assert recs["lp"].sampling == {"logprobs": True, "top_logprobs": 3}
    assert recs["comp-lp"].sampling == {"logprobs": True, "top_logprobs": 2} and recs["comp-lp"].prompt == "Once"
    assert recs["so-choice"].sampling == {"choice": ["yes", "no"]}
    assert recs["so-json"].sampling["response_format"]["json_schema"]["schema"] == {"type": "object"}
    assert {k: (recs[k].reason, recs[k].id) for k in errors} == {k: ("bad_request", k) for k in errors}


@pytest.mark.parametrize(
    "line, says",
    [
        (chat_line("x", "hi", logprobs=2), "body.logprobs must be true, false or null for /v1/chat/completions"),
        (chat_line("x", "hi", top_logprobs=2), r"body.top_logprobs=2 needs body.logprobs: true"),
        (chat_line("x", "hi", logprobs=False, top_logprobs=1), "needs body.logprobs: true"),
        (completion_line("x", "p", logprobs=True), r"body.logprobs must be an integer 0-5 or null for /v1/completions"),
        (completion_line("x", "p", logprobs=6), "integer 0-5"),
        (completion_line("x", "p", logprobs=-1), "integer 0-5"),
        (completion_line("x", "p", logprobs=2, top_logprobs=2), "body.top_logprobs is not a /v1/completions field"),
        (chat_line("x", "hi", structured_outputs={"regex": "a", "choice": ["a"]}), "sets regex and choice; set one"),
        (chat_line("x", "hi", structured_outputs={"json": "{bad"}), "structured_outputs.json is not valid JSON"),
        (chat_line("x", "hi", structured_outputs=["regex"]), "structured_outputs must be an object"),
        (chat_line("x", "hi", response_format={"type": "json_object"}, structured_outputs={"regex": "a"}),
         "body.structured_outputs and body.response_format both set a structured output"),
        (chat_line("x", "hi", stream=True), "body.stream=True is not supported in batch jobs"),
    ],
)
def test_refused_request_kinds_say_why(line, says):
    with pytest.raises(LineError, match=says):
        parse_request(json.dumps(line))


def test_served_spellings_of_the_request_kinds():
    assert parse_request(json.dumps(chat_line("x", "hi", top_logprobs=0)))["top_logprobs"] == 0  # vLLM's default
    text = parse_request(json.dumps(chat_line("x", "hi", response_format={"type": "text"},
                                              structured_outputs={"grammar": "root ::= \"a\""})))
    assert (text["response_format"], text["grammar"]) == ({"type": "text"}, 'root ::= "a"')  # text is no constraint
    obj = parse_request(json.dumps(completion_line("x", "p", structured_outputs={"json_object": True})))
    assert obj["response_format"] == {"type": "json_object"}
    as_text = parse_request(json.dumps(chat_line("x", "hi", structured_outputs={"json": '{"type": "array"}'})))
    assert as_text["response_format"]["json_schema"]["schema"] == {"type": "array"}
    assert "logprobs" not in parse_request(json.dumps(completion_line("x", "p", logprobs=None)))


def test_a_bad_response_format_is_a_bad_sampling_dead_letter():
    row = line_row(json.dumps(chat_line("fmt", "hi", response_format={"type": "xml"})).encode(), 0, 0)
    assert row["response_format"] == {"type": "xml"}  # passed on: Validate judges it
    rec = validate_row(row)
    assert (rec.reason, rec.id) == ("bad_sampling", "fmt") and "response_format.type must be" in rec.message
    row = line_row(json.dumps(chat_line("schema", "hi", response_format={"type": "json_schema",
                                                                         "json_schema": {"name": "s"}})).encode(), 0, 1)
    assert validate_row(row).reason == "bad_sampling"
    row = line_row(json.dumps(chat_line("top", "hi", logprobs=True, top_logprobs=21)).encode(), 0, 2)
    assert validate_row(row).reason == "bad_sampling"  # OpenAI's 0-20, RowSampling's range


# ---------------------------------------------------------------- log-probabilities out

TOKENS = [
    {"token": "Caf", "logprob": -0.25, "top_logprobs": [{"token": "Caf", "logprob": -0.25}, {"token": "Tea", "logprob": -1.5}]},
    {"token": "é", "logprob": -0.01, "top_logprobs": [{"token": "é", "logprob": -0.01}, {"token": "e", "logprob": -4.75}]},
    {"token": " ok", "logprob": -2.0, "top_logprobs": [{"token": " ok", "logprob": -2.0}, {"token": "!", "logprob": -2.5}]},
]


def output_row(**over):
    row = {"job_id": "j", "id": "r1", "input_file": 0, "input_row": 0, "model": "m", "text": "Café ok",
           "finish_reason": "stop", "prompt_tokens": 5, "output_tokens": 3, "finished_at": 1700000000.5,
           "logprobs": None, "valid": None, "invalid_reason": None, "parsed": None, "choice_probs": None}
    return {**row, **over}


def as_line(body):
    return {"id": "batch_req_x", "custom_id": "r1", "error": None,
            "response": {"status_code": 200, "request_id": "x", "body": body}}


def test_chat_body_carries_the_rows_logprobs_in_openai_shape():
    from openai.types.chat import ChatCompletion

    from tokenmill.schemas.wire.openai.request import CHAT
    from tokenmill.schemas.wire.openai.response import response_body

    body = response_body(output_row(logprobs=TOKENS), CHAT, "m")
    validate_with_vllm(as_line(body))
    lp = ChatCompletion.model_validate(body).choices[0].logprobs
    assert lp is not None and lp.content is not None and lp.refusal is None
    assert [(t.token, t.logprob) for t in lp.content] == [(t["token"], t["logprob"]) for t in TOKENS]
    assert [bytes(t.bytes or []).decode("utf-8") for t in lp.content] == ["Caf", "é", " ok"]
    assert lp.content[1].bytes == [0xC3, 0xA9]
    assert [[(a.token, a.logprob, bytes(a.bytes or []).decode()) for a in t.top_logprobs] for t in lp.content] == [
        [(a["token"], a["logprob"], a["token"]) for a in t["top_logprobs"]] for t in TOKENS]
    plain = response_body(output_row(), CHAT, "m")
    assert plain["choices"][0]["logprobs"] is None and ChatCompletion.model_validate(plain).choices[0].logprobs is None
    assert {k: v for k, v in body.items() if k != "choices"} == {k: v for k, v in plain.items() if k != "choices"}


def test_completion_body_carries_the_rows_logprobs_in_the_legacy_shape():
    from openai.types import Completion

    from tokenmill.schemas.wire.openai.request import COMPLETIONS
    from tokenmill.schemas.wire.openai.response import response_body

    body = response_body(output_row(logprobs=TOKENS), COMPLETIONS, "m")
    validate_with_vllm(as_line(body))
    lp = Completion.model_validate(body).choices[0].logprobs
    assert lp is not None
    assert lp.tokens == ["Caf", "é", " ok"] and lp.token_logprobs == [-0.25, -0.01, -2.0]
    assert lp.top_logprobs == [{"Caf": -0.25, "Tea": -1.5}, {"é": -0.01, "e": -4.75}, {" ok": -2.0, "!": -2.5}]
    assert lp.text_offset == [0, 3, 4]  # characters into the completion text
    text = body["choices"][0]["text"]
    assert [text[o:o + len(t)] for o, t in zip(lp.text_offset, lp.tokens)] == lp.tokens
    plain = response_body(output_row(), COMPLETIONS, "m")
    assert plain["choices"][0]["logprobs"] is None and Completion.model_validate(plain).choices[0].logprobs is None


def test_a_structured_rows_body_is_its_text_as_openai_returns_it():
    from openai.types.chat import ChatCompletion

    from tokenmill.schemas.wire.openai.request import CHAT
    from tokenmill.schemas.wire.openai.response import response_body

    text = '{"name": "Ada"}'
    plain = response_body(output_row(text=text), CHAT, "m")
    structured = response_body(output_row(text=text, valid=True, parsed={"name": "Ada"}), CHAT, "m")
    assert structured == plain
    message = ChatCompletion.model_validate(structured).choices[0].message
    assert message.content == text and json.loads(message.content) == {"name": "Ada"}
    choice = response_body(output_row(text="yes", valid=True, choice_probs=[{"choice": "yes", "prob": 0.9}]), CHAT, "m")
    assert choice == response_body(output_row(text="yes"), CHAT, "m")


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


def embedding_line(cid, text, model="smollm2-135m", **body):
    return {"custom_id": cid, "method": "POST", "url": "/v1/embeddings", "body": {"model": model, "input": text, **body}}


def test_a_pass_reads_its_own_tasks_lines_and_leaves_the_others_to_theirs(tmp_path):
    lines = [chat_line("c", "hi"), embedding_line("e", "x"), embedding_line("e-bad", ["a", "b"]),
             {**chat_line("no-url", "hi"), "url": "/v1/moderations"}]
    plan = plan_jsonl(str(write_jsonl(tmp_path / "mixed.jsonl", lines)))
    assert plan.tasks == ["generate", "embed"]

    def read(task):
        plan.task = task
        return {r["id"]: (r.get("_error") or ("ok",))[0] for shard in plan.shards for r in read_jsonl_shard(shard, plan.rules())}

    # a line naming an endpoint is read by its task's pass alone, malformed or not; one naming
    # no served endpoint is a dead letter in any pass
    assert read("generate") == {"c": "ok", "no-url": "bad_request"}
    assert read("embed") == {"e": "ok", "e-bad": "bad_request", "no-url": "bad_request"}
    assert [s.endpoints for s in plan.shards] == ["022?"]
    for task in ("generate", "embed"):  # without the shard's note each pass reads every line, as before
        plan.task = task
        got = {r["id"] for s in plan.shards for r in read_jsonl_shard(replace(s, endpoints=None), plan.rules())}
        assert got == ({"c", "e-bad", "no-url"} if task == "generate" else {"e", "e-bad", "no-url"})
    single = plan_jsonl(str(write_jsonl(tmp_path / "chat.jsonl", [chat_line("c", "hi"), ""])))
    assert [s.endpoints for s in single.shards] == [None]  # one pass: no note
    assert plan_jsonl(str(write_jsonl(tmp_path / "e.jsonl", lines[1:2]))).tasks == ["embed"]
    assert plan_jsonl(str(write_jsonl(tmp_path / "bad.jsonl", ["{bad"]))).tasks == []


def test_a_file_mixing_tasks_runs_a_pass_of_each_into_one_job(tmp_path, sqlite_url):
    from tokenmill.schemas import storage as S

    lines = [chat_line("c1", "hi", max_tokens=2), embedding_line("e1", "some text"),
             completion_line("p1", "Once", max_tokens=3), embedding_line("e2", "more text"),
             embedding_line("e3", "x", dimensions=8)]
    inp = write_jsonl(tmp_path / "mixed.jsonl", lines)
    stages: list[str] = []
    res = run_job(job_spec(inp, tmp_path / "out", job_id="oa-mixed"), db_url=sqlite_url, session_factory=FakeSession,
                  stage=stages.append)
    assert (res.total, res.succeeded, res.failed) == (5, 4, 1), res
    assert [s for s in stages if s.startswith("pass ")] == [
        "pass 1 of 2: the chat and completions lines, engine task generate",
        "pass 2 of 2: the /v1/embeddings lines, engine task embed"]
    engines = [(s.cfg.task, len(s.added)) for s in FakeSession.instances if s.added]
    assert engines == [("generate", 2), ("embed", 2)], engines  # an engine per pass, each given its own lines
    outs = read_jsonl(tmp_path / "out" / "outputs.jsonl")
    assert [o["custom_id"] for o in outs] == ["c1", "e1", "p1", "e2"]  # one file, in input order
    assert [o["response"]["body"]["object"] for o in outs] == ["chat.completion", "list", "text_completion", "list"]
    err = read_jsonl(tmp_path / "out" / "errors.jsonl")
    assert [e["custom_id"] for e in err] == ["e3"] and "dimensions" in err[0]["error"]["message"]
    eng = S.connect(sqlite_url)
    workers = S.MetricsReader(eng).workers("oa-mixed")
    assert sorted(w["engine_info"]["task"] for w in workers) == ["embed", "generate"]  # a worker row per engine
    m = S.JobStore(eng).get("oa-mixed")["metrics"]
    assert m["engine"]["task"] == "generate+embed" and m["requests"]["succeeded"] == 4
    from tokenmill.jobs.cli.run import format_summary

    assert "a pass of generation, then one of embeddings" in format_summary(res.summary())
    FakeSession.instances.clear()
    again = run_job(job_spec(inp, tmp_path / "out", job_id="oa-mixed"), db_url=sqlite_url, session_factory=FakeSession)
    assert again.resumed and again.succeeded == 4 and not any(s.added for s in FakeSession.instances)


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
    # the request kinds beyond free text, which vLLM's run_batch serves too
    from tests.request_kinds import PERSON, PERSON_FORMAT

    lines.append(chat_line("json", "Give the person as JSON with name and age: Alice, 31", model=model_path,
                           max_tokens=40, temperature=0.0, response_format=PERSON_FORMAT))
    lines.append(chat_line("logprobs", "What is the capital of France?", model=model_path, max_tokens=8,
                           temperature=0.0, logprobs=True, top_logprobs=2))
    inp = write_jsonl(tmp_path / "in.jsonl", lines)

    spec = job_spec(inp, tmp_path / "out", job_id="oa-engine", engine=TEST_ENGINE)
    res = run_job(spec, db_url=sqlite_url)
    assert res.status == "succeeded", res
    ours = {o["custom_id"]: o for o in read_jsonl(tmp_path / "out" / "outputs.jsonl")}
    for o in ours.values():
        validate_with_vllm(o)
        ChatCompletion.model_validate(o["response"]["body"])
    import jsonschema

    jsonschema.validate(json.loads(ours["json"]["response"]["body"]["choices"][0]["message"]["content"]), PERSON)
    lp = ours["logprobs"]["response"]["body"]["choices"][0]["logprobs"]["content"]
    text = ours["logprobs"]["response"]["body"]["choices"][0]["message"]["content"]
    assert "".join(t["token"] for t in lp).startswith(text)  # and the end-of-turn token, where it came
    assert all(len(t["top_logprobs"]) == 2 for t in lp)

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
        if tb["choices"][0].get("logprobs"):  # the same tokens, each with the same log-probability
            ours_lp, theirs_lp = ob["choices"][0]["logprobs"]["content"], tb["choices"][0]["logprobs"]["content"]
            assert [t["token"] for t in ours_lp] == [t["token"] for t in theirs_lp], cid
            for a, b in zip(ours_lp, theirs_lp):
                assert abs(a["logprob"] - b["logprob"]) < 1e-3, (cid, a, b)
                assert [x["token"] for x in a["top_logprobs"]] == [x["token"] for x in b["top_logprobs"]], cid


def test_an_exported_body_says_when_its_usage_is_an_estimate():
    from tokenmill.schemas.wire.openai.request import CHAT
    from tokenmill.schemas.wire.openai.response import response_body

    row = {"job_id": "j", "id": "r1", "prompt_tokens": 3, "output_tokens": 4, "text": "hi", "finish_reason": "stop"}
    assert "token_count_source" not in response_body({**row, "token_count_source": "engine"}, CHAT, "m")["usage"]
    est = response_body({**row, "token_count_source": "local_tokenizer+stream_chunks"}, CHAT, "m")["usage"]
    assert est["token_count_source"] == "local_tokenizer+stream_chunks" and est["total_tokens"] == 7


def test_a_requests_samples_are_one_line_with_n_choices_also_across_chunks():
    from openai.types import Completion

    from tokenmill.schemas.wire.openai.request import CHAT, COMPLETIONS
    from tokenmill.schemas.wire.openai.response import by_request, response_body

    def row(i, k, text):
        return {"job_id": "j", "id": f"r{i}", "input_file": 0, "input_row": i, "sample": k, "text": text,
                "finish_reason": "stop", "prompt_tokens": 7, "output_tokens": 2 + k, "finished_at": 100.0 + k}

    samples = [row(0, k, f"t{k}") for k in range(3)]
    body = ChatCompletion.model_validate(response_body(samples, CHAT, "m"))
    assert [(c.index, c.message.content) for c in body.choices] == [(0, "t0"), (1, "t1"), (2, "t2")]
    assert (body.usage.prompt_tokens, body.usage.completion_tokens, body.created) == (7, 2 + 3 + 4, 102)
    comp = Completion.model_validate(response_body(samples, COMPLETIONS, "m"))
    assert [c.text for c in comp.choices] == ["t0", "t1", "t2"]
    # a chunk of the export ending between a row's samples: still one request
    chunks = [[row(0, 0, "a"), row(0, 1, "b")], [row(0, 2, "c"), row(1, 0, "d")], [row(2, 0, "e")]]
    got = [[[r["text"] for r in req] for req in part] for part in by_request(chunks)]
    assert got == [[["a", "b", "c"]], [["d"]], [["e"]]]
