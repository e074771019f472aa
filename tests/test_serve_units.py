"""The service's pieces without a server or an engine: the batch file check, the status of a
batch from its timestamps, the objects against the `openai` package's types, the config,
the files store's ids, the storage of keys, files and batches on both backends."""

from __future__ import annotations

import json
import time

import pytest

from tests.helpers import RecordingEngine
from tokenmill.jobs.serve.blobs import BlobError, LocalBlobs
from tokenmill.jobs.serve.config import ServeConfig, load_config, window_seconds
from tokenmill.jobs.serve.finalize import derived_file_id
from tokenmill.jobs.serve.objects import batch_object, batch_status, file_object, page
from tokenmill.jobs.serve.service import ApiError, priority_of
from tokenmill.jobs.serve.validate import check_lines
from tokenmill.schemas import storage as S
from tokenmill.schemas.config import SpecError


def _line(cid, model="m", url="/v1/chat/completions", **extra):
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}]}
    return json.dumps({"custom_id": cid, "method": "POST", "url": url, "body": body, **extra}).encode()


def test_a_clean_file_passes_with_its_one_model_and_request_count():
    got = check_lines([_line("a"), b"\n", _line("b", url="/v1/completions").replace(b'"messages": [{"role": '
                                                                                     b'"user", "content": "hi"}]',
                                                                                     b'"prompt": "x"')],
                      {"m": "m"}, max_lines=10)
    assert (got.lines, got.model, got.errors) == (2, "m", [])


@pytest.mark.parametrize("lines,code,line", [
    ([b"{", _line("a")], "invalid_json_line", 1),
    ([b"[1]"], "invalid_json_line", 1),
    ([_line("a", method="GET")], "invalid_method", 1),
    ([_line("a"), _line("b", url="/v1/files")], "invalid_url", 2),
    ([_line("a"), b"", _line("a")], "duplicate_custom_id", 3),
    ([_line("a", model="other")], "model_not_found", 1),
    ([_line("a"), _line("b", model="n")], "mismatched_model", 2),
    ([_line("a", body=None).replace(b'"body": null', b'"body": {"model": "m", "messages": "no"}')],
     "invalid_request", 1),
    ([b"", b"  "], "empty_file", None),
    ([_line(f"x{i}") for i in range(4)], "too_many_requests", 4),
])
def test_each_bad_line_is_named_with_its_code_and_line(lines, code, line):
    got = check_lines(lines, {"m": "m", "n": "n"}, max_lines=3)
    assert (got.errors[0]["code"], got.errors[0]["line"]) == (code, line), got.errors
    assert got.errors[0]["message"]


def test_errors_are_listed_up_to_the_limit_and_all_counted():
    got = check_lines([b"{"] * 7, {"m": "m"}, max_lines=100, max_errors=3)
    assert len(got.errors) == 3 and got.error_count == 7 and [e["line"] for e in got.errors] == [1, 2, 3]


SERVED = {"m": "m", "m-sql": "m", "m-poem": "m", "n": "n", "n-sql": "n"}  # ServeConfig.served_names' shape


def test_lines_naming_a_served_model_and_its_adapters_mix_and_the_batch_runs_on_the_base_model():
    got = check_lines([_line("a", model="m-sql"), _line("b"), _line("c", model="m-poem")], SERVED, max_lines=10)
    assert (got.lines, got.model, got.errors) == (3, "m", [])
    got = check_lines([_line("a", model="n-sql")], SERVED, max_lines=10)
    assert (got.model, got.errors) == ("n", [])


@pytest.mark.parametrize("models,says", [
    (["m-sql", "n-sql"], "line 2: model 'n-sql' (an adapter of 'n'), but line 1 names 'm-sql' (an adapter of 'm')"),
    (["m", "m-sql", "n"], "line 3: model 'n', but line 1 names 'm'"),
    (["m-poem", "n"], "line 2: model 'n', but line 1 names 'm-poem' (an adapter of 'm')"),
], ids=["adapters-of-two-models", "a-model-and-another", "an-adapter-and-another-model"])
def test_lines_of_two_served_models_adapters_or_an_adapter_and_another_model_are_mismatched(models, says):
    got = check_lines([_line(f"c{i}", model=m) for i, m in enumerate(models)], SERVED, max_lines=10)
    assert [(e["code"], e["line"], e["param"]) for e in got.errors] == [("mismatched_model", len(models),
                                                                         "body.model")]
    assert got.errors[0]["message"].startswith(says), got.errors[0]["message"]


def test_an_unknown_model_lists_the_served_names_with_their_adapters_in_bounded_length():
    got = check_lines([_line("a", model="m-typo")], SERVED, max_lines=10)
    assert got.errors[0]["code"] == "model_not_found"
    assert got.errors[0]["message"] == ("line 1: model 'm-typo' is not served here (served: m (adapters: m-sql, "
                                        "m-poem), n (adapters: n-sql))")
    many = {"m": "m", **{f"adapter-{i:03d}": "m" for i in range(200)}}
    msg = check_lines([_line("a", model="x")], many, max_lines=10).errors[0]["message"]
    assert len(msg) < 420 and msg.endswith("… (201 names in all))") and "m (adapters: adapter-000" in msg


def test_a_served_model_answers_to_its_name_and_its_adapters_and_no_name_may_mean_two_things(tmp_path):
    cfg = ServeConfig(models={"a": {"engine": {"lora_adapters": {"a-sql": "/x/sql", "a-poem": "/x/poem"}}},
                              "b": {}})
    assert cfg.names("a") == ("a", "a-sql", "a-poem") and cfg.names("b") == ("b",)
    assert cfg.served_names() == {"a": "a", "a-sql": "a", "a-poem": "a", "b": "b"}
    for models, says in (
            ({"a": {"engine": {"lora_adapters": {"b": "/x"}}}, "b": {}},
             "the name 'b' is both an adapter of served model 'a' and served model 'b'"),
            ({"b": {}, "a": {"engine": {"lora_adapters": {"b": "/x"}}}},
             "the name 'b' is both served model 'b' and an adapter of served model 'a'"),
            ({"a": {"engine": {"lora_adapters": {"s": "/x"}}}, "b": {"engine": {"lora_adapters": {"s": "/y"}}}},
             "the name 's' is both an adapter of served model 'a' and an adapter of served model 'b'"),
            ({"a": {"engine": {"lora_adapters": {"a": "/x"}}}},
             "the name 'a' is both served model 'a' and an adapter of served model 'a'")):
        p = tmp_path / "c.yaml"
        p.write_text(json.dumps({"models": models}))
        with pytest.raises(SpecError) as err:
            load_config(str(p))
        assert says in str(err.value) and "\n" not in str(err.value).strip(), str(err.value)


def _batch(**kw):
    now = 1_796_000_000.0
    row = {"id": "batch_x", "endpoint": "/v1/chat/completions", "input_file_id": "file-" + "a" * 24,
           "completion_window": "24h", "created_at": now, "expires_at": now + 86400, "lines": 4, "metadata": None}
    row.update(kw)
    return row


@pytest.mark.parametrize("times,status", [
    ({}, "validating"), ({"in_progress_at": 1.0}, "in_progress"),
    ({"in_progress_at": 1.0, "cancelling_at": 2.0}, "cancelling"),
    ({"cancelling_at": 2.0, "finalizing_at": 3.0}, "finalizing"),
    ({"in_progress_at": 1.0, "finalizing_at": 3.0, "completed_at": 4.0}, "completed"),
    ({"cancelling_at": 2.0, "cancelled_at": 4.0}, "cancelled"), ({"expired_at": 5.0}, "expired"),
    ({"failed_at": 1.0}, "failed"),
])
def test_a_batchs_status_is_read_from_its_timestamps(times, status):
    assert batch_status(_batch(**times)) == status
    obj = batch_object(_batch(**times), {"completed": 1, "failed": 1})
    assert obj["status"] == status and obj["object"] == "batch"
    assert obj["request_counts"] == {"total": 4, "completed": 1, "failed": 1}


def test_objects_are_openais_types_field_for_field():
    from openai.types import Batch, FileObject

    f = file_object({"id": "file-" + "b" * 24, "bytes": 10, "created_at": 5.5, "filename": "x.jsonl",
                     "purpose": "batch"})
    assert set(f) == set(FileObject.model_fields) and f["status"] == "processed"
    b = batch_object(_batch(errors=[{"code": "c", "message": "m", "param": None, "line": 2}], failed_at=9.0))
    assert set(b) == set(Batch.model_fields) and b["errors"]["data"][0]["line"] == 2
    from pydantic import ValidationError

    with pytest.raises(ValidationError):
        batch_object(_batch(endpoint=None))  # the SDK's type refuses what a client would choke on
    listing = page([_batch(id="b1"), _batch(id="b2")], batch_object, True)
    assert (listing["first_id"], listing["last_id"], listing["has_more"]) == ("b1", "b2", True)


def test_windows_priorities_and_derived_file_ids():
    assert [window_seconds(w) for w in ("24h", "90m", "30s", "2d", "24", "h", "-1h")] == [
        86400, 5400, 30, 172800, None, None, None]
    assert priority_of({"priority": "7"}) == 7 and priority_of(None) == 0
    with pytest.raises(ApiError):
        priority_of({"priority": "high"})
    assert derived_file_id("batch_1", "output") == derived_file_id("batch_1", "output") != derived_file_id(
        "batch_1", "error")


def test_the_config_refuses_what_would_fail_at_the_first_batch(tmp_path):
    cfg = ServeConfig()
    assert list(cfg.models) == ["smollm2-135m"] and cfg.limits.max_file_lines == 50_000
    assert (cfg.lease_s, cfg.drain_s) == (30.0, 30.0)
    for bad, says in (({"models": {}}, "names no model"), ({"models": {"a": {"engine": {"model": "b"}}}},
                                                             "name it the same"),
                      ({"models": {"a": {"input": "x"}}}, "not served model keys"),
                      ({"models": {"a": {"sampling": {"temperature": -1}}}}, "temperature"),
                      ({"port": 70000}, "port"), ({"lease_s": 0.2}, "lease_s"), ({"drain_s": -1}, "drain_s")):
        p = tmp_path / "c.yaml"
        p.write_text(json.dumps(bad))
        with pytest.raises(SpecError) as err:
            load_config(str(p))
        assert says in str(err.value) and "\n" not in str(err.value).strip(), str(err.value)


def test_the_files_store_takes_only_its_own_ids(tmp_path):
    store = LocalBlobs(str(tmp_path / "files"))
    src = tmp_path / "x"
    src.write_bytes(b"data\n")
    fid = "file-" + "c" * 24
    store.put_file(fid, str(src))
    with store.open(fid) as fh:
        assert fh.read() == b"data\n"
    for bad in ("../x", "file-../../etc/passwd", "/etc/passwd", "file-" + "C" * 24, fid + "/.."):
        with pytest.raises(BlobError):
            store.path(bad)


@pytest.mark.parametrize("backend", ["sqlite", "postgres"])
def test_keys_files_and_batches_are_each_owners_own(backend, request, tmp_path):
    url = f"sqlite:///{tmp_path / 's.db'}" if backend == "sqlite" else request.getfixturevalue("pg_url")
    eng = S.connect(url)
    keys = S.KeyStore(eng)
    a = keys.add("key_a", "alice", "tm-secret-a")
    assert keys.by_secret("tm-secret-a")["id"] == "key_a" and keys.by_secret("tm-secret-b") is None
    assert "tm-secret-a" not in json.dumps(keys.all(), default=str) and a["prefix"] == "tm-secret-"
    assert keys.revoke("key_a") == 1 and keys.by_secret("tm-secret-a") is None and keys.revoke("key_a") == 0
    files = S.FileStore(eng)
    for i, owner in enumerate(["a", "a", "b"]):
        files.add({"id": f"file-{i}", "owner": owner, "filename": "f", "purpose": "batch", "bytes": 1, "lines": 1,
                   "created_at": 100.0 + i, "deleted_at": None})
    assert [f["id"] for f in files.page("a")] == ["file-1", "file-0"]  # newest first
    assert [f["id"] for f in files.page("a", after="file-1")] == ["file-0"]
    assert [f["id"] for f in files.page(None, newest_first=False)] == ["file-0", "file-1", "file-2"]
    assert files.get("file-2", "a") is None and files.get("file-2", None)["owner"] == "b"
    assert files.delete("file-2", "a") is False and files.delete("file-2", "b") is True
    assert files.get("file-2", "b") is None
    batches = S.BatchStore(eng)
    now = time.time()
    for i, owner in enumerate(["a", "b"]):
        batches.add({"id": f"batch_{i}", "owner": owner, "endpoint": "/v1/chat/completions",
                     "input_file_id": "file-0", "completion_window": "24h", "created_at": now + i,
                     "expires_at": now + 100})
    assert batches.get("batch_1", "a") is None and batches.in_flight("a") == 1
    assert batches.set("batch_0", unless="completed_at", completed_at=now) is True
    assert batches.set("batch_0", unless="completed_at", completed_at=now + 1) is False  # written once
    assert batches.in_flight("a") == 0 and [b["id"] for b in batches.unfinished()] == ["batch_1"]


def _service(tmp_path):
    from tokenmill.jobs.serve.service import BatchService

    cfg = ServeConfig(db=f"sqlite:///{tmp_path / 's.db'}", files=str(tmp_path / "files"), work=str(tmp_path / "runs"),
                      models={"m": {}})
    svc = BatchService(cfg)
    engine = RecordingEngine()
    svc.scheduler.engines["m"] = engine  # type: ignore[assignment]
    svc.scheduler._engine = lambda model: engine  # type: ignore[method-assign]
    src = tmp_path / "in.jsonl"
    src.write_bytes(_line("a") + b"\n" + _line("b") + b"\n")
    f = svc.add_file("k", "in.jsonl", "batch", str(src), src.stat().st_size, 2)
    return svc, engine, f["id"]


def test_one_models_queued_batches_run_one_at_a_time_by_priority_then_age(tmp_path):
    svc, engine, fid = _service(tmp_path)
    made = [svc.create_batch("k", fid, "/v1/chat/completions", "24h", meta)["id"]
            for meta in (None, {"priority": "5"}, None, {"priority": "-1"})]
    svc.scheduler.tick()  # validates all four (in_progress) and hands the first to the engine
    assert [b["status"] for b in map(batch_object, map(svc.batches.get, made))] == ["in_progress"] * 4
    order = []
    for _ in made:
        assert engine.running is not None
        order.append(engine.running)
        svc.scheduler.tick()  # nothing else starts while the model's engine is busy
        assert [s[0] for s in engine.submitted] == order
        engine.running = None
        S.JobStore(svc.eng).finish(order[-1], status="cancelled")  # its job's row: how its run ended
        svc.scheduler.tick()
    assert order == [made[1], made[0], made[2], made[3]]
    assert engine.submitted[0][1:] == (made[1], "openai-jsonl")  # the batch's job has its id


def test_a_batch_whose_validation_raises_is_tried_again_then_failed_never_left_validating(tmp_path, caplog):
    from tokenmill.jobs.serve.scheduler import MAX_ATTEMPTS

    svc, engine, fid = _service(tmp_path)
    real, calls = svc.blobs.local_copy, []

    def flaky(file_id):  # the store fails once: the next tick checks the file and the batch runs
        calls.append(file_id)
        if len(calls) == 1:
            raise RuntimeError("store did not answer")
        return real(file_id)

    svc.blobs.local_copy = flaky  # type: ignore[method-assign]
    a = svc.create_batch("k", fid, "/v1/chat/completions", "24h", None)["id"]
    svc.scheduler.tick()
    assert batch_status(svc.batches.get(a)) == "validating" and engine.running is None
    svc.scheduler.tick()
    assert batch_status(svc.batches.get(a)) == "in_progress" and engine.running == a

    def broken(file_id):
        raise RuntimeError("unhashable type: 'dict'")

    svc.blobs.local_copy = broken  # type: ignore[method-assign]
    b = svc.create_batch("k", fid, "/v1/chat/completions", "24h", None)["id"]
    for _ in range(MAX_ATTEMPTS):
        svc.scheduler.tick()
    row = svc.batches.get(b)
    assert batch_status(row) == "failed" and row["output_file_id"] is None
    assert [(e["code"], e["line"]) for e in row["errors"]] == [("validation_failed", None)]
    assert "unhashable type" in row["errors"][0]["message"] and f"({MAX_ATTEMPTS} tries)" in row["errors"][0]["message"]
    assert [s[0] for s in engine.submitted] == [a]  # the failed one never ran


def test_a_batch_handed_to_an_engine_process_that_just_died_stays_queued_for_the_next_one(tmp_path):
    import multiprocessing as mp

    from tokenmill.jobs.serve.engines import EngineProcess

    parent, child = mp.Pipe()
    child.close()  # the process is gone: its end of the pipe with it
    dead = EngineProcess("m", 60.0, str(tmp_path / "e.log"), lambda model, msg: None, conn=parent)
    assert dead.launch("batch_x", {}, "sqlite://") is False and dead.running is None
    svc, engine, fid = _service(tmp_path)
    engine.gone = 1
    a = svc.create_batch("k", fid, "/v1/chat/completions", "24h", None)["id"]
    svc.scheduler.tick()
    assert engine.running is None and engine.submitted == [] and batch_status(svc.batches.get(a)) == "in_progress"
    svc.scheduler.tick()  # the next process takes it
    assert engine.running == a and [s[0] for s in engine.submitted] == [a]


def test_a_queued_batch_cancelled_or_expired_ends_with_every_line_an_error_and_never_runs(tmp_path):
    svc, engine, fid = _service(tmp_path)
    engine.running = "busy-elsewhere"
    a = svc.create_batch("k", fid, "/v1/chat/completions", "24h", None)["id"]
    b = svc.create_batch("k", fid, "/v1/chat/completions", "1s", None)["id"]
    svc.scheduler.tick()
    assert svc.cancel_batch("k", a)["cancelling_at"]
    time.sleep(1.1)
    svc.scheduler.tick()
    for batch_id, status, code in ((a, "cancelled", "batch_cancelled"), (b, "expired", "batch_expired")):
        row = svc.batches.get(batch_id)
        assert batch_status(row) == status and row["output_file_id"] is None
        assert row["request_counts"] == {"total": 2, "completed": 0, "failed": 2}
        with svc.blobs.open(row["error_file_id"]) as fh:
            errs = [json.loads(x) for x in fh.read().splitlines()]
        assert [(e["custom_id"], e["error"]["code"]) for e in errs] == [("a", code), ("b", code)]
    assert engine.submitted == []
    with pytest.raises(ApiError) as err:
        svc.cancel_batch("k", a)
    assert err.value.status == 409


def test_batches_of_two_models_run_side_by_side_up_to_concurrent_models(tmp_path):
    from tokenmill.jobs.serve.service import BatchService

    src = tmp_path / "in.jsonl"
    for limit, started in ((2, 2), (1, 1)):
        cfg = ServeConfig(db=f"sqlite:///{tmp_path / f's{limit}.db'}", files=str(tmp_path / "files"),
                          work=str(tmp_path / "runs"), models={"m": {}, "n": {}}, concurrent_models=limit)
        svc = BatchService(cfg)
        engines = {"m": RecordingEngine(), "n": RecordingEngine()}
        sched = svc.scheduler
        sched._engine = lambda model, sched=sched, engines=engines: sched.engines.setdefault(model, engines[model])  # type: ignore
        for model in ("m", "n"):
            src.write_bytes(_line("a", model=model) + b"\n")
            f = svc.add_file("k", "in.jsonl", "batch", str(src), src.stat().st_size, 1)
            svc.create_batch("k", f["id"], "/v1/chat/completions", "24h", None)
        svc.scheduler.tick()
        assert sum(1 for e in engines.values() if e.submitted) == started


def test_an_engine_process_unloads_its_engine_when_idle_and_answers_each_batch(monkeypatch, tmp_path):
    import os
    import threading
    from multiprocessing import Pipe

    from tokenmill.jobs.lifecycle import runner
    from tokenmill.jobs.lifecycle.launchers import EngineLoaded, Launched
    from tokenmill.jobs.serve.engines import Launch, engine_main
    from tokenmill.transforms.engines import registry

    held: list[str] = []

    class Done:
        status, note = "succeeded", None

    def run_job(spec, db_url, **kw):
        if spec.job_id == "held-elsewhere":
            raise S.JobBusy("job 'held-elsewhere' is running (owner host:1)")
        held.append(spec.job_id)  # the engine is loaded by the job
        return Done()

    monkeypatch.setattr(runner, "run_job", run_job)
    monkeypatch.setattr(registry, "sessions", lambda: list(held))
    monkeypatch.setattr(registry, "shutdown_all", lambda **kw: held.clear())
    ours, theirs = Pipe()
    t = threading.Thread(target=engine_main, args=("m", theirs, os.getppid(), 0.5, str(tmp_path / "e.log")),
                         daemon=True)
    t.start()
    spec = ServeConfig(models={"m": {}}).job_spec("m", input="x.jsonl", output=str(tmp_path / "o"), job_id="b1")
    ours.send(Launch("b1", spec.model_dump(mode="json", exclude_none=True), "sqlite://"))
    assert ours.recv() == Launched("b1", "succeeded", None)
    assert ours.recv() == EngineLoaded("m", True) and held == ["b1"]
    assert ours.poll(5) and ours.recv() == EngineLoaded("m", False) and held == []  # idle 0.5 s: unloaded
    busy = ServeConfig(models={"m": {}}).job_spec("m", input="x.jsonl", output=str(tmp_path / "o"),
                                                  job_id="held-elsewhere")
    ours.send(Launch("held-elsewhere", busy.model_dump(mode="json", exclude_none=True), "sqlite://"))
    got = ours.recv()  # not an error: the scheduler runs it again later
    assert (got.job_id, got.status, got.raised) == ("held-elsewhere", "busy", False)
    ours.send(None)
    t.join(5)
    assert not t.is_alive()
