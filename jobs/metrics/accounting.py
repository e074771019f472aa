"""Account: per-job serving metrics from the engine's own per-request figures.

Every throughput figure says what it counts and over which wall time:

* `output_tok_per_s`: generated tokens ÷ generation wall time (the sum over the
  job's runs of each run's first batch admitted → last batch finished, across
  workers; model load and the time between a killed run and its resume excluded);
* `total_tok_per_s`: (prompt + generated) tokens ÷ the same wall time;
* `requests_per_s`: answered requests ÷ the same wall time;
* `mean_request_output_tok_per_s`: mean over requests of output tokens ÷ e2e.

Clocks: TTFT comes from vLLM's front end (first token time − arrival, wall
clock); TPOT from the engine core's monotonic timestamps ((last − first token)
÷ (output tokens − 1)); E2E from the front end (finish − arrival); queue time
from the engine core (scheduled − queued).  Offline, every request of a batch
arrives when the batch is admitted, so TTFT includes waiting for a slot.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

from tokenmill.jobs.metrics.adapters import adapter_figures
from tokenmill.jobs.metrics.devices import device_summary, worker_summary
from tokenmill.jobs.metrics.pricing import launcher_worker, price_table, prices_used, worker_rate
from tokenmill.jobs.metrics.runs import job_task, run_figures, run_of, span, worker_run
from tokenmill.schemas.records import METRIC_COLUMNS, TOKEN_COUNT_SOURCES, TOKENS_BY_ENGINE, metric_values
from tokenmill.schemas.storage.summary import DIST_COLUMNS, RequestStats
from tokenmill.transforms.engines.kinds import engine_for

#: Which clock each figure is measured on (shown beside the figures in reports).
CLOCKS: dict[str, str] = {
    "ttft_s": "vLLM front end, wall clock: first token time - arrival time",
    "tpot_s": "vLLM engine core, monotonic: (last token - first token) / (output tokens - 1)",
    "e2e_s": "vLLM front end, wall clock: finish time - arrival time",
    "queue_s": "vLLM engine core, monotonic: scheduled - queued",
    "generation_wall_s": "worker wall clock (time.time): per run, first batch admitted -> last batch finished; "
                         "summed over the job's runs",
    "model_load_s": "worker wall clock: importing vLLM and constructing the engine (slowest worker of each run; "
                    "summed over runs)",
    "run_held_s": "launcher wall clock (time.time): run start -> after export (a killed run: its last heartbeat)",
    "worker_measure": "worker wall clock (time.time): engine ready -> latest report; NVML and psutil readings",
    "job_wall_s": "launcher wall clock: job start -> accounting (includes checks, load, export)",
    "outputs.finished_at": "worker wall clock (time.time) when the request finished",
    "utilization": "launcher monotonic clock, one sample per interval",
}

def clocks_for(engine_config: Mapping[str, Any]) -> dict[str, str]:
    """The clock of each figure for a job's engine (`engine_config`: its EngineConfig as a dict):
    the defaults, with the figures its engine measures on another clock (`EngineKind.clocks`)."""
    engine = engine_for(engine_config)
    return {**CLOCKS, **engine.clocks} if engine and engine.clocks else CLOCKS


def _values(values: Iterable[float | None]) -> np.ndarray:
    """Float array of the given values, None and NaN left out."""
    vals = values if isinstance(values, np.ndarray) else np.array(list(values), dtype=float)
    vals = vals.astype(float, copy=False)
    return vals[~np.isnan(vals)]


def percentile(values: Iterable[float | None], q: float) -> float | None:
    """Linear-interpolated percentile (numpy's default), ignoring None and NaN; None for no values."""
    vals = _values(values)
    return float(np.percentile(vals, q)) if vals.size else None


def dist(values: Iterable[float | None]) -> dict[str, float | None]:
    vals = _values(values)
    if not vals.size:
        return {"mean": None, "p50": None, "p95": None, "p99": None, "max": None, "n": 0}
    qs = np.percentile(vals, [50, 95, 99])
    p50, p95, p99 = (float(x) for x in qs)  # type: ignore[attr-defined]  # an array for a list of q
    return {"mean": float(vals.mean()), "p50": p50, "p95": p95, "p99": p99, "max": float(vals.max()),
            "n": int(vals.size)}


def request_columns(rows: Sequence[dict[str, Any]] | Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Per-request figures as one float array per column (None → NaN): what storage's
    `request_columns` streams out of the database, or the same built from row dicts."""
    if isinstance(rows, Mapping):
        return dict(rows)
    return {k: np.fromiter(metric_values(k, (r.get(k) for r in rows)), dtype=float, count=len(rows))
            for k in METRIC_COLUMNS}


COUNT_SOURCE_DEFINITION = (
    "answered rows and their prompt/output tokens by outputs.token_count_source: engine = the engine's own counts "
    "(vLLM's request output, the server's usage); local_tokenizer+stream_chunks, server_tokenizer+stream_chunks, "
    "estimate+stream_chunks = the server sent no usage: prompt tokens as counted before sending (by the job's "
    "tokenizer and chat template, by the server's /tokenize, or at 1 token per 4 bytes of text), output tokens = "
    "streamed text chunks (estimates); not_recorded = rows stored before tokenmill recorded the source")


def count_sources(cols: Mapping[str, np.ndarray]) -> dict[str, dict[str, int]]:
    """Rows, prompt and output tokens by where the rows' token counts came from
    (records.TOKEN_COUNT_SOURCES; "not_recorded": rows stored before the column existed,
    "unknown": a value this version does not know)."""
    prompt, outs = cols["prompt_tokens"], cols["output_tokens"]
    codes = cols.get("token_count_source")
    if codes is None:
        codes = np.full(len(prompt), np.nan)
    names = {float(i): s for i, s in enumerate(TOKEN_COUNT_SOURCES)}
    groups = [(names.get(float(code), "unknown"), codes == code) for code in np.unique(codes) if not np.isnan(code)]
    groups.append(("not_recorded", np.isnan(codes)))  # last, as before
    return {name: {"rows": int(sel.sum()), "prompt": int(np.nansum(prompt[sel])), "output": int(np.nansum(outs[sel]))}
            for name, sel in groups if sel.any()}


def request_stats(rows: Sequence[dict[str, Any]] | Mapping[str, np.ndarray]) -> RequestStats:
    """`RequestStats` of request rows held in memory (row dicts or `request_columns`): the
    figures storage's `RequestSummary.stats` has the database compute, numpy's way."""
    cols = request_columns(rows)
    outs, e2e = cols["output_tokens"], cols["e2e_s"]
    ok = (e2e > 0) & (outs > 0)  # NaN compares False
    per_req = outs[ok] / e2e[ok]
    marks = [] if isinstance(rows, Mapping) else [r.get("valid") for r in rows]  # columns do not say what was checked
    return RequestStats(
        n=len(cols["prompt_tokens"]), prompt=int(np.nansum(cols["prompt_tokens"])), output=int(np.nansum(outs)),
        cached=int(np.nansum(cols["cached_tokens"])), cached_known=bool(np.isfinite(cols["cached_tokens"]).any()),
        by_source=count_sources(cols), dists={c: dist(cols[c]) for c in DIST_COLUMNS},
        mean_request_output_tok_per_s=float(per_req.mean()) if per_req.size else None,
        checked=sum(v is not None for v in marks), valid=sum(v is True for v in marks))


@dataclass(frozen=True)
class JobWork:
    """What a job's workers left in the database, as `job_metrics` reads it."""

    rows: RequestStats | Sequence[dict[str, Any]] | Mapping[str, np.ndarray]
    """The answered requests' figures as storage's `RequestSummary.stats` sums and ranks them in
    the database (a job of millions of rows never leaves it), or per-request outputs (prompt/
    output/cached tokens, ttft_s, tpot_s, e2e_s, queue_s) held in memory, as row dicts or columns
    (`request_columns`, summed by `request_stats`)."""
    batches: Sequence[dict[str, Any]]
    workers: Sequence[dict[str, Any]]
    failed_by_reason: dict[str, int] = field(default_factory=dict)
    """The dead-lettered rows by reason code."""
    runs: Sequence[dict[str, Any]] = ()
    """The job's run rows (storage `job_runs`)."""


@dataclass(frozen=True)
class JobTerms:
    """What a job's figures are measured against: its rows and engine, its prices, and what
    the launcher saw of the run."""

    total: int
    """The input's rows."""
    engine_config: dict[str, Any]
    token_budget: int | None = None
    price_per_hour: float | None = None
    """The job's flat hourly price (`prices` first when both are given)."""
    prices: dict[str, float] | None = None
    """A pricing.price_table; with neither it nor `price_per_hour` there is no cost."""
    hardware: dict[str, Any] | None = None
    """The launcher's hardware: prices the worker rows that measured nothing."""
    device_count: int = 1
    job_wall_s: float | None = None
    utilization: dict[str, Any] | None = None
    """The launcher's `UtilizationSampler` summary, if any."""
    now: float | None = None
    """The end of a run still going (a report of a live job)."""
    cache_mode: str | None = None
    """The run's `cache` (the rows served from the result cache are in `cache`, not in the
    engine's figures)."""


@dataclass(frozen=True)
class Served:
    """What a job's costs are divided by."""

    output_tokens: int
    total_tokens: int
    requests: int


def job_metrics(work: JobWork, terms: JobTerms) -> dict[str, Any]:
    """The job's serving metrics (see the module docstring for what each counts) of `work`,
    measured against `terms`.  Cost (`job_cost`) is priced from `terms.prices` or the flat
    `terms.price_per_hour`."""
    rows, batches, workers, failed_by_reason = work.rows, work.batches, work.workers, work.failed_by_reason
    total, engine_config, utilization = terms.total, terms.engine_config, terms.utilization
    s = rows if isinstance(rows, RequestStats) else request_stats(rows)
    n, prompt, output, cached = s.n, s.prompt, s.output, s.cached
    by_engine = s.by_source.get(TOKENS_BY_ENGINE, {}).get("rows", 0)
    # an engine that may not report cached tokens (a server's), and reported none: unknown, not zero
    engine = engine_for(engine_config)
    cache_unknown = engine is not None and not engine.measures_prefix_cache and not s.cached_known
    per_run = run_figures(batches, workers, work.runs, now=terms.now)
    gen_wall = sum(r["generation_wall_s"] for r in per_run)
    run_loads = [r["model_load_s"] for r in per_run if r["model_load_s"] is not None]
    failed = sum(failed_by_reason.values())
    peak_rss = max((w.get("peak_rss_bytes") or 0 for w in workers), default=0)
    info: dict[str, Any] = next((w["engine_info"] for w in workers if w.get("engine_info")), {})
    m: dict[str, Any] = {
        "requests": {"total": total, "succeeded": n if s.rows is None else s.rows, "failed": failed,
                     "samples": n + s.cache["samples"]},
        # rows served from the result cache (docs/CACHE.md): outputs, in no engine figure below and at no cost
        "cache": {"mode": terms.cache_mode, **s.cache},
        "concurrency": {
            "arrival": "offline: all requests available at start; admitted by token budget",
            "max_num_seqs": engine_config.get("max_num_seqs"),
            "max_num_batched_tokens": info.get("max_num_batched_tokens") or engine_config.get("max_num_batched_tokens"),
            "token_budget": terms.token_budget,
            "workers": len(workers),
            "batches": len(batches),
            "mean_batch_requests": (sum(b["requests"] for b in batches) / len(batches)) if batches else None,
        },
        "lengths": {"prompt_tokens": s.dists["prompt_tokens"], "output_tokens": s.dists["output_tokens"]},
        "tokens": {"prompt": prompt, "output": output, "total": prompt + output,
                   "cached": None if cache_unknown else cached,
                   "by_count_source": s.by_source,
                   "count_source_definition": COUNT_SOURCE_DEFINITION},
        "percentiles": {
            "relative_error_max": dict(s.percentile_error),
            "definition": "the largest relative error of each column's p50/p95/p99 against numpy's linear "
                          "percentile of every row: 0 exact (ranked by the database, or token counts binned by "
                          "value); otherwise time percentiles read from the runs' merged log-binned summaries "
                          "(docs/ACCOUNTING.md, \"Percentiles\"); counts, sums, means and maxima are exact",
        },
        "latency_s": {
            "ttft": s.dists["ttft_s"],
            "tpot": s.dists["tpot_s"],
            "e2e": s.dists["e2e_s"],
            "queue": s.dists["queue_s"],
        },
        "throughput": {
            "generation_wall_s": gen_wall,
            "job_wall_s": terms.job_wall_s,
            "model_load_s": sum(run_loads) if run_loads else None,
            "runs": len(per_run),
            "output_tok_per_s": (output / gen_wall) if gen_wall > 0 else None,
            "total_tok_per_s": ((prompt + output) / gen_wall) if gen_wall > 0 else None,
            "requests_per_s": (n / gen_wall) if gen_wall > 0 else None,
            "mean_request_output_tok_per_s": s.mean_request_output_tok_per_s,
            "counts": ("tokens from the engine's outputs" if by_engine == n else
                       f"tokens from the engine's outputs for {by_engine:,} of {n:,} rows, the others as "
                       f"tokens.by_count_source says (…+stream_chunks: estimates)")
                      + " over generation wall time (model load excluded), the generation wall summed over the "
                        "job's runs",
        },
        "runs": per_run,
        "workers": [worker_summary(w) for w in workers],
        "devices": device_summary(workers),
        # the dtype the engine ran, and on a CPU with `dtype: auto` the measurement that chose it
        "engine": {"dtype": info.get("dtype"), "dtype_auto": info.get("dtype_auto"),
                   "task": job_task(workers, engine_config)},
        "prefix_cache": {
            "hit_rate": (cached / prompt) if prompt and not cache_unknown else None,
            "cached_prompt_tokens": None if cache_unknown else cached,
            "definition": "not reported by this engine's server (null, not zero)" if cache_unknown else
                          "cached prompt tokens / prompt tokens (vLLM num_cached_tokens per request)",
        },
        "tail": {
            "batch_tail_s": dist(b.get("tail_s") for b in batches),
            "tail_share": (sum(b.get("tail_s") or 0 for b in batches) / gen_wall) if gen_wall > 0 and batches else None,
        },
        "checkpoint": info.get("checkpoint"),
        "memory": {
            "peak_worker_rss_bytes": peak_rss or None,
            "peak_process_tree_rss_bytes": (utilization or {}).get("peak_process_tree_rss_bytes"),
            "weights_bytes": info.get("weights_file_bytes"),
            "kv_cache_bytes": info.get("kv_cache_bytes"),
            "kv_cache_tokens": info.get("kv_cache_tokens"),
        },
        "answers": {
            "checked": s.checked, "valid": s.valid,
            "valid_rate": (s.valid / s.checked) if s.checked else None,
            "definition": "structured rows (a JSON schema, JSON, a regex or a choice) whose output met its "
                          "constraint / structured rows answered (outputs.valid; grammars are not checked)",
        },
        "failures": {
            "rate": (failed / total) if total else 0.0,
            "by_reason": dict(sorted(failed_by_reason.items())),
            "rate_by_reason": {k: (v / total if total else 0.0) for k, v in sorted(failed_by_reason.items())},
            "definition": "dead-lettered input rows / input rows, per reason code",
            "retries_by_reason": _retries(batches),
            "retries_definition": "retried attempts of requests (answered or dead-lettered in the end) by the "
                                  "failed attempt's reason, as the HTTP engine counted them; null: the engine "
                                  "does not retry",
        },
        "utilization": utilization,
        "clocks": clocks_for(engine_config),
    }
    if terms.prices is not None or terms.price_per_hour is not None:
        m["cost"] = job_cost(workers, batches, per_run, prices=terms.prices, flat=terms.price_per_hour,
                             fallback=_fallback_worker(terms.hardware, terms.device_count),
                             served=Served(output_tokens=output, total_tokens=prompt + output, requests=n))
    adapters = bool(engine_config.get("lora_adapters")) or any(a["adapter"] is not None for a in s.by_adapter)
    m["adapters"] = adapter_figures(s.by_adapter, gen_wall, m.get("cost")) if adapters else None
    return m


def _retries(batches: Sequence[dict[str, Any]]) -> dict[str, int] | None:
    """The batches' retries summed by reason; None when no batch counted any (vLLM in process)."""
    counted = [b["retries"] for b in batches if b.get("retries") is not None]
    if not counted:
        return None
    total: Counter[str] = Counter()
    for r in counted:
        total.update(r)
    return dict(sorted(total.items()))


# ---------------------------------------------------------------- cost

def _fallback_worker(hardware: dict[str, Any] | None, device_count: int) -> dict[str, Any]:
    if hardware:
        return launcher_worker(hardware)
    return {"device_type": "cpu", "cpu_count": 1} if device_count <= 1 else {"device_type": "gpu",
                                                                              "device_count": device_count}


def _unit_costs(cost: float, served: Served) -> dict[str, Any]:
    output_tokens, total_tokens, requests = served.output_tokens, served.total_tokens, served.requests
    return {
        "total": cost,
        "per_1m_output_tokens": (cost / output_tokens * 1e6) if output_tokens else None,
        "per_1m_total_tokens": (cost / total_tokens * 1e6) if total_tokens else None,
        "per_successful_request": (cost / requests) if requests else None,
    }


def job_cost(workers: Sequence[dict[str, Any]], batches: Sequence[dict[str, Any]],
             per_run: Sequence[dict[str, Any]], *, prices: dict[str, float] | None, flat: float | None,
             fallback: dict[str, Any], served: Served) -> dict[str, Any]:
    """Σ over workers of hours × that worker's hourly price (pricing.worker_rate), two ways:

    * generation only (the top-level unit costs): each worker's active generation window
      (its first batch admitted → its last batch finished, per run);
    * held (`held`): each worker for the whole of its run as the launcher held it
      (start-up, model load, generation, export; `run_figures` held_s), or, where the
      run has no record, from the worker's start to its last report.

    A worker row without measured devices is priced as the launcher's `fallback`.  Each
    worker row names the prices it used with their origins (`prices`: job spec, user file
    or default table; pricing.worker_rate), and `prices_used` lists them once for the job."""
    table = prices if prices is not None else price_table()
    runs = {r["run_id"]: r for r in per_run}
    rows, gen_cost, held_cost, load_cost = [], 0.0, 0.0, 0.0
    sources = set()
    for w in workers:
        desc = w if w.get("device_type") else {**w, **fallback}
        rate = worker_rate(desc, table, flat)
        rid = worker_run(w, batches)
        mine = [b for b in batches if w.get("worker") is not None and b.get("worker") == w.get("worker")]
        by_run: dict[str, list[dict[str, Any]]] = {}
        for b in mine:
            by_run.setdefault(run_of(b.get("batch_id")), []).append(b)
        gen_s = 0.0
        for bs in by_run.values():
            t0, t1 = span(bs)
            gen_s += (t1 - t0) if t0 is not None and t1 is not None else 0.0
        run = runs.get(rid) if rid is not None else None
        if run is not None and run.get("held_s") is not None:
            held_s, held_basis = run["held_s"], "run"
        else:
            end = w.get("updated_at") or w.get("started_at")
            held_s = (end - w["started_at"]) if w.get("started_at") is not None and end is not None else gen_s
            held_s, held_basis = max(held_s, gen_s), "worker"
        usd = rate["usd_per_hour"]
        gen_cost += gen_s / 3600.0 * usd
        held_cost += held_s / 3600.0 * usd
        load_cost += (w.get("load_s") or 0.0) / 3600.0 * usd
        sources.add(rate["source"])
        rows.append({"worker": w.get("worker"), "run_id": rid, **rate, "generation_s": gen_s,
                     "generation_cost": gen_s / 3600.0 * usd, "held_s": held_s, "held_basis": held_basis,
                     "held_cost": held_s / 3600.0 * usd})
    hourly = sum(r["usd_per_hour"] for r in rows)
    return {
        **_unit_costs(gen_cost, served),
        "basis": "generation only: Σ over workers of its active generation windows × its hourly price "
                 "(model load, start-up and export excluded; see `held`)",
        "held": {
            **_unit_costs(held_cost, served),
            "basis": "everything the job held its devices for: Σ over workers of its run's launcher start -> "
                     "after export (start-up, model load, generation, export) × its hourly price",
        },
        "model_load": load_cost,
        "total_with_model_load": gen_cost + load_cost,
        "usd_per_hour": hourly,
        "price_per_hour": hourly,
        "price_source": "; ".join(sorted(sources)) or None,
        "prices_used": prices_used(rows),
        "workers": rows,
        "currency": "USD",
    }
