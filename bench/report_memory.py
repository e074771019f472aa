"""Peak memory of `tokenmill report` and `tokenmill status` on a finished job of N rows and of 10 N rows.

Two synthetic finished jobs are written straight into the database through the
storage layer (JobStore, ResultWriter): N and 10 N output rows with engine-like
figures (`output_rows`: prompt, output and cached tokens, ttft, tpot, e2e, queue,
~200 characters of text, finish times at ROWS_PER_S), a batch row per BATCH_ROWS
requests, one worker row and one run; the job row is finished with the metrics
jobs/lifecycle/runner.py stores (its `compute_metrics`), so `tokenmill report`
reads stored metrics as it does for a real finished job.

Each command of COMMANDS then runs as a user runs it, a CLI subprocess: one warm-up
round on the N job (not counted), then `--reps` rounds N, 10 N, N, 10 N, ...  A run's
peak RSS is the kernel's high-water mark of the CLI process (ru_maxrss, from
/usr/bin/time), beside a 20 ms psutil poll of its tree (bench/procs.py), which is
the peak where /usr/bin/time is missing.  Prints every run and, per command,
peak(10 N) ÷ peak(N) as min–max over the paired rounds; writes
bench/results/report-memory-<stamp>.json.  The jobs' rows are deleted at the end
unless --keep.  Not a timed test: a program whose figures go to docs/BENCHMARKS.md.

    python -m bench.report_memory --n 20000 --db postgresql://postgres@127.0.0.1:5432/test
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import random
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import RESULTS, ROOT, log, machine, utc_now, utc_stamp
from bench.procs import MiB, ProcessSampler
from bench.scale import code_version

MODEL = "smollm2-135m"
FILES = 4  # the rows' input files, as a job over a folder of Parquet parts
BATCH_ROWS = 256  # requests per batch row (the engine's default max_num_seqs)
ROWS_PER_S = 100  # the synthetic job's throughput: N = 20,000 rows finish over 200 s, 10 N over 2,000 s
LOAD_S = 20.0  # engine load before the first batch
RUN_ID = "bench0"  # the job's one run (6 characters, as a run id)
POLL_S = 0.02
TIME = "/usr/bin/time" if os.access("/usr/bin/time", os.X_OK) else None
GROWTH_MAX = 1.25  # the claim checked: peak at 10 N rows ÷ peak at N rows
#: the commands measured, as a user types them after `tokenmill`; the report's default writes the HTML too
COMMANDS = {
    "report": ("report", "{job}", "--no-html"),
    "report+html": ("report", "{job}", "--out", "{out}"),
    "status": ("status", "{job}", "--json"),
}
WORDS = ("the model answers each prompt with a short paragraph of plain text about batch inference "
         "tokens latency throughput cache memory report status queue engine worker").split()


def output_rows(job_id: str, n: int, t0: float, rng: random.Random, worker: str):
    """The job's n output rows (`OutputRow.as_dict()`), in input order."""
    from tokenmill.schemas.records import TOKENS_BY_ENGINE, OutputRow

    per_file = -(-n // FILES)
    for i in range(n):
        prompt = max(8, min(1800, int(rng.lognormvariate(5.5, 0.6))))
        out = rng.randint(16, 128)
        queue, ttft, tpot = rng.uniform(0.0, 20.0), rng.uniform(0.05, 1.5), rng.uniform(0.02, 0.06)
        e2e = queue + ttft + tpot * (out - 1)  # from arrival, which is after the engine loaded
        yield OutputRow(
            job_id=job_id, id=f"r{i:07d}", input_file=i // per_file, input_row=i % per_file, model=MODEL,
            text=" ".join(rng.choices(WORDS, k=40))[:200], finish_reason="length" if out == 128 else "stop",
            prompt_tokens=prompt, output_tokens=out, cached_tokens=min(prompt - 1, rng.choice((0, 0, 64, 128, 192))),
            token_count_source=TOKENS_BY_ENGINE, ttft_s=ttft, tpot_s=tpot, e2e_s=e2e,
            queue_s=queue, finished_at=t0 + LOAD_S + i / ROWS_PER_S + rng.uniform(0.0, 1.0) + e2e,
            # generate.py's batch ids: <run id>-<unit>.<part>-<6 hex>-<batch>; here a unit is one input file
            batch_id=f"{RUN_ID}-{i // per_file}.0-000000-{(i % per_file) // BATCH_ROWS}", worker=worker,
        ).as_dict()


def make_job(db_url: str, job_id: str, n: int, chunk: int = 5000) -> float:
    """A finished job of n output rows in the database, as `run_job` leaves one; returns the seconds it took."""
    from tokenmill.jobs.lifecycle.jobrow import job_values
    from tokenmill.jobs.lifecycle.runner import compute_metrics, hardware, versions
    from tokenmill.schemas import storage as S
    from tokenmill.schemas import tables as T
    from tokenmill.schemas.config import load_spec
    from tokenmill.schemas.records import BatchStats, WorkerRow

    started = time.monotonic()
    eng = S.connect(db_url)
    spec = load_spec({"job_id": job_id, "input": f"bench://report-memory/{n}", "output": f"bench://report-memory/{job_id}",
                      "engine": {"model": MODEL}})
    hw = hardware()
    t0 = time.time() - LOAD_S - n / ROWS_PER_S - 40.0  # the job ends about now
    S.JobStore(eng).claim(job_id, {**job_values(spec), "versions": versions(spec.engine.kind), "hardware": hw, "total": n})
    S.JobStore(eng).start_run(job_id, RUN_ID, t0)
    worker = f"{socket.gethostname()}:{os.getpid()}"
    writer, rows, batches = S.ResultWriter(eng), [], {}
    for i, r in enumerate(output_rows(job_id, n, t0, random.Random(n), worker), start=1):
        b = batches.setdefault(r["batch_id"], {"job_id": job_id, "batch_id": r["batch_id"], "worker": worker, "requests": 0,
                                               "prompt_tokens": 0, "output_tokens": 0, "cached_tokens": 0,
                                               "started_at": float("inf"), "finished_at": 0.0,
                                               "tail_s": 0.5, "engine_idle_s": 0.0, "retries": None})
        for k in ("prompt_tokens", "output_tokens", "cached_tokens"):
            b[k] += r[k]
        b["requests"] += 1
        b["started_at"] = min(b["started_at"], r["finished_at"] - r["e2e_s"])
        b["finished_at"] = max(b["finished_at"], r["finished_at"])
        rows.append(r)
        if len(rows) == chunk or i == n:
            # a plain executemany INSERT (new job ids): ResultWriter.insert_rows' ON CONFLICT ... RETURNING
            # is ~5x slower on PostgreSQL
            with eng.begin() as conn:
                conn.execute(T.outputs.insert(), rows)
            rows = []
    writer.insert_rows(BatchStats, batches.values())
    end = max(b["finished_at"] for b in batches.values())
    tokens = sum(b["output_tokens"] for b in batches.values())
    measure = {"window_started_at": t0 + LOAD_S, "window_ended_at": end, "window_s": end - t0 - LOAD_S, "samples": 100,
               "clock": "worker time.time(): engine ready -> latest report", "peak_tree_rss_bytes": 1536 * MiB,
               "tree_cpu_s": 1.8 * (end - t0 - LOAD_S), "tree_cores_busy_mean": 1.8, "gpus": None, "gpu_energy_j": None,
               "gpu_process_memory_bytes_max": None}
    writer.record_worker(WorkerRow(
        job_id=job_id, worker=worker, hostname=socket.gethostname(), pid=os.getpid(), device="cpu", load_s=LOAD_S,
        engine_info={"device": "cpu", "load_s": LOAD_S, "note": "bench/report_memory.py synthetic job"},
        peak_rss_bytes=1536 * MiB, admitted_rows=n, generated_rows=n, generated_tokens=tokens, started_at=t0,
        updated_at=end, run_id=RUN_ID, device_type="cpu", device_model=hw.get("cpu_model"), device_count=1,
        cpu_count=os.cpu_count(), measure=measure))
    S.JobStore(eng).finish_run(job_id, RUN_ID, end + 2.0)
    metrics = compute_metrics(eng, job_id, spec, n, hw, job_wall_s=end + 2.0 - t0)
    counts = S.MetricsReader(eng).counts(job_id)
    S.JobStore(eng).finish(job_id, status="succeeded", error=None, metrics=metrics, heartbeat_at=None, owner=None,
                           started_at=dt.datetime.fromtimestamp(t0, dt.timezone.utc), **counts)
    return time.monotonic() - started


def measure(name: str, job_id: str, rows: int, db_url: str, scratch: Path) -> dict[str, Any]:
    """One CLI run of command `name` on `job_id`: its wall and peak RSS, the kernel's high-water mark
    (ru_maxrss) as /usr/bin/time reports it, beside the peak of a psutil poll of its tree."""
    out = scratch / f"html-{rows}"
    argv = [sys.executable, "-m", "tokenmill.jobs.cli", *(a.format(job=job_id, out=out) for a in COMMANDS[name]),
            "--db", db_url]
    logfile, maxrss = scratch / f"{name}-{rows}.log", scratch / "maxrss.txt"
    maxrss.unlink(missing_ok=True)
    with open(logfile, "w") as so:
        t = time.monotonic()
        # /usr/bin/time, not this process's wait4: a child's ru_maxrss counts the RSS of the process it
        # was forked from (this one, a few hundred MiB), and /usr/bin/time is a small C program
        proc = subprocess.Popen([TIME, "-f", "%M", "-o", str(maxrss), *argv] if TIME else argv, stdout=so,
                                stderr=subprocess.STDOUT)
        sampler = ProcessSampler(proc.pid, every_s=POLL_S)
        sampler.start()
        proc.wait()
        wall = time.monotonic() - t
        sampler.stop()
    polled = max((p.peak_rss for p in sampler.procs.values()), default=0) / MiB
    kib = maxrss.read_text().split()[-1] if maxrss.is_file() else ""
    run = {"command": name, "rows": rows, "exit_code": proc.returncode, "wall_s": round(wall, 2),
           "peak_rss_mib": round(int(kib) / 1024 if kib.isdigit() else polled, 1),
           "peak_from": "ru_maxrss (/usr/bin/time %M)" if kib.isdigit() else f"psutil poll every {POLL_S} s",
           "polled_peak_rss_mib": round(polled, 1)}
    if proc.returncode != 0:
        run["output_tail"] = logfile.read_text().strip().splitlines()[-3:]
    return run


def ratios(runs: list[dict[str, Any]], n: int, key: str) -> dict[str, dict[str, Any]]:
    """Per command, value(10 N) ÷ value(N) of each paired round, and their min and max."""
    out = {}
    for name in COMMANDS:
        small = [r[key] for r in runs if r["command"] == name and r["rows"] == n]
        large = [r[key] for r in runs if r["command"] == name and r["rows"] == 10 * n]
        each = [round(b / a, 3) for a, b in zip(small, large) if a]
        out[name] = {"each": each, "min": min(each, default=None), "max": max(each, default=None)}
    return out


def table(res: dict[str, Any]) -> str:
    from tabulate import tabulate

    n, body = res["n"], []
    for name in COMMANDS:
        for rows in (n, 10 * n):
            mine = [r for r in res["runs"] if r["command"] == name and r["rows"] == rows]
            body.append([name, f"{rows:,}", " ".join(f"{r['peak_rss_mib']:.1f}" for r in mine),
                         " ".join(f"{r['polled_peak_rss_mib']:.1f}" for r in mine),
                         " ".join(f"{r['wall_s']:.2f}" for r in mine), " ".join(str(r["exit_code"]) for r in mine)])
        p, w = res["peak_ratio"][name], res["wall_ratio"][name]
        body.append([name, "10 N ÷ N", f"{p['min']}–{p['max']}", "", f"{w['min']}–{w['max']}",
                     f"≤ {GROWTH_MAX}: {'yes' if p['max'] is not None and p['max'] <= GROWTH_MAX else 'no'}"])
    return tabulate(body, headers=["command", "rows", "peak RSS MiB (ru_maxrss), each round", "polled peak MiB",
                                   "wall s", "exit codes; claim"], disable_numparse=True)


def main(argv=None) -> int:
    from tokenmill.schemas import storage as S
    from tokenmill.schemas.db import default_db_url
    from tokenmill.schemas.secrets import mask_url

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=20000, help="N: the jobs have N and 10 N output rows")
    ap.add_argument("--reps", type=int, default=3, help="rounds of every command on both jobs, after one warm-up")
    ap.add_argument("--db", default=None, help="database URL (default: the CLI's, TOKENMILL_DB_URL or its SQLite file)")
    ap.add_argument("--keep", action="store_true", help="keep the two jobs' rows in the database")
    ap.add_argument("--json", default=None, help="results file (default bench/results/report-memory-<stamp>.json)")
    ap.add_argument("--code", default=None, help="what code ran, when PYTHONPATH points at another tree's tokenmill")
    args = ap.parse_args(argv)
    db_url = args.db or default_db_url()
    stamp = utc_stamp()
    sizes = (args.n, 10 * args.n)
    jobs = {rows: f"bench-report-{stamp}-n{rows}" for rows in sizes}
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    res: dict[str, Any] = {
        "command": " ".join(["python -m bench.report_memory", *(argv if argv is not None else sys.argv[1:])]),
        "started_at": utc_now(), "commit": commit, "code": args.code or code_version(), **machine(),
        "db": mask_url(db_url), "n": args.n, "reps": args.reps, "jobs": jobs, "poll_s": POLL_S,
        "settings": {"files": FILES, "batch_rows": BATCH_ROWS, "rows_per_s": ROWS_PER_S, "commands": COMMANDS},
        "setup_s": {}, "warmup": [], "runs": [],
    }
    try:
        for rows, job_id in jobs.items():
            log(f"writing job {job_id}: {rows:,} output rows")
            res["setup_s"][rows] = round(make_job(db_url, job_id, rows), 1)
            log(f"  {res['setup_s'][rows]} s")
        with tempfile.TemporaryDirectory(prefix="bench-report-") as tmp:
            res["warmup"] = [measure(name, jobs[args.n], args.n, db_url, Path(tmp)) for name in COMMANDS]
            for rep in range(args.reps):
                for rows in sizes:
                    for name in COMMANDS:
                        run = {"round": rep, **measure(name, jobs[rows], rows, db_url, Path(tmp))}
                        res["runs"].append(run)
                        log(f"round {rep} {name} {rows:,} rows: {run['peak_rss_mib']} MiB, {run['wall_s']} s, "
                            f"exit {run['exit_code']}")
    finally:
        if not args.keep:
            for job_id in jobs.values():
                S.JobStore(S.connect(db_url)).delete(job_id)
            log("deleted the bench's jobs")
    res["peak_ratio"] = ratios(res["runs"], args.n, "peak_rss_mib")
    res["wall_ratio"] = ratios(res["runs"], args.n, "wall_s")
    res["finished_at"] = utc_now()
    print(table(res))
    path = Path(args.json) if args.json else RESULTS / f"report-memory-{stamp}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(res, indent=1, default=str) + "\n")
    print(f"\nresults: {os.path.relpath(path, ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
