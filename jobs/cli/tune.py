"""`tokenmill tune`: search the configurations of a job spec for the cheapest one that
passes the quality gate, on a sample of the job's own prompts (docs/TUNE.md)."""

from __future__ import annotations

import click

from tokenmill.jobs.cli.app import main
from tokenmill.jobs.cli.common import CONTEXT_SETTINGS, EXIT_USAGE, Failure, db_option, emit_json, json_option


@main.command(context_settings=CONTEXT_SETTINGS)
@click.argument("spec_file", type=click.Path(dir_okay=False))
@click.option("--sample", "-n", type=click.IntRange(min=1), required=True,
              help="Rows drawn from the job's input for the largest sample (smaller rungs take the first half, ...).")
@click.option("--out", "-o", required=True, type=click.Path(file_okay=False),
              help="Folder for the sample, the candidates' outputs, the table, the HTML report and winner.yaml.")
@click.option("--gate", default=None, metavar="EXPR",
              help="Quality gate against the spec as given: auto<=3% (default: accuracy drop on the job's "
                   "references, else on the eval set), accuracy_drop<=0.03, disagreement<=5%, exact_match>=90%, "
                   "similarity>=0.95.")
@click.option("--budget-minutes", type=click.FloatRange(min=0, min_open=True), default=20.0, show_default=True,
              help="Wall time of the candidates' jobs; no rung starts that would not fit.")
@click.option("--space", type=click.Path(dir_okay=False, exists=True), default=None,
              help="Search space YAML (default: the one shipped, jobs/modeltools/tune/tune_space.yaml).")
@click.option("--repeats", type=click.IntRange(min=2), default=2, show_default=True,
              help="Runs of every candidate at every sample size (interleaved); their spread is the noise.")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the sample draw.")
@click.option("--eval-set", type=click.Path(dir_okay=False), default=None,
              help="Parquet of questions with a `reference` column: the default gate's accuracy where the "
                   "job's rows have no references (default: the bundled data/eval_set.parquet).")
@db_option
@json_option
def tune(spec_file, sample, out, gate, budget_minutes, space, repeats, seed, eval_set, db_url, as_json):
    """Find the cheapest configuration of a job that passes the quality gate.

    \b
    Every candidate (the spec as given with some keys changed) runs as an ordinary job on
    the same sampled rows; successive halving keeps the cheaper half ($ per 1M output
    tokens) of those that pass the gate at each sample size.  Rerun the same command to
    resume an interrupted tune.  See docs/TUNE.md.

    \b
    Examples:
      tokenmill tune job.yaml --sample 64 --out tune/ --budget-minutes 20
      tokenmill run tune/winner.yaml
    """
    from tokenmill.jobs.modeltools.tune import TuneError, TuneOptions, format_table
    from tokenmill.jobs.modeltools.tune import tune as do_tune
    from tokenmill.schemas.config import SpecError, read_spec_file

    try:
        data = read_spec_file(spec_file)
    except SpecError as err:
        raise Failure(str(err), EXIT_USAGE) from None
    echo = (lambda line: None) if as_json else (lambda line: click.echo(line, err=True))
    try:
        res = do_tune(data, TuneOptions(sample=sample, out=out, db_url=db_url, gate=gate, budget_minutes=budget_minutes,
                                        space=space, repeats=repeats, seed=seed, eval_set=eval_set, echo=echo))
    except TuneError as err:
        raise Failure(str(err), EXIT_USAGE) from None
    except KeyboardInterrupt:
        raise Failure("interrupted: what was measured is kept; rerun the same command to resume") from None
    if as_json:
        emit_json(res.as_dict())
        return
    click.echo(format_table(res.table))
    for n in res.notes:
        click.echo(f"note: {n}")
    click.echo(res.recommendation)
    click.echo(f"report {res.files['html']}\nwinning spec {res.files['spec']}")
