"""A tune's files: the table as text, the HTML report with its two plots, the winning spec
and tune.json."""

from __future__ import annotations

import html as H
import json
from pathlib import Path
from typing import Any

import yaml
from tabulate import tabulate

from tokenmill.jobs.metrics.catalog import fmt
from tokenmill.jobs.metrics.plots import fig_html, page
from tokenmill.jobs.modeltools.tune.common import REFERENCE, mean
from tokenmill.jobs.modeltools.tune.result import TuneResult


def vs_reference(r: dict[str, Any]) -> str:
    """How many times cheaper than the reference on the same rows; `(tie)` when the
    difference is inside the runs' noise."""
    text = fmt(r.get("cheaper_than_reference"), "ratio")
    if r["candidate"] != REFERENCE and r.get("cheaper_than_reference") and not r.get("beats_reference") \
            and r["cheaper_than_reference"] > 1:
        text += " (tie)"
    return text


def format_table(table: list[dict[str, Any]]) -> str:
    def cost(r):
        if r.get("cost") is None:
            return "-"
        return f"{fmt(r['cost'], 'usd')} ±{fmt((r.get('cost_spread') or 0) / 2, 'usd')}"

    body = []
    for r in table:
        ran = r.get("rows") is not None
        gate = "-" if not r.get("gate") else (f"{r['gate']} ({r['gate_metric']})" if r.get("quality_loss") is None
                                               else f"{r['gate']} ({r['quality_loss']:+.1%} {r['gate_metric']})")
        sim = r.get("sample_similarity")
        body.append((
            r["label"], r["outcome"] if len(r["outcome"]) < 70 else r["outcome"][:67] + "...",
            r["rows"] if ran else "-", cost(r),
            vs_reference(r) if ran else "-",
            fmt(r.get("output_tok_per_s")) if ran else "-", fmt(r.get("tpot_p95_s"), "s") if ran else "-",
            fmt(r.get("ttft_p95_s"), "s") if ran else "-", fmt(r.get("e2e_p95_s"), "s") if ran else "-",
            fmt(r.get("peak_rss_bytes"), "bytes") if ran else "-", gate,
            "-" if sim is None or r["candidate"] == REFERENCE else f"{sim:.3f}",
        ))
    return tabulate(body, headers=("candidate", "outcome", "rows", "$/1M out (±half spread)", "× cheaper",
                                   "out tok/s", "TPOT p95", "TTFT p95", "E2E p95", "peak RSS", "gate",
                                   "similarity to ref"),
                    tablefmt="simple", disable_numparse=True)


def plot_figures(res: TuneResult):
    """(cost against quality loss, output throughput against P95 TPOT), one point per
    candidate at the largest sample it ran on; error bars span its runs."""
    import plotly.graph_objects as go

    ran = [r for r in res.table if r.get("rows") is not None]
    groups = (("reference", lambda r: r["candidate"] == REFERENCE, "#1f77b4", "star"),
              ("passes the gate", lambda r: r["candidate"] != REFERENCE and r.get("gate") == "pass", "#2ca02c", "circle"),
              ("fails the gate", lambda r: r.get("gate") == "fail", "#d62728", "x"),
              ("failed to run", lambda r: r["candidate"] != REFERENCE and r.get("gate") is None, "#7f7f7f", "diamond"))

    def bars(r, name):
        vals = [x[name] for x in res.log.entry(r["candidate"], r["rows"]).runs if x.get(name) is not None]
        m = mean(vals)
        return (max(vals) - m, m - min(vals)) if vals else (0, 0)

    cost = go.Figure()
    perf = go.Figure()
    for gname, test, color, symbol in groups:
        rs = [r for r in ran if test(r)]
        if not rs:
            continue
        text = [f"{r['label']} (n={r['rows']})" for r in rs]
        cost.add_trace(go.Scatter(
            x=[(r.get("quality_loss") or 0.0) * 100 for r in rs], y=[r["cost"] for r in rs], mode="markers+text",
            name=gname, text=[r["label"] for r in rs], textposition="top center", hovertext=text,
            marker=dict(color=color, symbol=symbol, size=12),
            error_y=dict(type="data", symmetric=False, array=[bars(r, "cost")[0] for r in rs],
                         arrayminus=[bars(r, "cost")[1] for r in rs])))
        perf.add_trace(go.Scatter(
            x=[(r.get("tpot_p95_s") or 0.0) * 1e3 for r in rs], y=[r.get("output_tok_per_s") for r in rs],
            mode="markers+text", name=gname, text=[r["label"] for r in rs], textposition="top center", hovertext=text,
            marker=dict(color=color, symbol=symbol, size=12),
            error_x=dict(type="data", symmetric=False, array=[bars(r, "tpot_p95_s")[0] * 1e3 for r in rs],
                         arrayminus=[bars(r, "tpot_p95_s")[1] * 1e3 for r in rs]),
            error_y=dict(type="data", symmetric=False, array=[bars(r, "output_tok_per_s")[0] for r in rs],
                         arrayminus=[bars(r, "output_tok_per_s")[1] for r in rs])))
    limit = res.gate.limit if res.gate.op == "<=" else 1.0 - res.gate.limit
    cost.add_vline(x=limit * 100, line_dash="dash", line_color="#999", annotation_text=f"gate {res.gate.text}")
    cost.update_layout(title="Cost against quality loss (lower left is better)", height=460,
                       xaxis_title=f"quality loss against the spec as given (points; {res.gate.metric})",
                       yaxis_title="USD per 1M output tokens (generation)", margin=dict(t=60, b=50))
    perf.update_layout(title="Output throughput against P95 TPOT (upper left is better)", height=460,
                       xaxis_title="TPOT p95 (ms)", yaxis_title="output tok/s", margin=dict(t=60, b=50))
    return cost, perf


def render_html(res: TuneResult, path: Path) -> Path:
    """The self-contained HTML report: recommendation, table, the two plots."""
    cost, perf = plot_figures(res)
    notes = "".join(f"<p class=muted>{H.escape(n)}</p>" for n in res.notes)
    body = (f"<h1>tokenmill tune {H.escape(res.tune_id)}</h1><p><b>{H.escape(res.recommendation)}</b></p>{notes}"
            f"<p class=muted>gate {H.escape(res.gate.text)}; samples of {res.log.sizes} rows, {res.repeats} runs each, "
            "interleaved; a cost is lower only when every run of it is below every run of the other (else a tie)."
            f"</p><h2>Candidates</h2><pre>{H.escape(format_table(res.table))}</pre>"
            + fig_html(cost) + fig_html(perf))
    path.write_text(page(f"tokenmill tune {res.tune_id}", body), encoding="utf-8")
    return path


def write_outputs(res: TuneResult, out: Path) -> None:
    """tune-table.txt, tune-report.html, winner.yaml and tune.json under `out`."""
    out.mkdir(parents=True, exist_ok=True)
    files = {"table": out / "tune-table.txt", "html": out / "tune-report.html", "spec": out / "winner.yaml",
             "json": out / "tune.json", "sample": out / "samples" / "sample.parquet"}
    files["table"].write_text(format_table(res.table) + "\n\n" + res.recommendation + "\n", encoding="utf-8")
    render_html(res, files["html"])
    w = res.log.decided().winner
    head = (f"# tokenmill tune {res.tune_id}: " + ("the spec as given (no candidate beat it)" if w == REFERENCE
            else next(c.label for c in res.candidates if c.key == w)) + "\n# run it with: tokenmill run "
            f"{files['spec']}\n")
    files["spec"].write_text(head + yaml.safe_dump(res.winner_spec, sort_keys=False), encoding="utf-8")
    res.files = {k: str(v) for k, v in files.items()}
    files["json"].write_text(json.dumps(res.as_dict(), indent=2, default=str), encoding="utf-8")
