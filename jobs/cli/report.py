"""`tokenmill report`: the serving report of a job, or two jobs side by side."""

from __future__ import annotations

import click

from tokenmill.jobs.cli.app import main
from tokenmill.jobs.cli.common import CONTEXT_SETTINGS, Failure, connect, db_option, emit_json, json_option


def _default_out() -> str:
    from tokenmill.schemas.models import tokenmill_home

    return str(tokenmill_home() / "reports")


@main.command(context_settings=CONTEXT_SETTINGS)
@click.argument("job_id")
@click.option("--out", "out_dir", default=None, metavar="DIR",
              help="Folder for the HTML report (default: ~/.cache/tokenmill/reports).")
@click.option("--compare", "other", default=None, metavar="OTHER_JOB",
              help="Put OTHER_JOB beside JOB_ID (A = JOB_ID, B = OTHER_JOB; ratios are B / A).")
@click.option("--no-html", is_flag=True, help="Only the terminal table / JSON.")
@click.option("--html-only", is_flag=True, help="Write the HTML report and print its path, no table.")
@db_option
@json_option
def report(job_id, out_dir, other, no_html, html_only, db_url, as_json):
    """Serving report of a job: latency percentiles, throughput, concurrency,
    memory, utilization, failures and cost, plus an HTML page with plots.

    \b
    Examples:
      tokenmill report demo --out reports/
      tokenmill report job-a --compare job-b --json
    """
    from tokenmill.jobs.metrics import report as R

    eng = connect(db_url)
    try:
        a = R.load_report(eng, job_id)
        b = R.load_report(eng, other) if other else None
    except R.ReportError as err:
        raise Failure(str(err)) from None
    html_path = None
    if not no_html:
        try:
            out = out_dir or _default_out()
            path = R.render_compare_html(a, b, out) if b else R.render_html(a, out)
        except OSError as err:
            raise Failure(f"cannot write the HTML report to {out}: {err.strerror or err}") from None
        html_path = str(path)
    if no_html and html_only:
        raise Failure("--no-html and --html-only exclude each other", 2)
    if as_json:
        emit_json(R.compare_json(a, b, html_path) if b else R.report_json(a, html_path))
        return
    if html_only:
        click.echo(f"HTML report: {html_path}")
        return
    click.echo(R.format_compare(a, b) if b else R.format_report(a), nl=False)
    if html_path:
        click.echo(f"\nHTML report: {html_path}")
