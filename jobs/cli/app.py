"""The `tokenmill` click group: global options, logging, and engines stopped on exit."""

from __future__ import annotations

import logging
import os

import click

from tokenmill.jobs.cli.common import CONTEXT_SETTINGS

#: Commands that may start an engine in this process (the CLI's re-exec and the engines'
#: shutdown at the end are for them).
ENGINE_COMMANDS = {"run", "run-pending", "tune", "estimate", "serve"}
#: `ctx.meta` key: the group's -v (engine and library output on the terminal, not in a log file)
VERBOSE = "tokenmill.verbose"


def _quiet_logs(verbose: bool) -> None:
    level = logging.INFO if verbose else logging.WARNING
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    # ERROR on a terminal; a job's log file (console.JobConsole) raises it to INFO unless the user set it
    if "VLLM_LOGGING_LEVEL" not in os.environ:
        os.environ["VLLM_LOGGING_LEVEL"] = "INFO" if verbose else "ERROR"
        os.environ["TOKENMILL_VLLM_LEVEL_DEFAULT"] = "1"
    # vLLM logs to stdout by default (its engine processes too); stdout is the
    # summary or, with --json, the machine-readable result.
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    for name in ("apache_beam", "root", "alembic"):  # "root" is the root logger itself
        logging.getLogger(name).setLevel(logging.ERROR if not verbose else logging.INFO)
    # tokenmill's own warnings (a retried pipeline, a killed engine) are for the user.
    logging.getLogger("tokenmill").setLevel(level)
    if not verbose:
        import warnings

        warnings.filterwarnings("ignore")


def _shutdown_engines() -> None:
    # Engines started in this process (run, run-pending on the DirectRunner) hold
    # worker processes and device memory: stop them however the command ends.
    from tokenmill.transforms.engines.registry import shutdown_all

    shutdown_all()


@click.group(context_settings=CONTEXT_SETTINGS)
@click.option("-v", "--verbose", is_flag=True, help="Show engine and pipeline logs.")
@click.version_option(package_name="tokenmill")
@click.pass_context
def main(ctx: click.Context, verbose: bool) -> None:
    """tokenmill: offline batch LLM inference on Apache Beam and vLLM.

    \b
    Example:
      tokenmill run --input prompts.parquet --output out/ --max-tokens 64
      tokenmill status JOB_ID
    """
    _quiet_logs(verbose)
    ctx.meta[VERBOSE] = verbose
    if ctx.invoked_subcommand in ENGINE_COMMANDS:
        # Only a command that may start engines stops them: `cancel` or `status` run in the
        # process of a running job (an embedding program, a test) must leave its engine alone.
        ctx.call_on_close(_shutdown_engines)
