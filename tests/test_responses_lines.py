"""`/v1/responses` batch lines without an engine: the body mapped onto the chat row (what is
served, what fails its own line with `unsupported_parameter`, what is not a request at all),
the Responses object an answer becomes (checked against the `openai` SDK's own `Response`),
and a served batch's validation letting an unsupported line through."""

from __future__ import annotations

import json

import pytest
from openai.types.responses import Response

from tokenmill.jobs.serve.validate import check_lines
from tokenmill.schemas import records as R
from tokenmill.schemas.wire.lines import LineError, Unsupported
from tokenmill.schemas.wire.openai.request import RESPONSES, check_sampling, parse_request
from tokenmill.schemas.wire.openai.response import output_line, response_body
from tokenmill.transforms.openai_batch import ERROR_KEY, line_row

MODEL = "smollm2-135m"


def _line(cid: str = "r", **body) -> bytes:
    return json.dumps({"custom_id": cid, "method": "POST", "url": RESPONSES,
                       "body": {"model": MODEL, "input": "Hello", **body}}).encode()


def test_a_string_input_is_one_user_message_and_instructions_a_system_message_first():
    got = parse_request(_line(instructions="Be brief.", max_output_tokens=9, temperature=0.5, top_p=0.9))
    assert got["messages"] == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}]
    assert (got["prompt"], got["max_tokens"], got["temperature"], got["top_p"]) == (None, 9, 0.5, 0.9)
    assert "max_output_tokens" not in got and "response_format" not in got


def test_message_items_become_chat_messages_their_text_parts_joined():
    items = [{"type": "message", "role": "developer", "content": "Answer in French."},
             {"role": "user", "content": [{"type": "input_text", "text": "Capital "}, {"type": "input_text",
                                                                                      "text": "of Italy?"}]},
             {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Rome.",
                                                                    "annotations": []}]},
             {"role": "user", "content": "And Spain?"}]
    got = parse_request(_line(input=items))
    assert got["messages"] == [{"role": "developer", "content": "Answer in French."},
                               {"role": "user", "content": "Capital of Italy?"},
                               {"role": "assistant", "content": "Rome."}, {"role": "user", "content": "And Spain?"}]


def test_an_input_image_by_url_is_a_chat_image_part():
    items = [{"role": "user", "content": [{"type": "input_text", "text": "What is it?"},
                                          {"type": "input_image", "image_url": "data:image/png;base64,AAAA",
                                           "detail": "auto"}]}]
    assert parse_request(_line(input=items))["messages"][0]["content"] == [
        {"type": "text", "text": "What is it?"}, {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]


SCHEMA = {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]}


@pytest.mark.parametrize("fmt,want", [
    ({"type": "json_schema", "name": "ans", "schema": SCHEMA, "strict": True},
     {"type": "json_schema", "json_schema": {"name": "ans", "schema": SCHEMA, "strict": True}}),
    ({"type": "json_schema", "name": "ans", "schema": json.dumps(SCHEMA)},
     {"type": "json_schema", "json_schema": {"name": "ans", "schema": SCHEMA}}),
    ({"type": "json_object"}, {"type": "json_object"}),
    ({"type": "text"}, None),
], ids=["json_schema", "schema as text", "json_object", "text"])
def test_text_format_is_the_rows_response_format(fmt, want):
    got = parse_request(_line(text={"format": fmt, "verbosity": "medium"}))
    assert got.get("response_format") == want


def test_fields_left_at_their_defaults_or_that_do_not_change_the_answer_are_served():
    got = parse_request(_line(stream=False, background=False, tools=[], tool_choice="auto", include=[],
                              truncation="disabled", reasoning=None, store=True, metadata={"team": "x"},
                              user="u1", parallel_tool_calls=True, previous_response_id=None, top_logprobs=0))
    assert got["messages"] == [{"role": "user", "content": "Hello"}]


REFUSED = [
    ({"tools": [{"type": "function", "name": "f", "parameters": {}}]}, "body.tools"),
    ({"previous_response_id": "resp_123"}, "body.previous_response_id"),
    ({"reasoning": {"effort": "high"}}, "body.reasoning"),
    ({"input": [{"type": "reasoning", "id": "rs_1", "summary": []}, {"role": "user", "content": "hi"}]},
     "body.input[0]"),
    ({"input": [{"type": "function_call_output", "call_id": "c", "output": "1"}]}, "body.input[0]"),
    ({"stream": True}, "body.stream"),
    ({"background": True}, "body.background"),
    ({"tool_choice": "required"}, "body.tool_choice"),
    ({"include": ["reasoning.encrypted_content"]}, "body.include"),
    ({"truncation": "auto"}, "body.truncation"),
    ({"seed": 7}, "body.seed"),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "file-1"}]}]},
     "body.input[0].content[0]"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "file_id": "file-1"}]}]},
     "body.input[0].content[0]"),
    ({"text": {"format": {"type": "text"}, "verbosity": "high"}}, "body.text.verbosity"),
]


@pytest.mark.parametrize("body,param", REFUSED, ids=[p for _, p in REFUSED])
def test_what_is_not_served_is_unsupported_naming_the_field(body, param):
    with pytest.raises(Unsupported) as err:
        parse_request(_line(**body))
    assert (err.value.code, err.value.param) == (R.UNSUPPORTED_PARAMETER, param)


BAD = [
    ({"input": None}, "body.input"),
    ({"input": 5}, "body.input"),
    ({"input": []}, "body.input"),
    ({"input": ["hi"]}, "body.input[0]"),
    ({"input": [{"role": "robot", "content": "x"}]}, "body.input[0].role"),
    ({"input": [{"role": "user", "content": 5}]}, "body.input[0].content"),
    ({"input": [{"role": "user", "content": [{"type": "input_text", "text": 5}]}]}, "body.input[0].content[0].text"),
    ({"instructions": ["x"]}, "body.instructions"),
    ({"text": {"format": {"type": "xml"}}}, "body.text.format"),
    ({"text": {"format": {"type": "json_schema", "name": "a"}}}, "body.text.format.schema"),
    ({"text": {"format": {"type": "json_schema", "schema": "{not json"}}}, "body.text.format.schema"),
    # malformed and asking for tools: malformed wins, so validation refuses it rather than letting it through
    ({"input": 5, "tools": [{"type": "function", "name": "f"}]}, "body.input"),
]


@pytest.mark.parametrize("body,param", BAD, ids=[f"{p}:{json.dumps(b)[:30]}" for b, p in BAD])
def test_a_body_that_is_not_a_request_is_a_line_error_not_merely_unsupported(body, param):
    with pytest.raises(LineError) as err:
        parse_request(_line(**body))
    assert not isinstance(err.value, Unsupported) and err.value.param == param


def test_out_of_range_sampling_names_the_responses_field():
    with pytest.raises(LineError) as err:
        check_sampling(parse_request(_line(max_output_tokens=0)))
    assert err.value.param == "body.max_output_tokens"


def test_an_unsupported_line_is_its_own_dead_letter_with_its_code_and_custom_id():
    row = line_row(_line("t1", tools=[{"type": "web_search"}]), 0, 3)
    assert row is not None and row["id"] == "t1" and row[ERROR_KEY][0] == R.UNSUPPORTED_PARAMETER
    assert "body.tools" in row[ERROR_KEY][1]
    bad = line_row(_line("t2", input=5), 0, 4)
    assert bad is not None and bad[ERROR_KEY][0] == R.BAD_REQUEST
    ok = line_row(_line("t3"), 0, 5)
    assert ok is not None and ok["id"] == "t3" and ok["messages"] == [{"role": "user", "content": "Hello"}]


def test_validation_lets_an_unsupported_line_through_and_fails_a_malformed_one():
    got = check_lines([_line("a"), _line("b", reasoning={"effort": "low"}), _line("c", stream=True)], {MODEL: MODEL},
                      max_lines=10)
    assert got.errors == [] and got.lines == 3 and got.model == MODEL
    assert got.index.custom_ids == ["a", "b", "c"] and set(got.index.endpoints) == {RESPONSES}
    bad = check_lines([_line("a"), _line("b", input={"x": 1})], {MODEL: MODEL}, max_lines=10)
    assert [(e["line"], e["param"]) for e in bad.errors] == [(2, "body.input")]
    dup = check_lines([_line("a"), _line("a", tools=[{"type": "web_search"}])], {MODEL: MODEL}, max_lines=10)
    assert [e["code"] for e in dup.errors] == ["duplicate_custom_id"]  # the envelope is still checked
    other = check_lines([_line("a", tools=[{"type": "web_search"}], model="gpt-5")], {MODEL: MODEL}, max_lines=10)
    assert [e["code"] for e in other.errors] == ["model_not_found"]


def _row(**kw):
    return {"job_id": "batch_1", "id": "r1", "input_file": 0, "input_row": 0, "text": "Bonjour.", "finish_reason": "stop",
            "prompt_tokens": 11, "output_tokens": 3, "cached_tokens": 4, "finished_at": 1765000000.5, "model": MODEL,
            **kw}


def test_an_answer_is_a_responses_object_the_sdk_accepts():
    body = response_body(_row(), RESPONSES, "my-name")
    r = Response.model_validate(body)
    assert (r.object, r.status, r.model, r.output_text, r.incomplete_details) == ("response", "completed", "my-name",
                                                                                  "Bonjour.", None)
    assert "output_text" not in body  # an SDK property, not a field of the JSON
    assert r.output[0].type == "message" and r.output[0].content[0].type == "output_text"
    u = r.usage
    assert u is not None
    assert (u.input_tokens, u.input_tokens_details.cached_tokens, u.output_tokens,
            u.output_tokens_details.reasoning_tokens, u.total_tokens) == (11, 4, 3, 0, 14)
    assert r.created_at == 1765000000 and r.id.startswith("resp_")
    line = json.loads(output_line([_row()], RESPONSES, MODEL))
    assert line["response"]["status_code"] == 200 and line["response"]["body"] == response_body(_row(), RESPONSES,
                                                                                                MODEL)


def test_an_answer_cut_at_max_output_tokens_is_incomplete():
    r = Response.model_validate(response_body(_row(finish_reason="length"), RESPONSES, MODEL))
    assert r.status == "incomplete" and r.incomplete_details is not None
    assert r.incomplete_details.reason == "max_output_tokens" and r.output[0].status == "incomplete"
