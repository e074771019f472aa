"""CLI commands for schedulers: `submit`, `run-pending`, `validate` (docs/ORCHESTRATION.md).

Exit codes are jobs/cli/common.py's: 0 succeeded, 1 failed, 2 usage or invalid spec,
3 partial (dead letters), 4 cancelled, 5 busy (the queue lock or the job id is
held by another live run).
"""

from __future__ import annotations

import sys
from typing import Any

import click

from tokenmill.jobs.cli.app import main
from tokenmill.jobs.cli.common import (
    CONTEXT_SETTINGS,
    EXIT_BUSY,
    EXIT_CANCELLED,
    EXIT_FAILED,
    EXIT_OK,
    EXIT_PARTIAL,
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
from tokenmill.transforms.engines.kinds import engine_of

#: run-pending's exit code: the most serious outcome among the jobs it ran.
SEVERITY = [("failed", EXIT_FAILED), ("busy", EXIT_BUSY), ("cancelled", EXIT_CANCELLED), ("partial", EXIT_PARTIAL)]


@main.command(context_settings=CONTEXT_SETTINGS)
@job_spec_options
@json_option
def submit(spec_file, as_json, **kw):
    """Queue a job as pending and print its id at once (run it later with run-pending).

    The spec is validated strictly first, then the input (exists, has a prompt column),
    the output and their buckets; the model and the engine options are checked when
    the job runs (run-pending may run on another machine).  Submitting an id that is
    already pending does nothing, so a retried submit never queues a job twice.

    \b
    Examples:
      tokenmill submit job.yaml --job-id nightly-2026-11-29
      tokenmill submit --input prompts.parquet --output out/ --max-tokens 64 --json
    """
    from tokenmill.jobs.lifecycle.preflight import preflight
    from tokenmill.jobs.lifecycle.queue import QueueBusy, QueueError
    from tokenmill.jobs.lifecycle.queue import submit as submit_job

    spec = build_spec(spec_file, spec_overrides(kw))
    eng = connect(kw.get("db_url") or spec.db)
    from tokenmill.jobs.lifecycle.preflight import resolve_workers

    try:  # `auto` stays in the queued spec: it is counted on the host that runs the job
        checked = resolve_workers(spec, here=False)
    except JobError as err:
        raise Failure(str(err)) from None
    problems = preflight(checked, engine=False).problems
    if problems:
        raise Failure("; ".join(problems))
    try:
        res = submit_job(eng, spec)
    except QueueBusy as err:
        raise Failure(str(err), EXIT_BUSY) from None
    except QueueError as err:
        raise Failure(str(err)) from None
    if as_json:
        emit_json({"job_id": res.job_id, "status": res.status})
    else:
        click.echo(res.job_id)


@main.command(name="run-pending", context_settings=CONTEXT_SETTINGS)
@db_option
@click.option("--limit", type=int, default=None, help="Run at most this many jobs, then exit.")
@click.option("-q", "--quiet", is_flag=True, help="No progress; only one line per job.")
@json_option
def run_pending(db_url, limit, quiet, as_json):
    """Run pending jobs in submission order, one runner at a time (a database lock).

    What cron or Airflow calls.  Each job is resumable: a job interrupted here is
    finished by the next run-pending.  Exit code: 0 when every job succeeded (or
    none was pending), else the most serious outcome: 1 failed, 5 busy,
    4 cancelled, 3 partial; 5 also when another run-pending holds the lock.

    \b
    Example:
      tokenmill run-pending --db postgresql://tokenmill@db/tokenmill
    """
    from tokenmill.jobs.lifecycle.launchers.inprocess import run_here
    from tokenmill.jobs.lifecycle.queue import QueueBusy
    from tokenmill.jobs.lifecycle.queue import run_pending as run_queue
    from tokenmill.schemas.db import default_db_url

    url = db_url or default_db_url()
    eng = connect(url)
    progress: list[Progress] = []

    def run(spec):
        p = Progress.for_output(quiet, as_json)
        progress.append(p)
        try:
            return run_here(spec, db_url=url, progress=p)
        finally:
            p.close()

    def started(job: dict[str, Any]) -> None:
        if not quiet and not as_json:
            click.echo(f"job {job['id']}: running", err=True)

    def done(o) -> None:
        if not as_json:
            click.echo(f"job {o.job_id}: {o.status}" + (f" ({o.note})" if o.note else ""))

    try:
        outcomes = run_queue(eng, run, limit=limit, on_start=started, on_done=done)
    except QueueBusy as err:
        raise Failure(str(err), EXIT_BUSY) from None
    code = next((c for status, c in SEVERITY if any(o.status == status for o in outcomes)), EXIT_OK)
    if as_json:
        emit_json({"exit_code": code, "jobs": [
            {"job_id": o.job_id, "status": o.status, "error": o.note,
             **({"summary": o.result.summary()} if o.result is not None else {})} for o in outcomes]})
    elif not outcomes and not quiet:
        click.echo("no pending jobs")
    sys.exit(code)


def check_spec(spec) -> dict[str, Any]:
    """The checks `run` makes before a worker starts (preflight.py), without a database:
    returns what was found; raises Failure with every problem on one line."""
    from tokenmill.jobs.lifecycle.preflight import preflight, resolve_workers

    try:
        spec = resolve_workers(spec)
    except JobError as err:
        raise Failure(str(err), EXIT_FAILED) from None
    pf = preflight(spec)
    if pf.problems:
        raise Failure("; ".join(pf.problems), EXIT_FAILED)
    plan = pf.plan
    found = {"job_id": spec.derived_job_id(), "input_format": spec.resolved_input_format(),
             "output_format": spec.output_format, "model_path": pf.model_path,
             "rows": plan.total_rows, "files": len(plan.files), "columns": plan.columns}
    for key in ("endpoints", "models"):
        if getattr(plan, key, None):
            found[key] = getattr(plan, key)
    if pf.unserved_models():  # such lines would become dead letters
        found["unserved_models"] = pf.unserved_models()
    return found


@main.command(context_settings=CONTEXT_SETTINGS)
@job_spec_options
@json_option
def validate(spec_file, as_json, **kw):
    """Check a job spec without running it: keys, types and ranges (with the key path),
    then everything `run` checks before reading a row: the model, the engine options
    (and the checkpoint) for this machine, the output, the input and their buckets.

    Exit code 0 when the job could run, 2 for an invalid spec, 1 when the input,
    model, engine options or the database (when --db is given) are wrong.

    \b
    Examples:
      tokenmill validate job.yaml
      tokenmill validate --input batch.jsonl --output out/ --json
    """
    spec = build_spec(spec_file, spec_overrides(kw))
    found = check_spec(spec)
    if kw.get("db_url") or spec.db:  # the job database must be reachable too (and is migrated)
        connect(kw.get("db_url") or spec.db)
    if as_json:
        emit_json({"valid": True, **found})
        return
    click.echo(
        f"ok: job {found['job_id']}: {found['rows']:,} rows in {found['files']} file(s) "
        f"({found['input_format']} -> {found['output_format']}), model {engine_of(spec.engine.kind).describe(spec.engine, found['model_path'])}"
    )
    if found.get("unserved_models"):
        names = ", ".join(f"{m!r} ({n} lines)" for m, n in found["unserved_models"].items())
        click.echo(f"warning: lines naming another model will be dead letters: {names}")
