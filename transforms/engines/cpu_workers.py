"""How many engines a CPU host runs for `workers: auto`, from what its finished jobs measured.

Whether a second worker adds throughput depends on the host: one worker that tokenizes on
every core already keeps most of a 2-core host busy, and a second one then only adds its
own start and shares the cores (docs/BENCHMARKS.md, "Pipeline ceiling").  So each finished
job on this host adds one line to a record under tokenmill's home (`workers.json`), kept per
host kind (CPU model and the cores this process may use), engine kind and model: for each
worker count, the last job's rows per second over its wall and the CPU seconds its
processes used (launcher, workers and their engines), which give the cores one worker kept
busy.  Only jobs of at least `MIN_RECORD_ROWS` rows are kept: a smaller job's wall is mostly
its start.

`auto_workers` reads that record (the faster count when two are known; one worker when one
worker keeps more than half the cores busy, or when nothing is known), and `feed_note` is the
one line an explicit `--workers N` gets when the host's cores cannot feed N workers.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from tokenmill.schemas.model_home import locked_record, read_record, tokenmill_home
from tokenmill.transforms.engines.device import allowed_cores, cpu_model

#: The smallest job whose rate is kept (a smaller one's wall is mostly its start).
MIN_RECORD_ROWS = 10_000
#: Cores one worker is taken to keep busy where no job of this engine and model ran on this
#: host yet: the stated estimate behind `feed_note`'s line.
ESTIMATED_CORES_PER_WORKER = 1.0


@dataclass(frozen=True)
class WorkersRun:
    """One finished job of a worker count on this host: what `auto` compares."""

    workers: int
    rows: int
    wall_s: float
    """The job's wall, from its start to its end (engine loads and export included)."""
    cpu_s: float
    """CPU seconds of the job's processes over that wall (launcher, workers, their engines)."""
    at: str = ""
    """When it finished (UTC, ISO 8601)."""

    @property
    def rows_per_s(self) -> float:
        return self.rows / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def cores_per_worker(self) -> float:
        """The cores one worker kept busy: CPU seconds ÷ wall ÷ workers."""
        return self.cpu_s / self.wall_s / self.workers if self.wall_s > 0 else 0.0


def host_key(kind: str, model: str) -> str:
    """What a record holds for: this CPU's model, the cores this process may use, the engine
    kind and the model as the job names it."""
    return json.dumps({"cpu": cpu_model(), "cores": len(allowed_cores()), "kind": kind, "model": model},
                      sort_keys=True)


def _record_file() -> Path:
    return tokenmill_home() / "workers.json"


def _read() -> dict:
    return read_record(_record_file())


def host_record(kind: str, model: str) -> dict[int, WorkersRun]:
    """This host's last job per worker count for this engine kind and model (empty: none kept)."""
    runs = _read().get(host_key(kind, model)) or {}
    out = {}
    for n, r in runs.items() if isinstance(runs, dict) else ():
        try:
            out[int(n)] = WorkersRun(**r)
        except (TypeError, ValueError):
            continue  # a line of another version of this file: not used
    return out


def remember(kind: str, model: str, run: WorkersRun) -> bool:
    """Keep `run` as this host's last job of its worker count (False: too small to keep).
    One writer at a time (a file lock); the file is replaced whole."""
    if run.rows < MIN_RECORD_ROWS or run.wall_s <= 0 or run.workers < 1:
        return False
    with locked_record(_record_file()) as known:
        known.setdefault(host_key(kind, model), {})[str(run.workers)] = asdict(run)
    return True


def now_utc() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def auto_workers(record: dict[int, WorkersRun], cores: int) -> tuple[int, str]:
    """`workers: auto` on a CPU host with `cores` cores, and why (a phrase for the terminal):

    - two or more worker counts recorded: the one whose last job ran the most rows a second;
    - only one worker recorded: one when it kept more than half the cores busy, else as many
      as the cores hold at its load (at least 2, once, so that the next `auto` compares);
    - only another count recorded: one, so that the next `auto` compares;
    - nothing recorded: one."""
    if len(record) >= 2:
        best = max(record.values(), key=lambda r: r.rows_per_s)
        rates = ", ".join(f"{n} ran {r.rows_per_s:,.0f}" for n, r in sorted(record.items()))
        return best.workers, f"the fastest here for this engine and model (rows/s: {rates})"
    if 1 in record:
        busy = record[1].cores_per_worker
        if busy > cores / 2:
            return 1, f"one worker keeps {busy:.2f} of this host's {cores} cores busy"
        n = max(2, min(cores, int(cores // max(busy, 1e-6))))
        return n, (f"one worker kept {busy:.2f} of this host's {cores} cores busy: {n} tried, "
                   "the next auto compares their rates")
    if record:
        return 1, "one worker not yet measured with this engine and model here: the next auto compares"
    return 1, "no job of this engine and model measured on this host yet"


def feed_note(asked: int, record: dict[int, WorkersRun], cores: int) -> str | None:
    """The one line for an explicit `--workers asked` that this host's cores cannot feed
    (`asked` × the cores one worker keeps busy > `cores`), or None: the cores one worker kept
    busy in the record (one worker's job first, else the fewest workers'), or the stated
    estimate `ESTIMATED_CORES_PER_WORKER`."""
    if asked <= 1:
        return None
    if record:
        run = record[min(record)]
        busy = run.cores_per_worker
        source = f"measured: a {run.rows:,}-row job of {run.workers} worker{'s' if run.workers > 1 else ''} on {run.at[:10]}"
    else:
        busy, source = ESTIMATED_CORES_PER_WORKER, "an estimate: no job of this engine and model measured here"
    if asked * busy <= cores:
        return None
    return (f"warning: {asked} workers need about {asked * busy:.1f} cores at {busy:.2f} cores each ({source}); "
            f"this host has {cores}: they share them and may run no faster than fewer; running {asked} as asked")
