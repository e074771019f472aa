"""compare: the quality regression gate between two jobs' outputs."""

import json

import pytest
from sqlalchemy import update

from tests.conftest import TEST_ENGINE
from tests.helpers import cli, job_spec
from tokenmill.jobs.cli import EXIT_QUALITY
from tokenmill.jobs.modeltools.compare import CompareError, compare_rows, format_comparison, is_correct, word_similarity


@pytest.mark.parametrize("out,ref,ok", [
    ("The capital of France is Paris.", "Paris", True),
    ("paris", "Paris", True),
    ("A week has seven days.", "7|seven", True),
    ("41 + 17 = 58.", "58", True),
    ("The answer is 158.", "58", False),
    ("It is 5.8", "5", False),
    ("Water freezes at 10 degrees.", "0|zero", False),
    ("Water freezes at 0 °C.", "0|zero", True),
    ("1,000 meters", "1000", True),
    ("", "Paris", False),
    (None, "Paris", False),
])
def test_reference_match_is_whole_word(out, ref, ok):
    assert is_correct(out, ref) is ok


def test_word_similarity():
    assert word_similarity("a b c", "a b c") == 1.0
    assert word_similarity("a b c d", "a b x d") == 0.75
    assert word_similarity("a", "b") == 0.0
    assert word_similarity("", "") == 1.0


def rows(texts, refs=None):
    return {f"r{i}": {"text": t, "reference": (refs or [None] * len(texts))[i]} for i, t in enumerate(texts)}


def test_accuracy_drop_over_the_limit_fails_and_within_passes():
    refs = ["Paris", "Rome", "Tokyo", "Oslo"]
    base = rows(["Paris.", "Rome.", "Tokyo.", "Bergen."], refs)
    cand = rows(["Paris.", "Milan.", "Tokyo.", "Bergen."], refs)
    c = compare_rows(base, cand, max_drop=0.2)
    assert (c.base_accuracy, c.candidate_accuracy, c.accuracy_drop) == (0.75, 0.5, 0.25)
    assert c.exact_match_rate == 0.75 and c.gate_metric == "accuracy_drop" and not c.passed
    assert c.worst[0]["id"] == "r1"  # the answer the candidate lost comes first
    assert compare_rows(base, cand, max_drop=0.25).passed
    assert (c.lost, c.gained) == (1, 0)
    lo, hi = c.accuracy_drop_ci95  # (1/4 ± 1.96·sqrt((1/4 − 1/16)/4))
    assert lo == pytest.approx(0.25 - 0.4244, abs=1e-3) and hi == pytest.approx(0.25 + 0.4244, abs=1e-3)


def test_a_loss_offset_by_a_gain_is_no_drop_and_its_interval_spans_zero():
    refs = ["Paris", "Rome", "Tokyo", "Oslo"]
    base = rows(["Paris.", "Rome.", "Tokyo.", "Bergen."], refs)
    cand = rows(["Paris.", "Milan.", "Tokyo.", "Oslo."], refs)
    c = compare_rows(base, cand, max_drop=0.0)
    assert (c.lost, c.gained, c.accuracy_drop) == (1, 1, 0.0) and c.passed
    lo, hi = c.accuracy_drop_ci95
    assert lo < 0 < hi and hi == pytest.approx(-lo)
    assert "lost 1, gained 1" in format_comparison(c)
    assert compare_rows(rows(["a"]), rows(["b"])).accuracy_drop_ci95 is None  # no references, no interval


def test_missing_candidate_rows_count_against_the_candidate():
    refs = ["Paris", "Rome"]
    base = rows(["Paris", "Rome"], refs)
    cand = {"r0": {"text": "Paris", "reference": "Paris"}}
    c = compare_rows(base, cand, max_drop=0.0)
    assert c.only_base == 1 and c.candidate_accuracy == 0.5 and not c.passed
    assert c.exact_match_rate == 0.5


def test_without_references_the_gate_uses_disagreement():
    c = compare_rows(rows(["a b c d", "x"]), rows(["a b x d", "x"]), max_drop=0.1)
    assert c.with_reference == 0 and c.base_accuracy is None
    assert c.gate_metric == "disagreement" and c.gate_value == pytest.approx(1 - (0.75 + 1) / 2)
    assert not c.passed


def test_no_common_ids_is_an_error():
    with pytest.raises(CompareError, match="no output ids in common"):
        compare_rows(rows(["a"]), {"zz": {"text": "a"}})


def _fake_job(tmp_path, db, job_id):
    from tests.fakes import FakeSession
    from tokenmill.jobs.lifecycle.runner import run_job

    spec = job_spec("data/eval_set.parquet", tmp_path / job_id, job_id=job_id, reference_column="reference",
                    sampling={"max_tokens": 2})
    return run_job(spec, db_url=db, session_factory=FakeSession)


def test_cli_gate_exit_codes_on_both_backends(tmp_path, any_db_url, monkeypatch):
    from tokenmill.schemas import storage as S
    from tokenmill.schemas import tables as T

    monkeypatch.chdir(__import__("pathlib").Path(__file__).resolve().parent.parent)
    assert _fake_job(tmp_path, any_db_url, "base").status == "succeeded"
    assert _fake_job(tmp_path, any_db_url, "cand").status == "succeeded"
    res = cli("compare", "base", "cand", "--db", any_db_url, "--json")
    assert res.exit_code == 0, res.output
    d = json.loads(res.output)
    assert d["matched"] == 60 and d["exact_match_rate"] == 1.0 and d["with_reference"] == 60
    # the base answers everything right; the fake candidate (echo text) answers nothing
    eng = S.connect(any_db_url)
    with eng.begin() as conn:
        conn.execute(update(T.outputs).where(T.outputs.c.job_id == "base").values(text=T.outputs.c.reference))
    res = cli("compare", "base", "cand", "--db", any_db_url)
    assert res.exit_code == EXIT_QUALITY, res.output
    assert "drop +100.0%" in res.output and "FAIL" in res.output
    res = cli("compare", "base", "cand", "--db", any_db_url, "--max-drop", "1.0")
    assert res.exit_code == 0 and "PASS" in res.output
    res = cli("compare", "base", "nope", "--db", any_db_url)
    assert res.exit_code == 1 and res.output.strip() == "error: no job with id 'nope'"


@pytest.mark.engine
def test_real_eval_set_gate_and_kv_plan_against_the_engine(tmp_path, sqlite_url, model_path):
    """The default model partly solves the eval set; a candidate cut to one output
    token loses accuracy and fails the gate; kv-plan agrees with the engine's cache."""
    from pathlib import Path

    from tokenmill.jobs.lifecycle.runner import run_job

    root = Path(__file__).resolve().parent.parent

    def job(job_id, max_tokens):
        spec = job_spec(root / "data" / "eval_set.parquet", tmp_path / job_id, job_id=job_id,
                        reference_column="reference", engine=TEST_ENGINE,
                        sampling={"max_tokens": max_tokens, "temperature": 0.0})
        res = run_job(spec, db_url=sqlite_url)
        assert res.status == "succeeded", res
        return res

    job("eval-base", 32)
    job("eval-again", 32)
    job("eval-short", 1)
    res = cli("compare", "eval-base", "eval-again", "--db", sqlite_url, "--json")
    assert res.exit_code == 0, res.output
    same = json.loads(res.output)
    # a greedy rerun: batch composition may differ run to run (fp32 reduction order), so near-identical
    assert same["exact_match_rate"] >= 0.9 and abs(same["accuracy_drop"]) <= 0.05
    assert 0.2 <= same["base_accuracy"] <= 0.95  # partly solved: neither trivial nor hopeless
    res = cli("compare", "eval-base", "eval-short", "--db", sqlite_url, "--json")
    assert res.exit_code == EXIT_QUALITY, res.output
    short = json.loads(res.output)
    assert short["candidate_accuracy"] < short["base_accuracy"] and not short["passed"]

    res = cli("kv-plan", "--job", "eval-base", "--batch", str(TEST_ENGINE["max_num_seqs"]),
              "--db", sqlite_url, "--json")
    assert res.exit_code == 0, res.output
    p = json.loads(res.output)
    e = p["engine"]
    assert e["bytes_per_token_match"], p
    assert p["max_model_len"] == TEST_ENGINE["max_model_len"]
    assert e["engine_kv_cache_tokens"] > 0
    assert p["max_tokens_in_memory"] == e["engine_kv_cache_tokens"]
    assert e["engine_max_sequences_at_max_len"] == e["engine_kv_cache_tokens"] // TEST_ENGINE["max_model_len"]
