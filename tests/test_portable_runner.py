"""The unchanged pipeline on Beam's portable runner against a separate SDK worker pool.

This is the execution model of Flink, Spark and Dataflow: the launcher submits a
pipeline (here to Beam's Python job service, `--job_endpoint=embed`), and SDK
worker processes started by `apache_beam.runners.worker.worker_pool_main`
(`--environment_type=EXTERNAL`) run every step, each with its own engine.
Everything reaches the workers through the pipeline proto and the database;
nothing through the launcher's memory."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pyarrow.parquet as pq
import pytest
from sqlalchemy import select

from tests.conftest import TEST_ENGINE, write_parquet
from tests.helpers import job_spec
from tokenmill.jobs.lifecycle.runner import run_job
from tokenmill.schemas import storage as S
from tokenmill.schemas import tables as T

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def worker_pool():
    """A Beam SDK worker pool in its own process, with the CPU runtime env (tcmalloc, OpenMP)."""
    port = free_port()
    # The pool starts SDK workers as plain `python`: put this venv's first on PATH, or
    # (under `make test`, venv not activated) they start without Beam and die at once.
    env = {**os.environ, "TOKENMILL_NO_REEXEC": "1",
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "tokenmill.jobs.lifecycle.envexec", sys.executable, "-m",
         "apache_beam.runners.worker.worker_pool_main", f"--service_port={port}"],
        cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True,
    )
    deadline = time.time() + 60
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            if proc.poll() is not None or time.time() > deadline:
                proc.kill()
                pytest.fail(f"worker pool did not start: {proc.stderr.read().decode()[-2000:]}")
            time.sleep(0.2)
    yield port, proc
    stop_pool(proc)


def stop_pool(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)  # its own session: the pool and the SDK workers it started
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def portable_options(port: int) -> list[str]:
    return ["--job_endpoint=embed", "--environment_type=EXTERNAL", f"--environment_config=localhost:{port}"]


def pool_pids(proc: subprocess.Popen) -> set[int]:
    try:
        p = psutil.Process(proc.pid)
        return {p.pid} | {c.pid for c in p.children(recursive=True)}
    except psutil.NoSuchProcess:
        return set()


def worker_rows(db_url: str, job_id: str):
    with S.connect(db_url).connect() as conn:
        return [dict(r) for r in conn.execute(select(T.workers).where(T.workers.c.job_id == job_id)).mappings()]


def test_pipeline_runs_in_the_worker_pool_processes(worker_pool, tmp_path, sqlite_url):
    """Fake engine (tests.fakes, imported by the workers themselves): the plumbing, quickly."""
    from tests.fakes import FakeSession

    port, proc = worker_pool
    rows = [{"id": f"r{i}", "prompt": f"question {i}"} for i in range(6)] + [{"id": "bad", "prompt": ""}]
    inp = write_parquet(tmp_path / "in.parquet", rows)
    spec = job_spec(inp, tmp_path / "out", job_id="portable-fake", sampling={"max_tokens": 3},
                    runner={"runner": "PortableRunner", "pipeline_options": portable_options(port)})
    FakeSession.instances.clear()
    res = run_job(spec, db_url=sqlite_url, session_factory=FakeSession)
    assert (res.status, res.succeeded, res.failed) == ("partial", 6, 1)
    assert FakeSession.instances == []  # no engine session was made in the launcher process
    workers = worker_rows(sqlite_url, "portable-fake")
    assert workers and all(w["pid"] != os.getpid() for w in workers)
    assert {w["pid"] for w in workers} <= pool_pids(proc)
    out = pq.read_table(tmp_path / "out" / "outputs.parquet").to_pylist()
    assert sorted(r["id"] for r in out) == [f"r{i}" for i in range(6)]


@pytest.mark.engine
def test_real_engine_on_the_portable_runner_matches_the_direct_runner(worker_pool, tmp_path, sqlite_url):
    from tokenmill.transforms.engines import registry as E

    port, proc = worker_pool
    rows = [
        {"id": "capital", "messages": [{"role": "user", "content": "What is the capital of France?"}], "prompt": None},
        {"id": "colors", "prompt": "The three primary colors are", "messages": None},
        {"id": "count", "prompt": "One, two, three,", "messages": None},
    ]
    inp = write_parquet(tmp_path / "in.parquet", rows)
    base = {"engine": TEST_ENGINE, "sampling": {"max_tokens": 12, "temperature": 0.0}}
    launcher_sessions = E.sessions()
    spec = job_spec(inp, tmp_path / "portable", job_id="portable-real", **base,
                    runner={"runner": "PortableRunner", "pipeline_options": portable_options(port)})
    res = run_job(spec, db_url=sqlite_url)
    assert (res.status, res.succeeded, res.failed) == ("succeeded", 3, 0), res
    assert E.sessions() == launcher_sessions  # no engine was started in the launcher
    workers = worker_rows(sqlite_url, "portable-real")
    assert workers and {w["pid"] for w in workers} <= pool_pids(proc) and os.getpid() not in {w["pid"] for w in workers}
    assert all(w["load_s"] and w["load_s"] > 0 for w in workers)  # a real engine load, per worker process
    portable = {r["id"]: r for r in pq.read_table(tmp_path / "portable" / "outputs.parquet").to_pylist()}
    assert "Paris" in portable["capital"]["text"]
    stop_pool(proc)  # free its engine's memory before the direct run loads one here

    direct = run_job(job_spec(inp, tmp_path / "direct", job_id="direct-real", **base), db_url=sqlite_url)
    assert direct.status == "succeeded"
    ref = {r["id"]: r for r in pq.read_table(tmp_path / "direct" / "outputs.parquet").to_pylist()}
    for rid in ref:  # greedy: the same answers whichever runner ran the pipeline
        assert portable[rid]["text"] == ref[rid]["text"], rid
        assert portable[rid]["output_tokens"] == ref[rid]["output_tokens"], rid


# ---------------------------------------------------------------- deploy/: Dataflow, Flink, Spark


@pytest.mark.parametrize("name, runner_cls", [
    ("dataflow-gpu.yaml", "DataflowRunner"), ("flink.yaml", "FlinkRunner"), ("spark.yaml", "SparkRunner"),
])
def test_deploy_specs_load_strictly_and_build_a_valid_pipeline(name, runner_cls, tmp_path):
    import apache_beam as beam
    from apache_beam.options.pipeline_options import DebugOptions, GoogleCloudOptions, PortableOptions, WorkerOptions

    from tokenmill.jobs.lifecycle.preflight import pipeline_options
    from tokenmill.pipelines.batch import PipelineParts, build_pipeline
    from tokenmill.schemas.config import load_spec_file
    from tokenmill.transforms.read import plan_input

    spec = load_spec_file(ROOT / "deploy" / name)
    assert spec.runner.runner == runner_cls
    opts = pipeline_options(spec)
    if runner_cls == "DataflowRunner":
        worker, debug = opts.view_as(WorkerOptions), opts.view_as(DebugOptions)
        assert worker.sdk_container_image.endswith("/tokenmill/worker:0.1.0")
        assert "worker_accelerator=type:nvidia-l4;count:1;install-nvidia-driver" in opts.view_as(
            GoogleCloudOptions).dataflow_service_options
        assert {"use_runner_v2", "no_use_multiple_sdk_containers"} <= set(debug.experiments)
        assert debug.number_of_worker_harness_threads == 1
    else:
        assert opts.view_as(PortableOptions).environment_type in ("EXTERNAL", "DOCKER")
    # The graph these options run: built (not run) from a local stand-in input.
    inp = write_parquet(tmp_path / "in.parquet", [{"id": "a", "prompt": "hi"}])
    parts = PipelineParts(job_id="deploy", run_id="r", plan=plan_input(str(inp)), model_name="m",
                          model_path=spec.engine.model, db_url="postgresql+psycopg2://tokenmill@db/tokenmill")
    p = beam.Pipeline(options=opts)
    assert type(p.runner).__name__ == runner_cls
    build_pipeline(p, spec, parts)
    proto = p.to_runner_api()
    labels = {t.unique_name for t in proto.components.transforms.values()}
    assert {"PlanUnits", "ClaimIds", "ReadPrompts", "Validate", "SkipDone", "DedupIds", "Tokenize", "Generate",
            "WriteDeadLettersValidate", "WriteDeadLettersTokenize"} <= labels


def test_dockerfile_python_side_resolves(tmp_path):
    """The Dockerfile's `pip install` set (tokenmill[gpu] + apache-beam[gcp]) resolves from
    the package index with this project's files (pip --dry-run: no CUDA wheels are unpacked)."""
    import re

    text = (ROOT / "deploy" / "Dockerfile").read_text()
    beam_version = re.search(r"ARG BEAM_VERSION=(\S+)", text).group(1)
    line = re.search(r'pip install "\.\[gpu\]" "apache-beam\[gcp\]==\$\{BEAM_VERSION\}"', text)
    assert line, "the Dockerfile no longer installs tokenmill[gpu] and apache-beam[gcp]"
    report = tmp_path / "report.json"
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet", "--report",
         str(report), ".[gpu]", f"apache-beam[gcp]=={beam_version}"],
        cwd=ROOT, capture_output=True, text=True, timeout=1200,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    import json

    got = {i["metadata"]["name"].lower(): i["metadata"]["version"] for i in json.loads(report.read_text())["install"]}
    assert got["vllm"] == "0.32.0" and got["apache-beam"] == beam_version and "tokenmill" in got
    assert "google-cloud-storage" in got or "google-cloud-core" in got  # the gcp extra came with it
