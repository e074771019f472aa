"""Files that expire, without an engine: an upload's `expires_after` as the `openai` SDK sends
it (OpenAI's bounds, 30 days by default) and the scheduler's sweep of expired files (the
service in this process, on SQLite and PostgreSQL).  End to end with the SDK:
tests/test_serve_responses.py (a local files store) and tests/test_serve_files_s3.py (S3)."""

from __future__ import annotations

import json
import time

import pytest
from sqlalchemy import select, update

from tokenmill.jobs.serve.errors import ApiError
from tokenmill.jobs.serve.requests import BATCH_FILE_TTL_S, upload_expiry
from tokenmill.schemas import tables as T
from tokenmill.schemas.wire.openai.request import RESPONSES

MODEL = "smollm2-135m"


def _line(cid: str) -> bytes:
    return json.dumps({"custom_id": cid, "method": "POST", "url": RESPONSES,
                       "body": {"model": MODEL, "input": "Hello"}}).encode()


@pytest.mark.parametrize("anchor,seconds,param", [
    ("created_at", "3599", "expires_after.seconds"), ("created_at", "2592001", "expires_after.seconds"),
    ("created_at", "1e4", "expires_after.seconds"), ("created_at", None, "expires_after.seconds"),
    ("last_active_at", "3600", "expires_after.anchor"), (None, "3600", "expires_after.anchor"),
])
def test_an_uploads_expires_after_out_of_openais_bounds_is_a_400_naming_the_field(anchor, seconds, param):
    with pytest.raises(ApiError) as err:
        upload_expiry(anchor, seconds)
    assert (err.value.status, err.value.param) == (400, param)


def test_an_upload_without_expires_after_is_kept_30_days():
    assert upload_expiry(None, None) == BATCH_FILE_TTL_S == 30 * 86400
    assert upload_expiry("created_at", "3600") == 3600 and upload_expiry("created_at", "2592000") == 2592000


def test_the_sweep_removes_expired_files_but_not_the_input_of_a_batch_not_ended(tmp_path, any_db_url):
    from tokenmill.jobs.serve.config import ServeConfig
    from tokenmill.jobs.serve.service import BatchService

    cfg = ServeConfig(db=any_db_url, files=str(tmp_path / "files"), work=str(tmp_path / "runs"), models={MODEL: {}})
    svc = BatchService(cfg)
    src = tmp_path / "in.jsonl"
    src.write_bytes(_line("a") + b"\n")
    gone, kept, held = (svc.add_file("k", "in.jsonl", "batch", str(src), src.stat().st_size, 1, ttl_s=3600)
                        for _ in range(3))
    batch = svc.create_batch("k", held["id"], RESPONSES, "24h", None)  # validating: not ended, its input is held
    later = time.time() + 7200
    with svc.eng.begin() as conn:
        conn.execute(update(T.api_files).where(T.api_files.c.id == kept["id"]).values(expires_at=later + 3600))
    assert svc.files.get(gone["id"], "k") is not None
    assert svc.scheduler.sweep(later) == 1
    assert not svc.blobs.path(gone["id"]).exists() and svc.blobs.path(kept["id"]).exists()
    assert svc.blobs.path(held["id"]).exists()
    with svc.eng.connect() as conn:
        ids = set(conn.execute(select(T.api_files.c.id)).scalars())
    assert gone["id"] not in ids and {kept["id"], held["id"]} <= ids
    assert svc.scheduler.sweep(later) == 0  # the held input stays while its batch has not ended
    svc.batches.set(batch["id"], failed_at=time.time())
    assert svc.scheduler.sweep(later) == 1 and not svc.blobs.path(held["id"]).exists()
    assert svc.files.get(held["id"], None) is None and not svc.files.known(held["id"])
