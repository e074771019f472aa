"""`workers: auto` on a CPU host, from what its finished jobs measured (transforms/engines/cpu_workers.py),
and the one line an explicit `--workers N` gets when the host's cores cannot feed N workers."""

from __future__ import annotations

import pytest

from tests.helpers import job_spec
from tokenmill.jobs.lifecycle.preflight import resolve_workers
from tokenmill.transforms.engines import cpu_workers as W
from tokenmill.transforms.engines import kinds


def run(workers: int, rows_per_s: float, cores_busy: float, rows: int = 100_000) -> W.WorkersRun:
    """A finished job of `workers` workers that ran `rows_per_s` over its wall with its processes
    keeping `cores_busy` cores busy."""
    wall = rows / rows_per_s
    return W.WorkersRun(workers, rows, wall, cores_busy * wall, "2026-12-07T14:00:00Z")


def test_with_nothing_recorded_auto_is_one_worker():
    assert W.auto_workers({}, 2) == (1, "no job of this engine and model measured on this host yet")
    assert W.auto_workers({}, 64)[0] == 1


def test_one_worker_that_keeps_more_than_half_the_cores_busy_stays_one():
    n, why = W.auto_workers({1: run(1, 4000, 1.31)}, 2)
    assert (n, why) == (1, "one worker keeps 1.31 of this host's 2 cores busy")


def test_one_worker_that_leaves_cores_idle_tries_as_many_as_the_cores_hold_at_its_load():
    assert W.auto_workers({1: run(1, 4000, 0.9)}, 2)[0] == 2
    assert W.auto_workers({1: run(1, 4000, 1.9)}, 8)[0] == 4
    assert W.auto_workers({1: run(1, 4000, 0.1)}, 8)[0] == 8  # never more than the cores
    assert "the next auto compares" in W.auto_workers({1: run(1, 4000, 0.9)}, 2)[1]


def test_with_two_counts_recorded_auto_takes_the_one_that_ran_more_rows_a_second():
    slower_two = {1: run(1, 4000, 1.3), 2: run(2, 3700, 1.6)}
    faster_two = {1: run(1, 4000, 0.8), 2: run(2, 4600, 1.7)}
    assert W.auto_workers(slower_two, 2) == (1, "the fastest here for this engine and model "
                                                "(rows/s: 1 ran 4,000, 2 ran 3,700)")
    assert W.auto_workers(faster_two, 2)[0] == 2
    assert W.auto_workers({2: run(2, 4600, 1.7)}, 2)[0] == 1  # one worker not yet measured: measured next


def test_an_explicit_count_the_cores_cannot_feed_gets_one_line_with_the_measured_load_and_the_cores():
    line = W.feed_note(2, {1: run(1, 4000, 1.31)}, 2)
    assert line == ("warning: 2 workers need about 2.6 cores at 1.31 cores each (measured: a 100,000-row job of "
                    "1 worker on 2026-12-07); this host has 2: they share them and may run no faster than fewer; "
                    "running 2 as asked")
    assert "\n" not in line
    assert W.feed_note(2, {1: run(1, 4000, 0.9)}, 2) is None  # 1.8 cores: the host feeds them
    assert W.feed_note(1, {1: run(1, 4000, 1.9)}, 2) is None


def test_without_a_record_the_line_states_its_estimate_of_one_core_a_worker():
    assert W.feed_note(2, {}, 2) is None
    line = W.feed_note(3, {}, 2)
    assert line is not None and line.startswith("warning: 3 workers need about 3.0 cores at 1.00 cores each "
                                                "(an estimate: no job of this engine and model measured here)")
    assert "this host has 2" in line


def test_the_record_keeps_each_counts_last_job_per_engine_and_model_and_not_small_jobs(tmp_path, monkeypatch):
    monkeypatch.setenv("TOKENMILL_HOME", str(tmp_path))
    assert W.host_record("vllm", "m") == {}
    assert not W.remember("vllm", "m", run(1, 4000, 1.3, rows=W.MIN_RECORD_ROWS - 1))  # mostly its start: not kept
    assert W.host_record("vllm", "m") == {}
    assert W.remember("vllm", "m", run(1, 4000, 1.3))
    assert W.remember("vllm", "m", run(1, 3000, 1.2))  # the last job of a count replaces the one before
    assert W.remember("vllm", "m", run(2, 3500, 1.7))
    got = W.host_record("vllm", "m")
    assert sorted(got) == [1, 2]
    assert got[1].rows_per_s == pytest.approx(3000) and got[1].cores_per_worker == pytest.approx(1.2)
    assert got[2].cores_per_worker == pytest.approx(0.85)
    assert W.host_record("vllm", "other-model") == {} and W.host_record("llamacpp", "m") == {}
    monkeypatch.setattr(W, "allowed_cores", lambda: [0, 1, 2, 3])  # another host kind: its own record
    assert W.host_record("vllm", "m") == {}


@pytest.fixture
def cpu_host(tmp_path, monkeypatch):
    """A 2-core host without GPUs, its record in a home of its own."""
    monkeypatch.setenv("TOKENMILL_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("TOKENMILL_FORCE_CPU", "1")
    monkeypatch.setattr(W, "allowed_cores", lambda: [0, 1])
    monkeypatch.setattr(kinds, "allowed_cores", lambda: [0, 1])
    return tmp_path


def spec(tmp_path, workers):
    return job_spec(tmp_path / "in.parquet", tmp_path / "out", engine={"model": "smollm2-135m"},
                    runner={"num_workers": workers})


def test_resolve_workers_reads_the_record_and_says_why_on_a_cpu_host(cpu_host):
    lines: list[str] = []
    assert resolve_workers(spec(cpu_host, "auto"), say=lines.append).runner.num_workers == 1
    assert lines == ["workers: auto is 1 on this CPU host: no job of this engine and model measured on this host yet"]
    W.remember("vllm", "smollm2-135m", run(1, 4000, 0.8))
    W.remember("vllm", "smollm2-135m", run(2, 5000, 1.7))
    lines.clear()
    assert resolve_workers(spec(cpu_host, "auto"), say=lines.append).runner.num_workers == 2
    assert lines == ["workers: auto is 2 on this CPU host: the fastest here for this engine and model "
                     "(rows/s: 1 ran 4,000, 2 ran 5,000)"]
    assert resolve_workers(spec(cpu_host, "auto"), here=False).runner.num_workers == 1  # submit: counted where it runs
    assert resolve_workers(spec(cpu_host, "auto"), fake_engine=True).runner.num_workers == 1  # a test double


def test_an_explicit_number_runs_as_asked_with_the_line_when_the_cores_cannot_feed_it(cpu_host):
    W.remember("vllm", "smollm2-135m", run(1, 4000, 1.34))
    lines: list[str] = []
    assert resolve_workers(spec(cpu_host, 2), say=lines.append).runner.num_workers == 2
    assert len(lines) == 1 and lines[0].startswith("warning: 2 workers need about 2.7 cores at 1.34 cores each")
    lines.clear()
    assert resolve_workers(spec(cpu_host, 1), say=lines.append).runner.num_workers == 1
    assert resolve_workers(spec(cpu_host, 2), fake_engine=True, say=lines.append).runner.num_workers == 2
    assert lines == []


def test_a_finished_job_is_kept_only_for_a_cpu_hosts_own_workers(cpu_host):
    launch = kinds.engine_of("vllm").launch_side(spec(cpu_host, 1).engine)
    launch.remember_run(spec(cpu_host, 2).runner, 50_000, 20.0, 30.0)
    (kept,) = W.host_record("vllm", "smollm2-135m").values()
    assert (kept.workers, kept.rows_per_s, kept.cores_per_worker) == (2, 2500.0, 0.75)
    stand_in = kinds.engine_of("vllm").launch_side(spec(cpu_host, 1).engine, stand_in=True)
    stand_in.remember_run(spec(cpu_host, 1).runner, 50_000, 20.0, 30.0)
    launch.remember_run(job_spec(cpu_host / "in.parquet", cpu_host / "out",
                                 runner={"num_workers": 1, "runner": "DaskRunner"}).runner, 50_000, 20.0, 30.0)
    assert sorted(W.host_record("vllm", "smollm2-135m")) == [2]
