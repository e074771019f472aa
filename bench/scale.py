"""`make bench-scale`: does the pipeline's memory stay flat and its speed hold as
the input grows, do two workers share the work, and does a job survive losing a
worker or an engine mid-run?  A program, not a timed test: it prints PASS/MISS
per target and writes `bench/results/scale-<stamp>.json` and an RSS-over-time
plot beside it.

    python -m bench.scale                          # default N; ~20 min on a quiet 2-core CPU
    python -m bench.scale --n 2000 --skip-drills   # shorter
    python -m bench.scale --sizes 2000,20000 --skip-drills --json bench/results/scale-before.json
    python -m bench.scale --sizes 2000,20000 --skip-two-workers --skip-drills --runner dask

The engine is real vLLM with a tiny random-weight model (bench/tinymodel.py:
the default model's tokenizer and chat template, 2 layers of width 64), so the
pipeline, not the model, is what is measured.  The input follows the bundled
sample's distribution (bench/datasets.sample_chat_rows: the same shared system
prompts and prompt lengths), `max_tokens` 4 with `ignore_eos`, one row in
BAD_EVERY with a null prompt and one in DUP_EVERY repeating the previous row's
id (both dead-letter sinks), written as several Parquet files of several row
groups.

Runs, each a `tokenmill run` subprocess on a fresh SQLite database:
  1. N rows, 1 worker        2. 10 N rows, 1 worker        3. N rows, 2 workers
(1 and 2, the sized runs, on the DaskRunner instead with `--runner dask`: a loopback
cluster of 2 workers per run, started before it and stopped after it)
then the drills on 10 N rows with 2 workers, on each runner of RUNNERS (the
DirectRunner, then the DaskRunner on a loopback cluster the bench starts and stops
per drill): kill -9 of one worker process (an SDK worker; a dask worker, which its
nanny restarts), and separately of one vLLM engine core, when DRILL_KILL_AT of the
rows are done; a run that fails (or stalls) after the kill is rerun with the same
job id, which resumes.  A sampler reads the RSS of every process in the run's tree
(and the cluster's) every 0.5 s (bench/procs.py tells the launcher, SDK workers,
dask workers, engine cores and their model workers apart).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections import Counter, defaultdict
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, ContextManager, Iterator

from bench.common import RESULTS, ROOT, WORK, log, machine, utc_now, utc_stamp
from bench.procs import MAIN_KINDS, MiB, ProcessSampler

DEFAULT_N = 10_000
MAX_TOKENS = 4
BAD_EVERY = 100  # row i with i % BAD_EVERY == BAD_EVERY - 1: null messages → `empty_prompt`
DUP_EVERY = 500  # row i with i % DUP_EVERY == DUP_EVERY // 2: the previous row's id → `duplicate_id`
FILES = 4
ROW_GROUP_MAX = 2000  # each file is cut into equal row groups of at most this many rows
SAMPLE_SEED = 7  # the seed that made data/sample_prompts.parquet
ENGINE = {"max_num_seqs": 256, "max_model_len": 2048, "kv_cache_memory_bytes": 256 * MiB}
DRILL_KILL_AT = 0.4  # share of the rows in the database when the process is killed
EXIT_OK = (0, 3)  # succeeded, partial (the planted dead letters)

# targets (printed as PASS / MISS, never asserted)
RSS_GROWTH_MAX = 1.25
RATE_KEEP_MIN = 0.9
WORKER_WALL_SPREAD_MAX = 1.15


@dataclass(frozen=True)
class Attached:
    """What a runner's cluster gives the runs on it: the `tokenmill run` flags that point
    at it, and its processes (sampled beside the launcher's tree: its workers are not the
    launcher's children)."""

    args: tuple[str, ...] = ()
    pids: tuple[int, ...] = ()


@dataclass(frozen=True)
class Runner:
    """How a job is run: its `tokenmill run` flags, which process kind is one of its workers
    (the drills kill one), and what must run beside `tokenmill run` (`cluster`: a context
    manager that starts it in a folder and stops it).  A drill on another runner is a new
    entry in RUNNERS."""

    name: str
    args: tuple[str, ...]
    worker_kind: str = "sdk_worker"
    cluster: Callable[[Path], ContextManager[Attached]] | None = None
    #: the process kinds whose peak RSS the sized runs' targets compare and the table shows
    kinds: tuple[str, ...] = MAIN_KINDS


@contextmanager
def dask_cluster(folder: Path) -> Iterator[Attached]:
    """A loopback dask scheduler and two worker processes under nannies, for one drill
    (its engines start with the drill, and a killed worker's orphans go with the cluster)."""
    from bench.dask_cluster import start_cluster

    cluster = start_cluster(folder / "dask-logs", n_workers=2)
    try:
        yield Attached(tuple(f"--pipeline-option={o}" for o in cluster.options()),
                       (cluster.scheduler.pid, *(w.pid for w in cluster.workers)))
    finally:
        cluster.stop()


ONE_WORKER = Runner("direct-1", ("--workers", "1"), worker_kind="launcher")
RUNNERS = {
    "direct": Runner("direct-2", ("--workers", "2")),
    # the nanny restarts a killed worker process; the engine core is the worker's child
    "dask": Runner("dask-2", ("--runner", "DaskRunner", "--workers", "2"), worker_kind="dask_worker",
                   cluster=dask_cluster,
                   kinds=("launcher", "dask_scheduler", "dask_worker", "engine_core", "engine_worker")),
}
#: `--runner`: what the sized runs (N and 10 N rows) run on
SIZED_RUNNERS = {"direct-1": ONE_WORKER, "dask": RUNNERS["dask"]}


def sized_name(rows: int, runner: Runner) -> str:
    """A sized run's name (its folder and job id): `<rows>-rows-1-worker` on ONE_WORKER, as
    before there was a choice, else `<rows>-rows-<runner>`."""
    return f"{rows}-rows-1-worker" if runner is ONE_WORKER else f"{rows}-rows-{runner.name}"


def attach(runner: Runner, folder: Path) -> ContextManager[Attached]:
    """The runner's cluster, started in `folder` on entry and stopped on exit; nothing to
    attach for a runner without one."""
    folder.mkdir(parents=True, exist_ok=True)
    return runner.cluster(folder) if runner.cluster else nullcontext(Attached())


# ---------------------------------------------------------------- input


def _input_rows(rows: int, seed: int, planted: Counter) -> Iterator[dict[str, Any]]:
    """make_input's rows one at a time: bench.datasets' rows with ids `r<i>`, no
    `max_tokens`, and the planted bad rows and duplicate ids (counted into `planted`)."""
    from bench.datasets import iter_chat_rows

    prev_id = None
    for i, r in enumerate(iter_chat_rows(rows, seed=seed)):
        r.pop("max_tokens")  # the job's max_tokens holds for every row
        r["id"] = f"r{i:07d}"
        if i % BAD_EVERY == BAD_EVERY - 1:
            r["messages"] = None
            planted["empty_prompt"] += 1
        elif i % DUP_EVERY == DUP_EVERY // 2 and i:
            r["id"] = prev_id
            planted["duplicate_id"] += 1
        prev_id = r["id"]
        yield r


def make_input(rows: int, seed: int = SAMPLE_SEED, root: Path = WORK / "scale") -> dict[str, Any]:
    """`rows` rows as FILES Parquet files, each cut into equal row groups of at most
    ROW_GROUP_MAX rows (equal work units for the workers); cached by shape and seed.
    Streamed: one row group's rows are in memory at a time, at any `rows`."""
    from itertools import islice

    import pyarrow as pa
    import pyarrow.parquet as pq

    folder = root / f"input-{rows}-{seed}"
    meta_path = folder / "INPUT.json"
    per_file = -(-rows // FILES)
    group = -(-per_file // -(-per_file // ROW_GROUP_MAX))
    shape = {"rows": rows, "seed": seed, "files": FILES, "row_group_rows": group, "bad_every": BAD_EVERY,
             "dup_every": DUP_EVERY}
    if meta_path.is_file():
        meta = json.loads(meta_path.read_text())
        if all(meta.get(k) == v for k, v in shape.items()):
            return meta
    planted: Counter = Counter()
    stream = _input_rows(rows, seed, planted)
    folder.mkdir(parents=True, exist_ok=True)
    schema = pa.schema([("id", pa.string()), ("messages", pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())])))])
    for k in range(FILES):
        n = max(0, min(per_file, rows - k * per_file))  # the last files may be short, or empty
        with pq.ParquetWriter(folder / f"part-{k:03d}.parquet", schema) as writer:
            if not n:  # as pq.write_table of an empty table: one row group of no rows
                writer.write_table(pa.Table.from_pylist([], schema=schema), row_group_size=group)
            for start in range(0, n, group):
                batch = list(islice(stream, min(group, n - start)))
                writer.write_table(pa.Table.from_pylist(batch, schema=schema), row_group_size=group)
    bad, dups = planted["empty_prompt"], planted["duplicate_id"]
    meta = {"path": str(folder), **shape, "planted": {"empty_prompt": bad, "duplicate_id": dups},
            "distinct_ids": rows - dups}
    meta_path.write_text(json.dumps(meta, indent=1))
    return meta


# ---------------------------------------------------------------- one `tokenmill run`


@dataclass
class Leg:
    """One `tokenmill run` subprocess and what was seen of it."""

    name: str
    rows: int
    runner: Runner
    job_id: str
    folder: Path
    model: str
    attached: Attached = Attached()
    exit_code: int | None = None
    summary: dict[str, Any] = field(default_factory=dict)
    wall_s: float = 0.0
    stalled: bool = False
    sampler: ProcessSampler | None = None
    left_behind: list[str] = field(default_factory=list)
    events: list[dict[str, Any]] = field(default_factory=list)

    @property
    def db_url(self) -> str:
        return f"sqlite:///{self.folder / 'jobs.db'}"

    @property
    def out(self) -> Path:
        return self.folder / "out"

    @property
    def ok(self) -> bool:
        return self.exit_code in EXIT_OK and not self.stalled


def engine_spec(folder: Path) -> Path:
    """The engine options the CLI has no flag for, as a job spec file."""
    import yaml

    path = folder / "engine.yaml"
    path.write_text(yaml.safe_dump({"engine": ENGINE}))
    return path


def done_rows(db_url: str, job_id: str) -> int:
    from sqlalchemy.engine import make_url

    from tokenmill.schemas import storage as S

    u = make_url(db_url)
    if u.get_backend_name() == "sqlite" and not Path(u.database or "").is_file():
        return 0  # not created yet: leave that to the job
    try:
        eng = S.connect(db_url, migrate=False)
        c = S.MetricsReader(eng).counts(job_id)
        return c["succeeded"] + c["failed"]
    except Exception:  # the database is not there yet
        return 0


def tokenmill_run(leg: Leg, inp: dict[str, Any], *, during: Callable[[Leg, subprocess.Popen], None] | None = None,
                  stall_s: float | None = None, timeout_s: float = 4 * 3600) -> Leg:
    """Run `tokenmill run` for `leg` while sampling its process tree.  `during` runs in a
    thread beside it (a drill's kill).  Once `during` has acted (it appends to
    `leg.events`), a run with no new row in the database for `stall_s` seconds is
    stopped and marked stalled."""
    leg.folder.mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable, "-m", "tokenmill.jobs.cli", "run", str(engine_spec(leg.folder)),
        "--input", inp["path"], "--output", str(leg.out), "--db", leg.db_url, "--job-id", leg.job_id,
        "--model", leg.model, "--max-tokens", str(MAX_TOKENS), "--ignore-eos", "--json", *leg.runner.args, *leg.attached.args,
    ]
    n = len(list(leg.folder.glob("stdout*.txt")))  # a rerun keeps the first run's logs
    with open(leg.folder / f"stdout{n or ''}.txt", "w") as so, open(leg.folder / f"stderr{n or ''}.txt", "w") as se:
        t0 = time.monotonic()
        proc = subprocess.Popen(cmd, stdout=so, stderr=se, text=True, start_new_session=True)
        leg.sampler = ProcessSampler(proc.pid, also=leg.attached.pids)
        leg.sampler.start()
        th = None
        if during is not None:
            th = threading.Thread(target=during, args=(leg, proc), daemon=True)
            th.start()
        last_done, last_change = -1, time.monotonic()
        while proc.poll() is None:
            time.sleep(1.0)
            now = time.monotonic()
            if now - t0 > timeout_s:
                leg.stalled = True
                leg.events.append({"at_s": round(now - t0, 1), "event": f"timeout after {timeout_s:.0f} s: stopped"})
                break
            if stall_s is None or not leg.events:
                continue
            d = done_rows(leg.db_url, leg.job_id)
            if d != last_done:
                last_done, last_change = d, now
            elif now - last_change > stall_s:
                leg.stalled = True
                leg.events.append({"at_s": round(now - t0, 1), "event": f"no new row for {stall_s:.0f} s: stopped",
                                   "rows_done": d})
                break
        leg.wall_s = time.monotonic() - t0
        if proc.poll() is not None:
            time.sleep(2.0)  # the launcher's own clean-up is over; what lives on was left behind
            leg.left_behind = leg.sampler.still_running()
        _stop_group(proc)
        leg.sampler.stop()
        if th is not None:
            th.join(timeout=5)
    leg.exit_code = proc.returncode
    text = (leg.folder / f"stdout{n or ''}.txt").read_text()
    try:
        leg.summary = json.loads(text[text.index("{"):])
    except ValueError:
        leg.summary = {}
    if not leg.ok:
        err = (leg.folder / f"stderr{n or ''}.txt").read_text().strip().splitlines()
        leg.events.append({"event": f"exit {leg.exit_code}", "stderr_tail": err[-3:]})
    return leg


def _stop_group(proc: subprocess.Popen) -> None:
    """Stop the run's process group: a stalled launcher, and whatever a run left behind
    (an orphaned engine core after a kill)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


# ---------------------------------------------------------------- what a run did


def accounting(out: Path, inp: dict[str, Any]) -> dict[str, Any]:
    """Every input row exactly once across outputs.parquet and dead_letters.parquet,
    every id answered once (a duplicate id's later rows are dead letters), and the
    dead letters exactly the planted ones."""
    import pyarrow.parquet as pq

    if not (out / "outputs.parquet").is_file():
        return {"ok": False, "note": f"no export in {out}: the job did not finish"}
    o = pq.read_table(out / "outputs.parquet", columns=["id", "input_ref"]).to_pydict()
    d = pq.read_table(out / "dead_letters.parquet", columns=["id", "input_ref", "reason"]).to_pydict()
    refs = o["input_ref"] + d["input_ref"]
    out_ids = set(o["id"])
    reasons = Counter(d["reason"])
    dup_ok = all(i in out_ids for i, r in zip(d["id"], d["reason"]) if r == "duplicate_id")
    other_dead = {i for i, r in zip(d["id"], d["reason"]) if r != "duplicate_id"}
    checks = {
        "every_row_once": len(refs) == len(set(refs)) == inp["rows"],
        "output_ids_unique": len(o["id"]) == len(out_ids),
        "every_id_once": len(out_ids | other_dead) == inp["distinct_ids"] and not (out_ids & other_dead) and dup_ok,
        "dead_letters_as_planted": dict(reasons) == inp["planted"],
    }
    return {"ok": all(checks.values()), **checks, "outputs": len(o["id"]), "dead_letters": len(d["id"]),
            "dead_letter_reasons": dict(reasons)}


def worker_walls(db_url: str, job_id: str) -> dict[str, Any]:
    """Per worker, from the batches table: max(finished_at) − min(started_at)."""
    from tokenmill.schemas import storage as S

    spans: dict[str, list[float]] = defaultdict(list)
    rows: Counter = Counter()
    for b in S.MetricsReader(S.connect(db_url)).batches(job_id):
        if b["started_at"] is not None and b["finished_at"] is not None:
            spans[b["worker"]] += [b["started_at"], b["finished_at"]]
            rows[b["worker"]] += b["requests"] or 0
    walls = {w: round(max(s) - min(s), 2) for w, s in spans.items()}
    out: dict[str, Any] = {"walls_s": walls, "requests": dict(rows)}
    if len(walls) >= 2:
        out["ratio_longest_to_shortest"] = round(max(walls.values()) / min(walls.values()), 3) if min(walls.values()) else None
    return out


def steady_rate(db_url: str, job_id: str, lo: float = 0.1, hi: float = 0.9) -> dict[str, Any]:
    """Rows/s while outputs are being produced: the outputs between the `lo` and `hi`
    quantiles of their finish times (worker clock) over the time between them."""
    from tokenmill.schemas import storage as S

    t = sorted(r["finished_at"] for r in S.MetricsReader(S.connect(db_url)).request_rows(job_id, ("finished_at",))
               if r["finished_at"] is not None)
    if len(t) < 20:
        return {"rows_per_s": None}
    a, b = int(lo * (len(t) - 1)), int(hi * (len(t) - 1))
    span = t[b] - t[a]
    return {"rows_per_s": _r((b - a) / span) if span > 0 else None, "span_s": _r(span, 2),
            "first_to_last_output_s": _r(t[-1] - t[0], 2)}


def rework(db_url: str, job_id: str) -> dict[str, Any]:
    """Rows generated more than once, from the engine side: sum(workers.generated_rows) −
    count(outputs); and, where the workers table has it, sum(workers.admitted_rows) −
    count(outputs) (requests handed to an engine, retries included)."""
    from tokenmill.schemas import storage as S

    eng = S.connect(db_url)
    workers = S.MetricsReader(eng).workers(job_id)
    if not workers or "generated_rows" not in workers[0]:
        return {"rows": None, "note": "workers.generated_rows is not in this database's schema (a tokenmill "
                "without the column): rework not counted; see the rerun's figures"}
    outputs = S.MetricsReader(eng).counts(job_id)["succeeded"]
    generated = sum(w["generated_rows"] or 0 for w in workers)
    out: dict[str, Any] = {"rows": generated - outputs, "generated_rows": generated, "outputs": outputs,
                           "per_worker": {w["worker"]: {k: w.get(k) for k in ("admitted_rows", "generated_rows")}
                                          for w in workers}}
    if "admitted_rows" in workers[0]:
        admitted = sum(w["admitted_rows"] or 0 for w in workers)
        out.update(admitted_rows=admitted, admitted_minus_outputs=admitted - outputs)
    return out


def leg_report(leg: Leg, inp: dict[str, Any], *, final: bool = True) -> dict[str, Any]:
    s = leg.summary
    wall = s.get("wall_s") or leg.wall_s
    load = s.get("model_load_s")
    gen = s.get("generation_wall_s")
    procs = leg.sampler.processes() if leg.sampler else []
    rep: dict[str, Any] = {
        "name": leg.name, "rows": leg.rows, "runner": leg.runner.name, "job_id": leg.job_id,
        "exit_code": leg.exit_code, "status": s.get("status"), "stalled": leg.stalled, "events": leg.events,
        "left_behind_after_exit": leg.left_behind,
        "wall_s": round(leg.wall_s, 1), "job_wall_s": s.get("wall_s"), "model_load_s": _r(load),
        "generation_wall_s": _r(gen), "output_tokens": s.get("output_tokens"), "prompt_tokens": s.get("prompt_tokens"),
        "rows_per_s": _r(leg.rows / (wall - load)) if load and wall and wall > load else None,
        "rows_per_s_job_wall": _r(leg.rows / wall) if wall else None,
        "rows_per_s_generation_wall": _r(leg.rows / gen) if gen else None,
        "steady": steady_rate(leg.db_url, leg.job_id),
        "processes": procs,
        "peak_rss_mib_by_kind": peaks_by_kind(leg.sampler),
        "processes_by_kind": dict(Counter(p["kind"] for p in procs)),
        "rss_kinds": list(leg.runner.kinds),
        "rss_series_mib": leg.sampler.series() if leg.sampler else {},
        "worker_generation_walls": worker_walls(leg.db_url, leg.job_id),
        "folder": str(leg.folder.relative_to(ROOT)),
    }
    if final:
        rep["accounting"] = accounting(leg.out, inp)
    return rep


def peaks_by_kind(sampler: ProcessSampler | None) -> dict[str, float]:
    out: dict[str, float] = {}
    for p in sampler.processes() if sampler else []:
        out[p["kind"]] = max(out.get(p["kind"], 0.0), p["peak_rss_mib"])
    return out


def _r(x: float | None, nd: int = 1) -> float | None:
    return None if x is None else round(x, nd)


# ---------------------------------------------------------------- the runs


def plain_run(name: str, rows: int, runner: Runner, model: str, work: Path) -> dict[str, Any]:
    """One run of `rows` rows on `runner`; a runner's cluster is started for the run and
    stopped after it (its processes sampled beside the launcher's)."""
    inp = make_input(rows)
    log(f"{name}: {rows:,} rows, {runner.name}")
    with attach(runner, work / name) as attached:
        leg = tokenmill_run(Leg(name, rows, runner, f"scale-{name}", work / name, model, attached), inp)
    rep = leg_report(leg, inp)
    log(f"{name}: exit {leg.exit_code}, {leg.wall_s:.0f} s, {rep['rows_per_s']} rows/s, peaks {rep['peak_rss_mib_by_kind']} MiB, "
        f"accounted {rep['accounting']['ok']}")
    return rep


def drill(target: str, rows: int, runner: Runner, model: str, work: Path, *, stall_s: float) -> dict[str, Any]:
    """kill -9 one process of kind `target` (`worker` = the runner's worker kind, or
    `engine_core`) once DRILL_KILL_AT of the rows are in the database; rerun the same
    job id if the run does not finish by itself.  A runner's cluster is started for the
    drill and stopped after it."""
    name = f"drill-{target}-{runner.name}"
    folder = work / name
    with attach(runner, folder) as attached:
        return _drill(name, target, rows, runner, model, folder, attached, stall_s=stall_s)


def _drill(name: str, target: str, rows: int, runner: Runner, model: str, folder: Path, attached: Attached, *,
           stall_s: float) -> dict[str, Any]:
    kind = runner.worker_kind if target == "worker" else target
    inp = make_input(rows)
    leg = Leg(name, rows, runner, f"scale-{name}", folder, model, attached)

    def kill(leg: Leg, proc: subprocess.Popen) -> None:
        while proc.poll() is None:
            done = done_rows(leg.db_url, leg.job_id)
            if done >= DRILL_KILL_AT * rows:
                victim = leg.sampler.busiest(kind) if leg.sampler else None
                if victim is None:
                    time.sleep(0.5)
                    continue
                label, pid = victim
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    continue
                leg.events.append({"at_s": round(time.monotonic() - leg.sampler.t0, 1),
                                   "event": f"kill -9 {label} (pid {pid})", "rows_done": done})
                log(f"{name}: killed {label} (pid {pid}) with {done:,} of {rows:,} rows done")
                return
            time.sleep(0.5)

    log(f"{name}: {rows:,} rows, {runner.name}; kill -9 of one {kind} at {DRILL_KILL_AT:.0%} of the rows")
    tokenmill_run(leg, inp, during=kill, stall_s=stall_s)
    legs = [leg_report(leg, inp, final=False)]
    killed = any(e["event"].startswith("kill") for e in leg.events)
    rep: dict[str, Any] = {"name": name, "target": kind, "runner": runner.name, "rows": rows, "killed": killed,
                           "needed_rerun": not leg.ok}
    final = leg
    if not leg.ok:
        before_rows = done_rows(leg.db_url, leg.job_id)
        before_batches = _batch_ids(leg)
        log(f"{name}: the run {'stalled' if leg.stalled else f'exited {leg.exit_code}'} after the kill "
            f"with {before_rows:,} rows done: rerunning job {leg.job_id}")
        rerun = Leg(name + "-rerun", rows, runner, leg.job_id, leg.folder, model, attached)
        tokenmill_run(rerun, inp)
        legs.append(leg_report(rerun, inp, final=False))
        after_rows = done_rows(rerun.db_url, rerun.job_id)
        rep["rerun"] = {"resumed": rerun.summary.get("resumed"), "rows_done_before": before_rows,
                        "rows_redone": after_rows - before_rows, "batches_redone": len(_batch_ids(rerun) - before_batches),
                        "exit_code": rerun.exit_code}
        final = rerun
    rep["legs"] = legs
    rep["finished"] = final.ok
    rep["accounting"] = accounting(final.out, inp)
    rep["rework"] = rework(final.db_url, final.job_id)
    rep["orphans"] = [{**p, "leg": leg_["name"]} for leg_ in legs for p in leg_["processes"] if "orphaned_at_s" in p]
    rep["left_behind_after_exit"] = {leg_["name"]: leg_["left_behind_after_exit"] for leg_ in legs}
    log(f"{name}: finished {rep['finished']}, rerun {rep['needed_rerun']}, accounted {rep['accounting']['ok']}, "
        f"rework {rep['rework'].get('rows')}")
    return rep


def _batch_ids(leg: Leg) -> set[str]:
    from tokenmill.schemas import storage as S

    try:
        return {b["batch_id"] for b in S.MetricsReader(S.connect(leg.db_url)).batches(leg.job_id)}
    except Exception:
        return set()


# ---------------------------------------------------------------- targets


def targets(runs: dict[str, dict[str, Any]], small: str, large: str, two: str | None) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    a, b = runs.get(small), runs.get(large)
    if a and b:
        ka, kb = a["peak_rss_mib_by_kind"], b["peak_rss_mib_by_kind"]
        na, nb = a.get("processes_by_kind", {}), b.get("processes_by_kind", {})
        for kind in rss_kinds([a, b]):
            if ka.get(kind) and kb.get(kind):
                r = kb[kind] / ka[kind]
                # several of a kind (two dask workers, their engine cores): each run's largest peak
                ca, cb = na.get(kind, 1), nb.get(kind, 1)
                of = f" (the largest of each run's {ca if ca == cb else f'{ca} / {cb}'} {kind} processes)" \
                    if max(ca, cb) > 1 else ""
                out.append(_target(f"peak RSS of the {kind}{of}: {b['rows']:,} rows ÷ {a['rows']:,} rows", r,
                                   f"≤ {RSS_GROWTH_MAX}", r <= RSS_GROWTH_MAX, f"{ka[kind]:.0f} → {kb[kind]:.0f} MiB"))
        for what, x, y in (("rows/s (job wall − model load)", a.get("rows_per_s"), b.get("rows_per_s")),
                           ("steady rows/s (10%→90% of outputs)", a["steady"].get("rows_per_s"),
                            b["steady"].get("rows_per_s"))):
            if x and y:
                out.append(_target(f"{what}: {b['rows']:,} rows ÷ {a['rows']:,} rows", y / x, f"≥ {RATE_KEEP_MIN}",
                                   y / x >= RATE_KEEP_MIN, f"{x} → {y} rows/s"))
    t = runs.get(two) if two else None
    if t:
        w = t["worker_generation_walls"]
        r = w.get("ratio_longest_to_shortest")
        out.append(_target("two workers' generation walls, longest ÷ shortest", r, f"≤ {WORKER_WALL_SPREAD_MAX}",
                           None if r is None else r <= WORKER_WALL_SPREAD_MAX,
                           ", ".join(f"{v} s" for v in w["walls_s"].values()) or "fewer than two workers wrote batches"))
    for name, run in runs.items():
        acc = run.get("accounting", {})
        out.append(_target(f"{name}: every id exactly once, dead letters as planted", None, "yes", acc.get("ok"),
                           acc.get("note") or f"{acc.get('outputs'):,} outputs + {acc.get('dead_letters'):,} dead letters"))
    return out


def rss_kinds(runs: list[dict[str, Any]]) -> list[str]:
    """The process kinds the runs' RSS is compared and shown by, in order (each run's
    runner's kinds; MAIN_KINDS for results written before runs named theirs)."""
    return list(dict.fromkeys(k for r in runs for k in r.get("rss_kinds", MAIN_KINDS)))


def drill_targets(drills: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for d in drills:
        acc = d["accounting"]
        note = "killed, " + ("rerun needed" if d["needed_rerun"] else "finished without a rerun") if d["killed"] \
            else "the run ended before the kill point"
        out.append(_target(f"{d['name']}: job finished, every id exactly once", None, "yes",
                           bool(d["finished"] and acc.get("ok") and d["killed"]), note))
    return out


def _target(name: str, measured: float | None, target: str, met: bool | None, detail: str) -> dict[str, Any]:
    return {"target": name, "measured": None if measured is None else round(measured, 3), "goal": target,
            "verdict": "n/a" if met is None else ("PASS" if met else "MISS"), "detail": detail}


# ---------------------------------------------------------------- plot


def plot(res: dict[str, Any], stem: Path) -> Path:
    """RSS over time, one panel per run: PNG with matplotlib where installed, else plotly HTML
    (plotly.js from its CDN, to keep the file small)."""
    panels = [(r["name"], r["rss_series_mib"], r.get("events", [])) for r in res["runs"].values()]
    for d in res.get("drills", []):
        panels += [(leg["name"], leg["rss_series_mib"], leg.get("events", [])) for leg in d["legs"]]
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        plt = None
    if plt is not None:
        fig, axes = plt.subplots(len(panels), 1, figsize=(10, 2.8 * len(panels)), squeeze=False)
        for ax, (title, series, events) in zip(axes[:, 0], panels):
            for label, pts in series.items():
                ax.plot([p[0] for p in pts], [p[1] for p in pts], label=label, lw=1)
            for e in events:
                if "at_s" in e:
                    ax.axvline(e["at_s"], color="red", ls="--", lw=0.8)
            ax.set_title(title, fontsize=9)
            ax.set_ylabel("RSS MiB")
            ax.legend(fontsize=6, loc="upper left")
        axes[-1, 0].set_xlabel("seconds since the run started")
        fig.tight_layout()
        path = stem.with_suffix(".png")
        fig.savefig(path, dpi=90)
        return path
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    fig = make_subplots(rows=len(panels), cols=1, subplot_titles=[p[0] for p in panels], vertical_spacing=0.3 / len(panels))
    for i, (_, series, events) in enumerate(panels, start=1):
        for label, pts in series.items():
            fig.add_trace(go.Scatter(x=[p[0] for p in pts], y=[p[1] for p in pts], name=label, mode="lines",
                                     legendgroup=str(i), legendgrouptitle_text=panels[i - 1][0] if label == next(iter(series)) else None),
                          row=i, col=1)
        for e in events:
            if "at_s" in e:
                fig.add_vline(x=e["at_s"], line_dash="dash", line_color="red", row=i, col=1)
        fig.update_yaxes(title_text="RSS MiB", row=i, col=1)
    fig.update_xaxes(title_text="seconds since the run started", row=len(panels), col=1)
    fig.update_layout(height=320 * len(panels), title="tokenmill bench-scale: RSS per process", legend_groupclick="toggleitem")
    path = stem.with_suffix(".html")
    fig.write_html(path, include_plotlyjs="cdn", config={"displaylogo": False})
    return path


# ---------------------------------------------------------------- main


def code_version() -> str | None:
    """The last commit that touched the tokenmill code the runs ran (the checkout the
    `tokenmill` package resolves to), `+dirty` with local changes."""
    import tokenmill.jobs

    src = Path(tokenmill.jobs.__path__[0]).resolve().parent
    dirs = ["jobs", "pipelines", "schemas", "transforms"]
    try:
        sha = subprocess.run(["git", "log", "-1", "--format=%h", "--", *dirs], cwd=src, capture_output=True,
                             text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", *dirs], cwd=src, capture_output=True,
                               text=True, check=True).stdout.strip()
        return f"{sha}{'+dirty' if dirty else ''} ({src})" if sha else None
    except (OSError, subprocess.CalledProcessError):
        return None


def markdown(res: dict[str, Any]) -> str:
    kinds = rss_kinds(list(res["runs"].values()))
    lines = ["| run | rows | runner | exit | wall s | model load s | rows/s (wall − load) | steady rows/s | output tokens "
             "| peak RSS MiB (the largest of a kind's processes): "
             + " / ".join(k.replace("_", " ").replace("sdk", "SDK") for k in kinds) + " | every id once |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in res["runs"].values():
        k = r["peak_rss_mib_by_kind"]
        lines.append(f"| {r['name']} | {r['rows']:,} | {r['runner']} | {r['exit_code']} | {r['wall_s']} | {r['model_load_s']} | "
                     f"{r['rows_per_s']} | {r['steady'].get('rows_per_s')} | {r['output_tokens']} | "
                     + " / ".join(str(k.get(x, "–")) for x in kinds) + f" | {r['accounting']['ok']} |")
    if res.get("drills"):
        lines += ["", "| drill | rows | kill | finished | rerun | rows / batches the rerun redid | rework (generated − outputs) "
                  "| orphaned by the kill | alive after the launcher exited | every id once |", "|---|---|---|---|---|---|---|---|---|---|"]
    for d in res.get("drills", []):
        kill = next((e for leg in d["legs"] for e in leg["events"] if e["event"].startswith("kill")), None)
        rr = d.get("rerun") or {}
        orphans = ", ".join(f"{p['label']} ({p['peak_rss_mib']:.0f} MiB, lived {p['seen_s'][1] - p['orphaned_at_s']:.0f} s)"
                            for p in d["orphans"]) or "none"
        left = ", ".join(x for v in d["left_behind_after_exit"].values() for x in v) or "none"
        lines.append(f"| {d['name']} | {d['rows']:,} | {kill['event'] + ' at ' + format(kill['rows_done'], ',') + ' rows' if kill else 'none'} "
                     f"| {d['finished']} | {d['needed_rerun']} | {str(rr.get('rows_redone', '–')) + ' / ' + str(rr.get('batches_redone', '–')) if rr else '–'} "
                     f"| {d['rework'].get('rows') if d['rework'].get('rows') is not None else 'not counted'} | {orphans} | {left} "
                     f"| {d['accounting']['ok']} |")
    lines += ["", "| target | measured | goal | verdict | detail |", "|---|---|---|---|---|"]
    for t in res["targets"]:
        lines.append(f"| {t['target']} | {t['measured'] if t['measured'] is not None else '–'} | {t['goal']} | "
                     f"**{t['verdict']}** | {t['detail']} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=DEFAULT_N, help=f"N (default {DEFAULT_N:,}): the runs use N and 10 N rows")
    ap.add_argument("--sizes", default=None, help="the sized runs' sizes instead of N,10N, e.g. 2000,20000 "
                    "(the first is N for the two-worker run, the last is the drills' size)")
    ap.add_argument("--runner", choices=list(SIZED_RUNNERS), default="direct-1", help="what the sized runs run on: "
                    "direct-1 (default: the DirectRunner, one worker) or dask (a loopback cluster of 2 workers per run)")
    ap.add_argument("--skip-two-workers", action="store_true", help="no N-row two-worker run")
    ap.add_argument("--skip-drills", action="store_true", help="no failure drills")
    ap.add_argument("--drills", default="worker,engine_core", help="what the drills kill: worker (one of the runner's "
                    "workers), engine_core (one vLLM engine core)")
    ap.add_argument("--drill-runners", default=",".join(RUNNERS), help=f"the runners the drills run on, in order "
                    f"(default: every one of {', '.join(RUNNERS)}; dask starts a loopback cluster per drill)")
    ap.add_argument("--drill-rows", type=int, default=None, help="rows per drill (default: the largest size)")
    ap.add_argument("--stall-s", type=float, default=180.0, help="after a kill, a run with no new row for this long is stopped")
    ap.add_argument("--model", default="smollm2-135m", help="the prepared model whose tokenizer and architecture the tiny model takes")
    ap.add_argument("--json", default=None, help="results file (default bench/results/scale-<stamp>.json; the plot goes beside it)")
    args = ap.parse_args(argv)
    try:
        drill_runners = [RUNNERS[r] for r in args.drill_runners.split(",") if r]
    except KeyError as err:
        ap.error(f"--drill-runners: no runner {err}; the runners are {', '.join(RUNNERS)}")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    logging.basicConfig(level=logging.WARNING)

    from bench.tinymodel import TINY, tiny_model

    sizes = [int(x) for x in args.sizes.split(",")] if args.sizes else [args.n, 10 * args.n]
    sized = SIZED_RUNNERS[args.runner]
    stamp = utc_stamp()
    work = WORK / "scale" / stamp
    model = str(tiny_model(args.model))
    res: dict[str, Any] = {
        "command": " ".join(["python -m bench.scale", *(argv if argv is not None else sys.argv[1:])]),
        "started_at": utc_now(), "code": code_version(), **machine(),
        "model": {"base": args.model, "tiny": os.path.relpath(model, ROOT), "cut": TINY},
        "settings": {"sizes": sizes, "sized_runner": {"option": args.runner, "runner": sized.name, "args": list(sized.args),
                                                       "cluster": sized.cluster is not None},
                     "max_tokens": MAX_TOKENS, "ignore_eos": True, "engine": ENGINE,
                     "bad_every": BAD_EVERY, "dup_every": DUP_EVERY, "files": FILES, "row_group_rows_max": ROW_GROUP_MAX,
                     "sampler_every_s": 0.5, "drill_kill_at": DRILL_KILL_AT},
        "runs": {}, "drills": [],
    }
    for s in sizes:
        make_input(s)
    for s in sizes:
        res["runs"][sized_name(s, sized)] = plain_run(sized_name(s, sized), s, sized, model, work)
    two = None
    if not args.skip_two_workers:
        two = f"{sizes[0]}-rows-2-workers"
        res["runs"][two] = plain_run(two, sizes[0], RUNNERS["direct"], model, work)
    if not args.skip_drills:
        for runner in drill_runners:
            for target in [t for t in args.drills.split(",") if t]:
                res["drills"].append(drill(target, args.drill_rows or sizes[-1], runner, model, work, stall_s=args.stall_s))
    res["targets"] = targets(res["runs"], sized_name(sizes[0], sized), sized_name(sizes[-1], sized), two) \
        + drill_targets(res["drills"])
    res["finished_at"] = utc_now()
    path = Path(args.json) if args.json else RESULTS / f"scale-{stamp}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    res["plot"] = os.path.relpath(plot(res, path.with_suffix("")), ROOT)
    path.write_text(json.dumps(res, indent=1, default=str))
    print(markdown(res))
    print(f"\nresults: {os.path.relpath(path, ROOT)}; plot: {res['plot']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
