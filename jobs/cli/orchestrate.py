"""CLI commands for schedulers: `submit`, `run-pending`, `validate` (docs/ORCHESTRATION.md).

Exit codes are jobs/cli.py's: 0 succeeded, 1 failed, 2 usage or invalid spec,
3 partial (dead letters), 4 cancelled, 5 busy (the queue lock or the job id is
held by another live run).
"""

from __future__ import annotations

import sys
from typing import Any

import click

from tokenmill.jobs.cli import (
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
    main,
    spec_overrides,
)

#: run-pending's exit code: the most serious outcome among the jobs it ran.
SEVERITY = [("failed", EXIT_FAILED), ("busy", EXIT_BUSY), ("cancelled", EXIT_CANCELLED), ("partial", EXIT_PARTIAL)]


@main.command(context_settings=CONTEXT_SETTINGS)
@job_spec_options
@json_option
def submit(spec_file, as_json, **kw):
    """Queue a job as pending and print its id at once (run it later with run-pending).

    The spec is validated strictly first; submitting an id that is already pending
    does nothing, so a retried submit never queues a job twice.

    \b
    Examples:
      tokenmill submit job.yaml --job-id nightly-2026-11-29
      tokenmill submit --input prompts.parquet --output out/ --max-tokens 64 --json
    """
    from tokenmill.jobs.lifecycle.queue import QueueBusy, QueueError, submit as submit_job

    spec = build_spec(spec_file, spec_overrides(kw))
    eng = connect(kw.get("db_url") or spec.db)
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
    from tokenmill.jobs.lifecycle.queue import QueueBusy, run_pending as run_queue
    from tokenmill.jobs.lifecycle.runner import run_job
    from tokenmill.schemas.db import default_db_url

    url = db_url or default_db_url()
    eng = connect(url)
    progress: list[Progress] = []

    def run(spec):
        p = Progress(enabled=not quiet and not as_json and sys.stderr.isatty())
        progress.append(p)
        try:
            return run_job(spec, db_url=url, progress=p)
        finally:
            p.close()

    def started(job: dict[str, Any]) -> None:
        if not quiet and not as_json:
            click.echo(f"job {job['id']}: running", err=True)

    def done(o) -> None:
        if not as_json:
            click.echo(f"job {o.job_id}: {o.status}" + (f" ({o.error})" if o.error else ""))

    try:
        outcomes = run_queue(eng, run, limit=limit, on_start=started, on_done=done)
    except QueueBusy as err:
        raise Failure(str(err), EXIT_BUSY) from None
    finally:
        from tokenmill.transforms.engines.registry import shutdown_all

        shutdown_all()
    code = next((c for status, c in SEVERITY if any(o.status == status for o in outcomes)), EXIT_OK)
    if as_json:
        emit_json({"exit_code": code, "jobs": [
            {"job_id": o.job_id, "status": o.status, "error": o.error,
             **({"summary": o.result.summary()} if o.result is not None else {})} for o in outcomes]})
    elif not outcomes and not quiet:
        click.echo("no pending jobs")
    sys.exit(code)


def check_spec(spec) -> dict[str, Any]:
    """Everything `run` checks before a worker starts, without a database: the input
    (exists, readable, has a prompt column), the model (resolves to a local folder)
    and the engine options for this machine.  Returns what was found; raises Failure
    with every problem on one line."""
    from tokenmill.jobs.lifecycle.runner import check_output_path, set_filesystem_options
    from tokenmill.schemas.models import ModelNotFound, resolve_model
    from tokenmill.transforms.engines.protocol import EngineStartError
    from tokenmill.transforms.engines.checks import check_engine_config
    from tokenmill.transforms.engines.device import has_nvidia_gpu
    from tokenmill.transforms.read import InputError, plan_input

    problems, found = [], {"job_id": spec.derived_job_id(), "input_format": spec.resolved_input_format(),
                           "output_format": spec.output_format}
    try:
        found["model_path"] = str(resolve_model(spec.engine.model, need_weights=spec.engine.load_format != "dummy"))
    except ModelNotFound as err:
        problems.append(str(err))
    try:
        check_engine_config(spec.engine, on_gpu=has_nvidia_gpu())
    except EngineStartError as err:
        problems.append(str(err))
    try:
        check_output_path(spec.output)
    except Exception as err:
        problems.append(str(err))
    try:
        set_filesystem_options(spec)
        plan = plan_input(spec.input, spec.resolved_input_format())
        found.update(rows=plan.total_rows, files=len(plan.files), columns=plan.columns)
        for key in ("endpoints", "models"):
            if getattr(plan, key, None):
                found[key] = getattr(plan, key)
        if "models" in found and "model_path" in found:  # such lines would become dead letters
            import os

            served = {spec.engine.model, found["model_path"], os.path.basename(found["model_path"])}
            unserved = {m: n for m, n in found["models"].items() if m not in served}
            if unserved:
                found["unserved_models"] = unserved
    except InputError as err:
        problems.append(str(err))
    if problems:
        raise Failure("; ".join(problems), EXIT_FAILED)
    return found


@main.command(context_settings=CONTEXT_SETTINGS)
@job_spec_options
@json_option
def validate(spec_file, as_json, **kw):
    """Check a job spec without running it: keys, types and ranges (with the key path),
    then the input (exists, has a prompt column), the model and the engine options.

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
        f"({found['input_format']} -> {found['output_format']}), model {found['model_path']}"
    )
    if found.get("unserved_models"):
        names = ", ".join(f"{m!r} ({n} lines)" for m, n in found["unserved_models"].items())
        click.echo(f"warning: lines naming another model will be dead letters: {names}")
