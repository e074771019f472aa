"""The example Airflow DAG against a real Airflow (its own venv, .venv-airflow: `make airflow`).

Airflow's pins clash with the project's (SQLAlchemy 1.4 vs 2.x), so Airflow runs
from its own virtual environment and these tests drive it as a user would:
DagBag, `airflow tasks test`, and the rendered task commands."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import TEST_ENGINE, write_parquet
from tokenmill.schemas import storage as S

ROOT = Path(__file__).resolve().parents[1]
AIRFLOW_VENV = Path(os.environ.get("TOKENMILL_AIRFLOW_VENV", ROOT / ".venv-airflow"))
DAGS = ROOT / "examples" / "airflow"
DAY = "2026-11-29"


@pytest.fixture(scope="module")
def airflow_env(tmp_path_factory):
    if not (AIRFLOW_VENV / "bin" / "airflow").exists():
        pytest.fail(f"no Airflow at {AIRFLOW_VENV} (`make airflow` creates it; `make test` does it first)")
    home = tmp_path_factory.mktemp("airflow_home")
    env = {
        **os.environ,
        "AIRFLOW_HOME": str(home),
        "AIRFLOW__CORE__DAGS_FOLDER": str(DAGS),
        "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
        "TOKENMILL_BIN": str(Path(sys.executable).parent / "tokenmill"),
    }
    for k in ("PYTHONPATH", "VIRTUAL_ENV", "LD_PRELOAD"):  # the project's venv must not leak into Airflow's
        env.pop(k, None)
    proc = subprocess.run([str(AIRFLOW_VENV / "bin" / "airflow"), "db", "migrate"], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return env


@pytest.fixture
def job_env(airflow_env, tmp_path):
    spec = tmp_path / "daily.yaml"
    spec.write_text(json.dumps({"engine": TEST_ENGINE, "sampling": {"max_tokens": 4}}))
    inp = write_parquet(tmp_path / "prompts.parquet", [{"id": "a", "prompt": "The sky is"}, {"id": "b", "prompt": "Hello"}])
    db = f"sqlite:///{tmp_path / 'jobs.db'}"
    return {**airflow_env, "TOKENMILL_SPEC": str(spec), "TOKENMILL_INPUT": str(inp),
            "TOKENMILL_OUTPUT": str(tmp_path / "out" / "{{ ds }}"), "TOKENMILL_DB": db}, db, tmp_path


def airflow(env, *args, timeout=900):
    return subprocess.run([str(AIRFLOW_VENV / "bin" / "airflow"), *args], env=env, capture_output=True, text=True,
                          timeout=timeout)


PROBE = """
import json, sys
from airflow.models import DagBag
bag = DagBag(dag_folder=sys.argv[1], include_examples=False)
dag = bag.get_dag("tokenmill_daily")
out = {"errors": {k: v.splitlines()[-1] for k, v in bag.import_errors.items()}, "dags": list(bag.dag_ids)}
if dag is not None:
    out["tasks"] = {t.task_id: {"retries": t.retries, "cmd": t.render_template(t.bash_command, {"ds": sys.argv[2]}),
                                "downstream": sorted(t.downstream_task_ids)} for t in dag.tasks}
    out["max_active_runs"] = dag.max_active_runs
print("PROBE" + json.dumps(out))
"""


def test_dag_parses_in_dagbag_with_a_job_id_from_the_logical_date(airflow_env):
    proc = subprocess.run([str(AIRFLOW_VENV / "bin" / "python"), "-c", PROBE, str(DAGS), DAY], env=airflow_env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout.split("PROBE", 1)[1])
    assert out["errors"] == {} and out["dags"] == ["tokenmill_daily"]
    assert set(out["tasks"]) == {"validate", "run"} and out["tasks"]["validate"]["downstream"] == ["run"]
    run = out["tasks"]["run"]
    assert run["retries"] >= 1 and out["max_active_runs"] == 1
    assert f"--job-id daily-{DAY}" in run["cmd"] and f"--job-id daily-{DAY}" in out["tasks"]["validate"]["cmd"]
    assert "{{" not in run["cmd"]


def test_validate_task_runs_tokenmill_through_airflow(job_env):
    env, _, tmp = job_env
    proc = airflow(env, "tasks", "test", "tokenmill_daily", "validate", DAY)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-3000:]
    assert f"ok: job daily-{DAY}: 2 rows" in log
    assert "Marking task as SUCCESS" in log


def test_validate_task_fails_the_try_on_a_missing_input(job_env):
    env, _, tmp = job_env
    proc = airflow({**env, "TOKENMILL_INPUT": str(tmp / "missing.parquet")}, "tasks", "test", "tokenmill_daily",
                   "validate", DAY)
    log = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "error: input" in log and "does not exist" in log


@pytest.mark.engine
def test_run_task_retry_resumes_the_same_job_and_never_duplicates(job_env):
    env, db, tmp = job_env
    first = airflow(env, "tasks", "test", "tokenmill_daily", "run", DAY)
    assert first.returncode == 0, (first.stdout + first.stderr)[-3000:]
    eng = S.connect(db)
    job = S.JobStore(eng).get(f"daily-{DAY}")
    assert job["status"] == "succeeded" and job["total"] == 2
    from sqlalchemy import select

    from tokenmill.schemas import tables as T

    def outputs():
        with eng.connect() as conn:
            return sorted(conn.execute(select(T.outputs.c.id, T.outputs.c.batch_id, T.outputs.c.finished_at)
                                       .where(T.outputs.c.job_id == f"daily-{DAY}")).all())

    before = outputs()
    retry = airflow(env, "tasks", "test", "tokenmill_daily", "run", DAY)  # what an Airflow retry executes
    assert retry.returncode == 0, (retry.stdout + retry.stderr)[-3000:]
    assert outputs() == before and len(before) == 2  # nothing answered twice
    assert S.JobStore(eng).get(f"daily-{DAY}")["status"] == "succeeded"
    assert (tmp / "out" / DAY / "_SUCCESS.json").exists()
