"""The one queue and its launchers: the coordinator's order, each launcher's typed result
(in this process, the server's warm engine process, a process of its own) for a success, a
failure and a cancel, and a served batch's attempts kept in its job's row across a restart."""

from __future__ import annotations

import json
import queue
import threading
import time

import pytest

from tests.conftest import write_parquet
from tests.helpers import RecordingEngine, job_spec
from tests.openai_server import FaultServer
from tokenmill.jobs.lifecycle.coordinator import queue_order, take
from tokenmill.jobs.lifecycle.launchers import Launched
from tokenmill.jobs.serve.config import ServeConfig
from tokenmill.jobs.serve.objects import batch_status
from tokenmill.schemas import storage as S

KEY_VAR = "TOKENMILL_TEST_OPENAI_KEY"


def test_the_coordinator_takes_by_priority_then_age_one_job_per_model_up_to_its_slots():
    rows = [{"id": "a", "priority": 0, "at": 1, "model": "m"}, {"id": "b", "priority": 5, "at": 2, "model": "m"},
            {"id": "c", "priority": 0, "at": 0, "model": "n"}, {"id": "d", "priority": 1, "at": 3, "model": "o"}]
    order = sorted(rows, key=lambda r: queue_order(r, at="at"))
    assert [r["id"] for r in order] == ["b", "d", "c", "a"]
    model = lambda r: r["model"]  # noqa: E731
    assert [r["id"] for r in take(order, slots=2, model_of=model)] == ["b", "d"]
    assert [r["id"] for r in take(order, slots=3, busy=["m"], model_of=model)] == ["d", "c"]  # m's engine is busy
    assert take(order, slots=1, busy=["x"], model_of=model) == []  # every slot taken
    assert [r["id"] for r in take(order, slots=1)] == ["b"]  # run-pending: one at a time


# ---------------------------------------------------------------- the launchers' typed results


class _Pool:
    """The warm engine pool's launcher (a real engine process) reporting into `got`."""

    def __init__(self, tmp_path, got):
        from tokenmill.jobs.serve.engines import EngineProcess

        self.proc = EngineProcess("test-model", 60.0, str(tmp_path / "engine.log"),
                                  lambda model, event: got.put(event) if isinstance(event, Launched) else None)
        self.proc.start()

    def launch(self, job_id, spec, db_url):
        return self.proc.launch(job_id, spec, db_url)


def _launcher(kind, tmp_path, got, stages):
    from tokenmill.jobs.lifecycle.launchers.inprocess import InProcessLauncher
    from tokenmill.jobs.lifecycle.launchers.spawned import SpawnedLauncher

    if kind == "in-process":
        return InProcessLauncher(got.put)
    if kind == "subprocess":
        return SpawnedLauncher(got.put, stages.append, tmp_path)
    return _Pool(tmp_path, got)


def _cancel_once_running(eng, job_id):
    """Ask `job_id` to stop as soon as its row says it runs (from another thread)."""
    def watch():
        end = time.monotonic() + 300  # a bound against a hung test
        while time.monotonic() < end:
            job = S.JobStore(eng).get(job_id)
            if job is not None and job["status"] == "running":
                S.JobStore(eng).request_cancel(job_id)
                return
            time.sleep(0.05)

    t = threading.Thread(target=watch, daemon=True)
    t.start()
    return t


@pytest.mark.parametrize("kind", ["in-process", "engine pool", "subprocess"])
def test_each_launcher_reports_a_success_a_failure_and_a_cancel_as_the_same_typed_result(kind, tmp_path, sqlite_url,
                                                                                         monkeypatch):
    monkeypatch.setenv(KEY_VAR, "sk-test")
    eng = S.connect(sqlite_url)
    got: queue.Queue = queue.Queue()
    with FaultServer(api_key="sk-test") as server:
        engine = {"kind": "openai", "base_url": server.base_url, "model": "test-model", "tokenizer": "smollm2-135m",
                  "api_key_env": KEY_VAR, "max_in_flight": 1}

        def spec(job_id, inp):
            return job_spec(inp, tmp_path / job_id, job_id=job_id, engine=engine, sampling={"max_tokens": 4},
                            batching={"token_budget": 64}).model_dump(mode="json", exclude_none=True)

        quick = write_parquet(tmp_path / "quick.parquet", [{"id": f"r{i}", "prompt": f"question {i}"} for i in range(3)])
        slow = write_parquet(tmp_path / "slow.parquet",
                             [{"id": f"r{i}", "prompt": f"[[slow]] question {i}"} for i in range(40)])
        stages: list[str] = []
        launcher = _launcher(kind, tmp_path, got, stages)
        try:
            assert launcher.launch("ok", spec("ok", quick), sqlite_url)
            assert got.get(timeout=300) == Launched("ok", "succeeded", None)
            if kind == "subprocess":  # its stage lines came over the pipe too
                assert any(line.startswith("checked: 3 input rows") for line in stages), stages
            assert launcher.launch("bad", spec("bad", tmp_path / "gone.parquet"), sqlite_url)
            bad = got.get(timeout=300)
            assert (bad.job_id, bad.status, bad.raised) == ("bad", "failed", True) and "does not exist" in bad.note
            watcher = _cancel_once_running(eng, "stop")
            assert launcher.launch("stop", spec("stop", slow), sqlite_url)
            stopped = got.get(timeout=300)
            watcher.join(5)
            assert (stopped.job_id, stopped.status, stopped.raised) == ("stop", "cancelled", False)
        finally:
            if isinstance(launcher, _Pool):
                launcher.proc.stop()
    assert S.JobStore(eng).get("ok")["status"] == "succeeded" and S.JobStore(eng).get("stop")["status"] == "cancelled"


# ---------------------------------------------------------------- attempts across a restart


def _service(tmp_path):
    from tokenmill.jobs.serve.service import BatchService

    cfg = ServeConfig(db=f"sqlite:///{tmp_path / 's.db'}", files=str(tmp_path / "files"), work=str(tmp_path / "runs"),
                      models={"m": {}})
    svc = BatchService(cfg)
    engine = RecordingEngine()
    svc.scheduler.engines["m"] = engine  # type: ignore[assignment]
    svc.scheduler._engine = lambda model: engine  # type: ignore[method-assign]
    return svc, engine


def test_attempts_survive_a_server_restart_a_batch_whose_job_failed_twice_fails_after_one_more(tmp_path):
    from tokenmill.jobs.serve.scheduler import MAX_ATTEMPTS

    assert MAX_ATTEMPTS == 3
    svc, engine = _service(tmp_path)
    src = tmp_path / "in.jsonl"
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    src.write_text(json.dumps({"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": body}) + "\n")
    f = svc.add_file("k", "in.jsonl", "batch", str(src), src.stat().st_size, 1)
    b = svc.create_batch("k", f["id"], "/v1/chat/completions", "24h", {"priority": "2"})["id"]
    svc.scheduler.tick()
    for _ in range(2):  # its job fails twice: run again each time
        assert engine.running == b
        svc.scheduler.on_engine("m", Launched(b, "failed", "job failed: boom", raised=True))
        svc.scheduler.tick()
    assert engine.launched == [b] * 3 and batch_status(svc.batches.get(b)) == "in_progress"
    job = S.JobStore(svc.eng).get(b)
    assert (job["attempts"], job["priority"], job["api_key"]) == (2, 2, "k")  # the queue's row says it

    again, engine = _service(tmp_path)  # the server restarted: one more attempt, not three
    again.scheduler.tick()
    assert engine.launched == [b]
    again.scheduler.on_engine("m", Launched(b, "failed", "job failed: boom", raised=True))
    again.scheduler.tick()
    row = again.batches.get(b)
    assert batch_status(row) == "failed" and engine.launched == [b]
    assert f"failed {MAX_ATTEMPTS} times; last: job failed: boom" in row["errors"][0]["message"]
