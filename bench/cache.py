"""What the result cache saves: a warm rerun against a cold run of the same rows (`make bench-cache`).

Each round runs two whole `tokenmill run` processes on the bundled model (greedy, so every
row is cacheable), in a fresh database of its own:

- **cold**: a job on the input's first N rows with `cache: read-write` (the cache is empty:
  every row is generated, and stored);
- **warm**: a new job (another id) on the same N rows plus 10% new ones, `cache: read-write`:
  the N rows come from the cache, the new ones from the engine.

The warm arm needs the cold arm's cache, so within a round cold runs first; the rounds
alternate which arm's round comes first only in the sense that each round is a fresh
database.  One warm-up job runs first (not counted: page cache, the dtype measurement).
Reported per round: each arm's process wall, the job's held wall and cost (its own
accounting, all held time), generation wall, rows the engine generated, rows served from
the cache; and warm ÷ cold for wall and cost.  Not a timed test: a program whose figures go to
docs/BENCHMARKS.md.

    python -m bench.cache --n 200 --rounds 2
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.common import WORK, code_label, log, utc_stamp, write_report

SAMPLE = Path(__file__).resolve().parent.parent / "data" / "sample_prompts.parquet"


def make_inputs(n: int, folder: Path) -> tuple[str, str]:
    """The first `n` rows of the bundled sample, and those plus the next n/10 (new rows)."""
    import pyarrow.parquet as pq

    t = pq.read_table(SAMPLE)
    extra = max(1, n // 10)
    if t.num_rows < n + extra:
        raise SystemExit(f"the bundled sample has {t.num_rows} rows; --n {n} needs {n + extra}")
    folder.mkdir(parents=True, exist_ok=True)
    cold, warm = folder / "cold.parquet", folder / "warm.parquet"
    pq.write_table(t.slice(0, n), cold)
    pq.write_table(t.slice(0, n + extra), warm)
    return str(cold), str(warm)


def run(inp: str, folder: Path, job_id: str, db_url: str, max_tokens: int, model: str) -> dict[str, Any]:
    """One `tokenmill run --json` process; its summary, process wall and the job's metrics."""
    from tokenmill.schemas import storage as S

    cmd = [sys.executable, "-m", "tokenmill.jobs.cli", "run", "--input", inp, "--output", str(folder / job_id),
           "--db", db_url, "--job-id", job_id, "--model", model, "--max-tokens", str(max_tokens),
           "--temperature", "0", "--cache", "read-write", "--json"]
    t0 = time.monotonic()
    p = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.monotonic() - t0
    if p.returncode != 0:
        raise SystemExit(f"{job_id}: exit {p.returncode}: {p.stderr.strip()[-2000:]}")
    summary = json.loads(p.stdout)
    metrics = S.JobStore(S.connect(db_url)).get(job_id)["metrics"] or {}
    workers = S.MetricsReader(S.connect(db_url)).workers(job_id)
    cost = metrics.get("cost") or {}
    return {
        "job_id": job_id, "process_wall_s": round(wall, 2), "rows_in": summary["rows_in"],
        "held_wall_s": (metrics.get("throughput") or {}).get("job_wall_s"),
        "generation_wall_s": summary.get("generation_wall_s"),
        "cost_usd": (cost.get("held") or {}).get("total"), "cost_generation_usd": cost.get("total"),
        "engine_rows": sum(int(w.get("generated_rows") or 0) for w in workers),
        "cache": metrics.get("cache"),
    }


def ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else round(a / b, 3)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=200, help="rows of the cold job (the warm one adds 10%%)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    stamp = utc_stamp()
    root = WORK / "cache" / stamp
    cold_in, warm_in = make_inputs(args.n, root)
    log("warm-up job (not counted)")
    run(cold_in, root / "warmup", "warmup", f"sqlite:///{root / 'warmup.db'}", args.max_tokens, args.model)
    rounds = []
    for i in range(args.rounds):
        db = f"sqlite:///{root / f'round{i}.db'}"
        cold = run(cold_in, root / f"round{i}", f"cold-{i}", db, args.max_tokens, args.model)
        warm = run(warm_in, root / f"round{i}", f"warm-{i}", db, args.max_tokens, args.model)
        r = {"round": i, "cold": cold, "warm": warm,
             "warm_over_cold": {k: ratio(warm[k], cold[k]) for k in
                                ("process_wall_s", "held_wall_s", "generation_wall_s", "cost_usd", "engine_rows")}}
        rounds.append(r)
        log(f"round {i}: cold {cold['process_wall_s']} s, {cold['engine_rows']} engine rows, ${cold['cost_usd']}; "
            f"warm {warm['process_wall_s']} s, {warm['engine_rows']} engine rows, ${warm['cost_usd']}; "
            f"warm/cold {r['warm_over_cold']}")
    rep = {"n": args.n, "new_rows": max(1, args.n // 10), "max_tokens": args.max_tokens, "model": args.model,
           "code": code_label(None), "made_at": stamp, "rounds": rounds}
    print(json.dumps(rep, indent=1, default=str))
    write_report(rep, args.json, f"cache-{stamp}.json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
