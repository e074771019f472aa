"""Request kinds beyond free text: structured outputs and log-probabilities (docs/REQUESTS.md).

Unit tests of the keys, the engine requests and the checks, then one mixed job on the
real vLLM engine and one on a real llama-server (the `openai` engine's run is in
tests/test_openai_vllm.py, against vLLM's own server)."""

from __future__ import annotations

import json
import math

import pytest

from tests import request_kinds as K
from tests.conftest import TEST_ENGINE, write_parquet
from tests.helpers import job_spec
from tokenmill.schemas import records as R
from tokenmill.schemas import storage as S
from tokenmill.schemas.exported import export_schema, exported_columns, stored_names
from tokenmill.schemas.records import OutputRow
from tokenmill.schemas.sampling import request_sampling
from tokenmill.transforms import answers
from tokenmill.transforms.engines import requests
from tokenmill.transforms.validate import validate_row


def _row(**kw):
    return {"_file_index": 0, "_row": 0, "id": "r", "prompt": "hi", **kw}


@pytest.mark.parametrize("keys, said", [
    ({"response_format": "{not json"}, "response_format is not valid JSON"),
    ({"response_format": {"type": "xml"}}, "response_format.type must be text, json_object or json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "nothing"}}}},
     "not a valid JSON Schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "needs json_schema.schema"),
    ({"choice": ["a", "a"]}, "distinct"),
    ({"regex": "(unclosed"}, "regex does not compile"),
    ({"choice": ["a", "b"], "regex": "a|b"}, "set one structured-output key, not regex and choice"),
    ({"top_logprobs": 21}, "top_logprobs must be an integer in [0, 20], got 21"),
])
def test_a_bad_request_kind_is_a_bad_sampling_dead_letter_naming_it(keys, said):
    rec = validate_row(_row(**keys))
    assert isinstance(rec, R.FailedRecord) and rec.reason == R.BAD_SAMPLING, rec
    assert said in rec.message and "\n" not in rec.message, rec.message


def test_a_rows_constraint_replaces_the_jobs_and_json_text_is_read_as_its_object():
    from tokenmill.schemas.config import SamplingDefaults

    rec = validate_row(_row(choice=["yes", "no"], logprobs=True))
    assert isinstance(rec, R.PromptRecord)
    job = SamplingDefaults(response_format=json.dumps(K.PERSON_FORMAT))
    assert job.response_format == K.PERSON_FORMAT

    class P:
        sampling = rec.sampling
        max_tokens = 8

    s = request_sampling(job, P)
    assert s["choice"] == ["yes", "no"] and s["response_format"] is None and s["logprobs"] is True


def test_each_engine_is_asked_for_the_constraint_in_its_own_terms():
    choice = {"choice": ["yes", "no"]}
    assert requests.http_body(choice, chat=True, dialect="openai") == {
        "logprobs": True, "top_logprobs": 20, "structured_outputs": {"choice": ["yes", "no"]}}
    assert requests.http_body(choice, chat=False, dialect="llama.cpp") == {
        "logprobs": 20, "grammar": 'root ::= "yes" | "no"'}
    fmt = {"response_format": K.PERSON_FORMAT}
    assert requests.http_body(fmt, chat=True, dialect="llama.cpp") == {"response_format": K.PERSON_FORMAT}
    assert requests.http_body(fmt, chat=False, dialect="llama.cpp") == {"json_schema": K.PERSON}
    assert requests.constraint(fmt) == {"json": K.PERSON}
    assert requests.constraint({"response_format": {"type": "text"}}) is None
    with pytest.raises(requests.UnsupportedRequest, match="no regex"):
        requests.http_body({"regex": "a+"}, chat=True, dialect="llama.cpp")
    assert requests.http_body({"logprobs": True, "top_logprobs": 2}, chat=False, dialect="openai") == {"logprobs": 2}
    assert requests.logprobs_wanted({"logprobs": False, "top_logprobs": 5}) is None


def test_streamed_logprobs_in_the_chat_and_the_legacy_completions_shapes_read_alike():
    chat = {"logprobs": {"content": [{"token": "Hi", "logprob": -0.1, "bytes": [72, 105],
                                      "top_logprobs": [{"token": "Yo", "logprob": -3.0}, {"token": "Hi", "logprob": -0.1}]}]}}
    legacy = {"logprobs": {"tokens": ["Hi"], "token_logprobs": [-0.1], "top_logprobs": [{"Yo": -3.0, "Hi": -0.1}]}}
    want = [{"token": "Hi", "logprob": -0.1, "top_logprobs": [{"token": "Hi", "logprob": -0.1}]}]
    assert requests.http_logprobs(chat, chat=True, k=1) == want
    assert requests.http_logprobs(legacy, chat=False, k=1) == want
    assert requests.http_logprobs({"logprobs": None}, chat=True, k=1) == []
    # a token the constraint ruled out (-inf) is no alternative, and JSON could not hold it
    ruled = {"logprobs": {"content": [{"token": "a", "logprob": 0.0,
                                       "top_logprobs": [{"token": "a", "logprob": 0.0}, {"token": "b", "logprob": float("-inf")}]}]}}
    assert requests.http_logprobs(ruled, chat=True, k=5) == [{"token": "a", "logprob": 0.0,
                                                              "top_logprobs": [{"token": "a", "logprob": 0.0}]}]


def test_outputs_are_checked_against_their_constraint_with_a_reason():
    fmt = {"response_format": K.PERSON_FORMAT}
    assert answers.check(fmt, '{"name": "A", "age": 3}', "stop") == {"valid": True, "parsed": {"name": "A", "age": 3}}
    bad = answers.check(fmt, '{"name": "A", "age": "three"}', "stop")
    assert bad["valid"] is False and bad["invalid_reason"].startswith("schema: at age:"), bad
    cut = answers.check(fmt, '{"name": "A', "length")
    assert cut["valid"] is False and cut["invalid_reason"].endswith("(truncated at max_tokens)"), cut
    assert answers.check({"response_format": {"type": "json_object"}}, "[1]", "stop")["valid"] is False
    assert answers.check({"regex": "[0-9]+"}, "123", "stop")["valid"] is True
    assert answers.check({"regex": "[0-9]+"}, "123a", "stop")["valid"] is False  # the whole output must match
    assert answers.check({"choice": ["a", "b"]}, "c", "stop")["valid"] is False
    assert answers.check({"grammar": "root ::= \"a\""}, "a", "stop") == {}
    assert answers.check({}, "free text", "stop") == {}


def test_choice_probabilities_from_the_first_tokens_alternatives():
    def tok(t, lp, top):
        return {"token": t, "logprob": lp, "top_logprobs": [{"token": a, "logprob": b} for a, b in top]}

    # "pos" and "p" begin only "positive"; "ne" begins both "negative" and "neutral": not measured
    lps = [tok("pos", math.log(0.5), [("pos", math.log(0.5)), ("ne", math.log(0.3)), ("p", math.log(0.1))]),
           tok("itive", math.log(0.9), [])]
    got = {p["choice"]: p["prob"] for p in answers.choice_probs(["positive", "negative", "neutral"], "positive", lps)}
    assert math.isclose(got["positive"], 0.6) and got["negative"] is None and got["neutral"] is None
    # the answer given, begun by a shared token: its own path's probability
    lps = [tok("ne", math.log(0.3), [("pos", math.log(0.5)), ("ne", math.log(0.3))]), tok("utral", math.log(0.5), [])]
    got = {p["choice"]: p["prob"] for p in answers.choice_probs(["positive", "negative", "neutral"], "neutral", lps)}
    assert math.isclose(got["neutral"], 0.15) and got["negative"] is None and math.isclose(got["positive"], 0.5)
    # ...added to what its own first tokens hold (as vLLM answered "negative" via "n" + "egative", 2026-12-03)
    lps = [tok("n", math.log(0.5), [("n", math.log(0.5)), ("pos", math.log(0.36)), ("negative", math.log(0.13))]),
           tok("egative", math.log(0.84), [])]
    got = {p["choice"]: p["prob"] for p in answers.choice_probs(["positive", "negative", "neutral"], "negative", lps)}
    assert math.isclose(got["negative"], 0.13 + 0.42) and math.isclose(got["positive"], 0.36) and got["neutral"] is None
    # distinct first tokens holding all the probability (a constrained distribution): the rest is 0
    lps = [tok("yes", math.log(0.8), [("yes", math.log(0.8)), ("no", math.log(0.2))])]
    got = {p["choice"]: p["prob"] for p in answers.choice_probs(["yes", "no", "maybe"], "yes", lps)}
    assert math.isclose(got["yes"], 0.8) and math.isclose(got["no"], 0.2) and got["maybe"] == 0.0
    # the alternatives leave mass out: an answer not among them is not measured (not 0)
    lps = [tok("yes", math.log(0.5), [("yes", math.log(0.5))])]
    assert answers.choice_probs(["yes", "no"], "yes", lps)[1] == {"choice": "no", "prob": None}
    assert answers.choice_probs(["yes", "no"], "yes", None) is None
    # the answer given, its first token not among the alternatives (llama-server's raw top 20): its own path
    lps = [tok("no", math.log(0.01), [("I", math.log(0.4))]), tok("<end>", math.log(0.5), [])]
    assert answers.choice_probs(["yes", "no"], "no", lps) == [{"choice": "yes", "prob": None},
                                                             {"choice": "no", "prob": pytest.approx(0.005)}]


def test_the_exported_columns_have_their_arrow_types_and_json_as_text():
    schema = export_schema(OutputRow)
    assert schema.field("logprobs").type == R.LOGPROBS_TYPE and schema.field("valid").type.id == 1  # bool
    assert schema.field("choice_probs").type == R.CHOICE_PROBS_TYPE and str(schema.field("parsed").type) == "string"
    row = {"job_id": "j", "id": "a", "input_file": 0, "input_row": 3, "parsed": {"k": [1, "é"]}, "valid": True}
    got = exported_columns(OutputRow, {k: [row.get(k)] for k in stored_names(OutputRow)})
    assert got["parsed"] == ['{"k": [1, "é"]}'] and got["input_ref"] == ["0:3"] and got["valid"] == [True]


def test_the_valid_rate_is_counted_by_the_database(any_db_url):
    eng = S.connect(any_db_url)
    rows = [OutputRow(job_id="v", id=f"r{i}", input_file=0, input_row=i, valid=v, text="x", prompt_tokens=1,
                      output_tokens=1).as_dict() for i, v in enumerate([True, True, False, None])]
    S.ResultWriter(eng).insert_rows(OutputRow, rows)
    st = S.RequestSummary(eng).stats("v")
    assert (st.n, st.checked, st.valid) == (4, 3, 2)


# ---------------------------------------------------------------- real engines


def _run(tmp_path, sqlite_url, job_id, engine):
    from tokenmill.jobs.lifecycle.runner import run_job

    inp = write_parquet(tmp_path / "in.parquet", K.rows())
    spec = job_spec(inp, tmp_path / "out", job_id=job_id, engine=engine, sampling={"temperature": 0.0})
    res = run_job(spec, db_url=sqlite_url)
    assert res.failed == len(K.REFUSED), res
    return (*K.outputs(tmp_path / "out"), S.JobStore(S.connect(sqlite_url)).get(job_id)["metrics"])


@pytest.mark.engine
def test_a_mixed_job_on_vllm(tmp_path, sqlite_url):
    """JSON-schema rows (one cut short), choice rows, a logprobs row, a grammar and a grammar
    the engine cannot compile (a dead letter, not a failed job)."""
    K.check_answers(*_run(tmp_path, sqlite_url, "kinds-vllm", TEST_ENGINE))


@pytest.mark.llamacpp
def test_a_mixed_job_on_llama_server_and_a_regex_it_cannot_serve(tmp_path, sqlite_url):
    K.check_answers(*_run(tmp_path, sqlite_url, "kinds-llama", {"kind": "llamacpp", "max_in_flight": 2,
                                                                "max_model_len": 1024}))
    from tokenmill.jobs.lifecycle.runner import run_job

    inp = write_parquet(tmp_path / "re.parquet", [{"id": "re", "prompt": "Digits:", "regex": "[0-9]+", "max_tokens": 4}])
    res = run_job(job_spec(inp, tmp_path / "re", job_id="kinds-llama-re", engine={"kind": "llamacpp"}),
                  db_url=sqlite_url)
    assert res.failed == 1, res
    import pyarrow.parquet as pq

    (dead,) = pq.read_table(tmp_path / "re" / "dead_letters.parquet").to_pylist()
    assert dead["reason"] == R.BAD_REQUEST and "llama-server has no regex constraint" in dead["message"], dead
