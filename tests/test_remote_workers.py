"""Remote workers: a database they cannot share is refused before any work; each worker
checks what it needs on its own host; a model given as an `s3://` URL is synced once per
host into its models cache, checksummed, so a cluster needs no shared filesystem.

"Another host" is a Dask worker process on loopback whose models cache is its own folder
(TOKENMILL_MODELS): what it finds or misses there is what a machine without the
launcher's filesystem would.  S3 is moto's server on loopback, with a count of the GETs
each object gets.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import uuid
from collections import Counter
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from apache_beam.options.pipeline_options import PipelineOptions

from tests.conftest import TEST_ENGINE, write_parquet
from tests.dask_cluster import start_cluster, stop_process
from tests.helpers import assert_one_line_error, cli, job_spec
from tokenmill.jobs.lifecycle import preflight as P
from tokenmill.schemas import model_sync as M
from tokenmill.schemas import storage as S
from tokenmill.schemas.models import ModelNotFound, resolve_model

ROOT = Path(__file__).resolve().parents[1]
HOST = socket.gethostname()


# --- which databases and runners go together ----------------------------------------------

@pytest.mark.parametrize("url, local", [
    ("sqlite:////home/u/.cache/tokenmill/tokenmill.db", True),
    ("postgresql://tokenmill@127.0.0.1/jobs", True),
    ("postgresql://tokenmill@localhost:5432/jobs", True),
    ("postgresql:///jobs", True),  # libpq's local socket
    ("postgresql://tokenmill:secret@db.internal:5432/jobs", False),
])
def test_a_file_or_localhost_database_is_this_machines_only(url, local, monkeypatch):
    monkeypatch.delenv("PGHOST", raising=False)
    assert (P.file_local_db(url) is not None) is local


@pytest.mark.parametrize("runner, flags, remote", [
    ("DirectRunner", [], False),
    # the suite's portable runner: Beam's embedded job service and a worker pool on localhost
    ("PortableRunner", ["--job_endpoint=embed", "--environment_type=EXTERNAL", "--environment_config=localhost:5000"],
     False),
    ("PortableRunner", ["--job_endpoint=embed", "--environment_type=PROCESS"], False),
    ("PortableRunner", ["--job_endpoint=flink-jobserver:8099", "--environment_type=LOOPBACK"], False),
    ("PortableRunner", ["--job_endpoint=flink-jobserver:8099", "--environment_type=EXTERNAL",
                        "--environment_config=localhost:5000"], True),
    ("PortableRunner", ["--job_endpoint=embed", "--environment_type=EXTERNAL", "--environment_config=10.0.0.7:5000"],
     True),
    ("PortableRunner", ["--job_endpoint=localhost:8099", "--environment_type=DOCKER"], True),
    ("FlinkRunner", [], False),  # an embedded Flink: Beam runs its workers LOOPBACK
    ("FlinkRunner", ["--flink_master=flink-master:8081", "--environment_type=PROCESS"], True),
    ("SparkRunner", ["--spark_master_url=spark://spark-master:7077", "--environment_type=PROCESS"], True),
    ("PrismRunner", [], False),
    ("DataflowRunner", [], True),
])
def test_where_a_runners_workers_run(runner, flags, remote):
    assert (P.remote_workers(runner, PipelineOptions(flags)) is not None) is remote


def test_dask_workers_are_local_only_when_every_worker_host_is_this_machine():
    opts = PipelineOptions(["--dask_client_address=tcp://127.0.0.1:8786"])
    assert P.remote_workers("DaskRunner", opts, {"127.0.0.1"}) is None
    assert P.remote_workers("DaskRunner", opts, {"127.0.0.1", "10.1.2.3"}) == "has workers on 10.1.2.3"
    # without the scheduler's answer (a job submitted to run later) its address decides
    assert P.remote_workers("DaskRunner", PipelineOptions(["--dask_client_address=tcp://gpu-head:8786"])) \
        == "has its scheduler at tcp://gpu-head:8786"


def test_the_refusal_names_the_runner_and_what_to_use_and_hides_a_password():
    with pytest.raises(ValueError) as err:
        P.check_shared_db("postgresql://u:hunter2@localhost/jobs", "DaskRunner",
                          PipelineOptions(["--dask_client_address=tcp://10.0.0.2:8786"]), {"10.0.0.3"})
    msg = str(err.value)
    assert "\n" not in msg and "hunter2" not in msg
    assert "runner DaskRunner has workers on 10.0.0.3" in msg and "PostgreSQL URL" in msg
    P.check_shared_db("postgresql://u@db.internal/jobs", "DaskRunner", PipelineOptions([]), {"10.0.0.3"})


@pytest.fixture
def prompts(tmp_path):
    return write_parquet(tmp_path / "in.parquet", [{"id": f"r{i}", "prompt": f"say {i}"} for i in range(4)])


REMOTE_PORTABLE = ["--runner", "PortableRunner", "--pipeline-option=--job_endpoint=flink-jobserver:8099",
                   "--pipeline-option=--environment_type=DOCKER"]


def test_validate_refuses_sqlite_with_a_remote_runner_in_one_line(prompts, tmp_path, sqlite_url):
    res = cli("validate", "--input", prompts, "--output", tmp_path / "out", "--db", sqlite_url, *REMOTE_PORTABLE)
    assert_one_line_error(res, 1, "is a SQLite file on this machine", "runner PortableRunner",
                          "Docker containers", "PostgreSQL URL")


def test_run_refuses_it_before_any_work(prompts, tmp_path, sqlite_url):
    res = cli("run", "--input", prompts, "--output", tmp_path / "out", "--db", sqlite_url, "--job-id", "refused",
              *REMOTE_PORTABLE)
    assert_one_line_error(res, 1, "runner PortableRunner", "PostgreSQL URL")
    assert S.JobStore(S.connect(sqlite_url)).get("refused") is None  # no job claimed, nothing ran
    assert not (tmp_path / "out").exists()


# --- S3 on loopback, with a count of the GETs --------------------------------------------

class CountingS3:
    """moto's S3 server on loopback (as its ThreadedMotoServer runs it), counting the fetches
    of each `bucket/key` (a GET from its first byte: a large file comes in ranged parts), in
    any process."""

    def __init__(self):
        from moto.moto_server.werkzeug_app import MotoRequestHandler
        from moto.server import DomainDispatcherApplication, create_backend_app
        from werkzeug.serving import make_server

        self.gets: Counter[str] = Counter()
        app = DomainDispatcherApplication(create_backend_app)

        def counting(environ, start_response):
            first = environ.get("HTTP_RANGE", "bytes=0-").startswith("bytes=0-")
            if environ["REQUEST_METHOD"] == "GET" and not environ.get("QUERY_STRING") and first:
                self.gets[environ["PATH_INFO"].lstrip("/")] += 1
            return app(environ, start_response)

        self.server = make_server("127.0.0.1", 0, counting, True, request_handler=MotoRequestHandler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()
        self.endpoint = "http://127.0.0.1:%d" % self.server.server_address[1]


AWS_ENV = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}


@pytest.fixture(scope="module")
def s3_server():
    server = CountingS3()
    yield server
    server.server.shutdown()


@pytest.fixture
def bucket(s3_server, monkeypatch):
    import boto3

    for k, v in AWS_ENV.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", s3_server.endpoint)
    name = f"models-{uuid.uuid4().hex[:8]}"
    client = boto3.client("s3", endpoint_url=s3_server.endpoint)
    client.create_bucket(Bucket=name)
    return name, client


def upload(client, bucket: str, prefix: str, folder: Path) -> str:
    for f in sorted(folder.rglob("*")):
        if f.is_file():
            client.upload_file(str(f), bucket, f"{prefix}/{f.relative_to(folder)}")
    return f"s3://{bucket}/{prefix}"


@pytest.fixture
def small_model(tmp_path):
    d = tmp_path / "src"
    (d / "tok").mkdir(parents=True)
    (d / "config.json").write_text('{"model_type": "llama"}')
    (d / "model.safetensors").write_bytes(os.urandom(3000))
    (d / "tok" / "vocab.json").write_text('{"a": 0}')
    return d


def test_a_sync_fetches_each_object_once_and_then_only_what_changed(bucket, small_model, s3_server, tmp_path,
                                                                  monkeypatch):
    monkeypatch.setenv("TOKENMILL_MODELS", str(tmp_path / "cache"))
    name, client = bucket
    url = upload(client, name, "m/small", small_model)
    folder = M.sync_model(url, client)
    assert folder.name == "small" and (folder / "tok" / "vocab.json").read_text() == '{"a": 0}'
    assert (folder / "model.safetensors").read_bytes() == (small_model / "model.safetensors").read_bytes()
    key = f"{name}/m/small/model.safetensors"
    assert s3_server.gets[key] == 1
    assert resolve_model(url) == folder.resolve()  # already here: nothing fetched
    assert M.sync_model(url, client) == folder and s3_server.gets[key] == 1

    client.put_object(Bucket=name, Key="m/small/tok/vocab.json", Body=b'{"b": 1}')
    M.sync_model(url, client)
    assert (folder / "tok" / "vocab.json").read_text() == '{"b": 1}'
    assert s3_server.gets[key] == 1 and s3_server.gets[f"{name}/m/small/tok/vocab.json"] == 2
    files = json.loads((folder / M.MANIFEST).read_text())["files"]
    assert set(files) == {"config.json", "model.safetensors", "tok/vocab.json"}


def test_a_failed_download_leaves_no_copy_that_looks_complete(bucket, small_model, tmp_path, monkeypatch):
    monkeypatch.setenv("TOKENMILL_MODELS", str(tmp_path / "cache"))
    name, client = bucket
    url = upload(client, name, "m/broken", small_model)
    real = client.download_file

    def fail_on_weights(b, key, dest, *a, **kw):  # the connection drops mid-model
        real(b, key, dest, *a, **kw)
        if key.endswith(".safetensors"):
            raise OSError("connection reset by peer")

    monkeypatch.setattr(client, "download_file", fail_on_weights)
    with pytest.raises(ModelNotFound, match="model.safetensors cannot be fetched: connection reset"):
        M.sync_model(url, client)
    assert not M.is_synced(url) and not M.synced_folder(url).exists()
    assert [p.name for p in M.synced_folder(url).parent.iterdir()] == [".broken.lock"]  # no partial folder left


def _sync_in_a_process(url: str, endpoint: str) -> None:
    import boto3

    M.sync_model(url, boto3.client("s3", endpoint_url=endpoint))


def test_two_processes_on_one_host_sync_once(bucket, small_model, s3_server, tmp_path, monkeypatch):
    import multiprocessing

    monkeypatch.setenv("TOKENMILL_MODELS", str(tmp_path / "cache"))
    name, client = bucket
    url = upload(client, name, "m/shared", small_model)
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_sync_in_a_process, args=(url, s3_server.endpoint)) for _ in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    assert [p.exitcode for p in procs] == [0, 0, 0]
    assert s3_server.gets[f"{name}/m/shared/model.safetensors"] == 1


def test_a_url_without_a_model_is_one_line(bucket, tmp_path, monkeypatch):
    monkeypatch.setenv("TOKENMILL_MODELS", str(tmp_path / "cache"))
    name, client = bucket
    client.put_object(Bucket=name, Key="m/nocfg/weights.bin", Body=b"x")
    with pytest.raises(ModelNotFound, match="has no config.json"):
        M.list_model(f"s3://{name}/m/nocfg", client)
    with pytest.raises(ModelNotFound, match="no objects under that URL"):
        M.list_model(f"s3://{name}/m/none", client)
    with pytest.raises(ModelNotFound, match="cannot be listed"):
        M.list_model("s3://no-such-bucket-here/m", client)


def test_validate_lists_a_model_url_without_fetching_weights(bucket, small_model, s3_server, prompts, tmp_path,
                                                           monkeypatch):
    """`submit`'s preflight (engine=False): the URL is read, the weights stay where they are."""
    monkeypatch.setenv("TOKENMILL_MODELS", str(tmp_path / "cache"))
    name, client = bucket
    url = upload(client, name, "m/listed", small_model)
    spec = job_spec(prompts, tmp_path / "out", engine={"model": url})
    assert P.preflight(spec, engine=False).problems == []
    assert s3_server.gets[f"{name}/m/listed/model.safetensors"] == 0 and not M.is_synced(url)
    bad = job_spec(prompts, tmp_path / "out", engine={"model": f"s3://{name}/m/missing"})
    assert any("no objects under that URL" in p for p in P.preflight(bad, engine=False).problems)


# --- a worker on "another host": its own models cache -------------------------------------

@pytest.fixture(scope="module")
def remote_worker(tmp_path_factory, s3_server):
    """A scheduler and one worker process on loopback whose models cache is empty at first
    (no shared filesystem with the launcher's), with S3 reached as the job's is."""
    from distributed import Client

    logs = tmp_path_factory.mktemp("dask-logs")
    cache = tmp_path_factory.mktemp("worker-models")
    cluster = start_cluster(logs, n_workers=0)
    env = {**os.environ, **AWS_ENV, "AWS_ENDPOINT_URL_S3": s3_server.endpoint, "TOKENMILL_MODELS": str(cache),
           "DASK_DISTRIBUTED__WORKER__DAEMON": "False", "PYTHONUNBUFFERED": "1"}
    with open(logs / "worker-0.log", "w") as log:
        cluster.workers.append(subprocess.Popen(
            [sys.executable, "-m", "tokenmill.jobs.lifecycle.envexec", sys.executable, "-m",
             "distributed.cli.dask_worker", cluster.address, "--name", "remote", "--host", "127.0.0.1",
             "--nworkers", "1", "--nthreads", "1", "--memory-limit", "0", "--no-dashboard", "--no-nanny"],
            cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
    try:
        with Client(cluster.address, timeout=30) as c:
            c.wait_for_workers(1, timeout=120)
    except Exception:
        cluster.stop()
        pytest.fail(f"the dask worker did not start:\n{cluster.tail()}")
    cluster.cache = cache
    yield cluster
    for w in cluster.workers:
        stop_process(w)
    stop_process(cluster.scheduler)


def dask_job(inp, out, job_id, cluster, model, **keys):
    return job_spec(inp, out, job_id=job_id, engine={"model": model, **TEST_ENGINE},
                    sampling={"max_tokens": 4, "temperature": 0.0},
                    runner={"runner": "DaskRunner", "num_workers": 1, "pipeline_options": cluster.options()}, **keys)


def test_a_worker_missing_the_model_fails_in_one_line_naming_its_host(remote_worker, prompts, tmp_path, sqlite_url,
                                                                    model_path):
    """The launcher has `smollm2-135m` prepared; the worker's host has not: the job fails in
    the worker's check, before any engine starts, saying which host lacked what."""
    from tokenmill.jobs.lifecycle.runner import JobError, run_job

    spec = dask_job(prompts, tmp_path / "out", "worker-lacks", remote_worker, "smollm2-135m")
    with pytest.raises(JobError) as err:
        run_job(spec, db_url=sqlite_url)
    msg = str(err.value)
    assert "\n" not in msg
    assert f"worker on host {HOST}: model 'smollm2-135m' is not prepared in {str(remote_worker.cache)!r}" in msg, msg
    assert S.MetricsReader(S.connect(sqlite_url)).workers("worker-lacks") == []  # no engine started anywhere


@pytest.mark.engine
def test_a_model_on_s3_is_synced_once_per_host_and_used(remote_worker, bucket, s3_server, tmp_path, sqlite_url,
                                                        monkeypatch):
    """A real job with `engine.model: s3://…`: the launcher's preflight syncs its own copy (its
    checks and the tokenizer read it), the worker syncs into its host's cache before its
    engine starts, and a second job reuses both copies: every object fetched twice, once per
    host, whatever the number of jobs."""
    from bench.tinymodel import tiny_model
    from tokenmill.jobs.lifecycle.runner import run_job

    name, client = bucket
    url = upload(client, name, "models/tiny", tiny_model())
    monkeypatch.setenv("TOKENMILL_MODELS", str(tmp_path / "launcher-models"))
    objects = [o["Key"] for o in client.list_objects_v2(Bucket=name)["Contents"]]
    inp = write_parquet(tmp_path / "in.parquet", [{"id": f"q{i}", "prompt": f"Count: {i}, {i + 1},"} for i in range(6)])
    for job in ("s3-model-1", "s3-model-2"):
        res = run_job(dask_job(inp, tmp_path / job, job, remote_worker, url), db_url=sqlite_url)
        assert (res.status, res.succeeded) == ("succeeded", 6), res
        rows = pq.read_table(tmp_path / job / "outputs.parquet").to_pylist()
        assert sorted(r["id"] for r in rows) == [f"q{i}" for i in range(6)]
        assert all(r["output_tokens"] == 4 for r in rows)
        assert {k: s3_server.gets[f"{name}/{k}"] for k in objects} == {k: 2 for k in objects}
    worker_copy = next(remote_worker.cache.glob(f"synced/*/tiny/{M.MANIFEST}"))
    assert json.loads(worker_copy.read_text())["url"] == url
    assert M.is_synced(url)  # the launcher's own copy


def _generate_config(model: str, model_path: str):
    from tokenmill.schemas.config import BatchingConfig, SamplingDefaults
    from tokenmill.transforms.batch_runner import GenerateConfig
    from tokenmill.transforms.engines.vllm_config import VllmConfig

    return GenerateConfig(job_id="j", run_id="r", model_name=model, model_path=model_path,
                          engine=VllmConfig(model=model, **TEST_ENGINE), sampling=SamplingDefaults(),
                          batching=BatchingConfig())


def test_a_worker_checks_its_host_once_per_process(tmp_path, model_path):
    """The worker's check (Generate's setup) is the engine's preflight on the worker's host,
    made once per process however many bundles (fresh DoFns) follow."""
    from tokenmill.transforms.generate import WorkerCheckError, check_worker

    lacking = tmp_path / "no-weights"
    lacking.mkdir()
    (lacking / "config.json").write_text("{}")
    with pytest.raises(WorkerCheckError) as err:
        check_worker(_generate_config(str(lacking), str(lacking)))
    assert str(err.value) == f"worker on host {HOST}: model folder {str(lacking)!r} has a config.json but no " \
                             "weights (*.safetensors)"
    copy = tmp_path / "model"
    copy.symlink_to(model_path)
    cfg = _generate_config(str(copy), str(copy))
    assert check_worker(cfg) == str(copy)
    copy.unlink()
    assert check_worker(cfg) == str(copy)  # checked already: no second look at the disk


def test_a_launcher_whose_workers_run_elsewhere_leaves_the_weights_where_they_are(bucket, s3_server, prompts,
                                                                                 tmp_path, monkeypatch):
    """The launcher reads the config and the tokenizer; the workers load the weights, each
    syncing them on its own host."""
    from bench.tinymodel import tiny_model

    name, client = bucket
    url = upload(client, name, "models/tiny", tiny_model())
    monkeypatch.setenv("TOKENMILL_MODELS", str(tmp_path / "launcher-models"))
    spec = job_spec(prompts, tmp_path / "out", engine={"model": url, **TEST_ENGINE},
                    runner={"runner": "PortableRunner",
                            "pipeline_options": ["--job_endpoint=flink-jobserver:8099", "--environment_type=DOCKER"]})
    pf = P.preflight(spec, db_url="postgresql://tokenmill@db.internal/jobs")
    assert pf.problems == []
    assert pf.model_path == str(M.synced_folder(url, weights=False).resolve())
    assert s3_server.gets[f"{name}/models/tiny/model.safetensors"] == 0
    assert s3_server.gets[f"{name}/models/tiny/config.json"] == 1
    assert (Path(pf.model_path) / "tokenizer.json").is_file() and not M.is_synced(url)
