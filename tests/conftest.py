"""Shared fixtures.  The real engine is loaded at most once per test session per
config (transforms.engines.registry keeps one per process); fakes serve the unit tests."""

from __future__ import annotations

import os
import socket
import uuid
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

def pytest_configure(config):
    config.addinivalue_line("markers", "llamacpp: needs llama.cpp's llama-server (`make llamacpp` builds it)")
    config.addinivalue_line("markers", "cpu_only: asserts what a CPU engine does (KV floor, core binding, the "
                                       "CPU dtype probe); skipped where this machine's engines would run on a GPU")


def pytest_collection_modifyitems(config, items):
    from tokenmill.transforms.engines.device import has_nvidia_gpu

    if not any(item.get_closest_marker("cpu_only") for item in items) or not has_nvidia_gpu():
        return
    skip = pytest.mark.skip(reason="a CPU engine's behaviour; this machine's engines run on its GPU")
    for item in items:
        if item.get_closest_marker("cpu_only"):
            item.add_marker(skip)


#: The bare form, as most users type it (SQLAlchemy 2.1 maps it to psycopg 3).
PG_URL = os.environ.get("TOKENMILL_TEST_PG_URL", "postgresql://postgres@127.0.0.1:5432/test")


@pytest.fixture(scope="session")
def model_path() -> str:
    from tokenmill.schemas.models import ModelNotFound, resolve_model

    try:
        return str(resolve_model("smollm2-135m"))
    except ModelNotFound as err:
        pytest.fail(f"{err} (make test prepares it)")


@pytest.fixture
def sqlite_url(tmp_path) -> str:
    return f"sqlite:///{tmp_path / 'tokenmill.db'}"


def _pg_up() -> bool:
    try:
        with socket.create_connection(("127.0.0.1", 5432), timeout=2):
            return True
    except OSError:
        return False


@pytest.fixture
def pg_url():
    """A fresh PostgreSQL schema per test on the local server (dropped afterwards)."""
    if not _pg_up():
        pytest.fail("PostgreSQL is not answering on 127.0.0.1:5432 (.ci/run starts it)")
    from sqlalchemy import create_engine, text

    schema = f"t_{uuid.uuid4().hex[:10]}"
    admin = create_engine(PG_URL)
    with admin.begin() as conn:
        conn.execute(text(f'CREATE SCHEMA "{schema}"'))
    url = f"{PG_URL}?options=-csearch_path%3D{schema}"
    yield url
    from tokenmill.schemas import db as D

    eng = D._ENGINES.pop(url, None)
    if eng is not None:
        eng.dispose()
    with admin.begin() as conn:
        conn.execute(text(f'DROP SCHEMA "{schema}" CASCADE'))
    admin.dispose()


@pytest.fixture(params=["sqlite", "postgres"])
def any_db_url(request, tmp_path):
    """Run a storage contract test against both backends."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'contract.db'}"
    return request.getfixturevalue("pg_url")


def write_parquet(path: Path, rows: list[dict], **kw) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), path, **kw)
    return path


#: The engine config every real-engine test shares, so one engine serves them all.
#: float32, the reference precision, whatever the CPU: `dtype: auto` picks bfloat16 where
#: it is faster (AMX), and in bfloat16 this 135M model answers "What is the capital of
#: France?" with "L'Étoile, la Marseillaise, ..." and runs past EOS (seen 2026-12-01),
#: a quality loss for `compare` to measure, not something the pipeline tests should see.
TEST_ENGINE = dict(max_num_seqs=32, max_model_len=1024, gpu_memory_utilization=0.3, dtype="float32")


@pytest.fixture(autouse=True)
def _fresh_fake_sessions():
    """Fakes are per test; the real engine stays loaded for the whole session."""
    from tests.fakes import FakeSession
    from tokenmill.transforms.engines import registry

    FakeSession.instances = []
    yield
    registry.shutdown_all(keep_default=True)


@pytest.fixture(scope="module")
def s3_endpoint():
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    yield f"http://{host}:{port}"
    server.stop()


@pytest.fixture
def s3(s3_endpoint, monkeypatch):
    """A boto3 client on the loopback endpoint, the standard AWS env set, and two fresh buckets."""
    import boto3

    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", s3_endpoint)
    client = boto3.client("s3", endpoint_url=s3_endpoint)
    tag = uuid.uuid4().hex[:8]
    buckets = {"in": f"in-{tag}", "out": f"out-{tag}"}
    for b in buckets.values():
        client.create_bucket(Bucket=b)
    client.buckets = buckets
    client.endpoint = s3_endpoint
    return client
