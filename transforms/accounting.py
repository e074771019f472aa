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

import math
from typing import Any, Iterable, Sequence


def percentile(values: Sequence[float], q: float) -> float | None:
    """Linear-interpolated percentile (numpy's default), None for no values."""
    vals = sorted(v for v in values if v is not None and not math.isnan(v))
    if not vals:
        return None
    if len(vals) == 1:
        return float(vals[0])
    k = (len(vals) - 1) * q / 100.0
    lo, hi = math.floor(k), math.ceil(k)
    return float(vals[lo] + (vals[hi] - vals[lo]) * (k - lo))


def dist(values: Iterable[float | None]) -> dict[str, float | None]:
    vals = [v for v in values if v is not None]
    return {
        "mean": (sum(vals) / len(vals)) if vals else None,
        "p50": percentile(vals, 50),
        "p95": percentile(vals, 95),
        "p99": percentile(vals, 99),
        "max": max(vals) if vals else None,
        "n": len(vals),
    }


def job_metrics(
    rows: Sequence[dict[str, Any]],
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
) -> dict[str, Any]:
    n = len(rows)
    prompt = sum(r["prompt_tokens"] or 0 for r in rows)
    output = sum(r["output_tokens"] or 0 for r in rows)
    cached = sum(r["cached_tokens"] or 0 for r in rows)
    if batches:
        gen_wall = max(b["finished_at"] for b in batches) - min(b["started_at"] for b in batches)
    else:
        gen_wall = 0.0
    per_req = [
        (r["output_tokens"] / r["e2e_s"]) for r in rows if r.get("e2e_s") and r["e2e_s"] > 0 and r["output_tokens"]
    ]
    failed = sum(failed_by_reason.values())
    load = [w.get("load_s") for w in workers if w.get("load_s") is not None]
    peak_rss = max((w.get("peak_rss_bytes") or 0 for w in workers), default=0)
    info = next((w.get("engine_info") for w in workers if w.get("engine_info")), {}) or {}
    in_lens = [r["prompt_tokens"] for r in rows if r["prompt_tokens"] is not None]
    out_lens = [r["output_tokens"] for r in rows if r["output_tokens"] is not None]
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
        "lengths": {"prompt_tokens": dist(in_lens), "output_tokens": dist(out_lens)},
        "tokens": {"prompt": prompt, "output": output, "total": prompt + output, "cached": cached},
        "latency_s": {
            "ttft": dist(r.get("ttft_s") for r in rows),
            "tpot": dist(r.get("tpot_s") for r in rows),
            "e2e": dist(r.get("e2e_s") for r in rows),
            "queue": dist(r.get("queue_s") for r in rows),
        },
        "throughput": {
            "generation_wall_s": gen_wall,
            "job_wall_s": job_wall_s,
            "model_load_s": max(load) if load else None,
            "output_tok_per_s": (output / gen_wall) if gen_wall > 0 else None,
            "total_tok_per_s": ((prompt + output) / gen_wall) if gen_wall > 0 else None,
            "requests_per_s": (n / gen_wall) if gen_wall > 0 else None,
            "mean_request_output_tok_per_s": (sum(per_req) / len(per_req)) if per_req else None,
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
            "weights_bytes": info.get("weights_file_bytes"),
            "kv_cache_bytes": info.get("kv_cache_bytes"),
            "kv_cache_tokens": info.get("kv_cache_tokens"),
        },
        "failures": {
            "rate": (failed / total) if total else 0.0,
            "by_reason": dict(sorted(failed_by_reason.items())),
        },
    }
    hours = (gen_wall * device_count) / 3600.0
    if price_per_hour is not None:
        cost = hours * price_per_hour
        m["cost"] = {
            "price_per_hour": price_per_hour,
            "device_hours": hours,
            "total": cost,
            "per_1m_output_tokens": (cost / output * 1e6) if output else None,
            "per_1m_total_tokens": (cost / (prompt + output) * 1e6) if (prompt + output) else None,
            "per_successful_request": (cost / n) if n else None,
            "basis": "generation wall time × devices × hourly price (model load excluded)",
        }
    return m
