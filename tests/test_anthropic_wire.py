"""Anthropic's Message Batches wire format without a server: a request read into the same row the
OpenAI chat path makes, what a create refuses and what only errors its line, the result lines
and the MessageBatch object checked against the `anthropic` package's own types, and a JSONL
file of requests planned and read by the pipeline's batch reader."""

from __future__ import annotations

import json

import pytest
from anthropic.types import Message
from anthropic.types.messages import DeletedMessageBatch, MessageBatch, MessageBatchIndividualResponse
from anthropic.types.shared import ErrorResponse

from tokenmill.schemas import records as R
from tokenmill.schemas.wire import formats
from tokenmill.schemas.wire.anthropic import objects, results
from tokenmill.schemas.wire.anthropic.request import MESSAGES, REFUSED, check_request, request_fields
from tokenmill.schemas.wire.lines import LineError
from tokenmill.schemas.wire.openai.request import request_fields as openai_fields
from tokenmill.transforms.inputs import InputError
from tokenmill.transforms.openai_batch import line_row, plan_jsonl, read_jsonl_shard


def request(cid: str = "q1", **params) -> dict:
    return {"custom_id": cid, "params": {"model": "smollm2-135m", "max_tokens": 16,
                                         "messages": [{"role": "user", "content": "Hello"}], **params}}


def test_a_request_becomes_the_row_an_openai_chat_line_with_the_same_prompt_becomes():
    anth = request_fields(request(system="Be brief.", temperature=0, top_p=0.9, top_k=5, stop_sequences=["\n\n"]))
    oai = openai_fields({"custom_id": "q1", "url": "/v1/chat/completions", "body": {
        "model": "smollm2-135m", "max_tokens": 16, "temperature": 0, "top_p": 0.9, "top_k": 5, "stop": ["\n\n"],
        "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}]}})
    assert anth["url"] == MESSAGES and oai["url"] != MESSAGES
    assert {k: v for k, v in anth.items() if k != "url"} == {k: v for k, v in oai.items() if k != "url"}


def test_text_blocks_are_joined_and_image_blocks_become_image_url_parts():
    png = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}
    row = request_fields(request(system=[{"type": "text", "text": "A"}, {"type": "text", "text": "B"}], messages=[
        {"role": "user", "content": [{"type": "text", "text": "x"}, {"type": "text", "text": "y"}]},
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": [png, {"type": "text", "text": "What is it?", "cache_control": {"type": "ephemeral"}}]}]))
    assert row["messages"] == [
        {"role": "system", "content": "AB"}, {"role": "user", "content": "xy"}, {"role": "assistant", "content": "ok"},
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}},
                                     {"type": "text", "text": "What is it?"}]}]


CREATE_REFUSALS = [
    ("no max_tokens", {"custom_id": "a", "params": {"model": "m", "messages": [{"role": "user", "content": "x"}]}},
     "requests.0.params.max_tokens"),
    ("max_tokens 0", request("a", max_tokens=0), "requests.0.params.max_tokens"),
    ("no model", {"custom_id": "a", "params": {"max_tokens": 1, "messages": []}}, "requests.0.params.model"),
    ("empty messages", request("a", messages=[]), "requests.0.params.messages"),
    ("custom_id with a space", request("a b"), "requests.0.custom_id"),
    ("custom_id of 65 characters", request("x" * 65), "requests.0.custom_id"),
    ("params not an object", {"custom_id": "a", "params": "hi"}, "requests.0.params"),
    ("an extra key", {**request("a"), "url": None}, "requests.0.url"),
]


@pytest.mark.parametrize("what,obj,param", CREATE_REFUSALS, ids=[c[0] for c in CREATE_REFUSALS])
def test_what_a_create_refuses_names_the_field(what, obj, param):
    with pytest.raises(LineError) as err:
        check_request(obj, "requests.0")
    assert err.value.code == REFUSED and err.value.param == param and str(err.value).startswith(param)


LINE_ERRORS = [
    ("tools", request(tools=[{"name": "t", "input_schema": {"type": "object"}}]), "params.tools"),
    ("tool_choice", request(tool_choice={"type": "auto"}), "params.tool_choice"),
    ("thinking", request(thinking={"type": "enabled", "budget_tokens": 1024}), "params.thinking"),
    ("stream", request(stream=True), "params.stream"),
    ("an unknown field", request(frequency_penalty=1), "params.frequency_penalty"),
    ("a tool_result block", request(messages=[{"role": "user", "content": [{"type": "tool_result"}]}]),
     "params.messages.0.content.0"),
    ("a system role in messages", request(messages=[{"role": "system", "content": "x"}]), "params.messages.0"),
    ("temperature over 1", request(temperature=1.5), "params.temperature"),
    ("a file image source", request(messages=[{"role": "user", "content": [
        {"type": "image", "source": {"type": "url", "url": "file:///etc/passwd"}}]}]),
     "params.messages.0.content.0.source"),
]


@pytest.mark.parametrize("what,obj,param", LINE_ERRORS, ids=[c[0] for c in LINE_ERRORS])
def test_what_the_engine_cannot_serve_passes_the_create_and_is_a_dead_letter_of_its_line(what, obj, param):
    check_request(obj)  # the create takes it
    with pytest.raises(LineError) as err:
        request_fields(obj)
    assert err.value.param == param
    row = line_row(json.dumps(obj).encode(), 0, 7)
    assert row is not None and row["id"] == "q1" and row["_error"][0] == R.BAD_REQUEST


def test_disabled_thinking_and_an_empty_tool_list_ask_for_nothing_and_are_served():
    assert request_fields(request(thinking={"type": "disabled"}, tools=[], metadata={"user_id": "u"}))["max_tokens"] == 16


def _out(**kw) -> dict:
    return {"job_id": "msgbatch_1", "id": "q1", "input_file": 0, "input_row": 0, "text": "Hi there",
            "finish_reason": "stop", "prompt_tokens": 20, "output_tokens": 3, "cached_tokens": 16, **kw}


def test_result_lines_are_what_the_anthropic_sdk_reads():
    ok = MessageBatchIndividualResponse.model_validate(json.loads(results.succeeded_line(_out(), "smollm2-135m")))
    assert ok.custom_id == "q1" and ok.result.type == "succeeded"
    msg = Message.model_validate(ok.result.message.model_dump())
    assert (msg.content[0].text, msg.stop_reason, msg.model) == ("Hi there", "end_turn", "smollm2-135m")
    assert (msg.usage.input_tokens, msg.usage.cache_read_input_tokens, msg.usage.output_tokens) == (4, 16, 3)
    cut = json.loads(results.succeeded_line(_out(finish_reason="length", stop_sequence="x"), None))
    assert (cut["result"]["message"]["stop_reason"], cut["result"]["message"]["stop_sequence"]) == ("max_tokens", None)
    stopped = MessageBatchIndividualResponse.model_validate(json.loads(results.succeeded_line(
        _out(stop_sequence="\n\n"), None))).result.message
    assert (stopped.stop_reason, stopped.stop_sequence) == ("stop_sequence", "\n\n")
    dead = {"job_id": "j", "id": "q2", "input_file": 0, "input_row": 1, "reason": R.BAD_REQUEST,
            "message": "params.tools: tools (tool use) are not served"}
    err = MessageBatchIndividualResponse.model_validate(json.loads(results.errored_line(dead)))
    assert err.result.type == "errored" and err.result.error.error.type == "invalid_request_error"
    assert "tools" in err.result.error.error.message
    engine = MessageBatchIndividualResponse.model_validate(json.loads(results.errored_line(
        {**dead, "reason": R.ENGINE_ERROR, "message": "boom"})))
    assert engine.result.error.error.type == "api_error"
    for ended, kind in (("cancelled", "canceled"), ("expired", "expired"), ("failed", "errored")):
        line = MessageBatchIndividualResponse.model_validate(json.loads(results.unrun_line("q3", ended)))
        assert line.result.type == kind


def test_the_batch_object_follows_the_rows_timestamps_and_counts():
    b = {"id": "msgbatch_x", "created_at": 1_800_000_000.5, "expires_at": 1_800_086_400.5, "lines": 10}
    running = MessageBatch.model_validate(objects.batch_object(b, {"succeeded": 3, "errored": 1}, "http://h/r"))
    assert running.processing_status == "in_progress" and running.results_url is None
    assert (running.request_counts.processing, running.request_counts.succeeded) == (6, 3)
    assert (running.expires_at - running.created_at).total_seconds() == 86400
    canceling = MessageBatch.model_validate(objects.batch_object({**b, "cancelling_at": 1_800_000_010.0}))
    assert canceling.processing_status == "canceling" and canceling.cancel_initiated_at is not None
    ended = MessageBatch.model_validate(objects.batch_object(
        {**b, "cancelling_at": 1_800_000_010.0, "cancelled_at": 1_800_000_020.0,
         "request_counts": {"total": 10, "completed": 3, "failed": 7, "succeeded": 3, "errored": 1, "canceled": 6,
                            "expired": 0}}, None, "http://h/r"))
    assert ended.processing_status == "ended" and ended.results_url == "http://h/r" and ended.ended_at is not None
    c = ended.request_counts
    assert (c.processing, c.succeeded, c.errored, c.canceled, c.expired) == (0, 3, 1, 6, 0)
    DeletedMessageBatch.model_validate(objects.deleted("msgbatch_x"))
    for status, kind in ((400, "invalid_request_error"), (401, "authentication_error"), (404, "not_found_error"),
                         (413, "invalid_request_error"), (429, "rate_limit_error"), (500, "api_error")):
        assert ErrorResponse.model_validate(objects.error_body(status, "m")).error.type == kind


def test_a_jsonl_file_of_requests_is_planned_and_read_as_chat_rows(tmp_path):
    path = tmp_path / "reqs.jsonl"
    path.write_text("\n".join(json.dumps(request(f"q{i}", system="S")) for i in range(3)) + "\n\n")
    plan = plan_jsonl(str(path))
    assert plan.total_rows == 3 and plan.tasks == ["generate"] and plan.endpoints == {MESSAGES: 3}
    rows = [r for s in plan.shards for r in read_jsonl_shard(s, plan.rules())]
    assert [r["id"] for r in rows] == ["q0", "q1", "q2"]
    assert rows[0]["messages"][0] == {"role": "system", "content": "S"} and rows[0]["max_tokens"] == 16
    index = formats.index_lines(path.read_bytes().splitlines(keepends=True))
    assert index.request_ids() == ["q0", "q1", "q2"] and index.endpoints[:3] == [MESSAGES] * 3


def test_an_input_mixing_anthropic_and_openai_lines_is_refused_at_planning(tmp_path):
    path = tmp_path / "mixed.jsonl"
    oai = {"custom_id": "o", "method": "POST", "url": "/v1/chat/completions",
           "body": {"model": "m", "messages": [{"role": "user", "content": "x"}]}}
    path.write_text(json.dumps(request()) + "\n" + json.dumps(oai) + "\n")
    with pytest.raises(InputError, match="mixes Anthropic"):
        plan_jsonl(str(path))


def _app(tmp_path, **limits):
    from fastapi.testclient import TestClient

    from tokenmill.jobs.serve.app import asgi_app
    from tokenmill.jobs.serve.config import ServeConfig
    from tokenmill.jobs.serve.service import BatchService
    from tokenmill.schemas import storage as S

    cfg = ServeConfig(db=f"sqlite:///{tmp_path / 's.db'}", files=str(tmp_path / "files"), work=str(tmp_path / "runs"),
                      models={"m": {}}, limits={"max_batches_in_flight": 100, **limits})
    svc = BatchService(cfg)  # not started: batches are stored, nothing runs
    S.KeyStore(svc.eng).add("k", "k", "tm-secret-k")
    return TestClient(asgi_app(cfg, svc)), {"x-api-key": "tm-secret-k", "anthropic-version": "2023-06-01"}


def test_the_list_pages_newest_first_by_after_id_and_before_id(tmp_path):
    c, h = _app(tmp_path)
    made = [c.post("/v1/messages/batches", headers=h, json={"requests": [request(f"q{i}", model="m")]}).json()
            for i in range(5)]
    newest = [MessageBatch.model_validate(b).id for b in reversed(made)]

    def page(**q):
        body = c.get("/v1/messages/batches", headers=h, params=q).json()
        return [MessageBatch.model_validate(b).id for b in body["data"]], body

    ids, p1 = page(limit=2)
    assert ids == newest[:2] and p1["has_more"] and (p1["first_id"], p1["last_id"]) == (newest[0], newest[1])
    ids, p2 = page(limit=2, after_id=p1["last_id"])
    assert ids == newest[2:4] and p2["has_more"]
    ids, p3 = page(limit=2, after_id=p2["last_id"])
    assert ids == newest[4:] and not p3["has_more"]
    ids, back = page(limit=2, before_id=p3["first_id"])
    assert ids == newest[2:4] and back["has_more"]
    ids, top = page(limit=2, before_id=newest[1])
    assert ids == newest[:1] and not top["has_more"]


def test_a_body_over_the_batch_byte_limit_is_refused_413_in_anthropics_shape_before_it_is_read(tmp_path):
    c, h = _app(tmp_path, max_message_batch_bytes=2000)
    r = c.post("/v1/messages/batches", headers=h, json={"requests": [request(f"q{i}", model="m") for i in range(40)]})
    assert r.status_code == 413 and ErrorResponse.model_validate(r.json()).error.type == "invalid_request_error"
    r = c.post("/v1/messages/batches", headers=h, json={"requests": [], "priority": 1})
    assert r.status_code == 400 and ErrorResponse.model_validate(r.json()).error.type == "invalid_request_error"
    assert c.get("/v1/messages/batches", headers=h).json()["data"] == []
