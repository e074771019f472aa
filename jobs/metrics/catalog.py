"""Every per-job figure, declared once: where it sits in a job's metrics (accounting.job_metrics),
its label, its unit, which direction is better, what it counts, and the views that show it.

Status, the run summary, the jobs list, compare and tune read their figures from `VIEWS`;
the report's sections (report.py) name figures from `FIGURES` in their line templates.  A
new figure is one `Figure` here, named in the views that show it.

Units are how `fmt` writes a value: "s" (seconds, shown in s/ms/µs), "bytes" (GiB/MiB),
"pct" (a fraction, shown as %), "pct100" (already in percent), "usd", "ratio" (×), "count",
"tok/s", "req/s" (numbers with thousands separators) and "text" (as it is).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Literal, Mapping

from tokenmill.jobs.metrics.pricing import price_line
from tokenmill.jobs.modeltools.kvplan import format_bytes

Better = Literal["higher", "lower", "neutral"]


def get_path(m: Mapping[str, Any] | None, path: str) -> Any:
    """`m["a"]["b"]` for "a.b"; None where any step is missing."""
    cur: Any = m
    for part in path.split("."):
        if not isinstance(cur, Mapping):
            return None
        cur = cur.get(part)
    return cur


def fmt(v: Any, kind: str = "count") -> str:
    """A figure for people in its unit (see the module docstring); "-" for no value."""
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


@dataclass(frozen=True)
class Figure:
    """One per-job figure."""

    name: str
    """Its key wherever figures are keyed by name (status and `run --json`)."""
    path: str
    """Where it sits in the metrics dict, dotted ("latency_s.ttft.p95")."""
    label: str
    """What compare and the HTML pages call it."""
    unit: str
    """How `fmt` writes it (see the module docstring)."""
    better: Better
    """Which direction is better when two jobs are compared."""
    counts: str
    """What it counts, in one line."""
    derive: Callable[[Any], Any] | None = None
    """Turns the stored value into the figure (a few status figures are shapes of a stored one)."""

    def value(self, metrics: Mapping[str, Any] | None) -> Any:
        """The figure in one job's metrics; None where the job has none."""
        raw = get_path(metrics, self.path)
        return self.derive(raw) if self.derive else raw

    def text(self, metrics: Mapping[str, Any] | None) -> str:
        return fmt(self.value(metrics), self.unit)


@dataclass(frozen=True)
class Latency:
    """A per-request latency, stored as a distribution (accounting.dist) under `latency_s.<key>`."""

    key: str
    label: str
    column: str
    """Its per-request column (outputs table) and its entry in the metrics' `clocks`."""

    @property
    def path(self) -> str:
        return f"latency_s.{self.key}"


LATENCIES = (Latency("ttft", "TTFT", "ttft_s"), Latency("tpot", "TPOT", "tpot_s"), Latency("e2e", "E2E", "e2e_s"),
             Latency("queue", "queue", "queue_s"))
#: The statistics of a latency distribution a report shows, in order.
STATS = ("p50", "p95", "p99", "mean", "max")
_WHAT_LATENCY = {"ttft": "time to first token", "tpot": "time per output token after the first",
                 "e2e": "end-to-end time of a request"}


def _none_if_empty(v: Any) -> Any:
    return v or None


def _percentiles() -> Iterator[Figure]:
    for lat in LATENCIES[:3]:
        for stat in ("p50", "p95", "p99"):
            yield Figure(f"{lat.key}_{stat}_s", f"{lat.path}.{stat}", f"{lat.label} {stat}", "s", "lower",
                         f"{stat} over answered requests of the {_WHAT_LATENCY[lat.key]} (clocks: {lat.column})")


def _f(name: str, path: str, label: str, unit: str, better: Better, counts: str, **kw: Any) -> Figure:
    return Figure(name, path, label, unit, better, counts, **kw)


_GEN = "over generation wall time"
FIGURES: tuple[Figure, ...] = (
    _f("requests_total", "requests.total", "input rows", "count", "neutral", "input rows of the job"),
    _f("requests_succeeded", "requests.succeeded", "succeeded requests", "count", "higher", "answered input rows"),
    _f("samples", "requests.samples", "output rows (samples)", "count", "neutral",
       "output rows: a row asking for n samples has n, each an engine request"),
    _f("requests_failed", "requests.failed", "failed requests", "count", "lower", "dead-lettered input rows"),
    _f("failure_rate", "failures.rate", "failure rate", "pct", "lower", "dead-lettered rows / input rows"),
    _f("structured_rows", "answers.checked", "structured rows checked", "count", "neutral",
       "answered rows whose output was checked against its constraint (JSON schema, JSON, regex, choice)"),
    _f("schema_valid_rate", "answers.valid_rate", "schema-valid rate", "pct", "higher",
       "structured rows whose output met its constraint / structured rows answered"),
    _f("failures_by_reason", "failures.by_reason", "failed rows by reason", "text", "neutral",
       "dead-lettered rows per reason code (none: null)", derive=_none_if_empty),
    _f("failure_rate_by_reason", "failures.rate_by_reason", "failure rate by reason", "text", "neutral",
       "dead-lettered rows / input rows, per reason code"),
    _f("retries_by_reason", "failures.retries_by_reason", "retried attempts by reason", "text", "neutral",
       "an HTTP engine's retried attempts by the failed attempt's reason (null: the engine does not retry)"),
    *_percentiles(),
    _f("output_tok_per_s", "throughput.output_tok_per_s", "output tok/s", "tok/s", "higher",
       f"generated tokens {_GEN}"),
    _f("total_tok_per_s", "throughput.total_tok_per_s", "total tok/s", "tok/s", "higher",
       f"prompt + generated tokens {_GEN}"),
    _f("requests_per_s", "throughput.requests_per_s", "requests/s", "req/s", "higher", f"answered requests {_GEN}"),
    _f("mean_request_output_tok_per_s", "throughput.mean_request_output_tok_per_s", "mean per-request output tok/s",
       "tok/s", "higher", "mean over requests of output tokens / e2e"),
    _f("generation_wall_s", "throughput.generation_wall_s", "generation wall", "s", "lower",
       "per run, first batch admitted -> last batch finished, summed over the job's runs"),
    _f("model_load_s", "throughput.model_load_s", "model load", "s", "lower",
       "engine construction, the slowest worker of each run, summed over runs"),
    _f("job_wall_s", "throughput.job_wall_s", "job wall", "s", "lower",
       "launcher wall clock, job start -> accounting (checks, load, export included)"),
    _f("runs", "throughput.runs", "runs", "count", "neutral", "runs of the job (the first and each resume)"),
    _f("units_taken_over", "work_lost.units_taken_over", "units taken over", "count", "lower",
       "a shared job's units another replica took after their holder's lease expired (killed, frozen)"),
    _f("rows_refused", "work_lost.rows_refused", "rows refused", "count", "lower",
       "rows whose commit a lost lease refused: generated by a replica that lost its unit (a zombie)"),
    _f("rows_admitted_not_committed", "work_lost.rows_admitted_not_committed", "rows admitted, not committed",
       "count", "lower", "per engine worker, rows admitted less rows it committed: a dead replica's batches in flight"),
    _f("input_rows_read", "input.rows_read", "input rows read", "count", "neutral",
       "rows this run's workers turned into records (null: the runner reports no counters)"),
    _f("input_rows_skipped_done", "input.rows_skipped_done", "input rows skipped as done", "count", "neutral",
       "rows this run left out before reading them: answered or dead-lettered by an earlier run"),
    _f("input_bytes_read", "input.bytes_read", "input bytes read", "bytes", "lower",
       "bytes this run's workers read of the Parquet input files, against input.file_bytes"),
    _f("input_file_bytes", "input.file_bytes", "input file size", "bytes", "neutral", "the Parquet input files' size"),
    _f("prompt_tokens", "tokens.prompt", "prompt tokens", "count", "neutral", "prompt tokens of answered requests"),
    _f("output_tokens", "tokens.output", "output tokens", "count", "neutral", "generated tokens"),
    _f("total_tokens", "tokens.total", "total tokens", "count", "neutral", "prompt + generated tokens"),
    _f("cached_tokens", "tokens.cached", "cached prompt tokens", "count", "neutral",
       "prompt tokens served from the prefix cache (null: the server does not report them)"),
    _f("rows_by_token_count_source", "tokens.by_count_source", "rows by token-count source", "text", "neutral",
       "answered rows by where their token counts came from (tokens.by_count_source)",
       derive=lambda v: {k: x["rows"] for k, x in (v or {}).items()} or None),
    _f("prefix_cache_hit_rate", "prefix_cache.hit_rate", "prefix cache hit rate", "pct", "higher",
       "cached prompt tokens / prompt tokens"),
    _f("cache_mode", "cache.mode", "result cache mode", "text", "neutral", "the run's `cache`: read-write, read or off"),
    _f("cache_rows", "cache.rows", "rows from the result cache", "count", "neutral",
       "answered input rows whose every sample was served from the result cache (no engine time, no cost)"),
    _f("cache_samples", "cache.samples", "output rows from the result cache", "count", "neutral",
       "output rows (samples) served from the result cache"),
    _f("cache_prompt_tokens", "cache.prompt_tokens", "prompt tokens saved by the result cache", "count", "higher",
       "prompt tokens of the output rows served from the result cache (in no throughput or cost figure)"),
    _f("cache_output_tokens", "cache.output_tokens", "output tokens saved by the result cache", "count", "higher",
       "output tokens of the output rows served from the result cache (in no throughput or cost figure)"),
    _f("cache_source_jobs", "cache.source_jobs", "result cache source jobs", "text", "neutral",
       "the jobs whose engines computed the served answers, samples each (at most 10)", derive=_none_if_empty),
    _f("max_num_seqs", "concurrency.max_num_seqs", "max_num_seqs", "count", "neutral", "the engine's sequence slots"),
    _f("max_num_batched_tokens", "concurrency.max_num_batched_tokens", "max_num_batched_tokens", "count", "neutral",
       "the engine's tokens per step"),
    _f("token_budget", "concurrency.token_budget", "batch token budget", "count", "neutral",
       "tokens admitted per batch"),
    _f("workers", "concurrency.workers", "workers", "count", "neutral", "worker rows of the job"),
    _f("batches", "concurrency.batches", "batches", "count", "neutral", "batches of the job"),
    _f("mean_batch_requests", "concurrency.mean_batch_requests", "mean requests per batch", "count", "neutral",
       "requests per batch, mean over batches"),
    _f("dtype", "engine.dtype", "dtype", "text", "neutral", "the dtype the engine ran"),
    _f("task", "engine.task", "task", "text", "neutral", "generate (text out), embed (a vector per row), or generate+embed "
       "(a batch file naming both: a pass of each, figures over both)"),
    _f("dtype_auto", "engine.dtype_auto", "dtype auto", "text", "neutral",
       "on a CPU with `dtype: auto`, the measurement that chose the dtype"),
    _f("checkpoint", "checkpoint", "checkpoint", "text", "neutral", "the model checkpoint's description"),
    _f("weights_bytes", "memory.weights_bytes", "model weights", "bytes", "neutral", "the model's weight files"),
    _f("kv_cache_bytes", "memory.kv_cache_bytes", "KV cache", "bytes", "neutral", "the KV cache the engine reported"),
    _f("kv_cache_tokens", "memory.kv_cache_tokens", "KV cache tokens", "count", "neutral",
       "tokens the engine's KV cache holds"),
    _f("peak_worker_rss_bytes", "memory.peak_worker_rss_bytes", "peak worker RSS", "bytes", "lower",
       "the largest worker's peak resident memory"),
    _f("peak_process_tree_rss_bytes", "memory.peak_process_tree_rss_bytes", "peak job process-tree RSS", "bytes",
       "lower", "the launcher's process tree's peak resident memory"),
    _f("cpu_util_pct_mean", "utilization.cpu_util_pct_mean", "CPU utilization mean", "pct100", "neutral",
       "all cores, mean over the launcher's samples"),
    _f("cpu_util_pct_max", "utilization.cpu_util_pct_max", "CPU utilization max", "pct100", "neutral",
       "all cores, largest of the launcher's samples"),
    _f("gpu_utilization", "utilization.gpus", "GPU utilization", "text", "neutral",
       "per GPU: memory, utilization and power over the launcher's samples"),
    _f("gpus", "devices.gpus", "GPUs", "count", "neutral", "GPUs over workers"),
    _f("nvml_errors", "devices.nvml_errors", "NVML errors", "text", "neutral",
       "workers whose GPUs NVML could not read", derive=_none_if_empty),
    _f("per_run", "runs", "runs", "text", "neutral", "each run's own figures (accounting.run_figures)"),
    _f("per_worker", "workers", "workers", "text", "neutral", "each worker's measured figures"),
    _f("cost_per_hour", "cost.usd_per_hour", "price per hour", "usd", "lower", "Σ of the workers' hourly prices"),
    _f("price_source", "cost.price_source", "price source", "text", "neutral", "where the prices came from"),
    _f("prices", "cost.prices_used", "prices used", "text", "neutral", "each price used, with its origin",
       derive=lambda v: [price_line(e) for e in v or []] or None),
    _f("cost_total", "cost.total", "cost", "usd", "lower", "Σ over workers of its generation windows × its price"),
    _f("cost_held_total", "cost.held.total", "cost (all held time)", "usd", "lower",
       "Σ over workers of its run's launcher start -> after export × its price"),
    _f("cost_model_load", "cost.model_load", "cost of model load", "usd", "lower",
       "Σ over workers of its model load × its price"),
    _f("cost_per_1m_output_tokens", "cost.per_1m_output_tokens", "USD per 1M output tokens", "usd", "lower",
       "generation-only cost / output tokens × 1M"),
    _f("cost_per_1m_total_tokens", "cost.per_1m_total_tokens", "USD per 1M total tokens", "usd", "lower",
       "generation-only cost / (prompt + output) tokens × 1M"),
    _f("cost_per_successful_request", "cost.per_successful_request", "USD per successful request", "usd", "lower",
       "generation-only cost / answered requests"),
    _f("cost_basis", "cost", "cost basis", "text", "neutral", "what the unit costs count",
       derive=lambda v: "generation only" if v else None),
    _f("cost_held_per_1m_output_tokens", "cost.held.per_1m_output_tokens", "USD per 1M output tokens (all held time)",
       "usd", "lower", "all-held-time cost / output tokens × 1M"),
    _f("cost_held_per_1m_total_tokens", "cost.held.per_1m_total_tokens", "USD per 1M total tokens (all held time)",
       "usd", "lower", "all-held-time cost / (prompt + output) tokens × 1M"),
    _f("cost_held_per_successful_request", "cost.held.per_successful_request",
       "USD per successful request (all held time)", "usd", "lower", "all-held-time cost / answered requests"),
    _f("cost_held_basis", "cost.held", "held cost basis", "text", "neutral", "what the held unit costs count",
       derive=lambda v: "all held time: start-up, model load, generation, export" if v else None),
)
BY_NAME: dict[str, Figure] = {f.name: f for f in FIGURES}


def figure(name: str) -> Figure:
    """The figure called `name`; KeyError names it."""
    try:
        return BY_NAME[name]
    except KeyError:
        raise KeyError(f"no figure named {name!r}") from None


def _view(*entries: str | tuple[str, str]) -> tuple[tuple[str, Figure], ...]:
    """(key, figure) pairs from figure names, or (key, name) where the view keys it otherwise."""
    return tuple((e, figure(e)) if isinstance(e, str) else (e[0], figure(e[1])) for e in entries)


#: Where each figure is shown, in the order shown, keyed as the view keys it.
VIEWS: dict[str, tuple[tuple[str, Figure], ...]] = {
    # `tokenmill report --compare`: two jobs side by side (compare_metrics)
    "compare": _view(
        "requests_succeeded", "failure_rate", "schema_valid_rate", "ttft_p50_s", "ttft_p95_s", "ttft_p99_s", "tpot_p50_s", "tpot_p95_s",
        "tpot_p99_s", "e2e_p50_s", "e2e_p95_s", "e2e_p99_s", "output_tok_per_s", "total_tok_per_s",
        "requests_per_s", "mean_request_output_tok_per_s", "generation_wall_s", "model_load_s",
        "prefix_cache_hit_rate", "kv_cache_bytes", "peak_worker_rss_bytes", "cpu_util_pct_mean",
        "cost_per_1m_output_tokens", "cost_per_1m_total_tokens", "cost_per_successful_request",
        "cost_held_per_1m_output_tokens", "cost_held_per_successful_request"),
    # `tokenmill status`: after the jobs-list figures and the job row's counts
    "status": _view(
        "ttft_p50_s", "ttft_p95_s", "ttft_p99_s", "tpot_p50_s", "tpot_p95_s", "e2e_p95_s", "e2e_p99_s",
        "total_tok_per_s", "requests_per_s", "generation_wall_s", "model_load_s", "prefix_cache_hit_rate",
        "failures_by_reason", "samples", "structured_rows", "schema_valid_rate", "dtype", "dtype_auto", "rows_by_token_count_source", "cache_mode", "cache_rows",
        "cache_output_tokens", "cache_source_jobs", "cost_per_1m_total_tokens", "cost_per_successful_request", "cost_basis", "prices", "cost_held_per_1m_output_tokens",
        "cost_held_per_1m_total_tokens", "cost_held_per_successful_request", "cost_held_basis", "runs", "gpus",
        "nvml_errors"),
    # `tokenmill jobs` (and the head of `status`)
    "jobs": _view("output_tok_per_s", "cost_per_1m_output_tokens"),
    # `tokenmill run`'s summary (runner.JobResult.summary, `run --json`)
    "summary": _view(
        "prompt_tokens", "output_tokens", "total_tokens", "model_load_s", "generation_wall_s", "output_tok_per_s",
        "total_tok_per_s", "prefix_cache_hit_rate", "cost_per_1m_output_tokens", "cost_held_per_1m_output_tokens",
        "dtype_auto", "task", "requests_per_s", "cost_per_1m_total_tokens", "cost_held_per_1m_total_tokens",
        "cache_mode", "cache_rows", "cache_samples", "cache_prompt_tokens", "cache_output_tokens"),
    # `tokenmill tune`: each run's figures and the table's columns ("cost" ranks the candidates)
    "tune": _view(("cost", "cost_per_1m_output_tokens"), "output_tok_per_s", "ttft_p95_s", "tpot_p95_s",
                  "e2e_p95_s", ("peak_rss_bytes", "peak_worker_rss_bytes")),
}


def shown_in(view: str) -> tuple[Figure, ...]:
    """The figures of a view, in its order."""
    return tuple(f for _, f in VIEWS[view])


def values(view: str, metrics: Mapping[str, Any] | None) -> dict[str, Any]:
    """{key: value} of a view's figures in one job's metrics, in the view's order."""
    return {key: f.value(metrics) for key, f in VIEWS[view]}


class FigureText(dict):
    """Figure names → their formatted values in one job's metrics, for `str.format_map`
    templates such as "{requests_failed} ({failure_rate})"."""

    def __init__(self, metrics: Mapping[str, Any] | None):
        super().__init__()
        self.metrics = metrics

    def __missing__(self, name: str) -> str:
        return figure(name).text(self.metrics)
