"""`make bench-estimate`: how close `tokenmill estimate` comes to the job it predicts, on this machine.

    python -m tokenmill.jobs.lifecycle.envexec python -m bench.estimate                       # ~25 min, 2-core CPU
    python -m tokenmill.jobs.lifecycle.envexec python -m bench.estimate --rows 60 --engines vllm --inputs sample

Three inputs of different length mixes:

- `sample`: the bundled data/sample_prompts.parquet (chat prompts of 37-425 tokens behind four
  system prompts, per-row max_tokens 32-96), its first `--rows` rows;
- `long_output`: short prompts asking for stories, per-row max_tokens uniform in [32, 256]
  (bench/workloads.long_output), `--rows` rows;
- `long_prompt`: documents of ~300 words with four short questions each, max_tokens 16,
  shuffled (bench/workloads.shared_prefix), about `--rows` rows.

For each input and each engine (`vllm`, `llamacpp` on the bundled SmolLM2-135M: its GGUF on
llama.cpp), in a fresh SQLite database: `tokenmill estimate --json` (the default sample: at most
10 % of the rows, at least 8), then the job itself, `tokenmill run --json`, each a process of its
own; the engines one after the other, never at once.  Recorded per run: each predicted figure
(generation wall, held wall, cost over all held time and over generation only, output tokens) with
its interval, the job's actual figure, the error and whether the interval held it, and the
estimate's own process wall.  Every run is reported, misses included.  Writes
`bench/results/estimate-<stamp>.json` (or `--json PATH`) and prints a table.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.common import ROOT, WORK, code_label, log, machine, utc_now, utc_stamp, write_report

SAMPLE = ROOT / "data" / "sample_prompts.parquet"
INPUTS = ("sample", "long_output", "long_prompt")
ENGINES = ("vllm", "llamacpp")
#: The figures compared, as jobs/estimate/beside.py names them.
FIGURES = ("generation_wall_s", "held_wall_s", "cost_usd", "cost_generation_usd", "tokens.output")
#: The accuracy the issue asks of generation wall and cost.
TARGET_PCT = 20.0


def make_input(name: str, rows: int, folder: Path, seed: int = 11) -> tuple[Path, int]:
    """The benchmark input `name` with about `rows` rows, written under `folder`, and the job's
    max_tokens for it (rows with their own `max_tokens` keep theirs)."""
    import pyarrow.parquet as pq

    from bench import workloads as W

    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.parquet"
    if name == "sample":
        t = pq.read_table(SAMPLE)
        pq.write_table(t.slice(0, min(rows, t.num_rows)), path)
        return path, 64
    if name == "long_output":
        return path, W.long_output(path, rows, seed=seed, min_out=32, max_out=256).max_tokens
    if name == "long_prompt":
        return path, W.shared_prefix(path, docs=max(1, rows // 4), questions=4, seed=seed, max_tokens=16).max_tokens
    raise SystemExit(f"--inputs: unknown input {name!r}; known: {', '.join(INPUTS)}")


def job_flags(inp: Path, out: Path, db: str, engine: str, model: str, max_tokens: int) -> list[str]:
    return ["--input", str(inp), "--output", str(out), "--db", db, "--engine", engine, "--model", model,
            "--max-tokens", str(max_tokens), "--temperature", "0"]


def cli(args: list[str], timeout_s: float) -> tuple[dict[str, Any], float]:
    """One `tokenmill ARGS --json` process: its JSON and its wall."""
    t = time.perf_counter()
    p = subprocess.run([sys.executable, "-m", "tokenmill.jobs.cli", *args, "--json"], capture_output=True, text=True,
                       timeout=timeout_s)
    wall = time.perf_counter() - t
    if p.returncode not in (0, 3):
        raise RuntimeError(f"tokenmill {args[0]}: exit {p.returncode}: {p.stderr.strip()[-1500:]}")
    return json.loads(p.stdout), wall


def compared(est: dict[str, Any], metrics: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The estimate's figures beside the job's (jobs/estimate/beside.compare), by name."""
    from tokenmill.jobs.estimate.beside import compare

    return {r["figure"]: {k: r[k] for k in ("value", "lo", "hi", "actual", "error_pct", "inside")}
            for r in compare(est, metrics) if r["figure"] in FIGURES}


def one_run(name: str, engine: str, inp: tuple[Path, int], folder: Path, args) -> dict[str, Any]:
    from tokenmill.schemas import storage as S

    db = f"sqlite:///{folder / f'{name}-{engine}.db'}"
    flags = job_flags(inp[0], folder / f"out-{name}-{engine}", db, engine, args.model, inp[1])
    log(f"{name} / {engine}: estimate")
    est, est_wall = cli(["estimate", *flags], args.timeout)
    log(f"{name} / {engine}: the job")
    summary, run_wall = cli(["run", *flags], args.timeout)
    job = S.JobStore(S.connect(db)).get(est["job_id"]) or {}
    return {"input": name, "engine": engine, "rows": est["rows"], "sample_rows": est["sample_rows"],
            "estimate_process_s": round(est_wall, 2), "run_process_s": round(run_wall, 2),
            "status": summary.get("status"), "figures": compared(est, job.get("metrics") or {}),
            "estimate": est}


def verdict(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per figure: runs within ±TARGET_PCT, runs whose interval held the actual, of those measured."""
    out = {}
    for f in FIGURES:
        rows = [r["figures"][f] for r in runs if f in r.get("figures", {}) and r["figures"][f]["error_pct"] is not None]
        out[f] = {"runs": len(rows), "within_target": sum(abs(x["error_pct"]) <= TARGET_PCT for x in rows),
                  "inside_interval": sum(bool(x["inside"]) for x in rows)}
    return out


def _cell(f: dict[str, Any] | None, unit: str) -> str:
    if not f:
        return "-"
    scale, fmt = (1.0, "{:.1f}") if unit == "s" else (1e3, "{:.3f}") if unit == "musd" else (1.0, "{:,.0f}")
    v, lo, hi, a = (fmt.format(x * scale) for x in (f["value"], f["lo"], f["hi"], f["actual"] or 0))
    err = "-" if f["error_pct"] is None else f"{f['error_pct']:+.1f}%"
    return f"{v} [{lo}-{hi}] vs {a} ({err}, {'in' if f['inside'] else 'OUT'})"


def table(runs: list[dict[str, Any]]) -> str:
    """One line per run: predicted [interval] vs actual (error, inside) for generation wall (s),
    held wall (s) and held cost (milli-USD)."""
    head = "| input | engine | rows | sample | generation wall s | held wall s | cost m$ (held) | estimate took s |"
    lines = [head, "|" + "---|" * 8]
    for r in runs:
        if "error" in r:
            lines.append(f"| {r['input']} | {r['engine']} | - | - | failed: {r['error'][:80]} | | | |")
            continue
        f = r["figures"]
        lines.append(f"| {r['input']} | {r['engine']} | {r['rows']} | {r['sample_rows']} | "
                     f"{_cell(f.get('generation_wall_s'), 's')} | {_cell(f.get('held_wall_s'), 's')} | "
                     f"{_cell(f.get('cost_usd'), 'musd')} | {r['estimate_process_s']} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--inputs", nargs="+", default=list(INPUTS), choices=INPUTS)
    ap.add_argument("--engines", nargs="+", default=list(ENGINES), choices=ENGINES)
    ap.add_argument("--rows", type=int, default=400, help="rows per input (the bundled sample has 240)")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds one process may take")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    stamp = utc_stamp()
    folder = WORK / "estimate" / stamp
    inputs = {name: make_input(name, args.rows, folder) for name in args.inputs}
    runs, started = [], utc_now()
    for engine in args.engines:
        for name, path in inputs.items():
            try:
                runs.append(one_run(name, engine, path, folder, args))
            except (RuntimeError, subprocess.TimeoutExpired, KeyError, ValueError) as err:
                log(f"{name} / {engine}: failed: {err}")
                runs.append({"input": name, "engine": engine, "error": str(err)[-2000:]})
    rep = {"benchmark": "estimate", "started_at": started, "finished_at": utc_now(), "code": code_label(None),
           "args": vars(args), "target_pct": TARGET_PCT, **machine(), "runs": runs, "verdict": verdict(runs)}
    print(table(runs))
    print(json.dumps(rep["verdict"], indent=1))
    write_report(rep, args.json, f"estimate-{stamp}.json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
