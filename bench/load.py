"""Load benchmark: a 20k-row job with small max_tokens, every row accounted for,
and the launching process's peak memory compared with a 2k-row job.

Each size runs as a real `tokenmill run` subprocess (real engine); a sampler
thread reads the RSS of the launcher process (the Beam pipeline runs inside it
with the DirectRunner) and of its whole process tree (vLLM's engine core is a
child) every 0.2 s.  About 1% of the rows have a null prompt, so the check
"total == outputs + dead letters" covers both sinks.

    python -m bench.load [--sizes 2000,20000] [--max-tokens 2] [--json bench/results/load.json]

Run it alone on the machine (it starts one engine per size).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pyarrow as pa
import pyarrow.parquet as pq

WORK = Path(__file__).resolve().parent / "work" / "load"
BAD_EVERY = 100  # one row in 100 has a null prompt: a dead letter


def make_input(path: Path, rows: int) -> int:
    ids = [f"L{i:06d}" for i in range(rows)]
    prompts = [None if i % BAD_EVERY == BAD_EVERY - 1 else f"Give one word that rhymes with item {i}." for i in range(rows)]
    pq.write_table(pa.table({"id": ids, "prompt": pa.array(prompts, pa.string())}), path, row_group_size=4096)
    return sum(p is None for p in prompts)


class Sampler(threading.Thread):
    def __init__(self, pid: int, every_s: float = 0.2):
        super().__init__(daemon=True)
        self.proc = psutil.Process(pid)
        self.every_s = every_s
        self.stop = threading.Event()
        self.peak_launcher = 0
        self.peak_tree = 0
        self.samples: list[tuple[float, int]] = []

    def run(self):
        t0 = time.time()
        while not self.stop.wait(self.every_s):
            try:
                rss = self.proc.memory_info().rss
                tree = rss
                for c in self.proc.children(recursive=True):
                    try:
                        tree += c.memory_info().rss
                    except psutil.NoSuchProcess:
                        pass
            except psutil.NoSuchProcess:
                return
            self.peak_launcher = max(self.peak_launcher, rss)
            self.peak_tree = max(self.peak_tree, tree)
            self.samples.append((round(time.time() - t0, 1), rss))


def run_size(rows: int, max_tokens: int, max_num_seqs: int) -> dict:
    d = WORK / str(rows)
    d.mkdir(parents=True, exist_ok=True)
    inp = d / "in.parquet"
    bad = make_input(inp, rows)
    db = d / "load.db"
    for f in d.glob("load.db*"):
        f.unlink()
    job = f"load-{rows}-{int(time.time())}"
    cmd = [
        sys.executable, "-m", "tokenmill.jobs.cli", "run", "--input", str(inp), "--output", str(d / "out"),
        "--db", f"sqlite:///{db}", "--job-id", job, "--max-tokens", str(max_tokens),
        "--max-num-seqs", str(max_num_seqs), "--max-model-len", "512", "--gpu-memory-utilization", "0.3", "--json",
    ]
    t0 = time.time()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    sampler = Sampler(proc.pid)
    sampler.start()
    stdout, stderr = proc.communicate()
    wall = time.time() - t0
    sampler.stop.set()
    sampler.join()
    if proc.returncode not in (0, 3):  # 3 = partial: the planted dead letters
        raise SystemExit(f"run of {rows} rows failed (exit {proc.returncode}): {stderr[-2000:]}")
    summary = json.loads(stdout)
    out = pq.read_table(d / "out" / "outputs.parquet", columns=["id"]).column("id").to_pylist()
    dead = pq.read_table(d / "out" / "dead_letters.parquet", columns=["id", "reason"]).to_pylist()
    ids = out + [r["id"] for r in dead]
    accounted = len(ids) == len(set(ids)) == rows and summary["rows_in"] == rows
    return {
        "rows": rows,
        "planted_dead_letters": bad,
        "status": summary["status"],
        "succeeded": summary["succeeded"],
        "failed": summary["failed"],
        "every_row_accounted_for": accounted and summary["failed"] == bad,
        "wall_s": round(wall, 1),
        "generation_wall_s": summary.get("generation_wall_s"),
        "rows_per_s": round(rows / wall, 1),
        "output_tok_per_s": summary.get("output_tok_per_s"),
        "launcher_peak_rss_mib": round(sampler.peak_launcher / 2**20, 1),
        "tree_peak_rss_mib": round(sampler.peak_tree / 2**20, 1),
        "rss_samples": len(sampler.samples),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="2000,20000")
    ap.add_argument("--max-tokens", type=int, default=2)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--json", default=str(Path(__file__).resolve().parent / "results" / "load.json"))
    a = ap.parse_args()
    results = []
    for n in [int(x) for x in a.sizes.split(",")]:
        r = run_size(n, a.max_tokens, a.max_num_seqs)
        results.append(r)
        print(json.dumps(r), flush=True)
    report = {
        "command": "python -m bench.load " + " ".join(sys.argv[1:]),
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
        f"{psutil.virtual_memory().total / 2**30:.0f} GiB",
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "max_tokens": a.max_tokens,
        "results": results,
    }
    if len(results) >= 2:
        report["launcher_peak_rss_ratio_last_to_first"] = round(
            results[-1]["launcher_peak_rss_mib"] / results[0]["launcher_peak_rss_mib"], 3
        )
    Path(a.json).parent.mkdir(parents=True, exist_ok=True)
    Path(a.json).write_text(json.dumps(report, indent=2))
    print("| rows | status | ok | dead letters | accounted | wall s | rows/s | launcher peak RSS MiB | tree peak RSS MiB |")
    for r in results:
        print(f"| {r['rows']:,} | {r['status']} | {r['succeeded']:,} | {r['failed']:,} | {r['every_row_accounted_for']} | "
              f"{r['wall_s']} | {r['rows_per_s']} | {r['launcher_peak_rss_mib']} | {r['tree_peak_rss_mib']} |")
    if not all(r["every_row_accounted_for"] for r in results):
        raise SystemExit("some rows were not accounted for")


if __name__ == "__main__":
    main()
