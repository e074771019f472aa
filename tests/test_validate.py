"""Validate: one case per kind of bad row, each with its exact reason code."""

import json

import pytest

from tests.helpers import cli, job_spec
from tokenmill.schemas import records as R
from tokenmill.schemas.records import Chunk, FailedRecord, PromptRecord
from tokenmill.transforms.validate import validate_row


def row(**kw):
    base = {"_input_ref": "0:5", "_row": 5, "_file_index": 0}
    base.update(kw)
    return base


@pytest.mark.parametrize(
    "fields, reason, message_part",
    [
        ({"prompt": None}, R.EMPTY_PROMPT, "prompt is null"),
        ({"prompt": b"   "}, R.EMPTY_PROMPT, "prompt is empty"),
        ({"prompt": 42}, R.BAD_PROMPT_TYPE, "must be a string, got int"),
        ({"prompt": b"\xff\xfebad"}, R.INVALID_UTF8, "not valid UTF-8"),
        ({"messages": b"[{bad json"}, R.BAD_MESSAGES, "not valid JSON"),
        ({"messages": [{"role": "wizard", "content": "hi"}]}, R.BAD_MESSAGES, "role must be one of"),
        ({"messages": [{"role": "user"}]}, R.BAD_MESSAGES, "has no content"),
        ({"messages": [{"role": "user", "content": None}]}, R.BAD_MESSAGES, "has no content"),
        ({"messages": []}, R.BAD_MESSAGES, "non-empty list"),
        ({"prompt": b"hi", "temperature": -0.5}, R.BAD_SAMPLING, "temperature must be >= 0, got -0.5"),
        ({"prompt": b"hi", "max_tokens": 0}, R.BAD_SAMPLING, "max_tokens must be an integer > 0, got 0"),
        ({"prompt": b"hi", "max_tokens": -3}, R.BAD_SAMPLING, "max_tokens must be an integer > 0"),
        ({"prompt": b"hi", "top_p": 1.5}, R.BAD_SAMPLING, "top_p must be in (0, 1], got 1.5"),
        ({"prompt": b"hi", "top_p": 0.0}, R.BAD_SAMPLING, "top_p must be in (0, 1]"),
        ({"prompt": b"hi", "stop": 7}, R.BAD_SAMPLING, "stop must be a string"),
    ],
)
def test_bad_row_becomes_dead_letter_with_reason(fields, reason, message_part):
    out = validate_row(row(**fields))
    assert isinstance(out, FailedRecord)
    assert out.reason == reason
    assert message_part in out.message
    assert out.input_ref == "0:5"


def test_good_rows_keep_overrides_and_generate_stable_ids():
    out = validate_row(row(prompt=b"Hello", max_tokens=12, temperature=0.2, top_p=0.9, seed=3, stop="END"))
    assert isinstance(out, PromptRecord)
    assert out.id == "row-0-5"
    assert out.sampling == {"max_tokens": 12, "temperature": 0.2, "top_p": 0.9, "seed": 3, "stop": ["END"]}
    msgs = validate_row(row(id="a1", messages=b'[{"role": "user", "content": "Hi"}]'))
    assert msgs.id == "a1" and msgs.messages == [{"role": "user", "content": "Hi"}]


def test_duplicate_ids_first_in_input_order_wins(sqlite_url):
    from tokenmill.schemas import storage as S
    from tokenmill.transforms.dedup import DedupIdsFn

    eng = S.connect(sqlite_url)
    a = PromptRecord(id="x", input_file=1, input_row=0, prompt="later file")
    b = PromptRecord(id="x", input_file=0, input_row=9, prompt="first")
    c = PromptRecord(id="x", input_file=0, input_row=10, prompt="second")
    S.ResultWriter(eng).claim_ids("j", [(r.id, r.input_file, r.input_row) for r in (a, c, b)])
    out = list(DedupIdsFn(sqlite_url, "j").process(Chunk("u", [a, c, b])))
    kept = [o for o in out if isinstance(o, Chunk)]
    dead = [o.value for o in out if not isinstance(o, Chunk)]
    assert [k.items for k in kept] == [[b]]
    assert [d.reason for d in dead] == [R.DUPLICATE_ID, R.DUPLICATE_ID]
    assert {d.input_ref for d in dead} == {"1:0", "0:10"}


def test_a_sampling_key_added_to_the_model_is_a_flag_and_is_validated_per_row():
    """Adding a per-row key is one edit in schemas/sampling.py: the flags and the row check follow."""
    import click
    from pydantic import Field

    from tokenmill.jobs.cli.common import apply_options, model_options
    from tokenmill.schemas.sampling import RowSampling
    from tokenmill.transforms.validate import parse_sampling

    class WithMinTokens(RowSampling):
        min_tokens: int = Field(0, ge=0)
        """Fewest output tokens before EOS may end the row."""

    cmd = apply_options(click.command()(lambda **kw: None), model_options(WithMinTokens))
    opt = next(p for p in cmd.params if p.name == "min_tokens")
    assert opt.opts == ["--min-tokens"] and opt.type is click.INT and "Fewest output tokens" in opt.help
    assert parse_sampling({"min_tokens": 3.0, "max_tokens": 8}, WithMinTokens) == {"min_tokens": 3, "max_tokens": 8}
    with pytest.raises(ValueError, match=r"^min_tokens must be an integer >= 0, got -1$"):
        parse_sampling({"min_tokens": -1}, WithMinTokens)


def test_row_sampling_refuses_strings_and_bools_for_numbers():
    for fields, says in [({"temperature": "0.5"}, "temperature must be >= 0, got '0.5'"),
                         ({"max_tokens": True}, "max_tokens must be an integer > 0, got True"),
                         ({"seed": 1.5}, "seed must be an integer, got 1.5")]:
        out = validate_row(row(prompt=b"hi", **fields))
        assert isinstance(out, FailedRecord) and out.reason == R.BAD_SAMPLING and out.message == says


def test_derived_job_id_counts_only_keys_set_away_from_their_defaults():
    plain = job_spec("in.parquet", "out/").derived_job_id()
    assert job_spec("in.parquet", "out/", sampling={"max_tokens": 128, "stop": None}).derived_job_id() == plain
    assert job_spec("in.parquet", "out/", sampling={"max_tokens": 64}).derived_job_id() != plain
    assert job_spec("in.parquet", "out/", job_id="nightly").derived_job_id() == "nightly"


def test_min_tokens_is_a_row_key_a_job_key_a_flag_and_an_openai_body_key():
    """The key was added in schemas/sampling.py alone; every surface sees it."""
    from tokenmill.schemas.wire.openai.request import parse_request

    ok = validate_row({"_file_index": 0, "_row": 0, "id": "a", "prompt": "hi", "min_tokens": 3.0})
    assert ok.sampling == {"min_tokens": 3}
    bad = validate_row({"_file_index": 0, "_row": 1, "id": "b", "prompt": "hi", "min_tokens": -1})
    assert (bad.reason, bad.message) == ("bad_sampling", "min_tokens must be an integer >= 0, got -1")
    assert job_spec("i", "o", sampling={"min_tokens": 2}).sampling.min_tokens == 2
    assert "--min-tokens" in cli("run", "--help").output
    line = json.dumps({"custom_id": "c", "method": "POST", "url": "/v1/completions",
                       "body": {"model": "m", "prompt": "x", "min_tokens": 5}})
    assert parse_request(line)["min_tokens"] == 5
