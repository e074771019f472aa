"""`tokenmill estimate`: what a job will cost and how long it will take here, before it runs."""

from __future__ import annotations

import click

from tokenmill.jobs.cli.app import VERBOSE, main
from tokenmill.jobs.cli.common import (
    CONTEXT_SETTINGS,
    EXIT_USAGE,
    Failure,
    build_spec,
    emit_json,
    job_spec_options,
    json_option,
    spec_overrides,
)


@main.command(context_settings=CONTEXT_SETTINGS)
@job_spec_options
@click.option("--sample", type=int, default=None, metavar="N",
              help="Rows to run through the engine (default: 10% of the usable rows, 8 to 200).")
@json_option
def estimate(spec_file, sample, as_json, **kw):
    """Predict a job's tokens, generation wall, held wall and cost, each with an interval:
    the whole input tokenized, a stratified sample of it run through the job's own engine
    and settings (as the job `<job id>:estimate`), the rest predicted from what it measured
    (docs/ESTIMATE.md).  Takes the same job spec and flags as `run`; the estimate is stored,
    and `report` / `status` show it beside what the job did.

    \b
    Examples:
      tokenmill estimate --input data/sample_prompts.parquet --output runs/demo --max-tokens 64
      tokenmill estimate job.yaml --sample 40 --json
    """
    from tokenmill.jobs.cli.console import JobConsole
    from tokenmill.jobs.estimate.make import EstimateError, estimate_job, sample_job_id
    from tokenmill.jobs.estimate.render import format_estimate
    from tokenmill.schemas import storage as S

    if sample is not None and sample < 1:
        raise Failure(f"--sample must be at least 1 row, got {sample}", EXIT_USAGE)
    spec = build_spec(spec_file, spec_overrides(kw))
    verbose = bool(click.get_current_context().meta.get(VERBOSE))
    console = JobConsole(sample_job_id(spec.derived_job_id()), verbose=verbose, show=not as_json)
    with console:
        if console.log is not None:
            console.stage(f"log: {console.log}")
        try:
            est = estimate_job(spec, db_url=kw.get("db_url"), sample=sample, stage=console.stage)
        except (EstimateError, S.StorageError) as err:
            log = f" (engine and library output: {console.log})" if console.log_written() else ""
            raise Failure(f"{err}{log}") from None
    if as_json:
        emit_json(est)
    else:
        click.echo(format_estimate(est), nl=False)
