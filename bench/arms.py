"""Benchmark arms: the same prompts (as token ids) and engine arguments through

* `raw`: one `vllm.LLM.generate` call over all prompts (the upper bound);
* `tokenmill`: `run_job` on the workload's Parquet file (Beam, tokenization,
  batching, database, export: everything a job does);
* `beam_stock`: Beam's `RunInference(VLLMCompletionsModelHandler)`, which starts
  `python -m vllm.entrypoints.openai.api_server` itself;
* `run_batch`: `python -m vllm.entrypoints.launchers.run_batch` on OpenAI batch JSONL.

Each returns a dict of counts and times; engine load is kept apart from the
generation time wherever the arm lets us see it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from tokenmill.transforms.engines.vllm_config import VllmConfig


def prompt_rows(workload, model_path: str, engine: VllmConfig) -> list[dict[str, Any]]:
    """The workload's prompts tokenized exactly as tokenmill's Tokenize step does."""
    import pyarrow.parquet as pq

    from tokenmill.transforms.counting import LocalEncoder, load_tokenizer
    from tokenmill.transforms.tokenize import RecordRules, tokenize_record
    from tokenmill.transforms.validate import validate_row

    tok = load_tokenizer(model_path)
    out = []
    for i, row in enumerate(pq.read_table(workload.path).to_pylist()):
        rec = validate_row({**row, "_file_index": 0, "_row": i})
        t = tokenize_record(LocalEncoder(tok), rec, RecordRules(max_model_len=engine.max_model_len,
                                                                default_max_tokens=workload.max_tokens))
        # run-batch's completions schema takes text only: the same tokens, decoded
        # a list, not Tokenize's array("i"): vLLM's msgspec cannot send an array to its engine core
        out.append({"id": t.id, "token_ids": list(t.token_ids), "max_tokens": t.max_tokens,
                    "messages": rec.messages, "text": tok.decode(t.token_ids)})
    return out


def _rates(prompt: int, output: int, n: int, gen_s: float) -> dict[str, Any]:
    return {
        "requests": n,
        "prompt_tokens": prompt,
        "output_tokens": output,
        "gen_s": gen_s,
        "output_tok_per_s": output / gen_s if gen_s else None,
        "total_tok_per_s": (prompt + output) / gen_s if gen_s else None,
        "requests_per_s": n / gen_s if gen_s else None,
    }


# ---------------------------------------------------------------- raw LLM.generate


def raw(session, rows: list[dict[str, Any]]) -> dict[str, Any]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    llm = session.llm
    llm.reset_prefix_cache()
    m0 = session.metrics()
    prompts = [TokensPrompt(prompt_token_ids=r["token_ids"]) for r in rows]
    params = [SamplingParams(max_tokens=r["max_tokens"], temperature=0.0, ignore_eos=True) for r in rows]
    t = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    gen_s = time.perf_counter() - t
    m1 = session.metrics()
    res = _rates(sum(len(o.prompt_token_ids) for o in outs), sum(len(o.outputs[0].token_ids) for o in outs), len(outs), gen_s)
    q = m1.get("prefix_cache_queries", 0) - m0.get("prefix_cache_queries", 0)
    h = m1.get("prefix_cache_hits", 0) - m0.get("prefix_cache_hits", 0)
    res["prefix_cache_hit_rate"] = h / q if q else None
    res["cached_tokens"] = sum(int(o.num_cached_tokens or 0) for o in outs)
    return res


# ---------------------------------------------------------------- tokenmill


def tokenmill(workload, engine: VllmConfig, work: Path, *, label: str, ordering: str = "prefix",
              num_workers: int = 1, session=None, batching: dict | None = None,
              count_load: bool | None = None) -> dict[str, Any]:
    """`count_load`: leave the job's engine start (its `model_load_s`) out of the
    generation time (default: with several workers, which start their own engines)."""
    from tokenmill.jobs.lifecycle.runner import run_job
    from tokenmill.schemas.config import load_spec

    if session is not None:
        session.llm.reset_prefix_cache()
    job = f"{label}-{time.time_ns()}"
    spec = load_spec({
        "job_id": job,
        "input": str(workload.path),
        "output": str(work / "out" / job),
        "engine": engine.model_dump(mode="json"),
        "sampling": {"max_tokens": workload.max_tokens, "temperature": 0.0, "ignore_eos": True},
        "batching": {"ordering": ordering, **(batching or {})},
        "runner": {"num_workers": num_workers},
    })
    db = f"sqlite:///{work / 'bench.db'}"
    t = time.perf_counter()
    r = run_job(spec, db_url=db)
    wall = time.perf_counter() - t
    th, tok = r.metrics.get("throughput", {}), r.metrics.get("tokens", {})
    load = th.get("model_load_s") if (num_workers > 1 if count_load is None else count_load) else 0.0
    gen_s = wall - (load or 0.0)
    res = _rates(int(tok.get("prompt") or 0), int(tok.get("output") or 0), r.succeeded, gen_s)
    res.update({
        "job_wall_s": wall,
        "engine_load_s": load,
        "pipeline_generation_wall_s": th.get("generation_wall_s"),
        "prefix_cache_hit_rate": r.metrics.get("prefix_cache", {}).get("hit_rate"),
        "failed": r.failed,
        "batches": _batch_summary(db, job),
        "job_id": job,
        "output_dir": str(work / "out" / job),
        # the report's figures, as the job's accounting gives them (bench/engines.py tables them)
        "latency_s": {k: r.metrics.get("latency_s", {}).get(k) for k in ("ttft", "tpot", "e2e")},
        "clocks": {k: r.metrics.get("clocks", {}).get(k) for k in ("ttft_s", "tpot_s", "e2e_s")},
        "failure_rate": r.metrics.get("failures", {}).get("rate"),
        "usd_per_1m_output_tokens": (r.metrics.get("cost") or {}).get("per_1m_output_tokens"),
        "workers": [{k: w.get(k) for k in ("worker", "cpu_count", "window_s", "peak_tree_rss_bytes",
                                           "tree_cores_busy_mean")} for w in r.metrics.get("workers") or []],
    })
    return res


def _batch_summary(db: str, job: str) -> dict[str, Any]:
    from sqlalchemy import select

    from tokenmill.schemas import storage as S
    from tokenmill.schemas import tables as T

    eng = S.connect(db)
    with eng.connect() as conn:
        rows = [dict(r) for r in conn.execute(select(T.batches).where(T.batches.c.job_id == job)).mappings()]
    if not rows:
        return {}
    tails = [r["tail_s"] or 0.0 for r in rows]
    return {
        "count": len(rows),
        "workers": len({r["worker"] for r in rows}),
        "tail_s_sum": sum(tails),
        "tail_s_max": max(tails),
        "mean_requests": sum(r["requests"] for r in rows) / len(rows),
    }


# ---------------------------------------------------------------- subprocess helpers


def server_args(kwargs: dict[str, Any]) -> list[str]:
    """vLLM EngineArgs (as `engine_kwargs` builds them) → command-line flags."""
    out: list[str] = []
    for k, v in kwargs.items():
        if k in ("model", "disable_log_stats") or v is None:
            continue
        flag = "--" + k.replace("_", "-")
        if isinstance(v, bool):
            out.append(flag if v else "--no-" + k.replace("_", "-"))
        elif isinstance(v, dict):
            out += [flag, json.dumps(v)]
        else:
            out += [flag, str(v)]
    return out


def _descendants() -> set[int]:
    import psutil

    return {p.pid for p in psutil.Process().children(recursive=True)}


def _kill_new(before: set[int]) -> list[int]:
    """Stop the processes this arm started (by pid) that are still alive."""
    import psutil

    killed = []
    for pid in sorted(_descendants() - before):
        try:
            p = psutil.Process(pid)
            p.terminate()
            killed.append(pid)
        except psutil.Error:
            pass
    gone, alive = psutil.wait_procs([psutil.Process(p) for p in killed if psutil.pid_exists(p)], timeout=10)
    for p in alive:
        try:
            p.kill()
        except psutil.Error:
            pass
    return killed


# ---------------------------------------------------------------- Beam's stock vLLM handler


def beam_stock(rows: list[dict[str, Any]], model_path: str, kwargs: dict[str, Any], max_tokens: int) -> dict[str, Any]:
    import apache_beam as beam
    from apache_beam.metrics.metric import MetricsFilter
    from apache_beam.ml.inference.base import RunInference
    from apache_beam.ml.inference.vllm_inference import VLLMCompletionsModelHandler
    from apache_beam.options.pipeline_options import PipelineOptions

    flags = server_args(kwargs)
    server_kwargs: dict[str, str | None] = {}
    i = 0
    while i < len(flags):
        if i + 1 < len(flags) and not flags[i + 1].startswith("--"):
            server_kwargs[flags[i][2:]] = flags[i + 1]
            i += 2
        else:
            server_kwargs[flags[i][2:]] = None
            i += 1
    handler = VLLMCompletionsModelHandler(model_path, server_kwargs)

    class Count(beam.DoFn):
        def process(self, pr):
            u = pr.inference.usage
            beam.metrics.Metrics.counter("bench", "prompt_tokens").inc(u.prompt_tokens)
            beam.metrics.Metrics.counter("bench", "output_tokens").inc(u.completion_tokens)
            beam.metrics.Metrics.counter("bench", "requests").inc()

    before = _descendants()
    opts = PipelineOptions(["--runner=DirectRunner", "--direct_running_mode=in_memory", "--direct_num_workers=1"])
    t = time.perf_counter()
    try:
        p = beam.Pipeline(options=opts)
        (
            p
            | beam.Create([r["token_ids"] for r in rows])
            | RunInference(handler, inference_args={"max_tokens": max_tokens, "temperature": 0.0,
                                                    "extra_body": {"ignore_eos": True}})
            | beam.ParDo(Count())
        )
        result = p.run()
        result.wait_until_finish()
        wall = time.perf_counter() - t
    finally:
        killed = _kill_new(before)
    m = result.metrics().query(MetricsFilter())
    counters = {c.key.metric.name: c.committed for c in m["counters"]}
    load_ms = None
    batches = None
    for d in m["distributions"]:
        if d.key.metric.name.endswith("load_model_latency_milli_secs"):
            load_ms = d.committed.sum
        if d.key.metric.name.endswith("inference_request_batch_size") and d.committed.count:
            # RunInference's batches run one after another, each waiting for its slowest request
            batches = {"count": d.committed.count, "mean_requests": d.committed.sum / d.committed.count,
                       "min_requests": d.committed.min, "max_requests": d.committed.max}
    for g in m.get("gauges", []):
        if load_ms is None and g.key.metric.name.endswith("load_model_latency_milli_secs"):
            load_ms = g.committed.value
    load_s = (load_ms or 0) / 1000.0
    res = _rates(counters.get("prompt_tokens", 0), counters.get("output_tokens", 0), counters.get("requests", 0), wall - load_s)
    res.update({"engine_load_s": load_s, "job_wall_s": wall, "prefix_cache_hit_rate": None,
                "leftover_processes_stopped": len(killed), "batches": batches})
    return res


# ---------------------------------------------------------------- vllm run-batch


def run_batch(rows: list[dict[str, Any]], model_path: str, kwargs: dict[str, Any], work: Path) -> dict[str, Any]:
    work.mkdir(parents=True, exist_ok=True)
    inp, outp = work / "run_batch_in.jsonl", work / "run_batch_out.jsonl"
    with inp.open("w") as f:
        for r in rows:
            f.write(json.dumps({
                # vLLM 0.32's run-batch takes chat completions, not completions: the
                # server applies the same chat template tokenmill does.
                "custom_id": r["id"], "method": "POST", "url": "/v1/chat/completions",
                "body": {"model": model_path, "messages": r["messages"], "max_tokens": r["max_tokens"],
                         "temperature": 0.0, "ignore_eos": True},
            }) + "\n")
    outp.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "vllm.entrypoints.launchers.run_batch", "-i", str(inp), "-o", str(outp),
           "--model", model_path, *server_args(kwargs)]
    env = dict(os.environ, VLLM_LOGGING_LEVEL="INFO")
    t = time.perf_counter()
    ready: list[float] = []
    tail: list[str] = []
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True)

    done: list[float] = []

    def pump():
        # Text mode turns tqdm's carriage returns into line ends, so the progress bar's
        # first frame arrives as a line of its own.  run_batch.py logs "Reading batch
        # from" through a logger named `__main__` (run with -m), which vLLM's logging
        # set-up does not configure, so that line never shows: the bar marks the start.
        for line in proc.stdout:
            now = time.perf_counter()
            if not ready and ("Running batch:" in line or "Reading batch from" in line):
                ready.append(now)  # engine up, every request parsed: the batch starts here
            if ready and not done and "[shutdown]" in line:
                done.append(now)  # outputs written, engine stopping: the batch is over
            tail.append(line)
            del tail[:-40]

    th = threading.Thread(target=pump, daemon=True)
    th.start()
    rc = proc.wait()
    th.join(timeout=5)
    wall = time.perf_counter() - t
    if rc != 0:
        raise RuntimeError(f"run_batch exited {rc}: {''.join(tail)[-2000:]}")
    prompt = output = n = 0
    for line in outp.read_text().splitlines():
        o = json.loads(line)
        u = ((o.get("response") or {}).get("body") or {}).get("usage") or {}
        if u:
            n += 1
            prompt += u.get("prompt_tokens", 0)
            output += u.get("completion_tokens", 0)
    load_s = (ready[0] - t) if ready else None
    if not ready:
        raise RuntimeError("run_batch never showed its progress bar: cannot split engine start from the work")
    end = done[0] if done else t + wall
    res = _rates(prompt, output, n, end - ready[0])
    res.update({"engine_load_s": load_s, "job_wall_s": wall, "prefix_cache_hit_rate": None,
                "shutdown_s": (t + wall - done[0]) if done else None})
    return res
