"""`make bench-engines`: the engines behind tokenmill side by side on the same jobs
(issue 13's benchmark).  A program, not a timed test.

Arms (`--arms`, default all), each a real tokenmill job unless said:

* `vllm`: the in-process vLLM engine, dtype `--vllm-dtype` (default: what `dtype: auto`
  runs on this machine, measured: bfloat16 on a CPU with bf16 units, float32 on an
  AVX2 one where bf16 ran ~20× slower; the results file says which);
* `vllm_w8a8`: the same on an int8 W8A8 checkpoint (`tokenmill quantize --scheme
  w8a8-int8`, RTN, made once into bench/work/engines-models), same dtype;
* `llamacpp_f16`, `llamacpp_q8_0`, `llamacpp_q4_k_m`: the `llamacpp` engine on GGUFs
  made once with `tokenmill quantize --scheme gguf-…`; each run starts its servers
  afresh (no prompt cache carried over), the start left out of the time;
* `openai_vllm`: the `openai` engine pointed at `python -m vllm.entrypoints.openai.api_server`
  started here (same model, dtype and engine arguments as `vllm`; its start
  not timed; its prefix cache reset before each run; stopped after the workload);
* `direct`: llama.cpp's own best: a `llama-server` started here on the same GGUF as one
  llamacpp arm (`--direct-gguf`, default q8_0) and every prompt sent at once, streamed
  with usage (no job: no Beam, Tokenize, database or export), through the `openai`
  engine's client so TTFT/TPOT/E2E are on the same client clock; the upper bound for
  the llamacpp arms.

Workloads (`--workloads`): (a) mixed chat, one worker; (b) shared prefixes, two
workers, as `make bench` defines them (bench/workloads.py; (b)'s per-worker vLLM
engine as bench/throughput.py's).  "Two workers" for `openai_vllm` is the same job
settings against one server holding both workers' sequences and KV cache; for
`direct`, one server with both workers' slots.  Each run's `parallelism` says what ran.

Per workload and arm: one warm-up run (and, for tokenmill arms, one untimed eval job on
data/eval_set.parquet (smoke: 16 rows spread over it) through the same engine config:
accuracy against its references, as `tokenmill compare` computes it; `direct` shows
its GGUF's llamacpp arm's), then `reps` passes A B B A …
(bench/throughput.abba); medians of every figure; every run kept in
`bench/results/engines-<stamp>.json`, the plot (output tok/s against P95 TPOT, one
point per arm and workload) beside it as `.html`, the Markdown tables printed.

Figures (see `FIGURES`): TTFT/TPOT/E2E percentiles from the job's accounting (engine
clock for vLLM, client clock for HTTP engines; the `clock` column says which);
output/total tok/s and requests/s over the generation time (engine start left out);
peak memory = the largest RSS sum of this program's child processes during a run
(vLLM's engine core, llama-server, vLLM's API server; on (b) also the two worker
processes; this process itself, which holds what earlier arms imported, and the API
server while another arm runs, left out); CPU utilization = CPU seconds ÷ generation
seconds (the job's own generation window, first batch admitted → last finished, for
tokenmill arms; the time all prompts were in flight for `direct`): for tokenmill arms
each worker's process tree as the job's meter measured it
(on (b) plus, for `openai_vllm`, the server's tree measured here over the run; on (a)
the one worker is this process, whose tree holds the server; an idle API server's CPU
seconds are taken off); for `direct`, this process's tree (server and client) over
the generation; sampled every 0.25 s, so a process's last fraction of a second before
it exits can be missed; failure rate = dead letters ÷ rows; $ per 1M output tokens =
the job's accounting figure (for `openai_vllm` it prices the job's workers, not the
server); for `direct`, its generation wall × the same CPU price (pricing.worker_rate
for its cores and peak RSS).  Rows lost: every input id answered or dead-lettered
exactly once (the export, checked as bench/scale.py does; for `direct`, the answers).

Targets: tokenmill+llamacpp ≥ 0.9× direct on the same GGUF; openai → vllm serve ≥
0.85× in-process vLLM on (a); no arm loses a row.

    python -m tokenmill.jobs.lifecycle.envexec python -m bench.engines --scale smoke --arms llamacpp_q8_0 direct
    make bench-engines BENCH_ARGS="--input my_chats.parquet --workloads a"
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from bench.common import RESULTS, ROOT, WORK, log, machine, utc_now, utc_stamp

MiB = 1 << 20
#: Workload sizes and repetitions; `full` is sized to about 25 minutes on the 2-core CPU.
SCALES: dict[str, dict[str, Any]] = {
    "smoke": dict(rows=12, max_tokens=8, docs=3, questions=3, doc_words=150, b_max_tokens=4, reps=2,
                  eval_rows=16, eval_max_tokens=16),
    "full": dict(rows=64, max_tokens=32, docs=8, questions=4, doc_words=250, b_max_tokens=8, reps=2,
                 eval_rows=None, eval_max_tokens=32),
}
ARMS = ("vllm", "vllm_w8a8", "llamacpp_f16", "llamacpp_q8_0", "llamacpp_q4_k_m", "openai_vllm", "direct")
GGUF_SCHEMES = {"f16": "gguf-f16", "q8_0": "gguf-q8_0", "q4_k_m": "gguf-q4_k_m"}
WORKLOADS = {"a": "chat", "b": "shared_prefix"}
SERVED = "smollm2-served"
#: in-process vLLM on (a): every row of a full run in flight
VLLM_A = dict(max_num_seqs=128, max_model_len=2048, kv_cache_memory_bytes=1024 * MiB)
#: (b) per worker: bench/throughput.py's two-worker engine
VLLM_B = dict(max_num_seqs=16, max_model_len=512)
EVAL = ROOT / "data" / "eval_set.parquet"
TARGET_DIRECT = 0.9
TARGET_OPENAI = 0.85

#: what each figure counts, written into the results file (the module docstring says more)
DEFINITIONS = {
    "latency": "the job's accounting percentiles (engine clock: vLLM; client clock: openai, llamacpp, direct)",
    "throughput": "tokens / generation seconds: job wall less its engine start (make bench's count); direct: "
                  "first request sent to last answer",
    "peak_rss": "largest RSS sum of this program's child processes in a run (engine core, llama-server, API "
                "server; on (b) the worker processes too); this process and an idle API server left out",
    "cpu_util": "CPU seconds / generation window: the workers' meters (+ the API server on (b)); direct: this "
                "process's tree",
    "failure_rate": "dead letters / rows",
    "usd_per_1m_output_tokens": "the job's accounting figure (openai_vllm: prices its workers, not the server); "
                                "direct: its generation wall x the same CPU price (pricing.worker_rate)",
    "rows_lost": "input ids neither answered nor dead-lettered exactly once (the worst run)",
    "eval_accuracy": "one untimed eval job per arm through the same engine config (direct: its GGUF's llamacpp arm)",
}
#: (key in a run's figures, column title, digits); percentiles in ms
FIGURES = (
    ("ttft_p50_ms", "TTFT p50 ms", 0), ("ttft_p95_ms", "TTFT p95 ms", 0),
    ("tpot_p50_ms", "TPOT p50 ms", 1), ("tpot_p95_ms", "TPOT p95 ms", 1),
    ("e2e_p50_ms", "E2E p50 ms", 0), ("e2e_p95_ms", "E2E p95 ms", 0),
    ("output_tok_per_s", "output tok/s", 1), ("total_tok_per_s", "total tok/s", 1),
    ("requests_per_s", "req/s", 2), ("peak_rss_mib", "peak RSS MiB", 0), ("cpu_util", "CPU s / s", 2),
    ("failure_rate", "failure rate", 3), ("eval_accuracy", "eval accuracy", 3),
    ("usd_per_1m_output_tokens", "$ / 1M output tok", 4), ("rows_lost", "rows lost", 0),
)


# ---------------------------------------------------------------- measuring a run


class ChildrenPeak(threading.Thread):
    """The largest RSS sum of this process's descendants, sampled every `every_s`;
    `exclude`: roots of trees left out (another arm's idle server)."""

    def __init__(self, every_s: float = 0.2, exclude: tuple[int, ...] = ()):
        super().__init__(daemon=True, name="bench-children-rss")
        import psutil

        self.me, self.every_s, self.peak, self.exclude = psutil.Process(), every_s, 0, exclude
        self._halt = threading.Event()

    def sample(self) -> None:
        import psutil

        skip = set(self.exclude)
        for pid in self.exclude:
            try:
                skip.update(c.pid for c in psutil.Process(pid).children(recursive=True))
            except psutil.Error:
                pass
        total = 0
        for c in self.me.children(recursive=True):
            try:
                total += c.memory_info().rss if c.pid not in skip else 0
            except psutil.Error:
                pass
        self.peak = max(self.peak, total)

    def run(self) -> None:
        while not self._halt.wait(self.every_s):
            self.sample()

    def stop(self) -> int:
        self._halt.set()
        self.join(5)
        self.sample()
        return self.peak


def cpu_meter(pid: int):
    """A process tree's CPU seconds from now on: the worker meter the jobs use."""
    from tokenmill.transforms.engines.meter import WorkerMeter

    return WorkerMeter({"device": "cpu"}, pid=pid, every_s=0.25).start()


def cpu_seconds(meter) -> float:
    meter.stop()
    return meter.reading()["measure"]["tree_cpu_s"]


def pct_ms(d: dict | None, q: str) -> float | None:
    v = (d or {}).get(q)
    return v * 1e3 if v is not None else None


def figures(r: dict[str, Any]) -> dict[str, Any]:
    """A run's table figures from what the arm returned."""
    lat = r.get("latency_s") or {}
    out = {f"{k}_{q}_ms": pct_ms(lat.get(k), q) for k in ("ttft", "tpot", "e2e") for q in ("p50", "p95")}
    out.update({k: r.get(k) for k in ("output_tok_per_s", "total_tok_per_s", "requests_per_s", "failure_rate",
                                      "usd_per_1m_output_tokens", "rows_lost", "cpu_util")})
    out["peak_rss_mib"] = r["peak_rss_bytes"] / MiB if r.get("peak_rss_bytes") else None
    return out


def medians(runs: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {"runs": len(runs)}
    figs = [figures(r) for r in runs]
    for key, _, _ in FIGURES:
        vals = [f[key] for f in figs if f.get(key) is not None]
        out[key] = statistics.median(vals) if vals else None
    if runs:
        out["rows_lost"] = max((r.get("rows_lost") or 0) for r in runs)  # the worst run, not the median
        out["clock"] = runs[0].get("clock")
        out["parallelism"] = runs[0].get("parallelism")
    return out


def rows_lost(out_dir: str, rows: int) -> dict[str, Any]:
    """Every input row answered or dead-lettered exactly once, from the job's export."""
    from bench.scale import accounting

    acc = accounting(Path(out_dir), {"rows": rows, "distinct_ids": rows, "planted": {}})
    done = (acc.get("outputs") or 0) + (acc.get("dead_letters") or 0)
    return {"rows_lost": rows - done if acc.get("every_row_once") else max(rows - done, 1),
            "every_id_once": bool(acc.get("every_id_once")), "outputs": acc.get("outputs"),
            "dead_letters": acc.get("dead_letters"), "note": acc.get("note")}


# ---------------------------------------------------------------- servers started here


class VllmServer:
    """`python -m vllm.entrypoints.openai.api_server` with the given vLLM engine arguments,
    in its own process group; dev mode on for /reset_prefix_cache."""

    def __init__(self, model_path: str, kwargs: dict[str, Any], log_path: Path, timeout_s: float = 600):
        from bench.arms import server_args
        from tokenmill.transforms.engines.cpu import cpu_runtime_env
        from tokenmill.transforms.engines.llamacpp_session import free_port, wait_until_answers

        port = free_port()
        self.root = f"http://127.0.0.1:{port}"
        self.argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model_path,
                     "--served-model-name", SERVED, "--host", "127.0.0.1", "--port", str(port), *server_args(kwargs)]
        env = {**cpu_runtime_env(), **os.environ, "VLLM_SERVER_DEV_MODE": "1"}
        t = time.perf_counter()
        with log_path.open("wb") as out:
            self.proc = subprocess.Popen(self.argv, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            wait_until_answers(self.proc, f"{self.root}/v1/models", timeout_s, "vLLM's API server",
                               lambda: log_path.read_text()[-1500:], every_s=1.0)
        except BaseException:
            self.stop()
            raise
        self.load_s = time.perf_counter() - t

    def reset_prefix_cache(self) -> bool:
        import httpx

        try:
            return httpx.post(f"{self.root}/reset_prefix_cache", timeout=30).status_code == 200
        except httpx.HTTPError:
            return False

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)


# ---------------------------------------------------------------- the bench


class Bench:
    def __init__(self, args, sc: dict[str, Any]):
        from tokenmill.schemas.models import resolve_model

        self.args, self.sc = args, sc
        self.model_path = str(resolve_model(args.model))
        # what `dtype: auto` runs here, resolved where the engine resolves it (named on a CPU,
        # so the results say it; left to vLLM, the model's own dtype, on a GPU)
        from tokenmill.transforms.engines.device import has_nvidia_gpu
        from tokenmill.transforms.engines.vllm_config import VllmConfig
        from tokenmill.transforms.engines.vllm_session import engine_kwargs

        self.vllm_dtype = engine_kwargs(VllmConfig(model=args.model, dtype=args.vllm_dtype), self.model_path,
                                        on_gpu=has_nvidia_gpu())["dtype"]
        self.models: dict[str, str] = {}
        self.servers: dict[str, VllmServer] = {}
        self.server_info: dict[str, Any] = {}
        self.rows: dict[str, list[dict[str, Any]]] = {}
        self.db = f"sqlite:///{WORK / 'bench.db'}"

    # -- models, made once
    def prepare_models(self, arms: list[str]) -> dict[str, Any]:
        from tokenmill.jobs.modeltools.quantize import quantize

        folder = WORK / "engines-models"
        made: dict[str, Any] = {}
        prov: dict[str, Any] = {}
        want = {a.split("_", 1)[1] for a in arms if a.startswith("llamacpp_")}
        if "direct" in arms:
            want.add(self.args.direct_gguf)
        for q in sorted(want):
            out = folder / f"{self.args.model}-{q}.gguf"
            if not out.is_file():
                t = time.perf_counter()
                quantize(self.args.model, GGUF_SCHEMES[q], out)
                made[q] = {"made_s": time.perf_counter() - t}
            self.models[q] = str(out)
            # where its weights came from: the bundled GGUF is itself quantized (llama-quantize requantizes it)
            note = out.with_name(out.name + ".tokenmill.json")
            prov[q] = json.loads(note.read_text()) if note.is_file() else None
        if "vllm_w8a8" in arms:
            out = folder / f"{self.args.model}-w8a8-int8"
            if not (out / "config.json").is_file():
                t = time.perf_counter()
                quantize(self.args.model, "w8a8-int8", out, method="rtn", force=out.exists())
                made["w8a8"] = {"made_s": time.perf_counter() - t}
            self.models["w8a8"] = str(out)
        return {"files": dict(self.models), "made_now": made, "gguf_provenance": prov}

    # -- engine configurations
    def vllm_config(self, wl: str, model: str):
        from bench.throughput import SCALES as TS
        from tokenmill.transforms.engines.vllm_config import VllmConfig

        if wl == "a":
            return VllmConfig(model=model, dtype=self.vllm_dtype, seed=0, **VLLM_A)
        kv = TS[self.args.scale]["b_kv_mib"] * MiB
        return VllmConfig(model=model, dtype=self.vllm_dtype, seed=0, kv_cache_memory_bytes=kv, **VLLM_B)

    def llamacpp_config(self, wl: str, q: str, slots: int):
        from tokenmill.transforms.engines.llamacpp_session import LlamaCppConfig

        return LlamaCppConfig(kind="llamacpp", model=self.models[q], tokenizer=self.args.model, max_in_flight=slots,
                              max_model_len=VLLM_A["max_model_len"] if wl == "a" else VLLM_B["max_model_len"])

    def arm_setup(self, arm: str, wl: str) -> dict[str, Any]:
        """The arm's engine config, workers and what its parallelism is, in words."""
        from tokenmill.transforms.engines.openai_config import OpenAIConfig

        workers = 2 if wl == "b" else 1
        slots = self.args.slots
        if arm in ("vllm", "vllm_w8a8"):
            cfg = self.vllm_config(wl, self.model_path if arm == "vllm" else self.models["w8a8"])
            par = f"{workers} worker(s), each its own in-process vLLM engine, max_num_seqs {cfg.max_num_seqs}"
        elif arm.startswith("llamacpp_"):
            cfg = self.llamacpp_config(wl, arm.split("_", 1)[1], slots)
            par = f"{workers} worker(s), each its own llama-server with {slots} slots on its share of the cores"
        elif arm == "openai_vllm":
            v = self.vllm_config(wl, self.model_path)
            cfg = OpenAIConfig(kind="openai", base_url=f"{self.servers[wl].root}/v1", model=SERVED,
                               tokenizer=self.args.model, max_in_flight=v.max_num_seqs, max_model_len=v.max_model_len)
            par = (f"{workers} worker(s), {v.max_num_seqs} requests in flight each, against one vLLM API server "
                   f"(max_num_seqs {v.max_num_seqs * workers})")
        else:
            cfg = self.llamacpp_config(wl, self.args.direct_gguf, slots * workers)
            par = f"every prompt in flight at once against one llama-server with {slots * workers} slots on every core"
        return {"cfg": cfg, "workers": workers, "parallelism": par}

    def start_server(self, wl: str) -> None:
        """The vLLM API server for `openai_vllm` on workload `wl`: `vllm`'s engine
        arguments (on (b), both workers' sequences and KV cache in one server)."""
        from tokenmill.transforms.engines.vllm_session import engine_kwargs

        v = self.vllm_config(wl, self.model_path)
        kw = engine_kwargs(v, self.model_path, on_gpu=False)
        if wl == "b":
            kw.update(max_num_seqs=2 * v.max_num_seqs, kv_cache_memory_bytes=2 * v.kv_cache_memory_bytes)
        kw = {k: v for k, v in kw.items() if k not in ("model", "tokenizer")}
        log(f"starting vLLM's API server for ({wl}) (not timed)")
        s = VllmServer(self.model_path, kw, WORK / f"engines-vllm-server-{wl}.log")
        self.servers[wl] = s
        self.server_info[wl] = {"argv": s.argv[1:], "load_s": s.load_s}
        log(f"  up in {s.load_s:.1f} s")

    def stop_server(self, wl: str) -> None:
        s = self.servers.pop(wl, None)
        if s is not None:
            s.stop()

    def idle_servers(self, used=None) -> tuple[int, ...]:
        """The vLLM API servers up but not serving this run (left out of its memory and CPU)."""
        return tuple(s.proc.pid for s in self.servers.values() if s is not used)

    # -- one run of an arm
    def run(self, arm: str, wl: str, workload) -> dict[str, Any]:
        setup = self.arm_setup(arm, wl)
        res = self.direct(setup, workload) if arm == "direct" else self.tokenmill(arm, wl, setup, workload)
        res["parallelism"] = setup["parallelism"]
        return res

    def tokenmill(self, arm: str, wl: str, setup: dict[str, Any], workload, *, label: str | None = None) -> dict[str, Any]:
        from bench.arms import tokenmill
        from tokenmill.schemas.models import resolve_model
        from tokenmill.transforms.engines import registry as E

        cfg, workers = setup["cfg"], setup["workers"]
        session = None
        if workers == 1 and cfg.kind == "vllm":  # loaded (untimed) or kept from this arm's last run
            session = E.get_session(cfg, str(resolve_model(cfg.model)))
        else:
            E.shutdown_all()  # a fresh llama-server per run: no prompt cache carried over
        server = self.servers.get(wl) if cfg.kind == "openai" else None
        reset = server.reset_prefix_cache() if server else None
        server_cpu = cpu_meter(server.proc.pid) if server else None
        idle = self.idle_servers(server)
        idle_cpu = cpu_meter(idle[0]) if idle else None
        peak = ChildrenPeak(exclude=idle)
        peak.start()
        try:
            r = tokenmill(workload, cfg, WORK, label=label or f"engines-{arm}-{wl}", num_workers=workers,
                          session=session, count_load=session is None)
        finally:
            rss = peak.stop()
            extra_cpu = cpu_seconds(server_cpu) if server_cpu else 0.0
            idle_s = cpu_seconds(idle_cpu) if idle_cpu else 0.0
            if cfg.kind == "llamacpp":
                E.shutdown_all()
        cpu = sum((w.get("tree_cores_busy_mean") or 0.0) * (w.get("window_s") or 0.0) for w in r["workers"])
        if workers > 1:  # the workers' own trees: the server is not in them
            cpu += extra_cpu
        else:  # one worker runs in this process, whose tree holds the server, and any idle one
            cpu -= idle_s
        # over the job's generation window (first batch admitted → last finished), where the
        # workers' meters measured: on (b) gen_s also holds the worker processes' start
        window = r.get("pipeline_generation_wall_s") or r["gen_s"]
        r.update({"peak_rss_bytes": rss, "cpu_s": cpu, "cpu_util": cpu / window if window else None,
                  "idle_server_cpu_s": idle_s,
                  "clock": "client" if cfg.kind in ("openai", "llamacpp") else "engine",
                  "engine": cfg.model_dump(mode="json", exclude_defaults=True)})
        if server:
            r.update({"server_cpu_s": extra_cpu, "prefix_cache_reset": reset})
        r.update(rows_lost(r["output_dir"], workload.rows))
        return r

    def direct(self, setup: dict[str, Any], workload) -> dict[str, Any]:
        """Every prompt at once to a llama-server started here, streamed with usage."""
        from bench.arms import _rates, prompt_rows
        from tokenmill.jobs.metrics.accounting import dist
        from tokenmill.jobs.metrics.pricing import price_table, worker_rate
        from tokenmill.transforms.engines.llamacpp_session import (
            LlamaServer,
            check_llamacpp,
            client_config,
            worker_cores,
        )
        from tokenmill.transforms.engines.openai_session import OpenAISession

        cfg = setup["cfg"]
        rows = self.rows.get(workload.name)
        if rows is None:
            rows = self.rows[workload.name] = prompt_rows(workload, self.model_path, cfg)
        cores = worker_cores()
        idle = self.idle_servers()
        peak = ChildrenPeak(exclude=idle)
        peak.start()
        t = time.perf_counter()
        server = LlamaServer(cfg, check_llamacpp(cfg), cores)  # started and /health-checked as the engine does
        try:
            load = time.perf_counter() - t
            client = OpenAISession(client_config(cfg, f"{server.url}/v1").model_copy(update={"max_in_flight": len(rows)}))
            meter = cpu_meter(os.getpid())
            idle_cpu = cpu_meter(idle[0]) if idle else None
            t = time.perf_counter()
            for r in rows:
                client.add(r["id"], r["token_ids"], {"max_tokens": r["max_tokens"], "temperature": 0.0, "ignore_eos": True},
                           source=r["messages"])
            done = []
            while client.num_unfinished():
                done += client.step()
            gen_s = time.perf_counter() - t
            cpu = cpu_seconds(meter) - (cpu_seconds(idle_cpu) if idle_cpu else 0.0)
            client.shutdown()
            argv = server.argv[1:]
        finally:
            server.stop()
            rss = peak.stop()
        ok = [f for f in done if not f.error_reason]
        res = _rates(sum(f.prompt_tokens for f in ok), sum(f.output_tokens for f in ok), len(ok), gen_s)
        rate = worker_rate({"device_type": "cpu", "cpu_count": len(cores), "measure": {"peak_tree_rss_bytes": rss}},
                           price_table())
        ids = [f.request_id for f in done]
        res.update({
            "engine_load_s": load, "server_args": argv, "clock": "client",
            "latency_s": {k: dist(getattr(f, f"{k}_s") for f in ok) for k in ("ttft", "tpot", "e2e")},
            "failure_rate": (len(done) - len(ok)) / len(rows), "peak_rss_bytes": rss, "cpu_s": cpu,
            "cpu_util": cpu / gen_s if gen_s else None,
            "usd_per_1m_output_tokens": (gen_s / 3600 * rate["usd_per_hour"] / res["output_tokens"] * 1e6
                                         if res["output_tokens"] else None),
            "price": {**rate, "basis": "the direct arm's generation wall × the same CPU price as the jobs"},
            "rows_lost": len({r["id"] for r in rows} - set(ids)), "every_id_once": len(ids) == len(set(ids)) == len(rows),
            "engine": cfg.model_dump(mode="json", exclude_defaults=True),
        })
        return res

    def eval_file(self) -> Path:
        """The eval set, or `eval_rows` of its rows spread evenly over it (smoke scale; the
        file is grouped by category)."""
        n = self.sc.get("eval_rows")
        if not n:
            return EVAL
        import pyarrow.parquet as pq

        t = pq.read_table(EVAL)
        path = WORK / f"engines-eval-{n}.parquet"
        pq.write_table(t.take(list(range(0, t.num_rows, max(1, t.num_rows // n)))[:n]), path)
        return path

    def eval_accuracy(self, arm: str, wl: str) -> dict[str, Any]:
        """One untimed job on the eval set through the arm's engine config (workload (a)'s;
        the direct arm: its GGUF's llamacpp config), accuracy against the references."""
        from tokenmill.jobs.lifecycle.runner import run_job
        from tokenmill.jobs.modeltools.compare import compare_jobs
        from tokenmill.schemas import storage as S
        from tokenmill.schemas.config import load_spec
        from tokenmill.transforms.engines import registry as E

        cfg = self.arm_setup(arm, wl)["cfg"]
        if arm == "direct":
            cfg = self.llamacpp_config(wl, self.args.direct_gguf, self.args.slots)
        job = f"engines-eval-{arm}-{time.time_ns()}"
        spec = load_spec({"job_id": job, "input": str(self.eval_file()), "output": str(WORK / "out" / job),
                          "engine": cfg.model_dump(mode="json"), "reference_column": "reference",
                          "sampling": {"max_tokens": self.sc["eval_max_tokens"], "temperature": 0.0}})
        if cfg.kind == "llamacpp":
            E.shutdown_all()
        r = run_job(spec, db_url=self.db)
        if cfg.kind == "llamacpp":
            E.shutdown_all()
        c = compare_jobs(S.connect(self.db), job, job)
        return {"job_id": job, "accuracy": c.base_accuracy, "rows": r.succeeded, "with_reference": c.with_reference,
                "engine": cfg.model_dump(mode="json", exclude_defaults=True),
                **({"note": f"the llamacpp engine on the direct arm's GGUF ({self.args.direct_gguf})"}
                   if arm == "direct" else {})}


def attempt(fn):
    try:
        return fn()
    except Exception as err:
        return err


def make_workloads(args, sc: dict[str, Any]) -> dict[str, Any]:
    from bench import workloads as W

    d = WORK / "engines-workloads" / args.scale
    out = {}
    if "a" in args.workloads:
        if args.input:
            import pyarrow.parquet as pq

            n = pq.read_metadata(args.input).num_rows
            out["a"] = W.Workload("chat", Path(args.input).resolve(), n, sc["max_tokens"], f"custom input {args.input}")
        else:
            out["a"] = W.chat(d / "a_chat.parquet", sc["rows"], max_tokens=sc["max_tokens"])
    if "b" in args.workloads:
        out["b"] = W.shared_prefix(d / "b_shared_prefix.parquet", sc["docs"], sc["questions"],
                                   doc_words=sc["doc_words"], max_tokens=sc["b_max_tokens"])
    return out


def run(args) -> dict[str, Any]:
    from bench.throughput import abba
    from tokenmill.transforms.engines import registry as E

    sc = dict(SCALES[args.scale])
    if args.reps:
        sc["reps"] = args.reps
    WORK.mkdir(parents=True, exist_ok=True)
    b = Bench(args, sc)
    res: dict[str, Any] = {"benchmark": "engines", "command": " ".join(["python -m bench.engines", *sys.argv[1:]]),
                           "started_at": utc_now(), "scale": args.scale, "settings": sc, "machine": machine(),
                           "arms": list(args.arms), "direct_gguf": args.direct_gguf, "workloads": {}, "runs": {},
                           "warmups": {}, "order": {}, "eval": {}, "errors": [], "servers": b.server_info,
                           "note": "shared 2-core CPU machine; greedy, ignore_eos, fixed max_tokens",
                           "definitions": DEFINITIONS}
    try:
        from tokenmill.transforms.engines.llamacpp_session import build_info

        res["llama_cpp"] = build_info()
    except Exception as err:
        res["llama_cpp"] = {"error": str(err)}
    res["models"] = b.prepare_models(list(args.arms))
    res["vllm_dtype"] = b.vllm_dtype
    wls = make_workloads(args, sc)
    stamp = utc_stamp()
    RESULTS.mkdir(parents=True, exist_ok=True)
    out_path = RESULTS / f"engines-{stamp}.json"

    def record(key: str, bucket: str, r) -> None:
        if isinstance(r, BaseException):
            res["errors"].append({"run": key, "bucket": bucket, "error": f"{type(r).__name__}: {str(r)[:1500]}"})
            log(f"{key} ({bucket}): FAILED {type(r).__name__}: {str(r)[:300]}")
            return
        res[bucket].setdefault(key, []).append(r)
        out_path.write_text(json.dumps(res, indent=1, default=str))
        f = figures(r)
        log(f"{key} ({bucket}): {f['output_tok_per_s'] or 0:.1f} out tok/s, TPOT p95 {f['tpot_p95_ms'] or 0:.1f} ms, "
            f"gen {r.get('gen_s') or 0:.1f} s, rows lost {r.get('rows_lost')}")

    try:
        for wl, workload in wls.items():
            res["workloads"][workload.name] = {"key": wl, "rows": workload.rows, "max_tokens": workload.max_tokens,
                                               "description": workload.description, "file": str(workload.path),
                                               "workers": 2 if wl == "b" else 1}
            if "openai_vllm" in args.arms:
                err = attempt(lambda: b.start_server(wl))
                if isinstance(err, BaseException):
                    record(f"{workload.name}/openai_vllm", "runs", err)
            arms = [a for a in args.arms if a != "openai_vllm" or wl in b.servers]
            t0 = time.perf_counter()
            for arm in arms:
                key = f"{workload.name}/{arm}"
                log(f"warm-up {key}")
                record(key, "warmups", attempt(lambda: b.run(arm, wl, workload)))
                if wl == "a" or "a" not in wls:  # one eval per arm, through (a)'s engine config
                    same = res["eval"].get(f"llamacpp_{args.direct_gguf}") if arm == "direct" else None
                    ev = dict(same, note=f"the llamacpp_{args.direct_gguf} arm's eval job: the same GGUF") if same else \
                        attempt(lambda: b.eval_accuracy(arm, wl))
                    if isinstance(ev, BaseException):
                        res["errors"].append({"run": f"eval/{arm}", "error": f"{type(ev).__name__}: {str(ev)[:1500]}"})
                        log(f"eval {arm}: FAILED {ev}")
                    else:
                        res["eval"][arm] = ev
                        log(f"eval {arm}: accuracy {ev['accuracy']}")
            res["order"][workload.name] = abba(arms, sc["reps"])
            for arm in res["order"][workload.name]:
                record(f"{workload.name}/{arm}", "runs", attempt(lambda: b.run(arm, wl, workload)))
            b.stop_server(wl)
            E.shutdown_all()  # no engine of this workload left holding memory or cores
            res["workloads"][workload.name]["wall_s"] = time.perf_counter() - t0
    finally:  # the API server runs in a session of its own: never leave it behind
        for wl in list(b.servers):
            b.stop_server(wl)
    summarize(res)
    res["finished_at"] = utc_now()
    out_path.write_text(json.dumps(res, indent=1, default=str))
    res["_path"] = str(out_path)
    return res


# ---------------------------------------------------------------- tables, targets, plot


def summarize(res: dict[str, Any]) -> None:
    """Medians per workload and arm (eval accuracy joined in), and the targets."""
    res["medians"] = {}
    for key, runs in res["runs"].items():
        m = medians(runs)
        m["eval_accuracy"] = (res.get("eval", {}).get(key.split("/", 1)[1]) or {}).get("accuracy")
        res["medians"][key] = m
    res["targets"] = targets(res["medians"], res.get("direct_gguf", "q8_0"))


def _ratio(m: dict[str, Any], a: str, b: str) -> float | None:
    x, y = (m.get(a) or {}).get("output_tok_per_s"), (m.get(b) or {}).get("output_tok_per_s")
    return x / y if x and y else None


def targets(m: dict[str, Any], direct_gguf: str) -> list[dict[str, Any]]:
    """Each target whose arms (one of the pair at least) ran: the measured ratio or count and
    whether it is met (None: not measured)."""
    out = []
    workloads = sorted({k.split("/", 1)[0] for k in m})
    for w in workloads:
        a, b = f"{w}/llamacpp_{direct_gguf}", f"{w}/direct"
        if a not in m and b not in m:
            continue
        r = _ratio(m, a, b)
        out.append({"name": f"tokenmill+llamacpp ({direct_gguf}) / direct llama-server, output tok/s on {w}",
                    "measured": r, "target": f"≥ {TARGET_DIRECT}", "met": None if r is None else r >= TARGET_DIRECT})
    if "chat/openai_vllm" in m or "chat/vllm" in m:
        r = _ratio(m, "chat/openai_vllm", "chat/vllm")
        out.append({"name": "openai → vllm serve / in-process vLLM, output tok/s on chat",
                    "measured": r, "target": f"≥ {TARGET_OPENAI}", "met": None if r is None else r >= TARGET_OPENAI})
    for key in sorted(m):
        lost = m[key].get("rows_lost")
        out.append({"name": f"rows lost, {key} (worst run)", "measured": lost, "target": "0",
                    "met": None if lost is None else lost == 0})
    return out


def _f(x, nd: int) -> str:
    if x is None:
        return "–"
    return f"{x:.{nd}f}" if isinstance(x, float) else str(x)


def markdown(res: dict[str, Any]) -> str:
    lines = []
    for wname, w in res["workloads"].items():
        lines += [f"### ({w['key']}) {wname}: {w['description']}, {w['rows']} rows, max_tokens {w['max_tokens']}, "
                  f"{w['workers']} worker(s)", "",
                  "| arm | runs | clock | " + " | ".join(t for _, t, _ in FIGURES) + " |",
                  "|---|---|---|" + "---|" * len(FIGURES)]
        for key, m in res["medians"].items():
            if key.split("/", 1)[0] != wname:
                continue
            lines.append(f"| {key.split('/', 1)[1]} | {m['runs']} | {m.get('clock') or '–'} | "
                         + " | ".join(_f(m.get(k), nd) for k, _, nd in FIGURES) + " |")
        lines.append("")
    lines += ["| target | measured | target | met |", "|---|---|---|---|"]
    for t in res["targets"]:
        met = "–" if t["met"] is None else ("yes" if t["met"] else "no")
        lines.append(f"| {t['name']} | {_f(t['measured'], 3)} | {t['target']} | {met} |")
    for e in res.get("errors") or []:  # a failed run is reported, not dropped
        lines.append(f"\nFailed: {e.get('run')} ({e.get('bucket', 'eval')}): `{e['error'][:300]}`")
    return "\n".join(lines) + "\n"


def plot_figure(res: dict[str, Any]):
    """Output tok/s against P95 TPOT, one point per arm and workload (one trace per workload)."""
    import plotly.graph_objects as go

    fig = go.Figure()
    for wname in res["workloads"]:
        pts = [(k.split("/", 1)[1], m) for k, m in res["medians"].items()
               if k.split("/", 1)[0] == wname and m.get("output_tok_per_s") is not None]
        fig.add_trace(go.Scatter(x=[m.get("tpot_p95_ms") for _, m in pts], y=[m["output_tok_per_s"] for _, m in pts],
                                 mode="markers+text", name=wname, text=[a for a, _ in pts], textposition="top center",
                                 marker=dict(size=12)))
    fig.update_layout(title="Output throughput against P95 TPOT (upper left is better)", height=520,
                      xaxis_title="TPOT p95 (ms)", yaxis_title="output tok/s (median)", margin=dict(t=60, b=50))
    return fig


def plot(res: dict[str, Any], path: Path) -> Path:
    """The plot and the tables as one HTML page next to the results file; plotly.js from its
    CDN, as bench-scale's plots (a committed results page stays small)."""
    import html

    fig = plot_figure(res).to_html(full_html=False, include_plotlyjs="cdn", config={"displaylogo": False})
    path.write_text("<!doctype html><html><head><meta charset='utf-8'><title>tokenmill bench-engines</title></head>"
                    f"<body><h1>bench-engines {res.get('started_at', '')}</h1><pre>{html.escape(markdown(res))}</pre>"
                    f"{fig}</body></html>")
    return path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scale", default="full", choices=sorted(SCALES))
    ap.add_argument("--arms", nargs="+", default=list(ARMS), choices=ARMS)
    ap.add_argument("--workloads", nargs="+", default=["a", "b"], choices=sorted(WORKLOADS))
    ap.add_argument("--model", default="smollm2-135m", help="the bundled short name (its GGUF and its weights)")
    ap.add_argument("--direct-gguf", default="q8_0", choices=sorted(GGUF_SCHEMES),
                    help="the GGUF the direct arm serves; its ratio is taken against that llamacpp arm")
    ap.add_argument("--slots", type=int, default=8, help="llama-server parallel slots per worker (engine.max_in_flight)")
    ap.add_argument("--reps", type=int, default=None, help="override the scale's A B B A passes")
    ap.add_argument("--vllm-dtype", default="auto", choices=["auto", "bfloat16", "float32"],
                    help="dtype of the vllm, vllm_w8a8 and openai_vllm arms (auto: the one `dtype: auto` measures fastest here)")
    ap.add_argument("--input", default=None, metavar="PARQUET",
                    help="your own rows (tokenmill's input schema) for workload (a) instead of the seeded chat")
    ap.add_argument("--report-only", metavar="JSON", help="recompute tables, targets and plot from a results file")
    args = ap.parse_args(argv)
    if args.input:
        try:
            import pyarrow.parquet as pq

            pq.read_metadata(args.input)
        except Exception as err:
            ap.error(f"--input {args.input!r} is not a readable Parquet file ({type(err).__name__})")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if args.report_only:
        src = Path(args.report_only)
        res = json.loads(src.read_text())
        summarize(res)
        src.write_text(json.dumps(res, indent=1, default=str))
        path = src
    else:
        res = run(args)
        path = Path(res.pop("_path"))
    html = plot(res, path.with_suffix(".html"))
    print(markdown(res))
    print(json.dumps({"results": str(path), "plot": str(html), "errors": len(res.get("errors", []))}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
