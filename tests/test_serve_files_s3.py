"""File expiry on an `s3://` files store, end to end: a real `tokenmill serve` on loopback whose
files store is a bucket on a loopback S3 endpoint (moto's server), driven by the real `openai`
SDK.  An upload past its `expires_after` answers 404 and its object and row are gone; one not
expired is untouched.  (No batch runs here: the engine is never loaded.  The local store, and a
batch's `output_expires_after`: tests/test_serve_responses.py.)"""

from __future__ import annotations

import time
import uuid

import boto3
import openai
import pytest
from sqlalchemy import select, update

from tests.serve_server import Server, jsonl
from tokenmill.schemas import storage as S
from tokenmill.schemas import tables as T

pytestmark = pytest.mark.engine  # the server checks its served model at start-up

AWS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}


@pytest.fixture(scope="module")
def bucket(s3_endpoint):
    client = boto3.client("s3", endpoint_url=s3_endpoint, region_name="us-east-1",
                          aws_access_key_id="testing", aws_secret_access_key="testing")
    name = f"files-{uuid.uuid4().hex[:8]}"
    client.create_bucket(Bucket=name)
    return client, name


@pytest.fixture(scope="module")
def server(tmp_path_factory, s3_endpoint, bucket):
    root = tmp_path_factory.mktemp("serve-s3")
    cfg = {"db": f"sqlite:///{root / 'serve.db'}", "files": f"s3://{bucket[1]}/store", "work": str(root / "runs"),
           "models": {"smollm2-135m": {}}, "sweep_s": 1}
    srv = Server(root, cfg, env={**AWS, "AWS_ENDPOINT_URL_S3": s3_endpoint}).start()
    yield srv
    srv.stop()


def _keys(bucket) -> set[str]:
    client, name = bucket
    return {o["Key"] for o in client.list_objects_v2(Bucket=name).get("Contents", [])}


def test_an_upload_past_its_expires_after_answers_404_and_its_object_and_row_are_gone(server, bucket, tmp_path):
    alice = server.client(server.make_key("alice")["key"])
    path = jsonl(tmp_path / "in.jsonl", [{"custom_id": "a", "method": "POST", "url": "/v1/responses",
                                          "body": {"model": "smollm2-135m", "input": "hi"}}])
    with open(path, "rb") as fh:
        f = alice.files.create(file=fh, purpose="batch", expires_after={"anchor": "created_at", "seconds": 3600})
    with open(path, "rb") as fh:
        kept = alice.files.create(file=fh, purpose="batch")
    assert f.expires_at == f.created_at + 3600 and kept.expires_at == kept.created_at + 30 * 86400
    key = f"store/{f.id}.jsonl"
    assert {key, f"store/{kept.id}.jsonl"} <= _keys(bucket)
    eng = S.connect(server.config["db"])
    with eng.begin() as conn:  # as an hour's wait would leave it
        conn.execute(update(T.api_files).where(T.api_files.c.id == f.id).values(expires_at=time.time() - 1))
    for call in (alice.files.retrieve, alice.files.content, alice.files.delete):
        with pytest.raises(openai.NotFoundError):
            call(f.id)
    deadline, gone = time.time() + 120, False
    while not gone and time.time() < deadline:  # the sweep runs every second here
        with eng.connect() as conn:
            row = conn.execute(select(T.api_files.c.id).where(T.api_files.c.id == f.id)).first()
        gone = row is None and key not in _keys(bucket)
        time.sleep(0.5)
    assert gone, _keys(bucket)
    assert f"store/{kept.id}.jsonl" in _keys(bucket) and alice.files.retrieve(kept.id).id == kept.id
    assert alice.files.content(kept.id).text == path.read_text()
