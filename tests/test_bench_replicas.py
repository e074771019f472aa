"""The replica benchmark's and harness's arithmetic without servers (bench/replicas.py,
tests/serve_replicas.py): a round's ratios against 1 replica, lines generated twice, and the
accounting that flags a custom_id twice or missing, counts that do not add up and usage that
is not the output lines' sum."""

from __future__ import annotations

from collections import Counter

from openai.types import Batch

from bench.replicas import round_ratios
from tests.serve_replicas import accounting, twice


def test_a_rounds_ratios_are_each_arm_over_1_replica_with_the_issues_targets():
    got = round_ratios({1: {"lines_per_s": 100.0}, 2: {"lines_per_s": 185.0}, 3: {"lines_per_s": 250.0}})
    assert got == {"2_over_1": {"ratio": 1.85, "target": "≥ 1.8", "pass": True},
                   "3_over_1": {"ratio": 2.5, "target": "≥ 2.6", "pass": False}}


def test_generated_twice_counts_every_generation_past_a_prompts_first():
    assert twice(Counter({"a": 1, "b": 3, "c": 2})) == 3 and twice(Counter()) == 0


def _batch(total, completed, failed, usage):
    return Batch.model_validate({
        "id": "batch_x", "object": "batch", "endpoint": "/v1/chat/completions", "input_file_id": "file-x",
        "completion_window": "24h", "status": "completed", "created_at": 0,
        "request_counts": {"total": total, "completed": completed, "failed": failed},
        "usage": usage and {"input_tokens": usage[0], "output_tokens": usage[1], "total_tokens": sum(usage),
                            "input_tokens_details": {"cached_tokens": 0},
                            "output_tokens_details": {"reasoning_tokens": 0}}})


def _out(cid, p, c):
    return {"custom_id": cid, "response": {"status_code": 200,
                                           "body": {"usage": {"prompt_tokens": p, "completion_tokens": c}}}}


def test_accounting_passes_a_batch_whose_files_counts_and_usage_agree():
    out, err = [_out("a", 5, 2), _out("b", 7, 2)], [{"custom_id": "c", "error": {"code": "x"}}]
    assert accounting(_batch(3, 2, 1, (12, 4)), out, err, ["a", "b", "c"]) == []


def test_accounting_flags_a_line_twice_a_line_missing_counts_off_and_usage_off():
    out = [_out("a", 5, 2), _out("a", 5, 2)]
    got = accounting(_batch(3, 1, 0, (5, 2)), out, [], ["a", "b", "c"])
    assert len(got) == 3, got
    assert "twice ['a'] (1), missing ['b', 'c'] (2)" in got[0]
    assert got[1].startswith("request_counts") and got[2].startswith("usage")
    assert accounting(_batch(1, 1, 0, None), [_out("a", 1, 1)], [], ["a"])[0].startswith("usage None")
