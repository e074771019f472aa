"""A daily tokenmill job as an Airflow DAG (docs/ORCHESTRATION.md).

The job id is derived from the logical date (`daily-{{ ds }}`), so every try of
one day's run is the same tokenmill job: an Airflow retry, a manual clear or a
backfill resumes that day's job from the database (answered rows are skipped,
outputs are inserted idempotently) and never answers a row twice.  If an
earlier try is somehow still alive, tokenmill refuses the overlapping run with
exit code 5 and the task fails, to be retried after `retry_delay`.

Exit codes (docs/JOBS.md): 0 succeeded, 3 partial (some rows are dead letters:
data problems a retry cannot fix, so the task succeeds and says so), anything
else fails the task.

Settings come from the environment of the Airflow worker, so the DAG file
itself needs no edits: TOKENMILL_BIN (the `tokenmill` executable),
TOKENMILL_SPEC (a job spec YAML: engine, sampling, batching), TOKENMILL_INPUT
and TOKENMILL_OUTPUT (templated with `{{ ds }}`), TOKENMILL_DB (the job
database all workers share).
"""

from __future__ import annotations

import os
from datetime import datetime, timedelta

from airflow import DAG
from airflow.operators.bash import BashOperator

TOKENMILL = os.environ.get("TOKENMILL_BIN", "tokenmill")
SPEC = os.environ.get("TOKENMILL_SPEC", "/etc/tokenmill/daily.yaml")
INPUT = os.environ.get("TOKENMILL_INPUT", "s3://prompts/daily/{{ ds }}/")
OUTPUT = os.environ.get("TOKENMILL_OUTPUT", "s3://answers/daily/{{ ds }}/")
DB = os.environ.get("TOKENMILL_DB", "postgresql://tokenmill@db/tokenmill")

#: One job per logical date: the same id on every try, so a retry resumes.
JOB_ID = "daily-{{ ds }}"
JOB_ARGS = f"{SPEC} --job-id {JOB_ID} --input '{INPUT}' --output '{OUTPUT}' --db '{DB}'"

with DAG(
    dag_id="tokenmill_daily",
    description="Daily batch inference with tokenmill; retries resume the day's job",
    schedule="@daily",
    start_date=datetime(2026, 11, 1),
    catchup=False,
    max_active_runs=1,  # one day's job at a time on the shared accelerators
    default_args={"retries": 3, "retry_delay": timedelta(minutes=10), "retry_exponential_backoff": True},
    tags=["tokenmill"],
) as dag:
    # Cheap checks first (spec keys, input exists with a prompt column, model resolves):
    # a bad day's input fails here in seconds, before an engine is started.
    validate = BashOperator(task_id="validate", bash_command=f"{TOKENMILL} validate {JOB_ARGS}")

    run = BashOperator(
        task_id="run",
        bash_command=(
            f"{TOKENMILL} run {JOB_ARGS} --quiet; rc=$?; "
            'if [ "$rc" -eq 3 ]; then echo "tokenmill: partial success, dead letters in the output"; exit 0; fi; '
            'exit "$rc"'
        ),
        execution_timeout=timedelta(hours=12),
    )

    validate >> run
