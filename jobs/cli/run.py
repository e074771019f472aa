"""`tokenmill run`, `status`, `jobs` and `cancel`: one job now, and the jobs table."""

from __future__ import annotations

import sys
from dataclasses import replace
from typing import Any

import click
from tabulate import simple_separated_format, tabulate

from tokenmill.jobs.cli.app import VERBOSE, main
from tokenmill.jobs.cli.common import (
    CONTEXT_SETTINGS,
    EXIT_BUSY,
    EXIT_FAILED,
    STATUS_EXIT,
    Failure,
    Progress,
    build_spec,
    connect,
    db_option,
    emit_json,
    job_spec_options,
    json_option,
    spec_overrides,
)
from tokenmill.jobs.lifecycle.errors import JobError
from tokenmill.jobs.metrics.catalog import values


def format_summary(s: dict[str, Any]) -> str:
    def num(v, fmt="{:,.1f}"):
        return "-" if v is None else fmt.format(v)

    lines = [
        f"job {s['job_id']}: {s['status']}" + (" (resumed)" if s.get("resumed") else ""),
        f"  rows in {s['rows_in']:,} / succeeded {s['succeeded']:,} / failed {s['failed']:,}",
        f"  tokens: prompt {num(s['prompt_tokens'], '{:,}')}, output {num(s['output_tokens'], '{:,}')}, "
        f"total {num(s['total_tokens'], '{:,}')}",
        f"  wall {num(s['wall_s'])} s (model load {num(s['model_load_s'])} s, generation {num(s['generation_wall_s'])} s)",
        f"  output {num(s['output_tok_per_s'])} tok/s, total {num(s['total_tok_per_s'])} tok/s "
        f"(over generation wall time); prefix cache hit rate {num(s['prefix_cache_hit_rate'], '{:.1%}')}",
    ]
    if s.get("task") == "embed":  # no output tokens: input tokens and rows per second, cost per input token
        lines[-1] = (f"  input {num(s['total_tok_per_s'])} tok/s, {num(s.get('requests_per_s'))} rows/s (over generation "
                     f"wall time; embeddings: no output tokens, no TTFT or TPOT)")
        if s.get("cost_per_1m_total_tokens") is not None:
            held = s.get("cost_held_per_1m_total_tokens")
            lines.append(f"  cost ${s['cost_per_1m_total_tokens']:.4f} per 1M input tokens over generation only"
                         + ("" if held is None else f", ${held:.4f} over all held time (start-up, load, export)"))
    elif s.get("cost_per_1m_output_tokens") is not None:
        held = s.get("cost_held_per_1m_output_tokens")
        lines.append(f"  cost ${s['cost_per_1m_output_tokens']:.4f} per 1M output tokens over generation only"
                     + ("" if held is None else f", ${held:.4f} over all held time (start-up, load, export)"))
    if s.get("task") == "generate+embed":
        lines.insert(-1, "  a pass of generation, then one of embeddings (the batch file's /v1/embeddings lines): "
                         "the figures count both")
    if s.get("cache_samples"):  # docs/CACHE.md: served rows are in no engine figure above, at no cost
        lines.append(f"  result cache ({s.get('cache_mode')}): {s['cache_rows']:,} rows ({s['cache_samples']:,} "
                     f"samples) served, {s['cache_prompt_tokens']:,} prompt + {s['cache_output_tokens']:,} output "
                     "tokens saved; tokens and rates above are the engine's")
    if s.get("dtype_auto"):
        d = s["dtype_auto"]
        lines.append(f"  dtype {d['choice']} (auto: {d['reason']})")
    if s.get("outputs"):
        lines.append(f"  outputs: {s['outputs']}")
    if s.get("log"):
        lines.append(f"  log: {s['log']}")
    if s.get("note"):
        lines.append(f"  note: {s['note']}")
    return "\n".join(lines)


def execute_job(spec, db_url, quiet: bool, as_json: bool, verbose: bool = False) -> int:
    """Run the job with engine and library output in its log file (`console.JobConsole`);
    the terminal gets a line per stage, the row bar, the summary and any error."""
    from tokenmill.jobs.cli.console import JobConsole
    from tokenmill.jobs.lifecycle.launchers.inprocess import run_here
    from tokenmill.jobs.lifecycle.launchers.spawned import Reporter
    from tokenmill.schemas import storage as S
    from tokenmill.transforms.engines.registry import shutdown_all

    reporter = Reporter.from_env()  # a launcher that started this process reads its stages and end there
    console = JobConsole(spec.derived_job_id(), verbose=verbose, show=not quiet and not as_json)
    with console:
        if console.log is not None:
            console.stage(f"log: {console.log}")

        def stage(line: str) -> None:
            console.stage(line)
            reporter.stage(line)

        progress = Progress.for_output(quiet, as_json, console.terminal)
        try:
            launched = run_here(spec, db_url=db_url, progress=progress, stage=stage)
        finally:
            progress.close()
            shutdown_all()  # inside: the engines' own shutdown lines go to the log too
    failure = None
    if isinstance(launched.error, S.JobBusy):
        failure = Failure(str(launched.error), EXIT_BUSY)
    elif isinstance(launched.error, (JobError, S.StorageError)):
        failure = Failure(_with_log(str(launched.error), console))
    reporter.done(launched if failure is None else replace(launched, note=failure.message))
    if failure is not None:
        raise failure
    if launched.error is not None:
        raise launched.error
    result = launched.result
    summary = result.summary()
    summary["resumed"] = result.resumed
    if console.log is not None:
        summary["log"] = str(console.log)
    if as_json:
        emit_json(summary)
    elif not quiet:
        click.echo(format_summary(summary))
    return STATUS_EXIT.get(result.status, EXIT_FAILED)


def _with_log(message: str, console) -> str:
    """The error, and where the engine and library output is when there is any (still one line)."""
    return f"{message} (engine and library output: {console.log})" if console.log_written() else message


@main.command(context_settings=CONTEXT_SETTINGS)
@job_spec_options
@click.option("-q", "--quiet", is_flag=True, help="No progress or summary.")
@json_option
def run(spec_file, quiet, as_json, **kw):
    """Run a batch job now (from a job spec YAML and/or flags).

    \b
    Examples:
      tokenmill run --input data/sample_prompts.parquet --output runs/demo --max-tokens 64
      tokenmill run job.yaml --job-id nightly-2026-11-29
    """
    spec = build_spec(spec_file, spec_overrides(kw))
    sys.exit(execute_job(spec, kw.get("db_url"), quiet, as_json, verbose=click.get_current_context().meta.get(VERBOSE)))


# ---------------------------------------------------------------- status / jobs


def job_summary_row(job: dict[str, Any]) -> dict[str, Any]:
    """A job's line in `tokenmill jobs`: the job row's counts and the jobs view's figures."""
    return {
        "id": job["id"],
        "name": job.get("name"),
        "status": job["status"],
        "model": job.get("model"),
        "total": job.get("total"),
        "succeeded": job.get("succeeded"),
        "failed": job.get("failed"),
        **values("jobs", job.get("metrics")),
        "started_at": job.get("started_at"),
        "finished_at": job.get("finished_at"),
    }


def _dtype_auto_line(d: dict[str, Any] | None) -> str | None:
    from tokenmill.jobs.metrics.report import describe_dtype  # storage and numpy: not at CLI start

    return describe_dtype(None, d) if d else None


def job_status(job: dict[str, Any]) -> dict[str, Any]:
    """What `status` shows: the summary row, reconciliation, failure rate, error, headline metrics."""
    row = job_summary_row(job)
    total, succeeded, failed = job.get("total"), job.get("succeeded"), job.get("failed")
    row["reconciled"] = None if total is None or succeeded is None else total == (succeeded or 0) + (failed or 0)
    row["failure_rate"] = (failed or 0) / total if total else None
    row["error"] = job.get("error")
    row.update(values("status", job.get("metrics")))  # the full set: `tokenmill report`
    return row


def _status_value(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, dict):
        return ", ".join(f"{a}: {n}" for a, n in v.items())
    if isinstance(v, list) and all(isinstance(x, str) for x in v):
        return "; ".join(v)
    return str(v)


@main.command(context_settings=CONTEXT_SETTINGS)
@click.argument("job_id")
@db_option
@json_option
def status(job_id, db_url, as_json):
    """Show one job: status, counts and headline metrics.

    \b
    Example:
      tokenmill status job-1a2b3c4d5e6f --json
    """
    from tokenmill.schemas import storage as S

    eng = connect(db_url)
    job = S.JobStore(eng).get(job_id)
    if job is None:
        raise Failure(f"no job with id {job_id!r}")
    if job["status"] == "running":  # live counts while it runs
        job.update(S.MetricsReader(eng).counts(job_id))
    row = job_status(job)
    from tokenmill.jobs.estimate.beside import job_estimate, one_line  # the newest estimate beside what happened

    est = job_estimate(eng, job_id, job.get("metrics"))
    if est is not None:
        row["estimate"] = est if as_json else one_line(est)
    if as_json:
        emit_json(row)
        return
    rows = [(k, _dtype_auto_line(v) if k == "dtype_auto" else _status_value(v)) for k, v in row.items()
            if v is not None]
    click.echo(tabulate(rows, tablefmt=simple_separated_format(": "), colalign=("right", "left"),
                        disable_numparse=True))


@main.command(name="jobs", context_settings=CONTEXT_SETTINGS)
@click.option("--limit", default=20, show_default=True, help="How many recent jobs.")
@db_option
@json_option
def jobs_cmd(limit, db_url, as_json):
    """List recent jobs with status, counts, tok/s and cost.

    \b
    Example:
      tokenmill jobs --limit 5
    """
    from tokenmill.schemas import storage as S

    rows = [job_summary_row(j) for j in S.JobStore(connect(db_url)).recent(limit)]
    if as_json:
        emit_json(rows)
        return
    if not rows:
        click.echo("no jobs")
        return
    table = [
        (r["id"], r["status"], r["total"] or 0, r["succeeded"] or 0, r["failed"] or 0,
         "-" if r["output_tok_per_s"] is None else f"{r['output_tok_per_s']:.1f}",
         "-" if r["cost_per_1m_output_tokens"] is None else f"{r['cost_per_1m_output_tokens']:.3f}")
        for r in rows
    ]
    click.echo(tabulate(table, headers=("id", "status", "total", "ok", "failed", "out tok/s", "$/1M out"),
                        tablefmt="plain", colalign=("left", "left", "right", "right", "right", "right", "right"),
                        disable_numparse=True))


@main.command(context_settings=CONTEXT_SETTINGS)
@click.argument("job_id")
@db_option
def cancel(job_id, db_url):
    """Ask a running job to stop after the batches in flight (pending jobs are cancelled at once).

    \b
    Example:
      tokenmill cancel job-1a2b3c4d5e6f
    """
    from tokenmill.schemas import storage as S

    eng = connect(db_url)
    try:
        job = S.JobStore(eng).request_cancel(job_id)
    except S.StorageError as err:
        raise Failure(str(err)) from None
    click.echo(f"job {job_id}: {'cancel requested' if job['status'] == 'running' else job['status']}")
