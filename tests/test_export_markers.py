"""The export's marker says how the job ended: `_SUCCESS.json` only for a finished export
(written after the row counts reconcile), `_FAILED.json` / `_CANCELLED.json` with the reason
otherwise; a rerun replaces whatever marker an earlier run left."""

from __future__ import annotations

import json
import time

import pyarrow.parquet as pq
import pytest
from sqlalchemy import func, select

from tests.conftest import write_parquet
from tests.fakes import FakeSession
from tests.helpers import job_spec, stale_output_job
from tokenmill.jobs.lifecycle import export as X
from tokenmill.jobs.lifecycle.runner import JobError, run_job
from tokenmill.schemas import storage as S
from tokenmill.schemas import tables as T

ROWS = 200


def markers(out) -> set[str]:
    return {p.name for p in out.iterdir() if p.name.startswith("_")} if out.exists() else set()


def read(out, name: str) -> dict:
    return json.loads((out / name).read_text())


def prompts(tmp_path, n: int, name: str = "in.parquet"):
    return write_parquet(tmp_path / name, [{"id": f"r{i:03d}", "prompt": f"question {i}"} for i in range(n)])


def test_a_row_count_mismatch_leaves_failed_json_with_the_reason_and_no_success(tmp_path, sqlite_url):
    # The same job id reused on a different input: a stale output makes the counts disagree.
    eng = S.connect(sqlite_url)
    stale_output_job(eng, "reused")
    out = tmp_path / "out"
    inp = write_parquet(tmp_path / "in.parquet", [{"id": "a", "prompt": "hi"}, {"id": "b", "prompt": "yo"}])
    res = run_job(job_spec(inp, out, job_id="reused", sampling={"max_tokens": 2}),
                  db_url=sqlite_url, session_factory=FakeSession)
    assert res.status == "failed"
    assert markers(out) == {"_FAILED.json"}  # no _SUCCESS.json: the folder does not read as finished
    m = read(out, "_FAILED.json")
    assert m["status"] == "failed"
    assert m["reason"] == ("row count mismatch: 2 input rows but 3 outputs + 0 dead letters = 3; "
           "0:9 (output) is not an input row") == res.note
    assert (m["rows_in"], m["succeeded"], m["failed"], m["outputs"], m["dead_letters"]) == (2, 3, 0, 3, 0)
    assert m["files"]["outputs"] == str(out / "outputs.parquet") and (out / "outputs.parquet").exists()
    assert m["tokens"]["output"] == 1 + 2 * 2  # the stale row's 1 and 2 tokens for each of a, b


class CancellingSession(FakeSession):
    """A fake engine (20 ms a step) whose first step asks for the job to be cancelled, as
    `tokenmill cancel` does; the workers see it at their next cancel check."""

    db_url = ""

    def step(self):
        if self.steps == 0:
            S.JobStore(S.connect(self.db_url)).request_cancel("cancel-me")
        time.sleep(0.02)
        return super().step()


def test_a_cancelled_job_leaves_cancelled_json_and_a_rerun_that_succeeds_replaces_it(tmp_path, sqlite_url,
                                                                                    monkeypatch):
    monkeypatch.setattr(CancellingSession, "db_url", sqlite_url)
    inp, out = prompts(tmp_path, ROWS), tmp_path / "out"
    spec = job_spec(inp, out, job_id="cancel-me", engine={"max_num_seqs": 4}, sampling={"max_tokens": 4},
                    batching={"token_budget": 64, "ordering": "none"})
    res = run_job(spec, db_url=sqlite_url, session_factory=CancellingSession)
    assert res.status == "cancelled" and res.succeeded < ROWS
    assert markers(out) == {"_CANCELLED.json"}
    m = read(out, "_CANCELLED.json")
    assert m["status"] == "cancelled"
    assert m["reason"] == (f"cancel requested: stopped after the batches in flight, {res.succeeded} of "
                           f"{ROWS} rows answered")
    assert (m["rows_in"], m["succeeded"], m["failed"], m["outputs"]) == (ROWS, res.succeeded, 0, res.succeeded)
    assert pq.read_table(out / "outputs.parquet").num_rows == res.succeeded  # the data files stay

    # The rerun resumes, succeeds, and the folder now reads as a finished export.
    res2 = run_job(spec, db_url=sqlite_url, session_factory=FakeSession)
    assert res2.resumed and res2.status == "succeeded"
    assert markers(out) == {"_SUCCESS.json"}
    m = read(out, "_SUCCESS.json")
    assert (m["status"], m["rows_in"], m["succeeded"], m["failed"], m["outputs"]) == ("succeeded", ROWS, ROWS, 0, ROWS)
    assert "reason" not in m and m["tokens"]["output"] == ROWS * 4 and m["format"] == "parquet"
    assert m["files"] == {"outputs": str(out / "outputs.parquet"), "dead_letters": str(out / "dead_letters.parquet")}


class BrokenEngine(FakeSession):
    """An engine that cannot start (the pipeline fails)."""

    def __init__(self, *a, **kw):
        raise RuntimeError("engine would not start")


def test_a_rerun_whose_pipeline_fails_removes_the_earlier_success(tmp_path, sqlite_url):
    out = tmp_path / "out"
    run_job(job_spec(prompts(tmp_path, 3), out, job_id="again"), db_url=sqlite_url, session_factory=FakeSession)
    assert markers(out) == {"_SUCCESS.json"}
    # The same job id with one more row: this run has work, and its engine fails.
    with pytest.raises(JobError, match="engine would not start"):
        run_job(job_spec(prompts(tmp_path, 4, "more.parquet"), out, job_id="again"),
                db_url=sqlite_url, session_factory=BrokenEngine)
    assert markers(out) == {"_FAILED.json"}  # the earlier _SUCCESS.json no longer says "finished"
    m = read(out, "_FAILED.json")
    assert m["status"] == "failed" and m["files"] == {} and (m["rows_in"], m["succeeded"]) == (4, 3)
    assert m["reason"].startswith("the pipeline failed; this run exported nothing: ")
    assert "engine would not start" in m["reason"]
    assert m["reason"] == f"the pipeline failed; this run exported nothing: {S.JobStore(S.connect(sqlite_url)).get('again')['error']}"


def test_a_crash_mid_export_leaves_no_success_beside_half_written_files(tmp_path, sqlite_url, monkeypatch):
    out = tmp_path / "out"
    run_job(job_spec(prompts(tmp_path, 3), out, job_id="crash"), db_url=sqlite_url, session_factory=FakeSession)
    assert markers(out) == {"_SUCCESS.json"}
    spec = job_spec(prompts(tmp_path, 4, "more.parquet"), out, job_id="crash")  # one more row: this run exports
    written = []

    def crash(dest, schema, chunks):
        written.append(dest)
        raise OSError("disk full")

    monkeypatch.setattr(X, "write_parquet", crash)
    with pytest.raises(OSError, match="disk full"):
        run_job(spec, db_url=sqlite_url, session_factory=FakeSession)
    assert written and markers(out) == set()


def test_write_marker_keeps_one_marker_and_refuses_an_unfinished_status(tmp_path):
    root = str(tmp_path / "o")
    X.write_marker(root, "cancelled", {"job_id": "j"}, "cancel requested")
    X.write_marker(root, "partial", {"job_id": "j"})
    assert markers(tmp_path / "o") == {"_SUCCESS.json"} and read(tmp_path / "o", "_SUCCESS.json") == {
        "job_id": "j", "status": "partial"}
    X.write_marker(root, "failed", {"job_id": "j"}, "row count mismatch")
    assert markers(tmp_path / "o") == {"_FAILED.json"}
    with pytest.raises(ValueError, match="no export marker for job status 'running'"):
        X.write_marker(root, "running", {})


def test_the_reconcile_names_the_rows_in_no_place_and_in_two():
    from tokenmill.jobs.lifecycle.reconcile import NAMED, misplaced

    placed = [(0, 0, "output"), (0, 2, "output"), (0, 2, "dead letter"), (1, 0, "output"), (1, 5, "output")]
    missing, extra = misplaced([(1, range(0, 3)), (0, range(0, 4))], iter(placed))
    assert (str(missing), missing.count) == ("0:1, 0:3, 1:1, 1:2", 4)
    assert str(extra) == "0:2 is in 2 places (output, dead letter), 1:5 (output) is not an input row"
    missing, extra = misplaced([(0, range(0, 1000))], iter([(0, 500, "output")]))
    assert missing.count == 999 and str(missing).endswith(f"0:{NAMED - 1} and {999 - NAMED} more") and extra.count == 0


def test_a_finished_job_rerun_starts_nothing_and_keeps_its_export_until_something_is_missing(tmp_path, sqlite_url):
    # A finished job run again on the same input: no engine, no export, no new run; its stored result.
    out = tmp_path / "out"
    spec = job_spec(prompts(tmp_path, 5), out, job_id="done-once")
    first = run_job(spec, db_url=sqlite_url, session_factory=FakeSession)
    stamp = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    FakeSession.instances.clear()
    again = run_job(spec, db_url=sqlite_url, session_factory=FakeSession)
    assert FakeSession.instances == []  # no engine was started
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == stamp  # nothing rewritten
    assert (again.status, again.succeeded, again.failed, again.resumed) == ("succeeded", 5, 0, True)
    assert again.metrics == first.metrics and again.files == first.files and again.note
    with S.connect(sqlite_url).connect() as c:  # no run was recorded for it
        assert c.execute(select(func.count()).select_from(T.runs).where(T.runs.c.job_id == "done-once")).scalar() == 1
    # The export's data gone (a part of it): the rerun exports again (and still generates nothing).
    next((out / "outputs.parquet").glob("part-*.parquet")).unlink()
    run_job(spec, db_url=sqlite_url, session_factory=FakeSession)
    assert pq.read_table(out / "outputs.parquet").num_rows == 5 and markers(out) == {"_SUCCESS.json"}
    assert not any(s.added for s in FakeSession.instances)
    # A marker that disagrees with the database: the job is exported again, its intact part kept (it
    # holds the job's every stored row) and the marker written anew.
    m = read(out, "_SUCCESS.json")
    (out / "_SUCCESS.json").write_text(json.dumps({**m, "succeeded": 4}))
    before = {p.name: p.stat().st_mtime_ns for p in (out / "outputs.parquet").iterdir()}
    time.sleep(0.01)
    run_job(spec, db_url=sqlite_url, session_factory=FakeSession)
    after = {p.name: p.stat().st_mtime_ns for p in (out / "outputs.parquet").iterdir()}
    assert after == before and read(out, "_SUCCESS.json")["succeeded"] == 5
