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
import re
import time
from pathlib import Path
from typing import Any, Callable

from tabulate import tabulate

from tokenmill.jobs.metrics.accounting import CLOCKS, JobTerms
from tokenmill.jobs.metrics.adapters import adapter_lines, compare_adapters
from tokenmill.jobs.metrics.catalog import LATENCIES, STATS, FigureText, figure, fmt, get_path, shown_in
from tokenmill.jobs.metrics.figures import stored_metrics
from tokenmill.jobs.metrics.plots import (
    cost_figure,
    fig_html,
    job_figures,
    latency_figure,
    page,
    table_html,
    throughput_figure,
)
from tokenmill.schemas import storage as S
from tokenmill.schemas.models import describe_checkpoint
from tokenmill.schemas.secrets import scrub
from tokenmill.transforms.engines.kinds import engine_for


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


def _live_metrics(eng, job: dict[str, Any]) -> dict[str, Any]:
    spec = job.get("spec") or {}
    c = S.MetricsReader(eng).counts(job["id"])
    return stored_metrics(eng, job["id"], JobTerms(
        total=job.get("total") or (c["succeeded"] + c["failed"]), hardware=job.get("hardware") or {},
        price_per_hour=spec.get("price_per_hour"), prices=spec.get("prices"), now=time.time(),
        engine_config=job.get("engine_config") or {},
        token_budget=(spec.get("batching") or {}).get("token_budget"), cache_mode=spec.get("cache"),
    ))


def load_report(eng, job_id: str) -> dict[str, Any]:
    """Job description and metrics of one job, and where the figures' per-request counts
    come from (`request_summary`: the database bins them; no request row is loaded, so a
    report's memory does not grow with the job); ReportError if the job is unknown."""
    job = S.JobStore(eng).get(job_id)
    if job is None:
        raise ReportError(f"no job with id {job_id!r}")
    metrics = job.get("metrics")
    source = "stored when the job finished"
    if not metrics:
        metrics = _live_metrics(eng, job)
        source = f"computed now from the rows in the database (job is {job.get('status')})"
    t0 = min((b["started_at"] for b in S.MetricsReader(eng).batches(job_id) if b.get("started_at")), default=None)
    from tokenmill.jobs.estimate.beside import job_estimate  # the newest estimate beside what happened

    return {**scrub({"job": job_info(job), "metrics": metrics, "metrics_source": source,
                     "generation_started_at": t0, "estimate": job_estimate(eng, job_id, metrics)}),
            "request_summary": S.RequestSummary(eng)}


def report_json(data: dict[str, Any], html_path: str | None = None) -> dict[str, Any]:
    """What `tokenmill report --json` prints: everything but the per-request source."""
    out = {k: v for k, v in data.items() if k != "request_summary"}
    out["html"] = html_path
    return out


# ---------------------------------------------------------------- formatting


def describe_dtype(dtype: str | None, auto: dict[str, Any] | None) -> str:
    """The dtype the engine ran and, for `dtype: auto` on a CPU, why: the measured choice."""
    if not auto:
        return dtype or "-"
    rates = ", ".join(f"{k} {v:,.0f}" for k, v in (auto.get("output_tok_per_s") or {}).items())
    agree = ", ".join(f"{k} {v:.0%}" for k, v in (auto.get("agreement_with_float32") or {}).items())
    return (f"{auto['choice']} (auto: {auto['reason']}; probe output tok/s {rates}; agreement with "
            f"float32's greedy tokens {agree}; measured {auto.get('measured_at')})")


def _failed_by_reason(m: dict[str, Any]) -> list[tuple[str, str]]:
    rates = figure("failure_rate_by_reason").value(m) or {}
    lines = [(f"  failed: {r}", f"{fmt(n)} ({fmt(rates.get(r), 'pct')})")
             for r, n in (figure("failures_by_reason").value(m) or {}).items()]
    by_reason = figure("retries_by_reason").value(m)  # None: an engine that does not retry
    if by_reason is not None:
        lines.append(("retried attempts (HTTP engine)", ", ".join(f"{r} {n}" for r, n in by_reason.items()) or "none"))
    return lines


def _rows_by_source(m: dict[str, Any]) -> list[tuple[str, str]]:
    rows = figure("rows_by_token_count_source").value(m) or {}
    return [("rows by token-count source (…+stream_chunks: estimates)",
             ", ".join(f"{k} {fmt(n)}" for k, n in rows.items()) or "-")]


def _gpu_lines(m: dict[str, Any]) -> list[tuple[str, str]]:
    return [(f"GPU {x['index']}", f"memory {fmt(x.get('memory_used_bytes_max'), 'bytes')} of "
                                  f"{fmt(x.get('memory_total_bytes'), 'bytes')}, util {fmt(x.get('util_pct_mean'), 'pct100')}, "
                                  f"power {fmt(x.get('power_w_mean'))} W (max {fmt(x.get('power_w_max'))} W)")
            for x in figure("gpu_utilization").value(m) or []]


def _answers(m: dict[str, Any]) -> list[tuple[str, str]]:
    """The schema-valid line, for a job with structured rows."""
    if not figure("structured_rows").value(m):
        return []
    return [("schema-valid (structured rows)", f"{figure('schema_valid_rate').text(m)} of {figure('structured_rows').text(m)}")]


def _result_cache(m: dict[str, Any]) -> list[tuple[str, str]]:
    """What the result cache served, for a job that used it (docs/CACHE.md)."""
    if figure("cache_mode").value(m) in (None, "off") and not figure("cache_rows").value(m):
        return []
    return [(f"from the result cache ({figure('cache_mode').text(m)})", "{cache_rows} rows, {cache_samples} samples; "
             "saved {cache_prompt_tokens} prompt + {cache_output_tokens} output tokens".format_map(FigureText(m)))]


def _work_lost(m: dict[str, Any]) -> list[tuple[str, str]]:
    """Engine work no commit kept, for a job several replicas ran (docs/SERVING.md, "Replicas")."""
    return [] if figure("units_taken_over").value(m) is None else [(
        "work lost to failures", "{units_taken_over} units taken over, {rows_refused} rows refused, "
        "{rows_admitted_not_committed} rows admitted and not committed".format_map(FigureText(m)))]


def _prices_used(m: dict[str, Any]) -> list[tuple[str, str]]:
    return [("price used", line) for line in figure("prices").value(m) or []]


#: The report's sections after "Job": (title, lines), each line (label, template) with the
#: template's {names} figures (catalog.FIGURES) written in their units, or a function of the
#: metrics giving a varying number of (label, text) lines.
Line = tuple[str, str] | Callable[[dict[str, Any]], list[tuple[str, str]]]
SECTIONS: tuple[tuple[str, tuple[Line, ...]], ...] = (
    ("Requests", (
        ("input rows", "{requests_total}"), ("succeeded", "{requests_succeeded}"),
        ("failed", "{requests_failed} ({failure_rate})"), _failed_by_reason, _answers, _result_cache, _work_lost,
        ("rows read / skipped as done", "{input_rows_read} / {input_rows_skipped_done}"),
        ("input bytes read / file size", "{input_bytes_read} / {input_file_bytes}"))),
    ("Concurrency (offline: all requests at once)", (
        ("max_num_seqs", "{max_num_seqs}"), ("max_num_batched_tokens", "{max_num_batched_tokens}"),
        ("batch token budget", "{token_budget}"), ("workers", "{workers}"),
        ("batches (mean requests each)", "{batches} ({mean_batch_requests})"))),
    ("Throughput (over generation wall time; model load separate)", (
        ("generation wall", "{generation_wall_s}"), ("model load", "{model_load_s}"),
        ("job wall (launcher)", "{job_wall_s}"), ("output tok/s", "{output_tok_per_s}"),
        ("total (prompt + output) tok/s", "{total_tok_per_s}"), ("requests/s", "{requests_per_s}"),
        ("mean per-request output tok/s", "{mean_request_output_tok_per_s}"),
        ("tokens prompt / output / cached", "{prompt_tokens} / {output_tokens} / {cached_tokens}"), _rows_by_source,
        ("prefix cache hit rate (cached ÷ prompt tokens)", "{prefix_cache_hit_rate}"))),
    ("Memory and utilization", (
        ("model weights (files)", "{weights_bytes}"), ("KV cache (engine reported)", "{kv_cache_bytes} ({kv_cache_tokens} tokens)"),
        ("peak worker RSS", "{peak_worker_rss_bytes}"), ("peak job process-tree RSS", "{peak_process_tree_rss_bytes}"),
        ("CPU utilization mean / max (all cores)", "{cpu_util_pct_mean} / {cpu_util_pct_max}"), _gpu_lines)),
)
#: Shown for a priced job, after the runs and workers.
COST_SECTION: tuple[str, tuple[Line, ...]] = (
    "Cost (USD; Σ over workers of hours × the worker's hourly price)", (
        ("price", "{cost_per_hour}/hour for all workers ({price_source})"), _prices_used,
        ("generation only", "{cost_total}"), ("all held time (start-up, load, generation, export)", "{cost_held_total}"),
        ("model load", "{cost_model_load}"),
        ("per 1M output tokens: generation only / all held time",
         "{cost_per_1m_output_tokens} / {cost_held_per_1m_output_tokens}"),
        ("per 1M total tokens: generation only / all held time",
         "{cost_per_1m_total_tokens} / {cost_held_per_1m_total_tokens}"),
        ("per successful request: generation only / all held time",
         "{cost_per_successful_request} / {cost_held_per_successful_request}")))


def section_lines(lines: tuple[Line, ...], m: dict[str, Any]) -> list[tuple[str, str]]:
    """A section's (label, text) lines for one job's metrics."""
    text = FigureText(m)
    out: list[tuple[str, str]] = []
    for line in lines:
        out += line(m) if callable(line) else [(line[0], line[1].format_map(text))]
    return out


def report_sections(data: dict[str, Any]) -> list[tuple[str, list[tuple[str, str]]]]:
    """The report as (section title, [(label, formatted value)]) — shared by terminal and HTML."""
    j, m = data["job"], data["metrics"]
    v = j.get("versions") or {}
    engine = engine_for(j.get("engine_config") or {})  # None: a kind no longer registered
    sections = [
        ("Job", [
            ("id", j["id"]), ("status", j.get("status") or "-"), ("model", j.get("model") or "-"),
            ("quantization / kv cache dtype", f"{j.get('quantization') or 'none'} / {j.get('kv_cache_dtype') or 'auto'}"),
            ("checkpoint", describe_checkpoint(figure("checkpoint").value(m)) or "-"),
            ("hardware", f"{j.get('device') or '-'} × {j.get('device_count') or 1}; CPU {j.get('cpu_model') or '-'}"),
            ("runner", j.get("runner") or "-"),
            ("versions", ", ".join(f"{k} {v[k]}" for k in ("tokenmill", *(engine.packages if engine else ()),
                                                             "apache-beam") if k in v) or "-"),
            ("engine", f"{engine.display_name if engine else '?'} {(engine and engine.engine_version(v)) or '?'}"),
            ("dtype", describe_dtype(figure("dtype").value(m), figure("dtype_auto").value(m))),
            ("started / finished", f"{j.get('started_at') or '-'} / {j.get('finished_at') or '-'}"),
            ("metrics", data.get("metrics_source") or "-"),
        ]),
    ] + [(title, section_lines(lines, m)) for title, lines in SECTIONS]
    runs = figure("per_run").value(m) or []
    if len(runs) > 1:
        sections.append(("Runs (a resumed job: each run's own figures)", [
            (f"run {r['run_id']}" + ("" if r.get("finished") else " (did not finish)"),
             f"model load {fmt(r.get('model_load_s'), 's')}, generation {fmt(r.get('generation_wall_s'), 's')}, "
             f"{fmt(r.get('output_tokens'))} output tokens ({fmt(r.get('output_tok_per_s'))} tok/s), "
             f"held {fmt(r.get('held_s'), 's')}")
            for r in runs]))
    if m.get("adapters"):
        sections.append(("LoRA adapters (generation wall and cost by token share)", adapter_lines(m)))
    workers = figure("per_worker").value(m) or []
    if workers:
        sections.append(("Workers (measured where the engine runs)", [
            (w.get("worker") or "-", _worker_line(w)) for w in workers]))
    if figure("cost_basis").value(m):  # the job was priced
        sections.append((COST_SECTION[0], section_lines(COST_SECTION[1], m)))
    if data.get("estimate"):  # tokenmill estimate made one for this job (jobs/estimate/beside.py)
        from tokenmill.jobs.estimate.beside import lines

        sections.append(("Estimate beside what happened (value [90 % interval]; actual)", lines(data["estimate"])))
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


def _plain(rows, headers=(), colalign=None, indent: str = "") -> list[str]:
    """Rows as aligned plain-text lines (tabulate's `plain` format), each prefixed by `indent`."""
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
            for lat in LATENCIES:
                d = get_path(data["metrics"], lat.path) or {}
                rows.append([lat.label, *(fmt(d.get(s), "s") for s in STATS), fmt(d.get("n")), _clock(data, lat.column)])
            lines += _plain(rows, headers=["", *STATS, "n", "clock"],
                            colalign=("left", *("right",) * (len(STATS) + 1), "left"), indent="  ")
            lines.append(f"  {percentile_note(data)}")
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"


def ratio(a: float | None, b: float | None) -> float | None:
    """b / a, or None where it is undefined (a missing or zero)."""
    if a is None or b is None or not isinstance(a, (int, float)) or not isinstance(b, (int, float)) or a == 0:
        return None
    return float(b) / float(a)


def compare_metrics(a: dict[str, Any], b: dict[str, Any]) -> list[dict[str, Any]]:
    """The compare view's figures (catalog.VIEWS) of two jobs side by side; `ratio` is B / A
    and `better` says which job the figure favours ("a", "b", "same" or None)."""
    out = []
    for f in shown_in("compare"):
        va, vb = f.value(a), f.value(b)
        if va is None or vb is None or f.better == "neutral":
            better = None
        elif va == vb:
            better = "same"
        else:
            better = "b" if ((vb > va) == (f.better == "higher")) else "a"
        out.append({"metric": f.path, "label": f.label, "a": va, "b": vb, "ratio_b_over_a": ratio(va, vb),
                    "better": better, "direction": f.better})
    return out


def compare_cells(a: dict[str, Any], b: dict[str, Any]) -> list[tuple[str, str, str, str, str]]:
    """(label, A, B, B ÷ A, the better job: A, B, = or nothing) per compared figure, written in its unit."""
    return [(r["label"], fmt(r["a"], f.unit), fmt(r["b"], f.unit), fmt(r["ratio_b_over_a"], "ratio"),
             {"a": "A", "b": "B", "same": "="}.get(r["better"], ""))
            for f, r in zip(shown_in("compare"), compare_metrics(a, b))]


#: The per-adapter figures `compare` shows, with their units.
ADAPTER_CELLS = (("rows", "count"), ("prompt_tokens", "count"), ("output_tokens", "count"), ("generation_s", "s"),
                 ("cost", "usd"))


def format_compare(a: dict[str, Any], b: dict[str, Any]) -> str:
    """Two jobs side by side; ratio = B ÷ A; the last column names the better job."""
    ida, idb = a["job"]["id"], b["job"]["id"]
    out = [f"A = {ida} ({a['job'].get('status')}), B = {idb} ({b['job'].get('status')})", ""]
    out += _plain(compare_cells(a["metrics"], b["metrics"]), headers=["", "A", "B", "B/A", "better"],
                  colalign=("left", "right", "right", "right", "left"))
    per = compare_adapters(a["metrics"], b["metrics"])
    if per:
        out += ["", "LoRA adapters (A / B)"]
        out += _plain([(r["adapter"], *(f"{fmt(r[k][0], u)} / {fmt(r[k][1], u)}" for k, u in ADAPTER_CELLS))
                       for r in per], headers=["", *(k for k, _ in ADAPTER_CELLS)], indent="  ")
    return "\n".join(out) + "\n"


def compare_json(a: dict[str, Any], b: dict[str, Any], html_path: str | None = None) -> dict[str, Any]:
    return {"a": report_json(a), "b": report_json(b), "ratio": "B / A",
            "rows": compare_metrics(a["metrics"], b["metrics"]),
            "adapters": compare_adapters(a["metrics"], b["metrics"]), "html": html_path}


def _clock(data: dict[str, Any], col: str) -> str:
    """The clock a job's figure was measured on (stored with its metrics: the engine's)."""
    return (data["metrics"].get("clocks") or {}).get(col) or CLOCKS[col]


def percentile_note(data: dict[str, Any]) -> str:
    """How close the latency percentiles are (the metrics' `percentiles`; docs/ACCOUNTING.md)."""
    err = ((data["metrics"].get("percentiles") or {}).get("relative_error_max") or {})
    worst = max((v for v in err.values() if v is not None), default=0.0)
    if not worst:
        return "percentiles: exact (numpy's linear interpolation over every request)"
    return (f"percentiles: token counts exact, times within {worst:.1%} (merged from the runs' summaries; "
            "counts, sums, means and maxima exact)")


def _latency_table(data: dict[str, Any]) -> str:
    head = "<tr><th></th>" + "".join(f"<th class=n>{s}</th>" for s in STATS) + "<th class=n>n</th><th>clock</th></tr>"
    body = ""
    for lat in LATENCIES:
        d = get_path(data["metrics"], lat.path) or {}
        body += (f"<tr><td>{lat.label}</td>" + "".join(f"<td class=n>{html.escape(fmt(d.get(s), 's'))}</td>" for s in STATS)
                 + f"<td class=n>{fmt(d.get('n'))}</td><td class=muted>{html.escape(_clock(data, lat.column))}</td></tr>")
    return f"<table>{head}{body}</table><p class=muted>{html.escape(percentile_note(data))}</p>"


def render_html(data: dict[str, Any], out_dir: str | Path) -> Path:
    """Write `report-<job id>.html` (self-contained, opens offline) and return its path."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    jid = data["job"]["id"]
    secs = report_sections(data)
    parts = [f"<h1>tokenmill job {html.escape(jid)} <span class=muted>({html.escape(str(data['job'].get('status')))})"
             "</span></h1>", "<div class=grid>"]
    for title, items in secs[:2]:
        parts.append(f"<div><h2>{html.escape(title)}</h2>{table_html(items)}</div>")
    figs = job_figures(data)
    parts.append("</div><h2>Latency (per request)</h2>" + _latency_table(data))
    parts += [fig_html(f) for _, f in figs[:1]]
    parts.append("<div class=grid>")
    for title, items in secs[2:]:
        parts.append(f"<div><h2>{html.escape(title)}</h2>{table_html(items)}</div>")
    parts.append("</div>")
    parts += [fig_html(f) for _, f in figs[1:]]
    path = out / f"report-{_safe(jid)}.html"
    path.write_text(page(f"tokenmill report {jid}", "".join(parts)), encoding="utf-8")
    return path


def render_compare_html(a: dict[str, Any], b: dict[str, Any], out_dir: str | Path) -> Path:
    """Write `compare-<A>-vs-<B>.html` with the ratio table and overlaid figures."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    ida, idb = a["job"]["id"], b["job"]["id"]
    head = (f"<tr><th></th><th class=n>A: {html.escape(ida)}</th><th class=n>B: {html.escape(idb)}</th>"
            "<th class=n>B ÷ A</th><th>better</th></tr>")
    body = "".join(f"<tr><td>{html.escape(label)}</td><td class=n>{html.escape(va)}</td><td class=n>{html.escape(vb)}"
                   f"</td><td class=n>{html.escape(r)}</td><td class=better>{better}</td></tr>"
                   for label, va, vb, r, better in compare_cells(a["metrics"], b["metrics"]))
    parts = [f"<h1>A = {html.escape(ida)} vs B = {html.escape(idb)}</h1>",
             f"<table>{head}{body}</table>",
             "<div class=grid>"]
    for label, d in (("A", a), ("B", b)):
        parts.append(f"<div><h2>{label}: job</h2>{table_html(report_sections(d)[0][1])}</div>")
    parts.append("</div>")
    names = [f"A {ida}", f"B {idb}"]
    parts.append(fig_html(latency_figure([a, b], names)))
    parts.append(fig_html(throughput_figure([a, b], names)))
    if figure("cost_basis").value(a["metrics"]) or figure("cost_basis").value(b["metrics"]):
        parts.append(fig_html(cost_figure([a, b], names)))
    path = out / f"compare-{_safe(ida)}-vs-{_safe(idb)}.html"
    path.write_text(page(f"tokenmill compare {ida} vs {idb}", "".join(parts)), encoding="utf-8")
    return path


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", name)[:100]
