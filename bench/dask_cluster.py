"""A `dask.distributed` cluster on loopback, for the DaskRunner tests (the fixture in
tests/dask_cluster.py) and the scale benchmark's Dask drills: one scheduler and worker
processes (`--nworkers 1 --nthreads 1` each, under a nanny), started as subprocesses with
the CPU runtime environment (tcmalloc, OpenMP) and always stopped afterwards.

Each process runs in a session of its own, so stopping it (SIGTERM, then SIGKILL of the
process group) also ends what it started: a worker's engine-core processes, and under a
nanny the worker process itself.

    cluster = start_cluster(Path("logs"))
    try:
        opts = cluster.options()  # ["--dask_client_address=tcp://127.0.0.1:PORT"]
    finally:
        cluster.stop()
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
START_TIMEOUT_S = 120


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


#: A worker under a nanny is a daemon process by default, and a daemon process may not
#: start children: vLLM's engine core would fail with "daemonic processes are not allowed
#: to have children".
#: Spilling stays on (a memory limit), but dask never pauses or restarts a worker over its
#: memory: the engine's KV cache is allocated up front and is no leak to act on.
#: Dask's statistical profiler is off: sampling every thread's stack every 10 ms, a worker keeps a
#: profile per task and one per second for its last 1,000 seconds (`distributed.admin.low-level-log-length`),
#: so its memory grew with the job's wall (tracemalloc: `distributed/profile.py` the largest growth;
#: docs/BENCHMARKS.md, "Ten million rows").
#: The scheduler and the workers keep their last 50 transitions and events, not dask's 1,000
#: (`distributed.admin.low-level-log-length`): a worker's log filled over the first ~170,000 rows of a
#: job, and its entries, small objects made between a unit's short-lived ones, kept pymalloc's 1 MiB
#: arenas from being freed, so the arenas a worker held grew with the job's length until the log was
#: full.  With 50 they stayed flat; the worker's peak RSS still varies from run to run
#: (docs/BENCHMARKS.md, "The Dask worker again").
CLUSTER_ENV = {"DASK_DISTRIBUTED__ADMIN__LOW_LEVEL_LOG_LENGTH": "50"}
WORKER_ENV = {**CLUSTER_ENV,
              "DASK_DISTRIBUTED__WORKER__DAEMON": "False",
              "DASK_DISTRIBUTED__WORKER__MEMORY__PAUSE": "False",
              "DASK_DISTRIBUTED__WORKER__MEMORY__TERMINATE": "False",
              "DASK_DISTRIBUTED__WORKER__PROFILE__ENABLED": "False"}


def _spawn(args: list[str], log: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    # Every process goes through envexec (tcmalloc, OpenMP binding), as `tokenmill run` does.
    env = {**os.environ, **(env or {}), "PYTHONUNBUFFERED": "1"}
    with open(log, "wb") as fh:
        return subprocess.Popen(
            [sys.executable, "-m", "tokenmill.jobs.lifecycle.envexec", sys.executable, *args],
            cwd=ROOT, env=env, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True,
        )


def stop_process(proc: subprocess.Popen, timeout: float = 30) -> None:
    """SIGTERM the process's group (its session), then SIGKILL if it lingers."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pass
    try:  # children left in the group (an engine core whose parent died) go too
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


@dataclass
class DaskCluster:
    address: str
    scheduler: subprocess.Popen
    workers: list[subprocess.Popen] = field(default_factory=list)
    logs: Path | None = None

    def options(self) -> list[str]:
        """The Beam flags that point the DaskRunner at this scheduler."""
        return [f"--dask_client_address={self.address}"]

    def worker_pids(self) -> dict[str, int]:
        """Dask worker name → pid of the process that runs its tasks (asked of the scheduler)."""
        from distributed import Client

        with Client(self.address, timeout=30) as c:
            names = {addr: w["name"] for addr, w in c.scheduler_info(n_workers=-1)["workers"].items()}
            return {names[addr]: pid for addr, pid in c.run(os.getpid).items()}

    def tail(self, n: int = 3000) -> str:
        """The end of every process's log, for a failure message."""
        if not self.logs:
            return ""
        return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-n:]}" for p in sorted(self.logs.glob("*.log")))

    def stop(self) -> None:
        for w in self.workers:
            stop_process(w)
        stop_process(self.scheduler)


def start_cluster(logs: Path, n_workers: int = 2, nanny: bool = True, env: dict[str, str] | None = None) -> DaskCluster:
    """A scheduler on 127.0.0.1 and `n_workers` worker processes of one thread each, with `env`
    over this process's environment (a benchmark's plugins on PYTHONPATH).

    Each worker's memory limit is the machine's memory over the workers (a fraction), so
    dask spills held results to disk past its `spill` share, but never pauses or restarts a
    worker (WORKER_ENV): an engine's KV cache is allocated up front.  Under a
    nanny the worker must not be a daemon process (`distributed.worker.daemon`), since
    vLLM starts its engine core as a child process."""
    logs.mkdir(parents=True, exist_ok=True)
    port = free_port()
    address = f"tcp://127.0.0.1:{port}"
    sched = _spawn(["-m", "distributed.cli.dask_scheduler", "--host", "127.0.0.1", "--port", str(port),
                    "--no-dashboard"], logs / "scheduler.log", {**(env or {}), **CLUSTER_ENV})
    cluster = DaskCluster(address=address, scheduler=sched, logs=logs)
    try:
        deadline = time.time() + START_TIMEOUT_S
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if sched.poll() is not None or time.time() > deadline:
                    raise RuntimeError(f"dask scheduler did not start:\n{cluster.tail()}") from None
                time.sleep(0.2)
        for i in range(n_workers):
            cluster.workers.append(_spawn(
                ["-m", "distributed.cli.dask_worker", address, "--name", f"w{i}", "--host", "127.0.0.1",
                 "--nworkers", "1", "--nthreads", "1", "--memory-limit", f"{1 / n_workers:.3f}", "--no-dashboard",
                 "--nanny" if nanny else "--no-nanny"],
                logs / f"worker-{i}.log", {**(env or {}), **WORKER_ENV}))
        if n_workers:
            from distributed import Client

            with Client(address, timeout=30) as c:
                c.wait_for_workers(n_workers, timeout=START_TIMEOUT_S)
    except BaseException:
        cluster.stop()
        raise
    return cluster
