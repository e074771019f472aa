"""`tokenmill serve` as one replica of several (issue 54): the registry (`replicas`), SQLite's
refusal of a second live replica before it binds its port, a killed replica's row that does not
block a restart, and SIGTERM's drain ending in exit 0 with the row stopped (one real server
for the module; the bundled model's engine is never started: no batch runs here); and two
replicas' threads over one PostgreSQL ending a batch once and sending each webhook once."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import threading
import time

import httpx
import pytest

from tests.conftest import TEST_ENGINE
from tests.serve_server import ROOT, Server
from tokenmill.schemas import storage as S
from tokenmill.schemas.storage.replicas import STALE_S
from tokenmill.schemas.wire.openai.objects import batch_status

REPLICA = re.compile(r"tokenmill serve: http://\S+/v1 \(.*; (replica_[0-9a-f]+)\)")


def _row(replica_id: str, **kw):
    now = time.time()
    return {"id": replica_id, "host": socket.gethostname(), "pid": os.getpid(), "url": None, "started_at": now,
            "seen_at": now, "draining": False, "stopped_at": None, **kw}


def test_the_registry_refuses_a_second_live_replica_only_when_asked_to_be_alone(any_db_url):
    store = S.ReplicaStore(S.connect(any_db_url))
    store.register(_row("r-dead", pid=2**22 + 12345))  # this host, no such process: not live
    store.register(_row("r-stale", host="elsewhere", seen_at=time.time() - STALE_S - 1))
    store.register(_row("r-stopped", host="elsewhere", stopped_at=time.time()))
    store.register(_row("r-1"), alone=True)
    assert [r["id"] for r in store.live()] == ["r-1"]
    with pytest.raises(S.ReplicaLive) as err:
        store.register(_row("r-2"), alone=True)
    assert err.value.live["id"] == "r-1" and store.get("r-2") is None
    store.register(_row("r-2"))  # PostgreSQL's replicas are not alone
    assert len(store.live()) == 2
    store.set("r-1", stopped_at=time.time())
    assert [r["id"] for r in store.live()] == ["r-2"]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("replicas")
    cfg = {"db": f"sqlite:///{root / 'serve.db'}", "files": str(root / "files"), "work": str(root / "runs"),
           "models": {"smollm2-135m": {"engine": dict(TEST_ENGINE)}}, "drain_s": 5}
    srv = Server(root, cfg)
    yield srv
    srv.stop()


def _replica_id(srv: Server) -> str:
    found = REPLICA.findall(srv.tail(100_000))
    assert found, srv.tail()
    return found[-1]


def test_a_second_replica_over_sqlite_is_refused_in_one_line_naming_the_live_one(server):
    server.start()
    live = _replica_id(server)
    store = S.ReplicaStore(S.connect(server.config["db"]))
    assert [r["id"] for r in store.live()] == [live] and store.get(live)["url"] == server.base_url
    second = subprocess.run(server.argv, cwd=ROOT, env=server.env, capture_output=True, text=True, timeout=120)
    assert second.returncode == 1, second.stderr
    said = second.stderr.strip()
    assert "\n" not in said and live in said and server.base_url in said, said
    assert "SQLite" in said and "one writer" in said and "PostgreSQL" in said, said
    assert "tokenmill serve: http://" not in second.stderr  # refused before it bound a port
    admin = server.make_key("admin", admin=True)
    metrics = httpx.get(f"{server.base_url}/metrics", headers={"Authorization": f"Bearer {admin['key']}"}).text
    assert "tokenmill_serve_replicas 1.0" in metrics, metrics


def test_a_killed_replicas_row_does_not_block_a_restart(server):
    killed = _replica_id(server)
    server.kill9()
    server.start()
    store = S.ReplicaStore(S.connect(server.config["db"]))
    assert store.get(killed)["stopped_at"] is None  # never marked: its pid is gone, so not live
    assert [r["id"] for r in store.live()] == [_replica_id(server)] != [killed]


def test_sigterm_drains_an_idle_server_and_exits_0_with_its_row_stopped(server):
    me = _replica_id(server)
    t0 = time.monotonic()
    code = server.drain(30)
    took = time.monotonic() - t0
    assert code == 0, server.tail()
    assert took < 10, f"an idle server took {took:.1f} s to drain"
    row = S.ReplicaStore(S.connect(server.config["db"])).get(me)
    assert row["stopped_at"] is not None and row["draining"], row
    assert not S.ReplicaStore(S.connect(server.config["db"])).live()


# ---------------------------------------------------------------- two replicas' threads over one PostgreSQL


def _line(cid: str) -> bytes:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    return json.dumps({"custom_id": cid, "method": "POST", "url": "/v1/chat/completions", "body": body}).encode()


def _replicas(pg_url: str, tmp_path, n: int = 2):
    """`n` services over one PostgreSQL and one shared files folder, as `n` replicas' would be
    (their engines stand-ins: nothing runs)."""
    from tests.helpers import RecordingEngine
    from tokenmill.jobs.serve.config import ServeConfig
    from tokenmill.jobs.serve.service import BatchService

    out = []
    for i in range(n):
        cfg = ServeConfig(db=pg_url, files=str(tmp_path / "files"), work=str(tmp_path / f"runs{i}"), models={"m": {}})
        svc = BatchService(cfg)
        engine = RecordingEngine()
        engine.running = "busy-elsewhere"  # nothing is dispatched
        svc.scheduler.engines["m"] = engine  # type: ignore[assignment]
        out.append(svc)
    return out


def test_two_replicas_finalizing_one_batch_at_once_end_it_once_and_write_its_files_once(pg_url, tmp_path):
    a, b = _replicas(pg_url, tmp_path)
    src = tmp_path / "in.jsonl"
    src.write_bytes(b"".join(_line(c) + b"\n" for c in ("x", "y", "z")))
    f = a.add_file("k", "in.jsonl", "batch", str(src), src.stat().st_size, 3)
    batch_id = a.create_batch("k", f["id"], "/v1/chat/completions", "24h", None)["id"]
    a.scheduler.tick()  # validated, queued behind the busy engine
    a.cancel_batch("k", batch_id)
    written, both_in = [], threading.Barrier(2)

    def slow(svc):
        real = svc.results.result_files

        def result_files(*args):
            written.append(svc)
            time.sleep(0.5)  # both replicas are inside finalize now
            return real(*args)
        svc.results.result_files = result_files

    for svc in (a, b):
        slow(svc)

    def finalize(svc):
        both_in.wait()
        svc.results.finalize(svc.batches.get(batch_id))

    threads = [threading.Thread(target=finalize, args=(svc,)) for svc in (a, b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert len(written) == 1, "the result files were written by both replicas"
    row = a.batches.get(batch_id)
    assert batch_status(row) == "cancelled" and row["request_counts"] == {"total": 3, "completed": 0, "failed": 3}
    ended = [svc.counters.get(("batches", "m", "cancelled"), 0) for svc in (a, b)]
    assert sorted(ended) == [0, 1]
    with a.blobs.open(row["error_file_id"]) as fh:
        assert sorted(json.loads(x)["custom_id"] for x in fh.read().splitlines()) == ["x", "y", "z"]
    b.results.finalize(row)  # ended: a later call does nothing
    assert len(written) == 1


def test_two_replicas_delivery_loops_send_each_event_once(pg_url):
    from tests.webhook_receiver import Receiver
    from tokenmill.jobs.serve.config import Webhooks
    from tokenmill.jobs.serve.webhooks import WebhookSender, new_secret

    eng = S.connect(pg_url)
    rx = Receiver(delay=0.2)  # a slow receiver: both loops have events due while one is sending
    senders = [WebhookSender(eng, Webhooks(allow_networks=["127.0.0.1/32"])) for _ in range(2)]
    try:
        S.KeyStore(eng).add("key_a", "a", "tm-a", webhook_url=rx.url, webhook_secret=new_secret())
        now = time.time()
        ids = [f"batch_{i}" for i in range(8)]
        for batch_id in ids:
            S.BatchStore(eng).add({"id": batch_id, "owner": "key_a", "endpoint": "/v1/chat/completions",
                                   "input_file_id": "file-x", "completion_window": "24h", "created_at": now,
                                   "expires_at": now + 3600, "in_progress_at": now, "finalizing_at": now})
            assert senders[0].end_batch(S.BatchStore(eng).get(batch_id), "completed", completed_at=time.time())
        for s in senders:
            s.start()
        rx.wait(lambda got: len(got) >= len(ids), timeout=30)
        time.sleep(1.0)  # a second delivery of any of them would come now
        sent = [h["webhook-id"] for h, _, _ in rx.got]
        assert sorted(sent) == sorted(set(sent)) and len(sent) == len(ids), sent
        events = [ev for batch_id in ids for ev in S.WebhookStore(eng).events(batch_id)]
        assert all(ev["delivered_at"] and len(ev["attempt_log"]) == 1 for ev in events), events
    finally:
        for s in senders:
            s.stop()
        rx.close()


class _DrainingEngine:
    """A stand-in for an engine process (jobs/serve/engines.py) whose run ends `run_s` after
    SIGTERM (never, with None), as a shared job's run that takes no new unit would."""

    model = "m"

    def __init__(self, pid: int, run_s: float | None):
        self.proc = type("Proc", (), {"pid": pid})()
        self.running: str | None = "batch_running"
        self.run_s, self.told, self.stopped = run_s, [], []

    def alive(self) -> bool:
        return not self.stopped

    def terminate(self) -> None:
        self.told.append(time.monotonic())
        if self.run_s is not None:
            threading.Timer(self.run_s, lambda: setattr(self, "running", None)).start()

    def stop(self, timeout: float = 30.0) -> None:
        if self.alive():  # as EngineProcess.stop: a process already gone is left as it is
            self.stopped.append((self.running, timeout))


@pytest.mark.parametrize("run_s", [0.3, None])
def test_a_drain_dispatches_nothing_waits_for_the_engines_run_up_to_drain_s_and_hands_back_its_leases(
        tmp_path, run_s):
    from tokenmill.jobs.serve.config import ServeConfig
    from tokenmill.jobs.serve.service import BatchService

    cfg = ServeConfig(db=f"sqlite:///{tmp_path / 's.db'}", files=str(tmp_path / "files"),
                      work=str(tmp_path / "runs"), models={"m": {}}, drain_s=1.5)
    svc = BatchService(cfg)
    engine = _DrainingEngine(2**22 + 777, run_s)
    svc.scheduler.engines["m"] = engine  # type: ignore[assignment]
    leases = S.LeaseStore(svc.eng)
    leases.seed("batch_running", ["u0", "u1"])
    assert leases.take("batch_running", "u0", S.owner_tag(engine.proc.pid), 60)
    svc.start_draining()
    assert svc.scheduler.draining and len(engine.told) == 1
    svc.scheduler._dispatch([{"id": "batch_new", "model": "m", "priority": 0, "created_at": 1.0}])
    assert S.JobStore(svc.eng).get("batch_new") is None  # nothing new starts while draining
    t0 = time.monotonic()
    svc.stop()
    took = time.monotonic() - t0
    assert len(engine.stopped) == 1
    if run_s is not None:
        assert took < 1.2 and engine.stopped[0][0] is None  # stopped once its run ended, not at drain_s
    else:
        assert 1.3 < took < 3 and engine.stopped[0][0] == "batch_running"  # cut off at drain_s
    state = leases.state("batch_running")
    assert (state["held"], state["free"]) == (0, 2)  # u0 handed back: another replica takes it now


def test_an_engine_process_told_sigterm_keeps_running_until_its_server_stops_it(tmp_path):
    from tokenmill.jobs.lifecycle.launchers import ProcessDied
    from tokenmill.jobs.serve.engines import EngineProcess

    said: list = []
    e = EngineProcess("m", 60.0, str(tmp_path / "e.log"), lambda model, msg: said.append(msg))
    e.start()
    try:
        deadline = time.time() + 60
        while not (tmp_path / "e.log").exists():  # made just after its SIGTERM handler is installed
            assert time.time() < deadline and e.alive()
            time.sleep(0.1)
        e.terminate()
        time.sleep(1.0)
        assert e.alive(), "SIGTERM ended the engine process instead of making it drain"
    finally:
        e.stop(timeout=10)
    assert not e.alive() and e.proc.exitcode == 0  # it left when told to, not by the signal
    deadline = time.time() + 5
    while not said and time.time() < deadline:
        time.sleep(0.1)
    assert [type(m) for m in said] == [ProcessDied]
