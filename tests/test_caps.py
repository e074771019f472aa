"""Cost and time caps: a job whose estimate crosses its cap does not start; a running job about to
cross it stops as a cancel does, keeps every finished row, and resumes after the cap is raised."""

from __future__ import annotations

import time

import pyarrow.parquet as pq
import pytest

from tests.conftest import write_parquet
from tests.fakes import FakeSession
from tests.helpers import assert_one_line_error, cli, job_spec
from tokenmill.jobs.lifecycle.caps import Bill, CapWatch, bill, crossed, held_seconds, refusal
from tokenmill.jobs.lifecycle.runner import JobError, run_job
from tokenmill.schemas import storage as S
from tokenmill.schemas.config import load_spec

ROWS = 240


def estimate(*, price=3600.0, fixed_s=1.0, per_row_s=0.01, rows=ROWS):
    """An estimate in `tokenmill estimate`'s shape (the parts caps read): `price` USD an hour,
    so a held second costs price / 3600."""
    per_s = price / 3600
    total_s = fixed_s + per_row_s * rows
    return {"rows": rows, "price_per_hour": price, "fixed": {"held_s": fixed_s, "cost_usd": fixed_s * per_s},
            "per_row": {"held_s": per_row_s, "cost_usd": per_row_s * per_s},
            "cost_usd": {"value": total_s * per_s, "lo": 0.8 * total_s * per_s, "hi": 1.2 * total_s * per_s},
            "held_wall_s": {"value": total_s, "lo": 0.8 * total_s, "hi": 1.2 * total_s}}


def spec_of(**keys):
    return load_spec({"input": "in.parquet", "output": "out", **keys})


def test_bill_counts_spent_time_and_the_rest_of_the_rows():
    est = estimate(price=360.0, fixed_s=10, per_row_s=1.0)
    b = bill(est, rows_left=50, held_s=36.0)
    assert b == Bill(spent_usd=pytest.approx(3.6), spent_h=pytest.approx(0.01), rest_usd=pytest.approx(6.0),
                     rest_h=pytest.approx(60 / 3600))
    # this run's start-up is spent as it goes, not counted twice
    assert bill(est, rows_left=50, held_s=36.0, fixed_spent_s=4.0).rest_usd == pytest.approx(5.6)
    assert bill(est, rows_left=50, held_s=36.0, fixed_spent_s=float("inf")).rest_usd == pytest.approx(5.0)


def test_crossed_names_the_cap_and_the_figures():
    b = Bill(spent_usd=1.0, spent_h=0.5, rest_usd=2.0, rest_h=0.25)
    assert crossed(spec_of(max_cost=3.5), b) is None
    assert crossed(spec_of(max_cost=2.5), b).startswith("max_cost $2.5: $3.0000 ($1.0000 spent, $2.0000")
    assert crossed(spec_of(max_hours=0.5), b).startswith("max_hours 0.5: 0.750 h")
    assert crossed(spec_of(), b) is None


def test_held_seconds_adds_up_runs_a_killed_one_to_its_last_heartbeat():
    runs = [{"run_id": "a", "started_at": 100.0, "finished_at": 130.0, "seen_at": 130.0},
            {"run_id": "b", "started_at": 200.0, "finished_at": None, "seen_at": 210.0},  # killed
            {"run_id": "c", "started_at": 300.0, "finished_at": None, "seen_at": 301.0}]  # this run
    assert held_seconds(runs, now=305.0, current="c") == pytest.approx(30 + 10 + 5)


def test_refusal_is_one_line_with_the_interval():
    why = refusal(spec_of(max_cost=0.5), estimate(price=3600.0), rows_left=ROWS, held_s=0.0)
    assert why is not None and "\n" not in why
    assert "not started" in why and "max_cost $0.5" in why and "interval $" in why and f"{ROWS:,} rows" in why
    assert refusal(spec_of(max_cost=100.0), estimate(price=3600.0), rows_left=ROWS, held_s=0.0) is None


def test_cap_watch_stops_once_when_spent_time_outgrows_the_estimate():
    now = [1000.0]
    done = [0]
    w = CapWatch(spec_of(max_cost=5.0), estimate(price=3600.0, fixed_s=1.0, per_row_s=0.01), total_rows=ROWS,
                 held_before_s=0.0, done=lambda: done[0], clock=lambda: now[0])
    assert w.check() is None  # $1 fixed + $2.40 of rows
    now[0] += 2.0
    assert w.check() is None  # a slow start: $2 spent, none of the fixed part left, $2.40 of rows
    done[0] = 100  # the engine answers
    assert w.check() is None  # $2 spent + $1.40 left
    now[0] += 2.0  # slower than estimated: $4 spent + $1.40 left
    assert w.check().startswith("stopped before crossing max_cost $5")
    assert w.check() is None  # said once


class SlowSession(FakeSession):
    """A fake engine slower than the estimate below says (80 ms a step, about 19 s for the job)."""

    def step(self):
        time.sleep(0.08)
        return super().step()


def _spec(tmp_path, inp, **keys):
    return job_spec(inp, tmp_path / "out", job_id="capped", engine={"max_num_seqs": 4}, sampling={"max_tokens": 4},
                    batching={"token_budget": 64, "ordering": "none"}, **keys)


def _input(tmp_path):
    return write_parquet(tmp_path / "in.parquet", [{"id": f"r{i:03d}", "prompt": f"question {i}"} for i in range(ROWS)])


def test_a_job_whose_estimate_crosses_its_cap_does_not_start(tmp_path, sqlite_url):
    inp = _input(tmp_path)
    eng = S.connect(sqlite_url)
    S.EstimateStore(eng).add("capped", estimate(price=3600.0), total_rows=ROWS)
    with pytest.raises(JobError) as err:
        run_job(_spec(tmp_path, inp, max_cost=1.0), db_url=sqlite_url, session_factory=FakeSession)
    assert "job capped not started" in str(err.value) and "max_cost $1" in str(err.value)
    assert S.JobStore(eng).get("capped") is None and not FakeSession.instances  # nothing claimed, no engine
    assert not (tmp_path / "out").exists()
    # The CLI says it in one line; with no estimate at all it says how to get one.
    args = ("run", "--input", inp, "--output", tmp_path / "out", "--job-id", "capped", "--db", sqlite_url)
    assert_one_line_error(cli(*args, "--max-hours", "0.0001"), 1, "not started", "max_hours 0.0001")


def test_a_running_job_crossing_its_cap_stops_keeps_its_rows_and_resumes_with_a_higher_cap(tmp_path, sqlite_url,
                                                                                          monkeypatch):
    from tokenmill.jobs.lifecycle import runner

    monkeypatch.setattr(runner, "CAP_CHECK_EVERY_S", 1.0)
    inp = _input(tmp_path)
    eng = S.connect(sqlite_url)
    # The estimate says 12 s of start-up and 1 ms a row at $1 a held second ($12.24 in all); the
    # slow engine takes about 19 s for the rows, so once it answers, the bill crosses $14 part-way.
    S.EstimateStore(eng).add("capped", estimate(price=3600.0, fixed_s=12.0, per_row_s=0.001), total_rows=ROWS)
    first = run_job(_spec(tmp_path, inp, max_cost=14.0), db_url=sqlite_url, session_factory=SlowSession)
    assert first.status == "cancelled" and 0 < first.succeeded < ROWS, first
    assert first.note.startswith("stopped before crossing max_cost $14") and "rows answered" in first.note
    marker = (tmp_path / "out" / "_CANCELLED.json").read_text()
    assert "max_cost $14" in marker and not (tmp_path / "out" / "_SUCCESS.json").exists()
    out = pq.read_table(tmp_path / "out" / "outputs.parquet").to_pylist()
    assert len(out) == first.succeeded == len({r["id"] for r in out})  # every finished row kept

    again = run_job(_spec(tmp_path, inp, max_cost=1000.0), db_url=sqlite_url, session_factory=FakeSession)
    assert again.resumed and (again.status, again.succeeded, again.failed) == ("succeeded", ROWS, 0)
    assert len(FakeSession.instances[-1].added) == ROWS - first.succeeded  # only the rest was generated
    out = pq.read_table(tmp_path / "out" / "outputs.parquet").to_pylist()
    assert sorted(r["id"] for r in out) == [f"r{i:03d}" for i in range(ROWS)]  # every id once
