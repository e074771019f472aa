"""The report's plotly figures (latency histograms, output tokens over time, cost, failures)
and the self-contained HTML page they go in (plotly.js embedded, so it opens offline).

plotly is the optional `report` extra and takes a second to import: each function that
draws imports it."""

from __future__ import annotations

import datetime as dt
import html
from typing import Any

import numpy as np

from tokenmill.jobs.metrics.catalog import LATENCIES, figure

#: Histogram bins per latency figure.
LATENCY_BINS = 40
#: Bins of the output-tokens-over-time figure.
TIME_BINS = 120
#: Job A and job B in every figure.
JOB_COLORS = ("#1f77b4", "#ff7f0e")
#: The cost figure's two bases: (its name, its figures: the job's cost, per 1M output tokens,
#: per 1M total tokens, per successful request).
COST_BARS = (
    ("generation only", ("cost_total", "cost_per_1m_output_tokens", "cost_per_1m_total_tokens",
                         "cost_per_successful_request")),
    ("all held time", ("cost_held_total", "cost_held_per_1m_output_tokens", "cost_held_per_1m_total_tokens",
                       "cost_held_per_successful_request")),
)


def _bins(lo: float, hi: float, bins: int) -> tuple[float, float, np.ndarray]:
    """(lo, bin width, edges) of `bins` equal bins over [lo, hi] (a single value: a narrow range)."""
    if hi <= lo:
        hi = lo + (abs(lo) * 0.01 or 1e-6)
    edges = np.linspace(lo, hi, bins + 1)
    return lo, (hi - lo) / bins, edges


def _extents(datas: list[dict[str, Any]], col: str) -> list[tuple[float, float, int]]:
    return [e for d in datas if (e := d["request_summary"].extent(d["job"]["id"], col))]


def latency_figure(datas: list[dict[str, Any]], names: list[str]):
    """Histograms of TTFT, TPOT and E2E; jobs share bin edges so their bars line up.  The
    database counts the rows per bin (storage `RequestSummary.histogram`)."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    panels = []
    for col, name in ((lat.column, lat.label) for lat in LATENCIES[:3]):
        extents = _extents(datas, col)
        top = max((e[1] for e in extents), default=0.0)
        # seconds once figures reach seconds, else milliseconds: axis labels stay short
        panels.append((col, f"{name} (s)", 1.0, extents) if top >= 2 else (col, f"{name} (ms)", 1e3, extents))
    fig = make_subplots(rows=1, cols=3, subplot_titles=[p[1] for p in panels])
    colors = JOB_COLORS
    for ci, (col, title, scale, extents) in enumerate(panels, start=1):
        if not extents:
            continue
        lo, width, edges = _bins(min(e[0] for e in extents), max(e[1] for e in extents), LATENCY_BINS)
        for i, (d, name) in enumerate(zip(datas, names)):
            counts = d["request_summary"].histogram(d["job"]["id"], col, lo, width, LATENCY_BINS)
            fig.add_trace(go.Bar(x=(edges[:-1] + edges[1:]) / 2 * scale, y=counts, width=width * scale,
                                 name=name, legendgroup=name, showlegend=(ci == 1), opacity=0.6 if len(datas) > 1 else 1,
                                 marker_color=colors[i % 2]), row=1, col=ci)
        fig.update_xaxes(title_text=title, row=1, col=ci)
    fig.update_yaxes(title_text="requests", row=1, col=1)
    fig.update_layout(barmode="overlay", title="Latency per request", height=380, margin=dict(t=70, b=40))
    return fig


def tokens_over_time(data: dict[str, Any]) -> tuple[list[float], list[int], list[float], list[int]]:
    """(bin starts s, output tokens finished in each bin, bin ends s, cumulative output tokens
    at each bin end, from 0 at the start), on the workers' wall clock relative to the first
    batch's start (or the first finish); at most TIME_BINS bins, summed by the database."""
    jid = data["job"]["id"]
    extent = data["request_summary"].extent(jid, "finished_at")
    if extent is None:
        return [], [], [], []
    first, last, n = extent
    t0 = min(data.get("generation_started_at") or first, first)
    bins = min(TIME_BINS, max(1, n))
    _, width, edges = _bins(0.0, last - t0, bins)
    sums = [int(v) for v in data["request_summary"].histogram(jid, "finished_at", t0, width, bins, weight="output_tokens")]
    return ([float(e) for e in edges[:-1]], sums, [float(e) for e in edges],
            [0, *np.cumsum(sums).tolist()])


def _estimated(data: dict[str, Any], path: str) -> dict[str, Any] | None:
    """The estimate's figure `path` beside the job (jobs/estimate/beside.py), if it has a value."""
    f = next((f for f in ((data.get("estimate") or {}).get("figures") or ()) if f.get("figure") == path), None)
    return f if f is not None and f.get("value") is not None else None


def _interval(f: dict[str, Any]) -> dict[str, Any]:
    """A plotly error bar of an estimated figure's interval [lo, hi] around its value."""
    v = f["value"]
    return dict(type="data", symmetric=False, array=[max(0.0, (f.get("hi") or v) - v)],
                arrayminus=[max(0.0, v - (f.get("lo") or v))])


def throughput_figure(datas: list[dict[str, Any]], names: list[str]):
    """Cumulative output tokens over time (and, for one job, output tokens per time bin); for
    one job with an estimate (`tokenmill estimate`), the estimated output tokens at the
    estimated end of generation with both intervals, beside the line of what happened."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    fig = make_subplots(specs=[[{"secondary_y": True}]])
    for d, name in zip(datas, names):
        starts, sums, ts, cum = tokens_over_time(d)
        if len(datas) == 1 and ts:
            width = (starts[1] - starts[0]) if len(starts) > 1 else 1.0
            fig.add_trace(go.Bar(x=[s + width / 2 for s in starts], y=[s / width for s in sums], width=width,
                                 name="output tok/s (per bin)", marker_color="#9ecae1"), secondary_y=False)
        if ts:
            fig.add_trace(go.Scatter(x=ts, y=cum, mode="lines", name=f"{name}: cumulative output tokens"),
                          secondary_y=len(datas) == 1)
        wall, out = _estimated(d, "generation_wall_s"), _estimated(d, "tokens.output")
        if len(datas) == 1 and wall is not None and out is not None:
            fig.add_trace(go.Scatter(x=[wall["value"]], y=[out["value"]], mode="markers", error_x=_interval(wall),
                                     error_y=_interval(out), marker=dict(symbol="diamond", size=11, color="#d62728"),
                                     name="estimate: output tokens at the end of generation (90 % intervals)"),
                          secondary_y=True)
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
        for j, (basis, figs) in enumerate(COST_BARS):
            label = basis if len(datas) == 1 else f"{name}: {basis}"
            color = ("#2ca02c", "#98df8a")[j] if len(datas) == 1 else JOB_COLORS[i % 2]
            total, per_1m_out, per_1m_total, per_request = (figure(f).value(d["metrics"]) for f in figs)
            fig.add_trace(go.Bar(x=[basis], y=[total], name=label, legendgroup=label,
                                 offsetgroup=f"{i}", marker_color=color), row=1, col=1)
            vals = [per_1m_out, per_1m_total, (per_request * 1000) if per_request is not None else None]
            fig.add_trace(go.Bar(x=units, y=vals, name=label, legendgroup=label, offsetgroup=f"{i}.{j}",
                                 showlegend=False, marker_color=color), row=1, col=2)
    fig.update_layout(barmode="group", title="Cost (generation only vs all held time: start-up, load, export)",
                      height=380, margin=dict(t=70, b=40))
    return fig


def failures_figure(datas: list[dict[str, Any]], names: list[str]):
    import plotly.graph_objects as go

    fig = go.Figure()
    for d, name in zip(datas, names):
        by = figure("failures_by_reason").value(d["metrics"]) or {}
        fig.add_trace(go.Bar(x=list(by), y=list(by.values()), name=name))
    fig.update_layout(title="Failed rows by reason", yaxis_title="rows", height=320, barmode="group",
                      margin=dict(t=60, b=40))
    return fig


def job_figures(data: dict[str, Any]) -> list[tuple[str, Any]]:
    """One job's figures, (name, plotly figure) in the report's order: latency, output tokens
    over time (with the estimate beside it), cost (a priced job) and failures (a job with any).
    The HTML report and the live page's job page (jobs/serve/page.py) both draw these."""
    name = data["job"]["id"]
    figs = [("latency", latency_figure([data], [name])), ("throughput", throughput_figure([data], [name]))]
    if figure("cost_basis").value(data["metrics"]):
        figs.append(("cost", cost_figure([data], [name])))
    if figure("failures_by_reason").value(data["metrics"]):
        figs.append(("failures", failures_figure([data], [name])))
    return figs


# ---------------------------------------------------------------- the page

_CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:24px auto;max-width:1200px;color:#222}
h1{font-size:1.5em} h2{font-size:1.1em;margin-top:1.6em;border-bottom:1px solid #ddd}
table{border-collapse:collapse;margin:6px 0 12px} td,th{padding:3px 10px;text-align:left;border-bottom:1px solid #eee}
td.n,th.n{text-align:right;font-variant-numeric:tabular-nums} .muted{color:#777;font-size:.9em}
.grid{display:grid;grid-template-columns:repeat(auto-fit,minmax(360px,1fr));gap:0 24px}
.better{color:#1a7f37;font-weight:600}
"""


def table_html(rows: list[tuple[str, str]]) -> str:
    body = "".join(f"<tr><td>{html.escape(k)}</td><td class=n>{html.escape(v)}</td></tr>" for k, v in rows)
    return f"<table>{body}</table>"


def page(title: str, body: str) -> str:
    """The self-contained page: `body` under a title, plotly.js embedded, and when it was made."""
    from plotly.offline import get_plotlyjs

    now = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
            f"<style>{_CSS}</style><script type='text/javascript'>{get_plotlyjs()}</script></head>"
            f"<body>{body}<p class=muted>tokenmill report, generated {now}</p>"
            "</body></html>")


def fig_html(fig) -> str:
    """A plotly figure as a <div> for `page` (which embeds plotly.js once)."""
    return fig.to_html(full_html=False, include_plotlyjs=False, config={"displaylogo": False})
