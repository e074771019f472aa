"""`make bench-lora`: rows spread over 4 LoRA adapters in one job (A) against the same rows in
4 jobs of one adapter each (B), on vLLM, each job a `tokenmill run` process of its own: one
untimed warm-up of each arm, then A B B A.

    python -m tokenmill.jobs.lifecycle.envexec python -m bench.lora      # ~10 min, 2-core CPU

The adapters are made here with peft on the bundled model (rank 8 on q_proj and v_proj, random
weights, seeded: throughput does not depend on what they learned), kept under bench/work/lora.
Throughput of an arm: its rows ÷ its generation wall (A: the one job's; B: the sum of its four
jobs'), model load apart; the whole-process walls (B loads the model four times) beside it.
The ratio A ÷ B is paired within a round (round 1 = runs 1-2, round 2 = runs 4-3); its
interval is the range of the two rounds' ratios.  Writes `bench/results/lora-<stamp>.json`
and prints the section for docs/BENCHMARKS.md.
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

ADAPTERS = 4
RANK = 8
ORDER = ("one", "four", "four", "one")
WORDS = ("river stone market engine window garden silver quiet morning letter table music station cloud paper "
         "winter harbor lantern orange planet meadow violin forest candle bridge").split()


def make_adapters(work: Path, base: str) -> dict[str, str]:
    """ADAPTERS random rank-RANK adapters for the bundled model (made once, seeded)."""
    out = {f"a{i}": work / "adapters" / f"a{i}" for i in range(ADAPTERS)}
    if all((p / "adapter_config.json").is_file() for p in out.values()):
        return {k: str(v) for k, v in out.items()}
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    for i, (name, path) in enumerate(out.items()):
        torch.manual_seed(i)
        model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
        cfg = LoraConfig(r=RANK, lora_alpha=16, target_modules=["q_proj", "v_proj"], init_lora_weights=False,
                         task_type="CAUSAL_LM")
        get_peft_model(model, cfg).save_pretrained(path)
        log(f"adapter {name} made in {path}")
    return {k: str(v) for k, v in out.items()}


def make_inputs(work: Path, n: int, seed: int) -> dict[str, Path]:
    """All rows (`all.parquet`, the adapter column cycling over the adapters) and each adapter's rows alone."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = random.Random(seed)
    rows = [{"id": f"r{i}", "adapter": f"a{i % ADAPTERS}",
             "messages": json.dumps([{"role": "user", "content": "Write about: " + " ".join(
                 rng.choice(WORDS) for _ in range(rng.randint(4, 40)))}])} for i in range(n)]
    paths = {"all": work / "all.parquet"}
    pq.write_table(pa.Table.from_pylist(rows), paths["all"])
    for a in range(ADAPTERS):
        paths[f"a{a}"] = work / f"a{a}.parquet"
        pq.write_table(pa.Table.from_pylist([r for r in rows if r["adapter"] == f"a{a}"]), paths[f"a{a}"])
    return paths


def one_job(work: Path, inp: Path, adapters: dict[str, str], label: str, args) -> dict[str, Any]:
    import yaml

    spec = {"input": str(inp), "output": str(work / f"out-{label}"), "job_id": f"lora-{label}",
            "db": f"sqlite:///{work / 'lora.db'}",
            "engine": {"dtype": args.dtype, "max_model_len": 1024, "lora_adapters": adapters,
                       "max_loras": len(adapters), "max_lora_rank": RANK},
            "sampling": {"max_tokens": args.max_tokens, "temperature": 0.0}}
    path = work / f"{label}.yaml"
    path.write_text(yaml.safe_dump(spec))
    cmd = [sys.executable, "-m", "tokenmill.jobs.cli", "run", str(path), "--json"]
    t = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - t
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {proc.returncode}: {proc.stderr.strip()[-800:]}")
    s = json.loads(proc.stdout)
    return {"rows": s["succeeded"], "generation_wall_s": s["generation_wall_s"], "model_load_s": s["model_load_s"],
            "process_wall_s": wall}


def arm(work: Path, paths: dict[str, Path], adapters: dict[str, str], arm_name: str, label: str,
        args) -> dict[str, Any]:
    if arm_name == "one":
        jobs = [one_job(work, paths["all"], adapters, f"{label}-one", args)]
    else:
        jobs = [one_job(work, paths[a], {a: adapters[a]}, f"{label}-{a}", args) for a in adapters]
    rows, gen = sum(j["rows"] for j in jobs), sum(j["generation_wall_s"] for j in jobs)
    return {"arm": arm_name, "jobs": jobs, "rows": rows, "generation_wall_s": gen, "rows_per_s": rows / gen,
            "model_load_s": sum(j["model_load_s"] or 0 for j in jobs),
            "process_wall_s": sum(j["process_wall_s"] for j in jobs)}


def run(args) -> dict[str, Any]:
    from tokenmill.schemas.models import resolve_model

    work = WORK / "lora"
    work.mkdir(parents=True, exist_ok=True)
    (work / "lora.db").unlink(missing_ok=True)
    adapters = make_adapters(work, str(resolve_model("smollm2-135m")))
    paths = make_inputs(work, args.n, args.seed)
    res: dict[str, Any] = {"command": " ".join(["python -m bench.lora", *sys.argv[1:]]), "started_at": utc_now(),
                           **machine(), "cpu_features": cpu_features(), "rows": args.n, "dtype": args.dtype,
                           "max_tokens": args.max_tokens, "adapters": ADAPTERS, "rank": RANK,
                           "order": ["warm-up one", "warm-up four", *ORDER], "runs": []}
    res["warmup"] = [arm(work, paths, adapters, "one", "w", args), arm(work, paths, adapters, "four", "w", args)]
    log("warm-ups (not counted): " + ", ".join(f"{r['arm']} {r['rows_per_s']:.2f} rows/s" for r in res["warmup"]))
    for i, name in enumerate(ORDER, 1):
        r = arm(work, paths, adapters, name, str(i), args)
        res["runs"].append(r)
        log(f"run {i} {name}: {r['rows_per_s']:.2f} rows/s, generation {r['generation_wall_s']:.1f} s, "
            f"processes {r['process_wall_s']:.1f} s")
    rs = [r["rows_per_s"] for r in res["runs"]]
    res["ratios"] = [rs[0] / rs[1], rs[3] / rs[2]]
    pw = [r["process_wall_s"] for r in res["runs"]]
    res["process_wall_ratios"] = [pw[1] / pw[0], pw[2] / pw[3]]
    res["finished_at"] = utc_now()
    return res


def markdown(res: dict[str, Any], json_name: str) -> str:
    lines = [
        "## LoRA adapters: 4 adapters in one job against 4 jobs of one", "",
        f"### {res['cpu_features']}, {res['started_at'][:10]} (`bench/results/{json_name}`)", "",
        f"Command `{res['command']}`, {res['started_at']} → {res['finished_at']}. {res['rows']} chat rows (seeded), "
        f"their `adapter` cycling over {res['adapters']} random rank-{res['rank']} adapters (q_proj, v_proj) of "
        f"smollm2-135m in {res['dtype']}, greedy, max_tokens {res['max_tokens']}, vLLM. A: one job of all rows "
        f"(max_loras {res['adapters']}); B: each adapter's rows in a job of its own (max_loras 1), one after "
        "another. Rows/s over the generation wall (B: summed over its jobs), model load apart; every job a "
        "`tokenmill run` process. One untimed warm-up of each, then A B B A.", "",
        "| run | arm | jobs | rows/s | generation wall s | model load s | process wall s |",
        "|---|---|---|---|---|---|---|",
    ]
    for label, r in [("warm-up", w) for w in res["warmup"]] + list(enumerate(res["runs"], 1)):
        lines.append(f"| {label} | {'A one job' if r['arm'] == 'one' else 'B four jobs'} | {len(r['jobs'])} | "
                     f"{r['rows_per_s']:.2f} | {r['generation_wall_s']:.1f} | {r['model_load_s']:.1f} | "
                     f"{r['process_wall_s']:.1f} |")
    lo, hi = min(res["ratios"]), max(res["ratios"])
    plo, phi = min(res["process_wall_ratios"]), max(res["process_wall_ratios"])
    lines += ["", f"A ÷ B rows/s over the generation wall, per round: {res['ratios'][0]:.2f}, {res['ratios'][1]:.2f} "
                  f"(interval {lo:.2f}–{hi:.2f}); B ÷ A whole-process wall: {plo:.2f}–{phi:.2f}.", ""]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=400, help="rows (default 400, 100 per adapter)")
    ap.add_argument("--dtype", default="bfloat16", help="the engine's dtype (default bfloat16)")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--seed", type=int, default=5)
    ap.add_argument("--json", help="results path (default bench/results/lora-<stamp>.json)")
    args = ap.parse_args()
    res = run(args)
    path = Path(args.json) if args.json else Path(__file__).resolve().parent / "results" / f"lora-{utc_stamp()}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(res, indent=2, default=str))
    print(markdown(res, path.name))


if __name__ == "__main__":
    main()
