"""`tokenmill serve` against a hostile key, without an engine: another key's id is an unknown
one in a list's cursor, deleting a file races creating a batch over it with one winner, no
error names a server path, values a column cannot hold and out-of-range sampling are refused
as 400s or in `validating` with the line named, and the files store, the job folders and the
SQLite database are their owner's alone."""

from __future__ import annotations

import json
import stat
import threading
import time
from pathlib import Path

import pytest

from tokenmill.jobs.serve.config import ServeConfig
from tokenmill.jobs.serve.errors import ApiError
from tokenmill.schemas import storage as S

SECRETS = {"key_a": "tm-secret-aaaa", "key_b": "tm-secret-bbbb"}


def _line(cid: str, **body) -> bytes:
    return json.dumps({"custom_id": cid, "method": "POST", "url": "/v1/chat/completions",
                       "body": {"model": "m", "messages": [{"role": "user", "content": "hi"}], **body}}).encode()


def _service(tmp_path: Path, db: str, **limits):
    from tokenmill.jobs.serve.service import BatchService

    cfg = ServeConfig(db=db, files=str(tmp_path / "files"), work=str(tmp_path / "runs"), models={"m": {}},
                      limits={"max_batches_in_flight": 1000, **limits})
    return BatchService(cfg)


def _upload(svc, tmp_path: Path, owner: str, *lines: bytes) -> str:
    src = tmp_path / f"in-{time.monotonic_ns()}.jsonl"
    src.write_bytes(b"\n".join(lines or (_line("a"),)) + b"\n")
    return svc.add_file(owner, src.name, "batch", str(src), src.stat().st_size, len(lines) or 1)["id"]


@pytest.fixture(params=["sqlite", "postgres"])
def db(request, tmp_path):
    return f"sqlite:///{tmp_path / 's.db'}" if request.param == "sqlite" else request.getfixturevalue("pg_url")


def test_after_with_another_keys_id_answers_exactly_as_an_unknown_id(tmp_path, db):
    from fastapi.testclient import TestClient

    from tokenmill.jobs.serve.app import create_app

    svc = _service(tmp_path, db)
    for key, secret in SECRETS.items():
        S.KeyStore(svc.eng).add(key, key, secret)
    made: dict[str, list[tuple[str, str]]] = {"files": [], "batches": []}
    for owner in ("key_a", "key_b", "key_a", "key_b", "key_a"):  # interleaved in time
        fid = _upload(svc, tmp_path, owner)
        made["files"].append((owner, fid))
        made["batches"].append((owner, svc.create_batch(owner, fid, "/v1/chat/completions", "24h", None)["id"]))
        time.sleep(0.002)
    client = TestClient(create_app(svc.cfg, svc))  # no `with`: the scheduler does not start
    auth = {"Authorization": f"Bearer {SECRETS['key_a']}"}
    for route, ids in made.items():
        theirs = [i for owner, i in ids if owner == "key_b"]
        unknown = client.get(f"/v1/{route}", params={"after": "file-" + "0" * 24}, headers=auth)
        assert unknown.status_code == 200 and unknown.json()["data"] == []
        for other in theirs:
            got = client.get(f"/v1/{route}", params={"after": other}, headers=auth)
            assert (got.status_code, got.json()) == (unknown.status_code, unknown.json()), route
        own = [i for owner, i in ids if owner == "key_a"]  # a key's own cursor still pages
        assert [d["id"] for d in client.get(f"/v1/{route}", params={"after": own[-1]}, headers=auth).json()["data"]
                ] == own[-2::-1]


def test_deleting_a_file_while_a_batch_is_created_over_it_never_both_succeed(tmp_path, pg_url):
    svc = _service(tmp_path, pg_url)
    outcomes = []
    for i in range(50):
        fid = _upload(svc, tmp_path, "key_a")
        start = threading.Barrier(2)
        done: dict[str, object] = {}

        def delete(fid=fid, start=start, done=done):
            start.wait()
            try:
                svc.delete_file("key_a", fid)
                done["delete"] = True
            except ApiError as err:
                done["delete"] = err.status

        def create(fid=fid, start=start, done=done):
            start.wait()
            try:
                done["create"] = svc.create_batch("key_a", fid, "/v1/chat/completions", "24h", None)["id"]
            except ApiError as err:
                done["create"] = err.status

        threads = [threading.Thread(target=delete), threading.Thread(target=create)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        made = isinstance(done["create"], str)
        assert not (done["delete"] is True and made), f"try {i}: the file was deleted under batch {done['create']}"
        assert done["delete"] in (True, 409) and (made or done["create"] == 404), done
        if made:  # the batch that won reads a file that is there
            assert svc.files.get(fid, "key_a") is not None and svc.blobs.path(fid).exists()
        outcomes.append("create" if made else "delete")
    assert len(outcomes) == 50


def test_a_batch_whose_input_file_is_gone_fails_without_naming_a_server_path(tmp_path, sqlite_url):
    svc = _service(tmp_path, sqlite_url)
    fid = _upload(svc, tmp_path, "key_a")
    b = svc.create_batch("key_a", fid, "/v1/chat/completions", "24h", None)
    svc.blobs.path(fid).unlink()  # its bytes lost under the server (a disk, an operator)
    assert svc.results.validate(svc.batches.get(b["id"])) is None
    (err,) = svc.batches.get(b["id"])["errors"]
    assert err["code"] == "file_unreadable" and fid in err["message"]
    assert str(tmp_path) not in json.dumps(err) and "/" not in err["message"], err


@pytest.mark.parametrize("window,meta,param", [
    ("0" * 20 + "1h", None, "completion_window"),
    ("24h\x00", None, "completion_window"),
    ("24h", {"priority": "9" * 30}, "metadata.priority"),
    ("24h", {"priority": str(2**31)}, "metadata.priority"),
])
def test_a_value_its_column_cannot_hold_is_a_400_naming_it(tmp_path, db, window, meta, param):
    svc = _service(tmp_path, db)
    fid = _upload(svc, tmp_path, "key_a")
    with pytest.raises(ApiError) as err:
        svc.create_batch("key_a", fid, "/v1/chat/completions", window, meta)
    assert (err.value.status, err.value.param) == (400, param)
    assert svc.batches.page("key_a") == []


def test_an_uploaded_files_name_is_cut_to_its_column_and_loses_nul(tmp_path, pg_url):
    svc = _service(tmp_path, pg_url)
    src = tmp_path / "in.jsonl"
    src.write_bytes(_line("a") + b"\n")
    row = svc.add_file("key_a", "x\x00" * 600, "batch", str(src), src.stat().st_size, 1)
    assert svc.files.get(row["id"], "key_a")["filename"] == "x" * 512


@pytest.mark.parametrize("body,param", [
    ({"n": 0}, "body.n"),
    ({"n": 65}, "body.n"),
    ({"temperature": 2.5}, "body.temperature"),
    ({"temperature": -0.1}, "body.temperature"),
    ({"top_p": 1.5}, "body.top_p"),
    ({"max_tokens": 0}, "body.max_tokens"),
    ({"max_completion_tokens": -4}, "body.max_tokens"),
    ({"top_logprobs": 21, "logprobs": True}, "body.top_logprobs"),
    ({"seed": 2**64}, "body.seed"),
    ({"temperature": "1"}, "body.temperature"),
])
def test_out_of_range_sampling_fails_in_validating_with_the_line_named(tmp_path, sqlite_url, body, param):
    from tokenmill.jobs.serve.validate import check_lines

    got = check_lines([_line("ok", temperature=2.0, n=2, top_p=1.0), _line("bad", **body)], {"m": "m"}, max_lines=10)
    (err,) = got.errors
    assert (err["line"], err["param"], err["code"]) == (2, param, "invalid_value")
    assert err["message"].startswith("line 2: ") and param.split(".")[1].replace("max_tokens", "max") in err["message"]
    svc = _service(tmp_path, sqlite_url)  # and through the service: the batch fails in validating
    fid = _upload(svc, tmp_path, "key_a", _line("bad", **body))
    b = svc.create_batch("key_a", fid, "/v1/chat/completions", "24h", None)
    assert svc.results.validate(svc.batches.get(b["id"])) is None
    row = svc.batches.get(b["id"])
    assert row["failed_at"] and row["in_progress_at"] is None and row["errors"][0]["line"] == 1


def _mode(p: Path) -> int:
    return stat.S_IMODE(p.stat().st_mode)


def test_files_outputs_job_folders_and_the_database_are_the_owners_alone(tmp_path):
    from tokenmill.schemas import db as D

    url = f"sqlite:///{tmp_path / 'data' / 's.db'}"
    svc = _service(tmp_path, url)
    fid = _upload(svc, tmp_path, "key_a")
    assert _mode(tmp_path / "data" / "s.db") == 0o600 and _mode(tmp_path / "data") == 0o700
    assert _mode(tmp_path / "files") == 0o700 and _mode(tmp_path / "runs") == 0o700
    assert _mode(svc.blobs.path(fid)) == 0o600
    b = svc.create_batch("key_a", fid, "/v1/chat/completions", "24h", None)
    svc.results.validate(svc.batches.get(b["id"]))  # stores the line index beside the file
    indexes = [p for p in (tmp_path / "files").iterdir() if p.name != svc.blobs.path(fid).name]
    assert indexes and all(_mode(p) == 0o600 for p in indexes)
    with svc.blobs.writer("file-" + "1" * 24) as fh:  # a result file written from the job's rows
        fh.write(b"{}\n")
    exported = tmp_path / "export.jsonl"  # a job's own export, moved into the store
    exported.write_bytes(b"{}\n")
    exported.chmod(0o644)
    svc.blobs.move_file("file-" + "2" * 24, str(exported))
    for f in ("1", "2"):
        assert _mode(svc.blobs.path("file-" + f * 24)) == 0o600
    D._ENGINES.pop(url).dispose()


def test_a_cancel_that_loses_to_finalizing_is_refused_and_leaves_no_cancelling_mark(tmp_path, sqlite_url):
    svc = _service(tmp_path, sqlite_url)
    b = svc.create_batch("key_a", _upload(svc, tmp_path, "key_a"), "/v1/chat/completions", "24h", None)
    read = svc.batches.get

    def read_then_finalize(batch_id, owner=None):  # the scheduler finalizes between cancel's read and its write
        row = read(batch_id, owner)
        svc.batches.set(batch_id, unless="finalizing_at", finalizing_at=time.time())
        return row

    svc.batches.get = read_then_finalize  # type: ignore[method-assign]
    with pytest.raises(ApiError) as err:
        svc.cancel_batch("key_a", b["id"])
    assert (err.value.status, err.value.code) == (409, "batch_not_cancellable")
    assert read(b["id"])["cancelling_at"] is None
