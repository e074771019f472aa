"""`tokenmill cancel`: a running job stops gracefully, keeps what finished, is marked cancelled."""

from __future__ import annotations

import threading
import time

import pyarrow.parquet as pq

from tests.conftest import write_parquet
from tests.fakes import FakeSession
from tests.helpers import cli, job_spec
from tokenmill.jobs.lifecycle.runner import run_job
from tokenmill.schemas import storage as S

ROWS = 200


class SlowSession(FakeSession):
    """A fake engine slow enough (20 ms a step) that a cancel lands mid-job."""

    def step(self):
        time.sleep(0.02)
        return super().step()


def spec(tmp_path, inp):
    return job_spec(inp, tmp_path / "out", job_id="cancel-me", engine={"max_num_seqs": 4}, sampling={"max_tokens": 4},
                    batching={"token_budget": 64, "ordering": "none"})


def wait_for(cond, timeout=120.0):
    # a bound against a hung test, not an assertion on speed
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.1)
    return False


def test_cancel_stops_a_running_job_and_keeps_what_finished(tmp_path, sqlite_url):
    inp = write_parquet(tmp_path / "in.parquet", [{"id": f"r{i:03d}", "prompt": f"question {i}"} for i in range(ROWS)]
                        + [{"id": "bad", "prompt": None}])
    eng = S.connect(sqlite_url)
    result = {}

    def target():
        try:
            result["res"] = run_job(spec(tmp_path, inp), db_url=sqlite_url, session_factory=SlowSession)
        except BaseException as err:  # surfaced by the assertions below
            result["err"] = err

    t = threading.Thread(target=target, daemon=True)
    t.start()
    assert wait_for(lambda: S.JobStore(eng).get("cancel-me") is not None and S.MetricsReader(eng).counts("cancel-me")["succeeded"] >= 8)
    r = cli("cancel", "cancel-me", "--db", sqlite_url)
    assert r.exit_code == 0 and r.output.strip() == "job cancel-me: cancel requested", r.output
    t.join(timeout=300)
    assert not t.is_alive() and "err" not in result, result
    res = result["res"]
    assert res.status == "cancelled"
    assert 8 <= res.succeeded < ROWS  # stopped part-way, after the batches in flight
    job = S.JobStore(eng).get("cancel-me")
    assert job["status"] == "cancelled" and job["owner"] is None
    assert (job["total"], job["succeeded"], job["failed"]) == (ROWS + 1, res.succeeded, 1)
    out = pq.read_table(tmp_path / "out" / "outputs.parquet").to_pylist()
    assert len(out) == res.succeeded == len({r["id"] for r in out})  # what finished is kept and exported
    st = cli("status", "cancel-me", "--db", sqlite_url)
    assert "status: cancelled" in st.output and f"succeeded: {res.succeeded}" in st.output

    # Rerunning the cancelled job answers the rest and duplicates nothing.
    res2 = run_job(spec(tmp_path, inp), db_url=sqlite_url, session_factory=FakeSession)
    assert res2.resumed and (res2.status, res2.succeeded, res2.failed) == ("partial", ROWS, 1)
    assert len(FakeSession.instances[-1].added) == ROWS - res.succeeded
    out = pq.read_table(tmp_path / "out" / "outputs.parquet").to_pylist()
    assert sorted(r["id"] for r in out) == [f"r{i:03d}" for i in range(ROWS)]


def test_cancel_of_a_pending_job_is_immediate_and_of_unknown_job_fails(sqlite_url):
    eng = S.connect(sqlite_url)
    assert S.JobStore(eng).submit({"id": "later", "status": "pending", "spec": {}})
    r = cli("cancel", "later", "--db", sqlite_url)
    assert r.exit_code == 0 and r.output.strip() == "job later: cancelled"
    assert S.JobStore(eng).get("later")["status"] == "cancelled"
    r = cli("cancel", "nope", "--db", sqlite_url)
    assert r.exit_code == 1 and r.output.strip() == "error: no job with id 'nope'"
