"""Database write benchmark: 100k output rows through the job's own write path.

Each finished batch of the pipeline is one `transforms.write.commit_batch` call = one
transaction with idempotent bulk inserts (its outputs and its figures); this drives that same function
with realistic rows (a ~400-character answer each) into SQLite (a file, WAL)
and the PostgreSQL server on 127.0.0.1:5432 (a fresh schema), then writes the
same rows a second time (a resumed job: every key exists, nothing is added).

    python -m bench.db_writes [--rows 100000] [--batch 256] [--pg URL] [--json FILE]

Prints one line per backend and writes the whole result as JSON to `--json`
(default bench/results/db-writes-<UTC stamp>.json): the machine (CPU model,
cores, load average before and after), the PostgreSQL server version, and per
backend the insert and rerun seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import uuid
from pathlib import Path

from sqlalchemy import create_engine, text

from bench.common import RESULTS, utc_now, utc_stamp
from tokenmill.jobs.metrics.hardware import cpu_flags
from tokenmill.schemas import storage as S
from tokenmill.schemas.records import BatchStats, OutputRow
from tokenmill.transforms.engines.device import cpu_model
from tokenmill.transforms.write import commit_batch

PG_URL = os.environ.get("TOKENMILL_TEST_PG_URL", "postgresql+psycopg2://postgres@127.0.0.1:5432/test")
ANSWER = ("The capital of France is Paris, a city on the Seine known for its museums, cafés and long history. " * 4)[:400]


def make_batches(job_id: str, rows: int, batch: int) -> list[list[dict]]:
    out, cur = [], []
    t = time.time()
    for i in range(rows):
        cur.append(OutputRow(
            job_id=job_id, id=f"req-{i:07d}", input_file=i // 100_000, input_row=i % 100_000, text=ANSWER,
            finish_reason="stop", prompt_tokens=80 + i % 50, output_tokens=100 + i % 30, cached_tokens=64,
            ttft_s=0.05 + (i % 100) / 1000, tpot_s=0.02, e2e_s=2.0 + (i % 10) / 10, queue_s=0.001,
            model="smollm2-135m", batch_id=f"b{i // batch}", worker="bench:1", finished_at=t + i / 1000,
        ).as_dict())
        if len(cur) == batch:
            out.append(cur)
            cur = []
    if cur:
        out.append(cur)
    return out


def _stats(job_id: str, i: int, rows: list[dict]) -> dict:
    return BatchStats(job_id=job_id, batch_id=f"b{i}", worker="bench:1", requests=len(rows)).as_dict()


def run_backend(name: str, url: str, batches: list[list[dict]], job_id: str) -> dict:
    eng = S.connect(url)  # schema at head before timing
    t0 = time.perf_counter()
    for i, b in enumerate(batches):
        commit_batch(url, job_id, b, [], _stats(job_id, i, b))
    first = time.perf_counter() - t0
    t0 = time.perf_counter()
    for i, b in enumerate(batches):
        commit_batch(url, job_id, b, [], _stats(job_id, i, b))
    again = time.perf_counter() - t0
    n = S.MetricsReader(eng).counts(job_id)["succeeded"]
    rows = sum(len(b) for b in batches)
    assert n == rows, f"{name}: {n} rows in the table, expected {rows}"
    return {"backend": name, "rows": rows, "transactions": len(batches), "insert_s": round(first, 2),
            "rows_per_s": round(rows / first), "rerun_insert_s": round(again, 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=100_000)
    ap.add_argument("--batch", type=int, default=256, help="rows per transaction (one finished batch)")
    ap.add_argument("--pg", default=PG_URL, help="PostgreSQL URL; 'none' to skip")
    ap.add_argument("--json", dest="json_path", default=None,
                    help="write the result here (default bench/results/db-writes-<UTC stamp>.json)")
    args = ap.parse_args()
    started = utc_now()
    load_before = os.getloadavg()
    pg_version = None
    job_id = f"bench-{uuid.uuid4().hex[:8]}"
    batches = make_batches(job_id, args.rows, args.batch)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        results.append(run_backend("sqlite", f"sqlite:///{tmp}/bench.db", batches, job_id))
    if args.pg != "none":
        schema = f"bench_{uuid.uuid4().hex[:8]}"
        admin = create_engine(args.pg)
        with admin.begin() as conn:
            conn.execute(text(f'CREATE SCHEMA "{schema}"'))
            pg_version = conn.execute(text("SHOW server_version")).scalar()
        try:
            sep = "&" if "?" in args.pg else "?"
            results.append(run_backend("postgresql", f"{args.pg}{sep}options=-csearch_path%3D{schema}", batches, job_id))
        finally:
            with admin.begin() as conn:
                conn.execute(text(f'DROP SCHEMA "{schema}" CASCADE'))
            admin.dispose()
    for r in results:
        print(f"{r['backend']:<11} {r['rows']:>7} rows in {r['transactions']} transactions: {r['insert_s']:.2f} s "
              f"({r['rows_per_s']:,} rows/s); rerun (all keys exist) {r['rerun_insert_s']:.2f} s")
    doc = {"benchmark": "db-writes", "started_at": started, "finished_at": utc_now(),
           "command": " ".join(["python -m bench.db_writes", *sys.argv[1:]]),
           "machine": f"{cpu_model()}, {os.cpu_count()} cores",
           "cpu_isa": sorted(f for f in cpu_flags() if f.startswith(("avx512", "amx")) or f == "avx2"),
           "memory_bytes": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"),
           "load_average_1m": {"before": round(load_before[0], 2), "after": round(os.getloadavg()[0], 2)},
           "postgresql_server_version": pg_version, "rows": args.rows, "batch_rows": args.batch,
           "results": results}
    path = Path(args.json_path) if args.json_path else RESULTS / f"db-writes-{utc_stamp()}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=2) + "\n")
    print(f"result: {path}")


if __name__ == "__main__":
    main()
