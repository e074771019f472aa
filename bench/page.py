"""How fast the live page answers with 10,000 jobs in the database, on SQLite and on PostgreSQL.

Each backend gets N synthetic jobs written straight into its tables (finished jobs with stored
metrics of the shape jobs/lifecycle/runner.py stores, half of them one API key's batches, a few
running jobs with live output rows and dead letters), then `tokenmill ui --db URL` is started on
loopback for each, as a user starts it.  Requests go over HTTP with the printed token (admin) or
the key (scoped to its batches): a warm-up of WARMUP requests per page, then `--rounds` rounds,
each asking every page of PAGES once on SQLite then PostgreSQL, then PostgreSQL then SQLite
(A B B A), so the two backends share the machine's moments.  Prints every request's time and,
per backend and page, the median, p95 and max; writes bench/results/page-<stamp>.json.  The
target (issue 40): ≤ 200 ms.  Not a timed test.

    python -m bench.page --n 10000 --pg postgresql://postgres@127.0.0.1:5432/test
"""

from __future__ import annotations

import argparse
import json
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from bench.common import RESULTS, ROOT, log, machine, utc_now, utc_stamp

RUNNING = 5  # running jobs, each with live rows the page counts
LIVE_ROWS = 2000  # output rows of each running job so far
WARMUP = 3
#: what is asked, as (name, path, who): who is "admin" (the ui's token) or "key" (one key's batches)
PAGES = (("jobs", "/", "admin"), ("jobs-deep", "/?offset=5000", "admin"), ("running", "/?status=running", "admin"),
         ("jobs-key", "/", "key"), ("job", "/jobs/{job}", "admin"))
KEY_SECRET = "tm-bench-page-key"


def metrics(rng: random.Random, rows: int) -> dict[str, Any]:
    """A finished job's stored metrics, in the parts the page and status read (a few KB)."""
    prompt, output = rows * rng.randint(80, 300), rows * rng.randint(16, 128)
    wall = rows / rng.uniform(5, 50)
    dist = {k: rng.uniform(0.01, 2.0) for k in ("p50", "p90", "p95", "p99", "mean", "max", "min")}
    return {"requests": {"total": rows, "succeeded": rows, "failed": 0, "samples": rows},
            "tokens": {"prompt": prompt, "output": output, "total": prompt + output, "cached": 0},
            "latency_s": {k: dict(dist, n=rows) for k in ("ttft", "tpot", "e2e", "queue")},
            "throughput": {"generation_wall_s": wall, "output_tok_per_s": output / wall,
                           "total_tok_per_s": (prompt + output) / wall, "requests_per_s": rows / wall,
                           "model_load_s": 3.0, "runs": 1},
            "failures": {"rate": 0.0, "by_reason": {}},
            "cost": {"total": wall / 3600 * 2.5, "per_1m_output_tokens": wall / 3600 * 2.5 / output * 1e6,
                     "held": {"total": (wall + 20) / 3600 * 2.5}},
            "engine": {"dtype": "bfloat16", "task": "generate"}}


def fill(url: str, n: int, seed: int = 0) -> str:
    """N jobs (RUNNING of them running, with rows) into the database at `url`; returns a job id."""
    import datetime as dt

    from sqlalchemy import insert

    from tokenmill.schemas import storage as S
    from tokenmill.schemas import tables as T

    rng = random.Random(seed)
    eng = S.connect(url)
    S.KeyStore(eng).add("key_bench", "bench", KEY_SECRET)
    t0 = time.time() - n * 60
    jobs, batches = [], []
    for i in range(n):
        running = i >= n - RUNNING
        rows = rng.randint(20, 5000)
        start = dt.datetime.fromtimestamp(t0 + i * 60, dt.timezone.utc)
        jobs.append({"id": f"job-{i:06d}", "name": f"bench {i}", "status": "running" if running else "succeeded",
                     "spec": {"model": "smollm2-135m", "price_per_hour": 2.5}, "model": "smollm2-135m",
                     "engine_config": {"model": "smollm2-135m"}, "submitted_at": start, "started_at": start,
                     "finished_at": None if running else start + dt.timedelta(seconds=30), "total": rows,
                     "succeeded": None if running else rows, "failed": None if running else 0,
                     "metrics": None if running else metrics(rng, rows)})
        if i % 2:
            batches.append({"id": f"job-{i:06d}", "owner": "key_bench", "endpoint": "/v1/chat/completions",
                            "input_file_id": "file-bench", "completion_window": "24h", "created_at": t0 + i * 60,
                            "expires_at": t0 + i * 60 + 86400, "in_progress_at": t0 + i * 60, "lines": rows,
                            "completed_at": None if running else t0 + i * 60 + 30})
    outs, dead = [], []
    for j in jobs[-RUNNING:]:
        for r in range(LIVE_ROWS):
            outs.append({"job_id": j["id"], "input_file": 0, "input_row": r, "sample": 0, "id": f"r{r}",
                         "prompt_tokens": rng.randint(50, 500), "output_tokens": rng.randint(16, 128)})
        for r in range(LIVE_ROWS, LIVE_ROWS + 7):
            dead.append({"job_id": j["id"], "input_file": 0, "input_row": r, "id": f"r{r}",
                         "reason": rng.choice(["too_long", "invalid_row"]), "message": "bench"})
    with eng.begin() as conn:
        for part in range(0, len(jobs), 1000):
            conn.execute(insert(T.jobs), jobs[part:part + 1000])
        conn.execute(insert(T.api_batches), batches)
        conn.execute(insert(T.outputs), outs)
        conn.execute(insert(T.dead_letters), dead)
    return jobs[n // 2]["id"]


def start_ui(url: str) -> tuple[subprocess.Popen, str, str]:
    proc = subprocess.Popen([sys.executable, "-m", "tokenmill.jobs.cli", "ui", "--db", url, "--port", "0"], cwd=ROOT,
                            stderr=subprocess.PIPE, text=True)
    assert proc.stderr is not None
    m = re.search(r"(http://[\d.]+:\d+)/ \(log in with (\S+)\)", proc.stderr.readline())
    if not m:
        proc.kill()
        raise SystemExit(f"tokenmill ui did not start for {url}")
    return proc, m.group(1), m.group(2)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=10_000, help="jobs in each database")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--pg", default="postgresql://postgres@127.0.0.1:5432/test",
                    help="PostgreSQL server (a schema of its own is made and dropped)")
    args = ap.parse_args()

    import httpx
    from sqlalchemy import create_engine, text

    work = Path(tempfile.mkdtemp(prefix="bench-page-"))
    schema = f"bench_page_{uuid.uuid4().hex[:8]}"
    admin = create_engine(args.pg)
    with admin.begin() as conn:
        conn.execute(text(f'CREATE SCHEMA "{schema}"'))
    urls = {"sqlite": f"sqlite:///{work / 'page.db'}", "postgresql": f"{args.pg}?options=-csearch_path%3D{schema}"}
    procs: list[subprocess.Popen] = []
    runs: list[dict[str, Any]] = []
    try:
        servers = {}
        for backend, url in urls.items():
            t = time.perf_counter()
            job = fill(url, args.n)
            log(f"{backend}: {args.n:,} jobs written in {time.perf_counter() - t:.1f} s")
            proc, base, token = start_ui(url)
            procs.append(proc)
            servers[backend] = (base, {"admin": token, "key": KEY_SECRET}, job)
        client = httpx.Client(timeout=30)

        def ask(backend: str, name: str, path: str, who: str, rnd: int | None) -> None:
            base, secrets, job = servers[backend]
            t = time.perf_counter()
            r = client.get(base + path.format(job=job), headers={"Authorization": f"Bearer {secrets[who]}"})
            ms = (time.perf_counter() - t) * 1000
            if r.status_code != 200 or "<main" not in r.text:
                raise SystemExit(f"{backend} {path}: HTTP {r.status_code}")
            if rnd is not None:
                runs.append({"backend": backend, "page": name, "round": rnd, "ms": ms, "bytes": len(r.content)})
                print(f"round {rnd} {backend:10s} {name:10s} {ms:7.1f} ms", flush=True)

        for backend in servers:
            for name, path, who in PAGES:
                for _ in range(WARMUP):
                    ask(backend, name, path, who, None)
        order = list(servers)
        for rnd in range(args.rounds):
            for backend in (order if rnd % 2 == 0 else order[::-1]):
                for name, path, who in PAGES:
                    ask(backend, name, path, who, rnd)
    finally:
        for p in procs:
            p.terminate()
            p.wait(30)
        with admin.begin() as conn:
            conn.execute(text(f'DROP SCHEMA "{schema}" CASCADE'))
        admin.dispose()
    summary = {}
    for backend in urls:
        for name, _, _ in PAGES:
            ms = sorted(r["ms"] for r in runs if r["backend"] == backend and r["page"] == name)
            summary[f"{backend}/{name}"] = {"median_ms": statistics.median(ms),
                                            "p95_ms": ms[min(len(ms) - 1, int(0.95 * len(ms)))], "max_ms": ms[-1],
                                            "n": len(ms)}
    print(f"\n{'backend/page':28s} {'median':>8s} {'p95':>8s} {'max':>8s}  (ms, {args.n:,} jobs)")
    for k, s in summary.items():
        print(f"{k:28s} {s['median_ms']:8.1f} {s['p95_ms']:8.1f} {s['max_ms']:8.1f}")
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / f"page-{utc_stamp()}.json"
    out.write_text(json.dumps({"when": utc_now(), "machine": machine(), "jobs": args.n, "rounds": args.rounds,
                               "pages": PAGES, "summary": summary, "runs": runs}, indent=1, default=str))
    log(f"wrote {out.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
