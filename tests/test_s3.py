"""S3 input and output against a real S3 HTTP endpoint on loopback (moto server).

Reads, writes and exports go through Beam's S3 filesystem (boto3) with the
endpoint from `--s3-endpoint-url` / `AWS_ENDPOINT_URL_S3`; the fake engine
serves, since what is under test is the storage path, not generation.
"""

from __future__ import annotations

import io
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import requests

from tests.fakes import FakeSession
from tests.helpers import assert_one_line_error, cli, job_spec
from tokenmill.jobs.lifecycle.runner import run_job
from tokenmill.schemas import records as R
from tokenmill.schemas import storage as S

pytestmark = pytest.mark.s3
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def put_parquet(client, bucket, key, rows):
    buf = io.BytesIO()
    pq.write_table(pa.Table.from_pylist(rows), buf)
    client.put_object(Bucket=bucket, Key=key, Body=buf.getvalue())


def get_parquet(client, bucket, key):
    return pq.read_table(io.BytesIO(client.get_object(Bucket=bucket, Key=key)["Body"].read())).to_pylist()


def read_export(client, bucket, key):
    """An exported file as a reader finds it at the path tokenmill prints: a folder of parts,
    read whole by pyarrow.dataset over S3 (names starting with `_` or `.` ignored), in part order."""
    import pyarrow.dataset as ds
    from pyarrow import fs

    s3fs = fs.S3FileSystem(endpoint_override=client.endpoint, access_key="testing", secret_key="testing",
                           region="us-east-1", scheme="http")
    return ds.dataset(f"{bucket}/{key}", filesystem=s3fs, format="parquet").to_table().to_pylist()


def export_keys(client, bucket, prefix):
    """The export's objects under `prefix`, each part named by its file (`outputs.parquet/part-*.parquet`)."""
    found = keys(client, bucket, prefix)
    assert all(k.endswith("_SUCCESS.json") or re.fullmatch(r".*/(outputs|dead_letters)\.parquet/part-\d{5}(-[\w-]+)?"
                                                                 r"\.parquet", k) for k in found), found
    return sorted({k[len(prefix):].split("/")[0] for k in found})


def keys(client, bucket, prefix=""):
    return sorted(o["Key"] for o in client.list_objects_v2(Bucket=bucket, Prefix=prefix).get("Contents", []))


def test_job_reads_and_writes_s3(s3, sqlite_url):
    b = s3.buckets
    put_parquet(s3, b["in"], "data/part-0.parquet", [{"id": f"a{i}", "prompt": f"question {i}"} for i in range(4)])
    put_parquet(s3, b["in"], "data/part-1.parquet", [{"id": "b0", "prompt": "one more"}, {"id": "bad", "prompt": ""}])
    spec = job_spec(f"s3://{b['in']}/data/", f"s3://{b['out']}/run1", job_id="s3-job", sampling={"max_tokens": 3})
    res = run_job(spec, db_url=sqlite_url, session_factory=FakeSession)
    assert (res.status, res.total, res.succeeded, res.failed) == ("partial", 6, 5, 1)
    assert res.files["outputs"] == f"s3://{b['out']}/run1/outputs.parquet"
    assert export_keys(s3, b["out"], "run1/") == ["_SUCCESS.json", "dead_letters.parquet", "outputs.parquet"]
    out = read_export(s3, b["out"], "run1/outputs.parquet")
    assert sorted(r["id"] for r in out) == ["a0", "a1", "a2", "a3", "b0"]
    assert {r["input_ref"] for r in out} == {"0:0", "0:1", "0:2", "0:3", "1:0"}
    dead = read_export(s3, b["out"], "run1/dead_letters.parquet")
    assert [(d["id"], d["reason"], d["input_ref"]) for d in dead] == [("bad", R.EMPTY_PROMPT, "1:1")]
    manifest = json.loads(s3.get_object(Bucket=b["out"], Key="run1/_SUCCESS.json")["Body"].read())
    assert (manifest["outputs"], manifest["dead_letters"]) == (5, 1)


def test_a_prefix_of_many_objects_is_planned_in_parallel_and_every_row_read_once(s3, sqlite_url):
    """An S3 prefix of many objects (footers read 16 at a time, one unit per object): three
    full rounds of the planner's 16 reads and a part round.  (300 objects took 170 s in a
    whole-suite run on 2 cores, about half a second a unit against the loopback S3, and
    proved no more.)"""
    from concurrent.futures import ThreadPoolExecutor

    b = s3.buckets
    n = 53
    with ThreadPoolExecutor(16) as pool:
        list(pool.map(lambda i: put_parquet(s3, b["in"], f"many/part-{i:04d}.parquet",
                                            [{"id": f"o{i}-{j}", "prompt": f"q {i} {j}"} for j in range(2)]), range(n)))
    spec = job_spec(f"s3://{b['in']}/many/", f"s3://{b['out']}/many", job_id="s3-many", sampling={"max_tokens": 2})
    res = run_job(spec, db_url=sqlite_url, session_factory=FakeSession)
    assert (res.status, res.total, res.succeeded, res.failed) == ("succeeded", 2 * n, 2 * n, 0)
    out = read_export(s3, b["out"], "many/outputs.parquet")
    assert sorted(r["id"] for r in out) == sorted(f"o{i}-{j}" for i in range(n) for j in range(2))
    assert [r["input_ref"] for r in out][:3] == ["0:0", "0:1", "1:0"]  # exported in input order


def cli_error(args, sqlite_url, endpoint):
    return assert_one_line_error(cli("run", *args, "--db", sqlite_url, "--s3-endpoint-url", endpoint), 1, alone=True)


def test_missing_input_bucket_is_one_clear_line(s3, sqlite_url, monkeypatch):
    monkeypatch.delenv("AWS_ENDPOINT_URL_S3")  # the flag alone carries the endpoint
    line = cli_error(["--input", "s3://no-such-bucket-x/p.parquet", "--output", f"s3://{s3.buckets['out']}/o"],
                     sqlite_url, s3.endpoint)
    assert line == "error: input 's3://no-such-bucket-x/p.parquet': bucket 'no-such-bucket-x' does not exist"


def test_missing_input_key_is_one_clear_line(s3, sqlite_url):
    url = f"s3://{s3.buckets['in']}/nothing/here.parquet"
    line = cli_error(["--input", url, "--output", f"s3://{s3.buckets['out']}/o"], sqlite_url, s3.endpoint)
    assert line == f"error: input '{url}' matched no *.parquet files"


def test_missing_output_bucket_fails_before_any_work(s3, sqlite_url):
    put_parquet(s3, s3.buckets["in"], "p.parquet", [{"id": "a", "prompt": "hi"}])
    FakeSession.instances.clear()
    spec = job_spec(f"s3://{s3.buckets['in']}/p.parquet", "s3://no-such-out-bucket/o", job_id="s3-noout")
    from tokenmill.jobs.lifecycle.runner import JobError

    with pytest.raises(JobError) as err:
        run_job(spec, db_url=sqlite_url, session_factory=FakeSession)
    assert str(err.value) == "output 's3://no-such-out-bucket/o': bucket 'no-such-out-bucket' does not exist"
    assert FakeSession.instances == [] and S.JobStore(S.connect(sqlite_url)).get("s3-noout") is None


def test_bad_credentials_are_one_clear_line(s3, sqlite_url):
    put_parquet(s3, s3.buckets["in"], "p.parquet", [{"id": "a", "prompt": "hi"}])
    # From now on the server checks every request's signature against its IAM users (it has none).
    requests.post(f"{s3.endpoint}/moto-api/reset-auth", data=b"0").raise_for_status()
    try:
        url = f"s3://{s3.buckets['in']}/p.parquet"
        line = cli_error(["--input", url, "--output", f"s3://{s3.buckets['out']}/o"], sqlite_url, s3.endpoint)
    finally:
        requests.post(f"{s3.endpoint}/moto-api/reset-auth", data=b"inf").raise_for_status()
    assert line == (f"error: input '{url}': access to bucket '{s3.buckets['in']}' denied (HTTP 403); "
                    "check the AWS credentials")
    assert "testing" not in line


DRIVER = textwrap.dedent("""
    import sys, time
    from tests.fakes import FakeSession
    from tokenmill.jobs.lifecycle.runner import run_job
    from tokenmill.schemas.config import load_spec

    class Slow(FakeSession):
        def step(self):
            time.sleep(0.05)
            return super().step()

    spec = load_spec({"input": sys.argv[1], "output": sys.argv[2], "job_id": "s3-kill",
                      "engine": {"max_num_seqs": 4}, "sampling": {"max_tokens": 4},
                      "batching": {"token_budget": 64, "ordering": "none"}})
    run_job(spec, db_url=sys.argv[3], session_factory=Slow)
""")


def test_kill_mid_run_then_resume_on_s3(s3, sqlite_url, tmp_path):
    n = 120
    b = s3.buckets
    put_parquet(s3, b["in"], "big.parquet", [{"id": f"r{i:03d}", "prompt": f"question {i}"} for i in range(n)])
    inp, out = f"s3://{b['in']}/big.parquet", f"s3://{b['out']}/killed"
    driver = tmp_path / "driver.py"
    driver.write_text(DRIVER)
    env = dict(os.environ, PYTHONPATH=REPO)
    proc = subprocess.Popen([sys.executable, str(driver), inp, out, sqlite_url], cwd=REPO, env=env,
                            start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    eng = S.connect(sqlite_url)
    end = time.monotonic() + 300  # a bound against a hung test, not a speed assertion
    while time.monotonic() < end and proc.poll() is None:
        if S.JobStore(eng).get("s3-kill") and S.MetricsReader(eng).counts("s3-kill")["succeeded"] >= 12:
            break
        time.sleep(0.1)
    assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    done = S.MetricsReader(eng).counts("s3-kill")["succeeded"]
    assert 12 <= done < n
    assert keys(s3, b["out"], "killed/") == []  # nothing presented as a finished export
    FakeSession.instances.clear()
    spec = job_spec(inp, out, job_id="s3-kill", sampling={"max_tokens": 4})
    res = run_job(spec, db_url=sqlite_url, session_factory=FakeSession)
    assert res.resumed and (res.status, res.succeeded, res.failed) == ("succeeded", n, 0)
    assert len(FakeSession.instances[-1].added) == n - done  # only the rest was sent to the engine
    rows = read_export(s3, b["out"], "killed/outputs.parquet")
    assert sorted(r["id"] for r in rows) == [f"r{i:03d}" for i in range(n)]
    assert export_keys(s3, b["out"], "killed/") == ["_SUCCESS.json", "dead_letters.parquet", "outputs.parquet"]


def test_an_s3_job_fetches_its_used_columns_once_counted_at_the_server(tmp_path, sqlite_url):
    """Many row groups and a wide column the job does not use: what the S3 server sends is
    the used columns' chunks once and the footer twice (the plan's, the worker's), each
    GET a bounded range (Beam's reader would ask for the rest of the object every time)."""
    from bench.s3_server import CountingS3

    n = 3000
    rows = [{"id": f"r{i}", "prompt": f"q{i} " * (i % 5 + 1), "document": f"doc {i} " * 40} for i in range(n)]
    path = tmp_path / "in.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=250)
    meta = pq.ParquetFile(path).metadata
    used = sum(meta.row_group(g).column(c).total_compressed_size for g in range(meta.num_row_groups)
               for c in range(meta.num_columns) if meta.row_group(g).column(c).path_in_schema != "document")
    footer = meta.serialized_size + 8
    with CountingS3() as s3:
        url = s3.put_file("counted", "in.parquet", path)
        with s3.env():
            res = run_job(job_spec(url, tmp_path / "out", job_id="s3-cols", sampling={"max_tokens": 2}),
                          db_url=sqlite_url, session_factory=FakeSession)
        got = s3.take()
    assert (res.status, res.succeeded) == ("succeeded", n)
    assert used <= got["bytes_sent"] <= used + 2 * footer, (got["bytes_sent"], used, footer, path.stat().st_size)
    assert got["bytes_sent"] < 0.5 * path.stat().st_size
    assert all(r and r.startswith("bytes=") and not r.endswith("-") for r in got["ranges"]), got["ranges"]


def test_the_serve_files_store_on_s3_keeps_each_file_under_its_id(s3, tmp_path):
    from tokenmill.jobs.serve.blobs import BlobError, blob_store

    store = blob_store(f"s3://{s3.buckets['out']}/serve/files")
    src = tmp_path / "in.jsonl"
    src.write_bytes(b'{"custom_id": "a"}\n')
    fid = "file-" + "d" * 24
    store.put_file(fid, str(src))
    assert keys(s3, s3.buckets["out"], "serve/") == [f"serve/files/{fid}.jsonl"]
    assert store.url(fid) == f"s3://{s3.buckets['out']}/serve/files/{fid}.jsonl"
    assert store.open(fid).read() == src.read_bytes()
    path, temp = store.local_copy(fid)
    assert temp and open(path, "rb").read() == src.read_bytes()
    store.delete(fid)
    assert keys(s3, s3.buckets["out"], "serve/") == []
    with pytest.raises(BlobError):
        store.url("file-../../other-bucket/x")
