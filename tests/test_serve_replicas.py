"""`tokenmill serve` as one replica of several (issue 54): the registry (`replicas`), SQLite's
refusal of a second live replica before it binds its port, a killed replica's row that does not
block a restart, and SIGTERM's drain ending in exit 0 with the row stopped.  One real server
per module (the bundled model's engine is never started: no batch runs here)."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import time

import httpx
import pytest

from tests.conftest import TEST_ENGINE
from tests.serve_server import ROOT, Server
from tokenmill.schemas import storage as S
from tokenmill.schemas.storage.replicas import STALE_S

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
    assert server.proc is not None
    t0 = time.monotonic()
    server.proc.send_signal(signal.SIGTERM)
    code = server.proc.wait(30)
    took = time.monotonic() - t0
    assert code == 0, server.tail()
    assert took < 10, f"an idle server took {took:.1f} s to drain"
    row = S.ReplicaStore(S.connect(server.config["db"])).get(me)
    assert row["stopped_at"] is not None and row["draining"], row
    assert not S.ReplicaStore(S.connect(server.config["db"])).live()
