"""The stand-in engine (bench/standin.py) on its own: with `step_s` it is a device that sleeps
each step and answers its `max_num_seqs` oldest requests, spending no CPU; without it, the
ceiling benchmark's engine that answers everything at once; with TOKENMILL_STANDIN_LOG each
process logs what it generated, so a prompt generated twice shows."""

from __future__ import annotations

import time

import pytest

from bench import standin


def _session(monkeypatch, tmp_path, log: bool, **cfg):
    if log:
        monkeypatch.setenv(standin.LOG_ENV, str(tmp_path / "gen"))
    else:
        monkeypatch.delenv(standin.LOG_ENV, raising=False)
    return standin.StandinSession(standin.StandinConfig(kind="standin", **cfg))


def test_a_sleeping_step_takes_its_wall_time_without_cpu_and_answers_the_oldest_max_num_seqs(monkeypatch, tmp_path):
    s = _session(monkeypatch, tmp_path, False, step_s=0.3, max_num_seqs=2)
    for i in range(5):
        s.add(f"r{i}", [1, 2, 3 + i], {"max_tokens": 3})
    wall, cpu = time.perf_counter(), time.process_time()
    first = s.step()
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    assert [f.request_id for f in first] == ["r0", "r1"] and s.num_unfinished() == 3
    assert wall >= 0.3 and cpu < 0.1, (wall, cpu)
    assert [(f.output_tokens, f.prompt_tokens, f.text) for f in first] == [(3, 3, "ok ok ok")] * 2
    assert [f.request_id for f in s.step()] == ["r2", "r3"]
    assert [f.request_id for f in s.step()] == ["r4"] and s.num_unfinished() == 0


def test_without_step_s_every_request_is_answered_at_the_next_step_at_once(monkeypatch, tmp_path):
    s = _session(monkeypatch, tmp_path, False, max_num_seqs=2)
    for i in range(5):
        s.add(f"r{i}", [i], {"max_tokens": 1})
    wall = time.perf_counter()
    assert len(s.step()) == 5 and time.perf_counter() - wall < 0.1
    assert not list(tmp_path.iterdir())  # no log unless asked for


def test_the_generation_log_names_each_answered_request_once_and_a_repeated_prompt_by_the_same_digest(
        monkeypatch, tmp_path):
    s = _session(monkeypatch, tmp_path, True, step_s=0.01, max_num_seqs=8)
    s.add("a.0", [5, 6], {"max_tokens": 2})
    s.add("a.1", [7, 8], {"max_tokens": 4})
    s.step()
    s.add("b.0", [5, 6], {"max_tokens": 2})  # the first prompt again: a line generated twice
    s.add("b.1", [9], {"max_tokens": 1})
    s.abort(["b.1"])  # aborted before a step: never generated
    s.step()
    s.shutdown()
    got = standin.read_log(tmp_path / "gen")
    assert [(g["request_id"], g["output_tokens"]) for g in got] == [("a.0", 2), ("a.1", 4), ("b.0", 2)]
    assert got[0]["digest"] == got[2]["digest"] != got[1]["digest"]
    assert len({g["file"] for g in got}) == 1
    with open(next((tmp_path / "gen").glob("*.log")), "a") as fh:
        fh.write("c.0\tcut")  # a kill -9 in the middle of a write
    assert len(standin.read_log(tmp_path / "gen")) == 3


def test_step_s_is_checked_when_the_config_is_made():
    with pytest.raises(ValueError, match="step_s"):
        standin.StandinConfig(kind="standin", step_s=-1)
