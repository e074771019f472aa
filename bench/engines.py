"""`make bench-engines`, first version: tokenmill + llama.cpp against llama.cpp's own
best on the same prompts.

Workload (a), mixed chat (bench/workloads.py), greedy with `ignore_eos`, through

* `tokenmill_llamacpp`: `run_job` with `engine.kind: llamacpp` (Beam, Tokenize,
  batching, the worker's own llama-server driven by the openai client, database,
  export: everything a job does), a fresh server each run, its start left out of
  the time (the job's `model_load_s`);
* `llama_server_direct`: llama-server started here with the same arguments the
  engine gives it, every prompt sent at once (one thread per request), timed
  from the first request to the last answer.

Arms interleaved A B B A after one warm-up each; medians; the ratio of output tok/s
(target: tokenmill ≥ 0.9× direct).  Writes `bench/results/engines-<stamp>.json`.
Not yet: the vLLM and `openai` arms, workload (b), latency percentiles, the plot and
the docs table of issue 13.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from bench.common import RESULTS, WORK, log, machine, utc_now, utc_stamp

SCALES = {"smoke": dict(rows=24, max_tokens=16, reps=2), "full": dict(rows=128, max_tokens=32, reps=2)}
TARGET = 0.9


def direct(rows: list[dict[str, Any]], cfg, gguf: Path, max_tokens: int) -> dict[str, Any]:
    """The rows through a llama-server started here, all in flight at once."""
    import httpx

    from tokenmill.transforms.engines.llamacpp_session import binary, free_port, server_args, worker_cores

    port = free_port()
    cores = worker_cores()
    argv = [str(binary("llama-server")), *server_args(cfg, gguf, port, len(cores))]
    log_path = WORK / "engines-direct-server.log"
    with log_path.open("wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        t0 = time.perf_counter()
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"llama-server exited {proc.returncode}: {log_path.read_text()[-500:]}")
            try:
                if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        load = time.perf_counter() - t0

        def ask(r: dict[str, Any]) -> dict[str, Any]:
            body = {"messages": r["messages"], "max_tokens": r.get("max_tokens") or max_tokens,
                    "temperature": 0.0, "ignore_eos": True}
            return httpx.post(f"{base}/v1/chat/completions", json=body, timeout=3600).json()["usage"]

        t = time.perf_counter()
        with ThreadPoolExecutor(len(rows)) as pool:
            usages = list(pool.map(ask, rows))
        gen_s = time.perf_counter() - t
    finally:
        proc.terminate()
        proc.wait(30)
    prompt = sum(u["prompt_tokens"] for u in usages)
    output = sum(u["completion_tokens"] for u in usages)
    return {"requests": len(rows), "prompt_tokens": prompt, "output_tokens": output, "gen_s": gen_s,
            "engine_load_s": load, "output_tok_per_s": output / gen_s, "total_tok_per_s": (prompt + output) / gen_s,
            "requests_per_s": len(rows) / gen_s, "server_args": argv[1:]}


def tokenmill_arm(workload, cfg) -> dict[str, Any]:
    """One job; its own server started and stopped with it, the start not counted."""
    from bench.arms import tokenmill
    from tokenmill.transforms.engines import registry

    registry.shutdown_all()  # a fresh server: no prompt cache carried over from the last run
    r = tokenmill(workload, cfg, WORK, label="engines-llamacpp", count_load=True)
    registry.shutdown_all()
    return r


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scale", default="full", choices=sorted(SCALES))
    ap.add_argument("--model", default="smollm2-135m", help="a GGUF or the bundled short name")
    ap.add_argument("--slots", type=int, default=8, help="llama-server parallel slots (engine.max_in_flight)")
    ap.add_argument("--reps", type=int, default=None)
    args = ap.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from bench import workloads
    from bench.throughput import abba, median_of
    from tokenmill.schemas.config import EngineConfig
    from tokenmill.transforms.engines.llamacpp_session import build_info, gguf_file

    sc = SCALES[args.scale]
    reps = args.reps or sc["reps"]
    WORK.mkdir(parents=True, exist_ok=True)
    wa = workloads.chat(WORK / "engines-chat.parquet", sc["rows"], max_tokens=sc["max_tokens"])
    import pyarrow.parquet as pq

    rows = [{**r, "messages": json.loads(r["messages"])} for r in pq.read_table(wa.path).to_pylist()]
    cfg = EngineConfig(kind="llamacpp", model=args.model, max_in_flight=args.slots, max_model_len=2048)
    gguf = gguf_file(args.model)
    arms = {"tokenmill_llamacpp": lambda: tokenmill_arm(wa, cfg),
            "llama_server_direct": lambda: direct(rows, cfg, gguf, wa.max_tokens)}
    res: dict[str, Any] = {"benchmark": "engines", "started_at": utc_now(), "scale": args.scale, "machine": machine(),
                           "llama_cpp": build_info(), "engine": cfg.model_dump(mode="json"), "gguf": str(gguf),
                           "workload": {"name": wa.name, "rows": wa.rows, "max_tokens": wa.max_tokens,
                                        "description": wa.description},
                           "note": "shared 2-core machine unless said otherwise; greedy, ignore_eos",
                           "runs": {a: [] for a in arms}}
    for a, fn in arms.items():
        log(f"warm-up {a}")
        fn()
    for a in abba(list(arms), reps):
        log(f"run {a}")
        r = arms[a]()
        log(f"  {a}: {r['output_tok_per_s']:.1f} output tok/s over {r['gen_s']:.1f} s")
        res["runs"][a].append(r)
    res["medians"] = {a: median_of(v) for a, v in res["runs"].items()}
    t, d = (res["medians"][a]["output_tok_per_s"] for a in arms)
    res["ratio_output_tok_per_s"] = t / d if t and d else None
    res["target"] = TARGET
    res["finished_at"] = utc_now()
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / f"engines-{utc_stamp()}.json"
    out.write_text(json.dumps(res, indent=1, default=str))
    print(json.dumps({"results": str(out), "medians": {a: {k: m[k] for k in ("output_tok_per_s", "gen_s")}
                                                       for a, m in res["medians"].items()},
                      "ratio": res["ratio_output_tok_per_s"], "target": TARGET}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
