"""`make bench-embed`: an embedding job (`tokenmill run --task embed`) against vLLM's own
`LLM.embed` on the same rows, same model, dtype and pooling, each a whole process of its own:
one untimed warm-up of each, then A B B A (A `LLM.embed`, B tokenmill).

    python -m tokenmill.jobs.lifecycle.envexec python -m bench.embed      # ~5 min, 2-core CPU

Rows/s of each: tokenmill's over its job's generation wall (model load excluded; the engine
time the job accounts), `LLM.embed`'s over the `embed()` call alone (the model loaded first);
the whole-process walls beside them (`LLM.embed` with `gpu_memory_utilization` 0.5, as vLLM-CPU asks).  The ratio tokenmill ÷ LLM.embed is paired within a round
(round 1 = runs 1-2, round 2 = runs 4-3); the target is at least 0.9: PASS or MISS only where
both rounds fall on the same side of it, else "not resolved" with the range.  Writes
`bench/results/embed-<stamp>.json` and prints the section for docs/BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.common import WORK, log, machine, utc_now, utc_stamp
from bench.dtype_ab import cpu_features

TARGET = 0.9
ORDER = ("raw", "tokenmill", "tokenmill", "raw")
WORDS = ("river stone market engine window garden silver quiet morning letter table music station cloud paper "
         "winter harbor lantern orange planet meadow violin forest candle bridge").split()

RAW = r"""
import json, sys, time
import pyarrow.parquet as pq
from vllm import LLM
args = json.loads(sys.argv[1])
texts = pq.read_table(args["input"]).column("prompt").to_pylist()
t0 = time.perf_counter()
llm = LLM(model=args["model"], runner="pooling", convert="embed", pooler_config={"pooling_type": "LAST"},
          dtype=args["dtype"], max_model_len=args["max_model_len"], enforce_eager=True, gpu_memory_utilization=0.5)
load = time.perf_counter() - t0
t1 = time.perf_counter()
out = llm.embed(texts, use_tqdm=False)
wall = time.perf_counter() - t1
print("RESULT " + json.dumps({"rows": len(out), "embed_wall_s": wall, "model_load_s": load, "dim": len(out[0].outputs.embedding)}), flush=True)
import os
llm.llm_engine.engine_core.shutdown()
os._exit(0)  # the measurement is out: no interpreter teardown (vLLM's aborted it once here)
"""


def make_input(path: Path, n: int, seed: int) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = random.Random(seed)
    texts = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(6, 90))) + "." for _ in range(n)]
    pq.write_table(pa.table({"id": [f"e{i}" for i in range(n)], "prompt": texts}), path)


def raw_run(work: Path, inp: Path, args) -> dict[str, Any]:
    from tokenmill.schemas.models import resolve_model

    spec = {"input": str(inp), "model": str(resolve_model("smollm2-135m")), "dtype": args.dtype,
            "max_model_len": args.max_model_len}
    t = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", RAW, json.dumps(spec)], capture_output=True, text=True,
                          cwd=work)
    wall = time.perf_counter() - t
    result = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
    if result is None:
        raise RuntimeError(f"LLM.embed run exited {proc.returncode}: {proc.stderr.strip()[-800:]}")
    r = json.loads(result[7:])
    return {"arm": "raw", "rows": r["rows"], "rows_per_s": r["rows"] / r["embed_wall_s"],
            "engine_wall_s": r["embed_wall_s"], "model_load_s": r["model_load_s"], "process_wall_s": wall,
            "dim": r["dim"]}


def tokenmill_run(work: Path, inp: Path, label: str, args) -> dict[str, Any]:
    out = work / f"out-{label}"
    cmd = [sys.executable, "-m", "tokenmill.jobs.cli", "run", "--input", str(inp), "--output", str(out),
           "--job-id", f"embed-{label}", "--db", f"sqlite:///{work / 'embed.db'}", "--task", "embed",
           "--pooling", "last", "--dtype", args.dtype, "--max-model-len", str(args.max_model_len), "--json"]
    t = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - t
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {proc.returncode}: {proc.stderr.strip()[-800:]}")
    s = json.loads(proc.stdout)
    return {"arm": "tokenmill", "rows": s["succeeded"], "rows_per_s": s["succeeded"] / s["generation_wall_s"],
            "engine_wall_s": s["generation_wall_s"], "model_load_s": s["model_load_s"], "process_wall_s": wall}


def verdict(ratios: list[float]) -> str:
    lo, hi = min(ratios), max(ratios)
    if lo >= TARGET:
        return f"PASS: tokenmill ÷ LLM.embed {lo:.2f}–{hi:.2f}, at least {TARGET} in both rounds"
    if hi < TARGET:
        return f"MISS: tokenmill ÷ LLM.embed {lo:.2f}–{hi:.2f}, under {TARGET} in both rounds"
    return f"not resolved: tokenmill ÷ LLM.embed {lo:.2f}–{hi:.2f} straddles {TARGET}"


def run(args) -> dict[str, Any]:
    work = WORK / "embed"
    work.mkdir(parents=True, exist_ok=True)
    (work / "embed.db").unlink(missing_ok=True)
    inp = work / "texts.parquet"
    make_input(inp, args.n, args.seed)
    res: dict[str, Any] = {"command": " ".join(["python -m bench.embed", *sys.argv[1:]]), "started_at": utc_now(),
                           **machine(), "cpu_features": cpu_features(), "rows": args.n, "dtype": args.dtype,
                           "order": ["warm-up raw", "warm-up tokenmill", *ORDER], "runs": []}
    res["warmup"] = [raw_run(work, inp, args), tokenmill_run(work, inp, "warmup", args)]
    log(f"warm-ups (not counted): raw {res['warmup'][0]['rows_per_s']:.1f}, tokenmill {res['warmup'][1]['rows_per_s']:.1f} rows/s")
    for i, arm in enumerate(ORDER, 1):
        r = raw_run(work, inp, args) if arm == "raw" else tokenmill_run(work, inp, f"{i}", args)
        res["runs"].append(r)
        log(f"run {i} {arm}: {r['rows_per_s']:.1f} rows/s, engine {r['engine_wall_s']:.1f} s, process {r['process_wall_s']:.1f} s")
    rs = [r["rows_per_s"] for r in res["runs"]]
    res["ratios"] = [rs[1] / rs[0], rs[2] / rs[3]]
    res["verdict"] = verdict(res["ratios"])
    res["finished_at"] = utc_now()
    return res


def markdown(res: dict[str, Any], json_name: str) -> str:
    lines = [
        "## Embeddings: tokenmill against LLM.embed", "",
        f"### {res['cpu_features']}, {res['started_at'][:10]} (`bench/results/{json_name}`)", "",
        f"Command `{res['command']}`, {res['started_at']} → {res['finished_at']}. {res['rows']} texts of 6-90 "
        f"words (seeded), smollm2-135m in {res['dtype']}, last-token pooling, max_model_len as given; each run a "
        "whole process: `LLM.embed` (vLLM's pooling runner, `convert=embed`) timed over the `embed()` call, "
        "tokenmill (`tokenmill run --task embed`) over the job's generation wall; model load apart. One untimed "
        "warm-up of each, then A B B A (A LLM.embed, B tokenmill).", "",
        "| run | arm | rows/s | engine wall s | model load s | process wall s |", "|---|---|---|---|---|---|",
    ]
    for label, r in [("warm-up", w) for w in res["warmup"]] + list(enumerate(res["runs"], 1)):
        lines.append(f"| {label} | {r['arm']} | {r['rows_per_s']:.1f} | {r['engine_wall_s']:.2f} | "
                     f"{r['model_load_s']:.1f} | {r['process_wall_s']:.1f} |")
    lo, hi = min(res["ratios"]), max(res["ratios"])
    lines += ["", f"tokenmill ÷ LLM.embed rows/s per round: {res['ratios'][0]:.2f}, {res['ratios'][1]:.2f} "
                  f"({lo:.2f}–{hi:.2f}); target ≥ {TARGET}: **{res['verdict']}**.", ""]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=2000, help="texts (default 2000)")
    ap.add_argument("--dtype", default="bfloat16", help="both arms' dtype (default bfloat16)")
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--seed", type=int, default=3)
    ap.add_argument("--json", help="results path (default bench/results/embed-<stamp>.json)")
    args = ap.parse_args()
    res = run(args)
    path = Path(args.json) if args.json else Path(__file__).resolve().parent / "results" / f"embed-{utc_stamp()}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(res, indent=2, default=str))
    print(markdown(res, path.name))


if __name__ == "__main__":
    main()
