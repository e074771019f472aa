"""`make bench-tune`: the acceptance measurement of `tokenmill tune` (docs/TUNE.md).

1. `tokenmill tune` on the bundled sample (`data/sample_prompts.parquet`) with the job
   spec as a user gives it (every engine and batching setting at its default), the
   default gate (the bundled eval set's accuracy, at most 3 points lost), `--sample` rows,
   `--budget-minutes`, and `bench/tune_space.yaml`: the default search space plus two
   W8A8 checkpoints made for the tune (RTN, and SmoothQuant + GPTQ calibrated on the
   job's own input; made once, outside the budget);
2. then the spec as given (A) and the winning spec (B) as full jobs on the whole file,
   each a fresh `tokenmill run` process (its own engine, as a nightly job runs), after
   one warm-up of each, interleaved A B B A (`--reps` pairs); every run kept.

Compared: $ per 1M output tokens over generation only (the figure tune ranks by),
the same over all held time, output tok/s, P95 TPOT, and `compare`'s gate on the full
outputs (each B run against the first A run).  The claim "B is ≥ 1.3× cheaper" holds only
where every B run is cheaper than every A run by that factor; where tune kept the spec as
given, nothing is confirmed and the tune table is the result.
Writes `bench/results/tune-<stamp>.json` and prints a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml

from bench.common import RESULTS, ROOT, WORK, log, machine, utc_now, utc_stamp

TARGET = 1.3


def cli(*args: str) -> subprocess.CompletedProcess:
    exe = Path(sys.executable).with_name("tokenmill")
    return subprocess.run([str(exe), *args], capture_output=True, text=True)


def full_job(spec_file: Path, job_id: str, db: str) -> dict[str, Any]:
    from tokenmill.jobs.modeltools.tune import figures_of
    from tokenmill.schemas import storage as S

    t = time.perf_counter()
    p = cli("run", str(spec_file), "--job-id", job_id, "--output", str(WORK / "tune" / "full" / job_id),
            "--db", db, "--json")
    wall = time.perf_counter() - t
    if p.returncode != 0:
        raise RuntimeError(f"tokenmill run {spec_file.name} exited {p.returncode}: {p.stderr.strip()[-800:]}")
    job = S.JobStore(S.connect(db)).get(job_id)
    m = job["metrics"] or {}
    return {"job_id": job_id, "wall_s": wall, "succeeded": job["succeeded"], "failed": job["failed"],
            "cost_held_per_1m_output": ((m.get("cost") or {}).get("held") or {}).get("per_1m_output_tokens"),
            **figures_of(m)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--input", default=str(ROOT / "data" / "sample_prompts.parquet"))
    ap.add_argument("--sample", type=int, default=64)
    ap.add_argument("--budget-minutes", type=float, default=20.0)
    ap.add_argument("--reps", type=int, default=2, help="A B B A pairs of full jobs after the tune")
    ap.add_argument("--space", default=str(ROOT / "bench" / "tune_space.yaml"))
    ap.add_argument("--keep", action="store_true", help="Reuse bench/work/tune (resume an interrupted tune).")
    args = ap.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from bench.throughput import abba
    from tokenmill.jobs.modeltools.compare import compare_jobs
    from tokenmill.schemas import storage as S

    work = WORK / "tune"
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True, exist_ok=True)
    db = f"sqlite:///{work / 'tune.db'}"
    ref_file = work / "job.yaml"
    ref_file.write_text(yaml.safe_dump({"input": args.input, "output": str(work / "runs" / "sample")}))
    res: dict[str, Any] = {"benchmark": "tune", "started_at": utc_now(), "machine": machine(),
                           "spec_as_given": yaml.safe_load(ref_file.read_text()), "sample": args.sample,
                           "budget_minutes": args.budget_minutes, "space": Path(args.space).read_text(),
                           "target": TARGET}

    log(f"tokenmill tune --sample {args.sample} --budget-minutes {args.budget_minutes}")
    t = time.perf_counter()
    p = cli("tune", str(ref_file), "--sample", str(args.sample), "--out", str(work / "out"),
            "--budget-minutes", str(args.budget_minutes), "--space", args.space, "--db", db, "--json")
    res["tune_wall_s"] = time.perf_counter() - t
    if p.returncode != 0:
        raise SystemExit(f"tokenmill tune exited {p.returncode}: {p.stderr.strip()[-800:]}")
    tuned = json.loads(p.stdout)
    res["tune"] = tuned
    res["tune_table"] = (work / "out" / "tune-table.txt").read_text()
    log(f"tune finished in {res['tune_wall_s']:.0f} s: winner {tuned['winner']}")
    print(res["tune_table"])

    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / f"tune-{utc_stamp()}.json"
    if tuned["winner"] == "ref":
        res["confirmation"] = "tune kept the spec as given: nothing to confirm"
    else:
        win_file = Path(tuned["files"]["spec"])
        files = {"A": ref_file, "B": win_file}
        runs: dict[str, list[dict[str, Any]]] = {"A": [], "B": []}
        for arm in files:
            log(f"warm-up {arm}")
            full_job(files[arm], f"full-warm-{arm}", db)
        for i, arm in enumerate(abba(["A", "B"], args.reps)):
            log(f"full job {arm} ({i + 1})")
            r = full_job(files[arm], f"full-{arm}-{i + 1}", db)
            log(f"  {arm}: ${r['cost']:.4f}/1M out, {r['output_tok_per_s']:.1f} output tok/s")
            runs[arm].append(r)
        eng = S.connect(db)
        gate = tuned["gate"]
        for r in runs["B"]:
            c = compare_jobs(eng, runs["A"][0]["job_id"], r["job_id"]).as_dict()
            c.pop("worst", None)
            r["vs_first_A"] = c
        a, b = ([r["cost"] for r in runs[k]] for k in ("A", "B"))
        res["confirmation"] = {
            "runs": runs, "gate": gate,
            "median_cost": {"A": statistics.median(a), "B": statistics.median(b)},
            "cheaper_by_median": statistics.median(a) / statistics.median(b),
            "cheaper_worst_case": min(a) / max(b),
            "target_met": min(a) / max(b) >= TARGET,
            "meaning": "cheaper_worst_case = cheapest A run / costliest B run: every B run at least that many "
                       "times cheaper than every A run",
        }
    res["finished_at"] = utc_now()
    out.write_text(json.dumps(res, indent=1, default=str))
    print(markdown(res))
    print(f"results {out}")
    return 0


def markdown(res: dict[str, Any]) -> str:
    c = res.get("confirmation")
    if not isinstance(c, dict):
        return f"Confirmation: {c}"
    lines = ["| run | $/1M output (generation) | output tok/s | P95 TPOT | rows | exact / similarity vs A1 |",
             "|---|---|---|---|---|---|"]
    for arm in ("A", "B"):
        for r in c["runs"][arm]:
            v = r.get("vs_first_A") or {}
            sim = f"{v.get('exact_match_rate', 0):.1%} / {v.get('word_similarity', 0):.3f}" if v else "-"
            lines.append(f"| {r['job_id']} | {r['cost']:.4f} | {r['output_tok_per_s']:.1f} | "
                         f"{(r.get('tpot_p95_s') or 0) * 1000:.1f} ms | {r['succeeded']} | {sim} |")
    lines.append(f"\nB cheaper than A: {c['cheaper_by_median']:.2f}× by median, {c['cheaper_worst_case']:.2f}× worst case "
                 f"(target ≥ {TARGET}×: {'MET' if c['target_met'] else 'MISSED'})")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
