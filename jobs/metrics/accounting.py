"""Account: per-job serving metrics from the engine's own per-request figures.

Every throughput figure says what it counts and over which wall time:

* `output_tok_per_s`: generated tokens ÷ generation wall time (first batch
  admitted → last batch finished, across workers; model load excluded);
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

from typing import Any, Iterable, Mapping, Sequence

import numpy as np


#: Which clock each figure is measured on (shown beside the figures in reports).
CLOCKS: dict[str, str] = {
    "ttft_s": "vLLM front end, wall clock: first token time - arrival time",
    "tpot_s": "vLLM engine core, monotonic: (last token - first token) / (output tokens - 1)",
    "e2e_s": "vLLM front end, wall clock: finish time - arrival time",
    "queue_s": "vLLM engine core, monotonic: scheduled - queued",
    "generation_wall_s": "worker wall clock (time.time): first batch admitted -> last batch finished",
    "model_load_s": "worker wall clock: importing vLLM and constructing the engine (slowest worker)",
    "job_wall_s": "launcher wall clock: job start -> accounting (includes checks, load, export)",
    "outputs.finished_at": "worker wall clock (time.time) when the request finished",
    "utilization": "launcher monotonic clock, one sample per interval",
}


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
    p50, p95, p99 = (float(x) for x in np.percentile(vals, [50, 95, 99]))
    return {"mean": float(vals.mean()), "p50": p50, "p95": p95, "p99": p99, "max": float(vals.max()),
            "n": int(vals.size)}


def request_columns(rows: Sequence[dict[str, Any]] | Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Per-request figures as one float array per column (None → NaN): what storage's
    `request_columns` streams out of the database, or the same built from row dicts."""
    if isinstance(rows, Mapping):
        return dict(rows)
    names = ("prompt_tokens", "output_tokens", "cached_tokens", "ttft_s", "tpot_s", "e2e_s", "queue_s")
    return {k: np.array([r.get(k) for r in rows], dtype=float) for k in names}


def job_metrics(
    rows: Sequence[dict[str, Any]] | Mapping[str, np.ndarray],
    batches: Sequence[dict[str, Any]],
    workers: Sequence[dict[str, Any]],
    *,
    total: int,
    failed_by_reason: dict[str, int],
    engine_config: dict[str, Any],
    token_budget: int | None,
    price_per_hour: float | None,
    device_count: int = 1,
    job_wall_s: float | None = None,
    utilization: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The job's serving metrics (see the module docstring for what each counts).

    `rows`: per-request outputs (prompt/output/cached tokens, ttft_s, tpot_s,
    e2e_s, queue_s), as row dicts or as columns (`request_columns`: a few bytes a
    request, so a job of millions of rows is summed in the launcher without a
    Python object per row); `batches`/`workers`: the job's batch and worker rows;
    `utilization`: the launcher's `UtilizationSampler` summary, if any."""
    cols = request_columns(rows)
    n = len(cols["prompt_tokens"])
    prompt = int(np.nansum(cols["prompt_tokens"]))
    output = int(np.nansum(cols["output_tokens"]))
    cached = int(np.nansum(cols["cached_tokens"]))
    if batches:
        gen_wall = max(b["finished_at"] for b in batches) - min(b["started_at"] for b in batches)
    else:
        gen_wall = 0.0
    e2e, outs = cols["e2e_s"], cols["output_tokens"]
    ok = (e2e > 0) & (outs > 0)  # NaN compares False
    per_req = outs[ok] / e2e[ok]
    failed = sum(failed_by_reason.values())
    load = [w.get("load_s") for w in workers if w.get("load_s") is not None]
    peak_rss = max((w.get("peak_rss_bytes") or 0 for w in workers), default=0)
    info = next((w.get("engine_info") for w in workers if w.get("engine_info")), {}) or {}
    m: dict[str, Any] = {
        "requests": {"total": total, "succeeded": n, "failed": failed},
        "concurrency": {
            "arrival": "offline: all requests available at start; admitted by token budget",
            "max_num_seqs": engine_config.get("max_num_seqs"),
            "max_num_batched_tokens": info.get("max_num_batched_tokens") or engine_config.get("max_num_batched_tokens"),
            "token_budget": token_budget,
            "workers": len(workers),
            "batches": len(batches),
            "mean_batch_requests": (sum(b["requests"] for b in batches) / len(batches)) if batches else None,
        },
        "lengths": {"prompt_tokens": dist(cols["prompt_tokens"]), "output_tokens": dist(outs)},
        "tokens": {"prompt": prompt, "output": output, "total": prompt + output, "cached": cached},
        "latency_s": {
            "ttft": dist(cols["ttft_s"]),
            "tpot": dist(cols["tpot_s"]),
            "e2e": dist(e2e),
            "queue": dist(cols["queue_s"]),
        },
        "throughput": {
            "generation_wall_s": gen_wall,
            "job_wall_s": job_wall_s,
            "model_load_s": max(load) if load else None,
            "output_tok_per_s": (output / gen_wall) if gen_wall > 0 else None,
            "total_tok_per_s": ((prompt + output) / gen_wall) if gen_wall > 0 else None,
            "requests_per_s": (n / gen_wall) if gen_wall > 0 else None,
            "mean_request_output_tok_per_s": float(per_req.mean()) if per_req.size else None,
            "counts": "tokens from the engine's outputs over generation wall time (model load excluded)",
        },
        "prefix_cache": {
            "hit_rate": (cached / prompt) if prompt else None,
            "cached_prompt_tokens": cached,
            "definition": "cached prompt tokens / prompt tokens (vLLM num_cached_tokens per request)",
        },
        "tail": {
            "batch_tail_s": dist(b.get("tail_s") for b in batches),
            "tail_share": (sum(b.get("tail_s") or 0 for b in batches) / gen_wall) if gen_wall > 0 and batches else None,
        },
        "memory": {
            "peak_worker_rss_bytes": peak_rss or None,
            "peak_process_tree_rss_bytes": (utilization or {}).get("peak_process_tree_rss_bytes"),
            "weights_bytes": info.get("weights_file_bytes"),
            "kv_cache_bytes": info.get("kv_cache_bytes"),
            "kv_cache_tokens": info.get("kv_cache_tokens"),
        },
        "failures": {
            "rate": (failed / total) if total else 0.0,
            "by_reason": dict(sorted(failed_by_reason.items())),
            "rate_by_reason": {k: (v / total if total else 0.0) for k, v in sorted(failed_by_reason.items())},
            "definition": "dead-lettered input rows / input rows, per reason code",
        },
        "utilization": utilization,
        "clocks": CLOCKS,
    }
    hours = (gen_wall * device_count) / 3600.0
    load_hours = ((max(load) if load else 0.0) * device_count) / 3600.0
    if price_per_hour is not None:
        cost = hours * price_per_hour
        m["cost"] = {
            "price_per_hour": price_per_hour,
            "device_count": device_count,
            "device_hours": hours,
            "total": cost,
            "model_load_device_hours": load_hours,
            "model_load": load_hours * price_per_hour,
            "total_with_model_load": cost + load_hours * price_per_hour,
            "per_1m_output_tokens": (cost / output * 1e6) if output else None,
            "per_1m_total_tokens": (cost / (prompt + output) * 1e6) if (prompt + output) else None,
            "per_successful_request": (cost / n) if n else None,
            "currency": "USD",
            "basis": "generation wall time × devices × hourly price (model load excluded; shown separately)",
        }
    return m


# ---------------------------------------------------------------- headline figures and comparison

#: (path in the metrics dict, label, which direction is better)
HEADLINE: tuple[tuple[str, str, str], ...] = (
    ("requests.succeeded", "succeeded requests", "higher"),
    ("failures.rate", "failure rate", "lower"),
    ("latency_s.ttft.p50", "TTFT p50", "lower"),
    ("latency_s.ttft.p95", "TTFT p95", "lower"),
    ("latency_s.ttft.p99", "TTFT p99", "lower"),
    ("latency_s.tpot.p50", "TPOT p50", "lower"),
    ("latency_s.tpot.p95", "TPOT p95", "lower"),
    ("latency_s.tpot.p99", "TPOT p99", "lower"),
    ("latency_s.e2e.p50", "E2E p50", "lower"),
    ("latency_s.e2e.p95", "E2E p95", "lower"),
    ("latency_s.e2e.p99", "E2E p99", "lower"),
    ("throughput.output_tok_per_s", "output tok/s", "higher"),
    ("throughput.total_tok_per_s", "total tok/s", "higher"),
    ("throughput.requests_per_s", "requests/s", "higher"),
    ("throughput.mean_request_output_tok_per_s", "mean per-request output tok/s", "higher"),
    ("throughput.generation_wall_s", "generation wall", "lower"),
    ("throughput.model_load_s", "model load", "lower"),
    ("prefix_cache.hit_rate", "prefix cache hit rate", "higher"),
    ("memory.kv_cache_bytes", "KV cache", "neutral"),
    ("memory.peak_worker_rss_bytes", "peak worker RSS", "lower"),
    ("utilization.cpu_util_pct_mean", "CPU utilization mean", "neutral"),
    ("cost.per_1m_output_tokens", "USD per 1M output tokens", "lower"),
    ("cost.per_1m_total_tokens", "USD per 1M total tokens", "lower"),
    ("cost.per_successful_request", "USD per successful request", "lower"),
)


def get_path(m: dict[str, Any] | None, path: str) -> Any:
    """`m["a"]["b"]` for "a.b"; None where any step is missing."""
    cur: Any = m
    for part in path.split("."):
        if not isinstance(cur, dict):
            return None
        cur = cur.get(part)
    return cur


def ratio(a: float | None, b: float | None) -> float | None:
    """b / a, or None where it is undefined (a missing or zero)."""
    if a is None or b is None or not isinstance(a, (int, float)) or not isinstance(b, (int, float)) or a == 0:
        return None
    return float(b) / float(a)


def compare_metrics(a: dict[str, Any], b: dict[str, Any]) -> list[dict[str, Any]]:
    """The headline figures of two jobs side by side; `ratio` is B / A and
    `better` says which job the figure favours ("a", "b", "same" or None)."""
    out = []
    for path, label, direction in HEADLINE:
        va, vb = get_path(a, path), get_path(b, path)
        r = ratio(va, vb)
        if va is None or vb is None or direction == "neutral":
            better = None
        elif va == vb:
            better = "same"
        else:
            b_higher = vb > va
            better = "b" if (b_higher == (direction == "higher")) else "a"
        out.append({"metric": path, "label": label, "a": va, "b": vb, "ratio_b_over_a": r, "better": better,
                    "direction": direction})
    return out
