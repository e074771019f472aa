"""Several real `tokenmill serve` replicas as one service (issue 54), for tests/test_serve_replicas.py
and bench/replicas.py alike.

- One fresh PostgreSQL database per `fresh_database()` (created, then dropped with whatever is
  still connected to it), one shared files folder, one webhook key file: what replicas share.
- Each replica is a `tokenmill serve` subprocess on its own loopback port (port 0: the one it
  says it listens on), in its own process session, with its own home (`TOKENMILL_HOME`: its
  logs and records) and its own `work` folder: a replica stands for a machine, and those are a
  machine's local disk.  The models folder is the test process's own (the stand-in reads only
  the bundled model's tokenizer).  Everything else of the config is the same for all.
- The engine is bench/standin.py through its entry point on PYTHONPATH (`plugin_env`), so no
  product code names it; with `step_s` it sleeps each step, and every replica's engine
  processes log what they generate to one folder (TOKENMILL_STANDIN_LOG, `generated()`).
- A signal goes to the replica's whole process group (`kill9`, `freeze`, `thaw`): a replica's
  death or a frozen VM takes its engine process with it, and the engine process is the lease
  holder.  `term` sends SIGTERM to the server alone, as `docker stop` and a spot notice handler
  do; the server drains its engines.
- Keys are made once with the real `tokenmill keys create`; every client is the `openai` SDK.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import time
import uuid
from collections import Counter
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import openai

from bench import standin
from tests.serve_server import ROOT, Server, chat_line, jsonl

#: The PostgreSQL server the tests already use (tests/conftest.py's PG_URL): its `test`
#: database is only where CREATE DATABASE is said.
PG_URL = os.environ.get("TOKENMILL_TEST_PG_URL", "postgresql://postgres@127.0.0.1:5432/test")
MODEL = "smollm2-135m"
#: Statuses a batch does not leave.
ENDED = ("completed", "failed", "cancelled", "expired")


@contextmanager
def fresh_database(prefix: str = "tm_replicas") -> Iterator[str]:
    """A new database on the tests' PostgreSQL server, its URL; dropped afterwards (WITH FORCE:
    a replica killed mid-transaction may still hold a connection)."""
    from sqlalchemy import create_engine, make_url, text

    name = f"{prefix}_{uuid.uuid4().hex[:10]}"
    admin = create_engine(PG_URL, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    url = make_url(PG_URL).set(database=name).render_as_string(hide_password=False)
    try:
        yield url
    finally:
        from tokenmill.schemas import db as D

        eng = D._ENGINES.pop(url, None)
        if eng is not None:
            eng.dispose()
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


def standin_model(*, step_s: float, max_num_seqs: int, max_tokens: int = 4, **keys: Any) -> dict[str, Any]:
    """A served model's keys that run it on the stand-in engine (`step_s` asleep per step)."""
    return {"engine": {"kind": standin.KIND, "step_s": step_s, "max_num_seqs": max_num_seqs},
            "sampling": {"max_tokens": max_tokens}, **keys}


def lines(n: int, prefix: str, *, max_tokens: int = 4) -> list[dict[str, Any]]:
    """N chat lines, each with its own prompt (its custom_id in it), so the stand-in's log tells
    one line's generations from another's."""
    return [chat_line(f"{prefix}-{i:05d}", f"line {prefix}-{i:05d}", model=MODEL, max_tokens=max_tokens)
            for i in range(n)]


def replica_env(root: Path) -> dict[str, str]:
    """The environment of a replica under `root`: the stand-in's entry point on PYTHONPATH, its
    generation log in `root/generated`, this process's models folder (each replica's home is
    its own, `Replicas._replica`)."""
    from tokenmill.schemas.model_home import models_dir

    env = standin.plugin_env(root / "plugin", ROOT)
    env[standin.LOG_ENV] = str(root / "generated")
    env["TOKENMILL_MODELS"] = str(models_dir())
    return env


class Replica(Server):
    """One `tokenmill serve` of the service, in its own process session."""

    def __init__(self, root: Path, config: dict[str, Any], env: dict[str, str], index: int):
        root.mkdir(parents=True, exist_ok=True)
        super().__init__(root, config, {**env, "TOKENMILL_HOME": str(root / "home")})  # its machine's home
        self.index = index
        self.frozen = False

    def start(self, timeout: float = 120.0) -> "Replica":
        self.launch()
        self.wait_ready(timeout)
        return self

    def launch(self, **popen: Any) -> "Replica":
        super().launch(start_new_session=True, **popen)
        return self

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def pids(self) -> set[int]:
        """The server's pid and its descendants' (its engine processes: the lease holders)."""
        import psutil

        if not self.alive():
            return set()
        assert self.proc is not None
        try:
            me = psutil.Process(self.proc.pid)
            return {me.pid, *(p.pid for p in me.children(recursive=True))}
        except psutil.NoSuchProcess:
            return set()

    def _group(self, sig: int) -> None:
        assert self.proc is not None
        try:
            os.killpg(self.proc.pid, sig)  # its own session: the group id is its pid
        except ProcessLookupError:
            pass

    def kill9(self) -> None:
        """kill -9 of the replica: the server and its engine processes at once."""
        self._group(signal.SIGKILL)
        assert self.proc is not None
        self.proc.wait(30)

    def freeze(self) -> None:
        """SIGSTOP the whole replica (a VM paused, a process stalled past its lease)."""
        self._group(signal.SIGSTOP)
        self.frozen = True

    def thaw(self) -> None:
        self._group(signal.SIGCONT)
        self.frozen = False

    def term(self, timeout: float) -> tuple[int | None, float]:
        """SIGTERM to the server (a preemption notice): its exit code (None: still running after
        `timeout`) and the seconds it took."""
        assert self.proc is not None
        t0 = time.monotonic()
        self.proc.send_signal(signal.SIGTERM)
        try:
            rc: int | None = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            rc = None
        return rc, time.monotonic() - t0

    def restart(self, timeout: float = 120.0) -> "Replica":
        return self.start(timeout)

    def stop(self) -> None:
        if self.alive():
            self.thaw()  # a frozen replica cannot stop
        super().stop()
        if self.proc is not None:
            self._group(signal.SIGKILL)  # anything of it left behind


class Replicas:
    """N replicas with one config over the database `db_url`, under `root`."""

    def __init__(self, root: Path, n: int, db_url: str, models: dict[str, dict[str, Any]], **config: Any):
        self.root = root
        self.db_url = db_url
        self.files = root / "files"
        self.generated_dir = root / "generated"
        self.config = {"db": db_url, "files": str(self.files), "models": models,
                       "webhooks": {"secret_key_file": str(root / "webhook-secrets.key")}, **config}
        env = replica_env(root)
        self.replicas = [self._replica(i, env) for i in range(n)]
        self._key: str | None = None

    def _replica(self, i: int, env: dict[str, str]) -> Replica:
        root = self.root / f"r{i}"
        cfg = {**self.config, "work": str(root / "runs")}
        return Replica(root, cfg, env, i)

    def __getitem__(self, i: int) -> Replica:
        return self.replicas[i]

    def __len__(self) -> int:
        return len(self.replicas)

    def start(self, timeout: float = 180.0) -> "Replicas":
        """Start every replica at once; return when each answers /health."""
        for r in self.replicas:
            r.launch()
        for r in self.replicas:
            r.wait_ready(timeout)
        return self

    def stop(self) -> None:
        for r in self.replicas:
            r.stop()

    def __enter__(self) -> "Replicas":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    # ---------------------------------------------------------------- clients

    @property
    def key(self) -> str:
        """One key, made once with `tokenmill keys create` (any replica's config: the database)."""
        if self._key is None:
            self._key = self.replicas[0].make_key("replicas")["key"]
        return self._key

    def live(self) -> list[Replica]:
        """The replicas a load balancer would send to: running, answering, not frozen."""
        return [r for r in self.replicas if r.alive() and r.base_url and not r.frozen]

    def client(self, i: int | None = None, **kw: Any) -> openai.OpenAI:
        """The `openai` SDK on replica `i`, or on a live one chosen at random (a load balancer)."""
        r = self.replicas[i] if i is not None else random.choice(self.live())
        return r.client(self.key, **kw)

    def _any(self, call, tries: int = 60) -> Any:
        """`call(client)` on a live replica; another one when the one asked dies meanwhile."""
        for _ in range(tries):
            live = self.live()
            if live:
                try:
                    return call(random.choice(live).client(self.key, timeout=30))
                except (openai.APIConnectionError, openai.InternalServerError):
                    pass
            time.sleep(0.5)
        raise AssertionError(f"no replica answered in {tries} tries")

    def upload(self, batch_lines: list[dict[str, Any]], name: str = "batch.jsonl", i: int | None = None) -> str:
        path = jsonl(self.root / name, batch_lines)

        def up(c: openai.OpenAI) -> str:
            with open(path, "rb") as fh:
                return c.files.create(file=fh, purpose="batch").id
        return up(self.client(i)) if i is not None else self._any(up)

    def create(self, file_id: str, i: int | None = None) -> str:
        def make(c: openai.OpenAI) -> str:
            return c.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h").id
        return make(self.client(i)) if i is not None else self._any(make)

    def submit(self, batch_lines: list[dict[str, Any]], name: str = "batch.jsonl", i: int | None = None) -> str:
        """Upload `batch_lines` and create their batch (through replica `i`, or any): its id."""
        return self.create(self.upload(batch_lines, name, i), i)

    def retrieve(self, batch_id: str) -> Any:
        return self._any(lambda c: c.batches.retrieve(batch_id))

    def wait(self, batch_id: str, timeout: float = 600, until=None, every: float = 0.3) -> Any:
        """Poll the batch through whichever replicas are alive until it has ended (or `until(b)`)."""
        deadline = time.time() + timeout
        while True:
            b = self.retrieve(batch_id)
            if b.status in ENDED or (until is not None and until(b)):
                return b
            if time.time() > deadline:
                raise AssertionError(f"batch {batch_id} still {b.status} after {timeout} s: {b}")
            time.sleep(every)

    def read(self, file_id: str | None) -> list[dict[str, Any]]:
        if file_id is None:
            return []
        text = self._any(lambda c: c.files.content(file_id).text)
        return [json.loads(x) for x in text.splitlines() if x.strip()]

    def outputs(self, batch: Any) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        """The batch's output and error files' lines."""
        return self.read(batch.output_file_id), self.read(batch.error_file_id)

    # ---------------------------------------------------------------- the database and the engines' side

    def engine(self):
        from tokenmill.schemas import storage as S

        return S.connect(self.db_url)

    def holders(self, job_id: str) -> dict[str, int]:
        """Units done per holder (`LeaseStore.holders`)."""
        from tokenmill.schemas import storage as S

        return S.LeaseStore(self.engine()).holders(job_id)

    def lease_state(self, job_id: str) -> dict[str, Any]:
        from tokenmill.schemas import storage as S

        return S.LeaseStore(self.engine()).state(job_id)

    def held(self, job_id: str) -> list[dict[str, Any]]:
        """The job's units held now under a live lease: unit, holder, epoch, expires_at."""
        from sqlalchemy import select

        from tokenmill.schemas import tables as T

        c = T.unit_leases.c
        q = select(c.unit, c.holder, c.epoch, c.expires_at).where(
            c.job_id == job_id, c.done_at.is_(None), c.holder.is_not(None), c.expires_at > time.time())
        with self.engine().connect() as conn:
            return [dict(r._mapping) for r in conn.execute(q)]

    def replica_of(self, holder: str) -> int | None:
        """Which replica a lease holder (`host:pid`, an engine process) belongs to."""
        pid = int(holder.rsplit(":", 1)[1])
        return next((r.index for r in self.replicas if pid in r.pids()), None)

    def generated(self) -> list[dict[str, Any]]:
        """Every request the replicas' stand-in engines answered (bench/standin.py's log)."""
        return standin.read_log(self.generated_dir) if self.generated_dir.exists() else []

    def generations(self) -> Counter:
        """Generations per prompt so far (subtract an earlier count: what a batch since generated)."""
        return Counter(g["digest"] for g in self.generated())

    def wait_holding(self, job_id: str, timeout: float = 60, exclude: int | None = None) -> tuple[dict[str, Any], int]:
        """The first unit of the job held under a live lease by a replica (other than `exclude`),
        and that replica's index; AssertionError when none is within `timeout`."""
        deadline = time.time() + timeout
        while time.time() < deadline:
            for h in self.held(job_id):
                i = self.replica_of(h["holder"])
                if i is not None and i != exclude:
                    return h, i
            time.sleep(0.1)
        raise AssertionError(f"no replica held a unit of {job_id} within {timeout} s: {self.lease_state(job_id)}")


def twice(generations: Counter) -> int:
    """Generations beyond each prompt's first: lines an engine generated again."""
    return sum(n - 1 for n in generations.values() if n > 1)


def accounting(batch: Any, out: list[dict[str, Any]], err: list[dict[str, Any]], custom_ids: list[str]) -> list[str]:
    """What is wrong with a batch's files against its input (empty: nothing): each custom_id in
    exactly one of the output and error files, request_counts adding up to them, and `usage`
    the sum over the output lines."""
    problems = []
    seen = Counter(x["custom_id"] for x in out + err)
    twice = sorted(c for c, n in seen.items() if n > 1)
    missing = sorted(set(custom_ids) - set(seen))
    extra = sorted(set(seen) - set(custom_ids))
    if twice or missing or extra:
        problems.append(f"custom_ids twice {twice[:5]} ({len(twice)}), missing {missing[:5]} ({len(missing)}), "
                        f"unknown {extra[:5]} ({len(extra)})")
    rc = batch.request_counts
    if (rc.total, rc.completed, rc.failed) != (len(custom_ids), len(out), len(err)):
        problems.append(f"request_counts {rc} against {len(custom_ids)} lines, {len(out)} output, {len(err)} errors")
    used = Counter()
    for x in out:
        u = (x.get("response") or {}).get("body", {}).get("usage") or {}
        used["input_tokens"] += u.get("prompt_tokens", 0)
        used["output_tokens"] += u.get("completion_tokens", 0)
    got = batch.usage
    if got is None or (got.input_tokens, got.output_tokens) != (used["input_tokens"], used["output_tokens"]):
        problems.append(f"usage {got} against the output lines' {dict(used)}")
    return problems
