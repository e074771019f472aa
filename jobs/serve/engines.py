"""One engine process per served model: it runs that model's batches one after another, each
a job through `runner.run_job` (the lifecycle `tokenmill run` uses), and keeps the engine
loaded between them (the engine registry holds one session per process), so a batch of a
few lines costs about its generation time.  An engine idle for `idle_unload_s` is shut
down; the process stays and loads it again for the next batch.

The process leaves as soon as the server that started it is gone (its parent pid changes),
and the engine's own processes follow it (transforms/engines/executors.py): a `kill -9` of
the server leaves nothing running, and the restarted server resumes the batch's job."""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import threading
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, Callable

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


def engine_main(model: str, conn: Connection, owner: int, idle_unload_s: float, log_path: str) -> None:
    """The engine process: receives (batch id, job spec as a dict, database URL), answers
    ("done", batch id, status, note), ("busy", batch id, message) where another live process
    still holds the job, or ("error", batch id, message); says ("loaded", bool) when its engine
    is loaded or unloaded."""
    _leave_with_owner(owner)
    Path(log_path).parent.mkdir(parents=True, exist_ok=True)
    logging.basicConfig(filename=log_path, level=logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from tokenmill.jobs.lifecycle.runner import run_job
    from tokenmill.schemas import storage as S
    from tokenmill.schemas.config import load_spec
    from tokenmill.schemas.errors import first_line
    from tokenmill.transforms.engines import registry

    loaded = False
    while True:
        if not conn.poll(idle_unload_s if loaded else None):
            registry.shutdown_all()  # idle: free the engine's memory; the next batch loads it again
            loaded = False
            conn.send(("loaded", False))
            continue
        msg = conn.recv()
        if msg is None:
            break
        batch_id, spec, db_url = msg
        try:
            res = run_job(load_spec(spec, source=f"batch {batch_id}"), db_url=db_url)
            conn.send(("done", batch_id, res.status, res.note))
        except S.JobBusy as err:  # the job's last owner is still alive (a server restarted at once): not a failure
            conn.send(("busy", batch_id, first_line(err, 1000)))
        except Exception as err:
            log.exception("batch %s", batch_id)
            conn.send(("error", batch_id, first_line(err, 1000)))
        loaded = bool(registry.sessions())
        conn.send(("loaded", loaded))
    registry.shutdown_all()


@dataclass
class EngineProcess:
    """The server's handle on one model's engine process: what it runs now, whether its engine
    is loaded; `on_message(model, message)` is called from a reader thread for each answer,
    and with ("died", batch id or None) when the process is gone."""

    model: str
    idle_unload_s: float
    log_path: str
    on_message: Callable[[str, tuple], None]
    running: str | None = None
    loaded: bool = False
    proc: Any = None
    conn: Connection | None = None
    started_at: float = field(default_factory=time.time)

    def start(self) -> None:
        ctx = mp.get_context("spawn")
        parent, child = ctx.Pipe()
        self.proc = ctx.Process(target=engine_main, name=f"tokenmill-engine-{self.model}", daemon=False,
                                args=(self.model, child, os.getpid(), self.idle_unload_s, self.log_path))
        self.proc.start()
        child.close()
        self.conn, self.loaded, self.running = parent, False, None
        threading.Thread(target=self._read, args=(parent,), daemon=True, name=f"tokenmill-read-{self.model}").start()

    def alive(self) -> bool:
        return self.proc is not None and self.proc.is_alive()

    def submit(self, batch_id: str, spec: dict[str, Any], db_url: str) -> bool:
        """Hand the process a batch; False when it is gone (it died since `alive()` said
        otherwise, and its reader has already reported it): then it is stopped, and the batch
        stays queued for the process the next tick starts."""
        assert self.conn is not None
        self.running = batch_id  # before the send: the answer may come back before it returns
        try:
            self.conn.send((batch_id, spec, db_url))
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
                self.on_message(self.model, ("died", self.running))
                return
            if msg[0] == "loaded":
                self.loaded = bool(msg[1])
            self.on_message(self.model, msg)

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
