"""One engine process per served model, the warm engine pool's launcher: it runs that model's
batches one after another, each a job through the in-process launcher (the lifecycle
`tokenmill run` uses), and keeps the engine
loaded between them (the engine registry holds one session per process), so a batch of a
few lines costs about its generation time.  An engine idle for `idle_unload_s` is shut
down; the process stays and loads it again for the next batch.

The process leaves as soon as the server that started it is gone (its parent pid changes),
and the engine's own processes follow it (transforms/engines/executors.py): a `kill -9` of
the server leaves nothing running, and the restarted server resumes the batch's job.  A
SIGTERM makes it drain instead (its run takes no new unit of a shared batch, and ends); the
server then stops it."""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import signal
import threading
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, Callable

from tokenmill.jobs.lifecycle.launchers import EngineLoaded, Event, Launched, ProcessDied

log = logging.getLogger(__name__)

#: How often an engine process looks for its server.
OWNER_POLL_S = 0.5


def _leave_with_owner(owner: int) -> None:
    def watch() -> None:
        while True:
            time.sleep(OWNER_POLL_S)
            if os.getppid() != owner:
                os._exit(1)

    threading.Thread(target=watch, daemon=True, name="tokenmill-serve-owner").start()


@dataclass(frozen=True)
class Launch:
    """What the server sends an engine process: run the job `job_id` of this spec."""

    job_id: str
    spec: dict[str, Any]
    db_url: str


def engine_main(model: str, conn: Connection, owner: int, idle_unload_s: float, log_path: str,
                online_conn: Connection | None = None, online: Any = None) -> None:
    """The engine process: receives `Launch`es (None: leave), runs each job here (the
    in-process launcher) and answers its `Launched` (`busy` where another live process still
    holds the job); says `EngineLoaded` when its engine is loaded or unloaded.  With
    `online_conn` and `online` (an `online_engine.OnlineSetup`), it also answers online
    requests on that connection, in the same engine (online_engine.OnlineHost)."""
    _leave_with_owner(owner)
    from tokenmill.transforms.leases import start_draining

    if threading.current_thread() is threading.main_thread():  # its own process (a test may run it in a thread)
        # the replica drains (SIGTERM, a spot notice): the run in progress takes no new unit and
        # ends, its units finished or handed back; the process waits for the server to stop it
        signal.signal(signal.SIGTERM, lambda sig, frame: start_draining())
    Path(log_path).parent.mkdir(parents=True, exist_ok=True)
    logging.basicConfig(filename=log_path, level=logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from tokenmill.jobs.lifecycle.launchers.inprocess import InProcessLauncher
    from tokenmill.transforms.engines import registry

    def report(done: Launched) -> None:
        if done.raised:
            log.error("batch %s", done.job_id, exc_info=done.error)
        conn.send(done.portable())

    here = InProcessLauncher(report)
    host = None
    if online_conn is not None and online is not None:
        from tokenmill.jobs.serve.online_engine import OnlineHost

        host = OnlineHost(model, online_conn, online)
        registry.share_sessions(host.wrap)  # the engine the batches get is shared with online requests
        host.start()
    loaded = False
    while True:
        if not conn.poll(idle_unload_s if loaded or host is not None else None):
            if host is not None and host.active_within(idle_unload_s):
                continue  # online requests keep it warm
            if loaded or registry.sessions():
                registry.shutdown_all()  # idle: free the engine's memory; the next batch loads it again
                conn.send(EngineLoaded(model, False))
            loaded = False
            continue
        msg: Launch | None = conn.recv()
        if msg is None:
            break
        if host is not None:
            host.batch_running = True
        try:
            here.launch(msg.job_id, msg.spec, msg.db_url)
        finally:
            if host is not None:
                host.batch_running = False
        loaded = bool(registry.sessions())
        conn.send(EngineLoaded(model, loaded))
    registry.shutdown_all()


@dataclass
class EngineProcess:
    """The server's handle on one model's engine process (the warm engine pool's launcher):
    what it runs now, whether its engine is loaded; `on_message(model, event)` is called from
    a reader thread for each `Launched` and `EngineLoaded`, and with `ProcessDied` when the
    process is gone."""

    model: str
    idle_unload_s: float
    log_path: str
    on_message: Callable[[str, Event], None]
    running: str | None = None
    loaded: bool = False
    proc: Any = None
    conn: Connection | None = None
    started_at: float = field(default_factory=time.time)
    online: Any = None
    """The process's `online_engine.OnlineSetup` (None: it answers batches only)."""
    on_online: Callable[[str, Any], None] | None = None
    """Called from a reader thread with each online message the process sends (None once it is gone)."""
    online_conn: Connection | None = None
    _online_send: threading.Lock = field(default_factory=threading.Lock)

    def start(self) -> None:
        ctx = mp.get_context("spawn")
        parent, child = ctx.Pipe()
        ours = theirs = None
        if self.online is not None and self.on_online is not None:
            ours, theirs = ctx.Pipe()
        self.proc = ctx.Process(target=engine_main, name=f"tokenmill-engine-{self.model}", daemon=False,
                                args=(self.model, child, os.getpid(), self.idle_unload_s, self.log_path, theirs,
                                      self.online if theirs is not None else None))
        self.proc.start()
        child.close()
        self.conn, self.loaded, self.running = parent, False, None
        threading.Thread(target=self._read, args=(parent,), daemon=True, name=f"tokenmill-read-{self.model}").start()
        if ours is not None and theirs is not None:
            theirs.close()
            self.online_conn = ours
            threading.Thread(target=self._read_online, args=(ours,), daemon=True,
                             name=f"tokenmill-online-{self.model}").start()

    def send_online(self, msg: Any) -> bool:
        """An online message to the process; False when it cannot take it (gone, or no online side)."""
        if self.online_conn is None:
            return False
        with self._online_send:
            try:
                self.online_conn.send(msg)
            except (OSError, ValueError):
                return False
        return True

    def _read_online(self, conn: Connection) -> None:
        assert self.on_online is not None
        while True:
            try:
                msg = conn.recv()
            except (EOFError, OSError):
                self.on_online(self.model, None)
                return
            self.on_online(self.model, msg)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.is_alive()

    def launch(self, batch_id: str, spec: dict[str, Any], db_url: str) -> bool:
        """Hand the process a batch; False when it is gone (it died since `alive()` said
        otherwise, and its reader has already reported it): then it is stopped, and the batch
        stays queued for the process the next tick starts."""
        assert self.conn is not None
        self.running = batch_id  # before the send: the answer may come back before it returns
        try:
            self.conn.send(Launch(batch_id, spec, db_url))
        except OSError:
            self.running = None
            self.stop(timeout=1)
            return False
        return True

    def _read(self, conn: Connection) -> None:
        while True:
            try:
                msg = conn.recv()
            except (EOFError, OSError):
                self.on_message(self.model, ProcessDied(self.model, self.running))
                return
            if isinstance(msg, EngineLoaded):
                self.loaded = msg.loaded
            self.on_message(self.model, msg)

    def terminate(self) -> None:
        """SIGTERM to the process: it drains (takes no new unit) and keeps running its job."""
        if self.alive():
            try:
                os.kill(self.proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass

    def stop(self, timeout: float = 30.0) -> None:
        if self.conn is not None and self.alive():
            try:
                self.conn.send(None)
            except OSError:
                pass
            self.proc.join(timeout)
        if self.alive():
            self.proc.kill()
            self.proc.join(5)
