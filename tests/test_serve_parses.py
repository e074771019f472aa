"""A served batch's input file is parsed twice, no more: once by validation (which stores the
file's per-line index) and once by the pipeline, whose passes (one per engine task a file
mixing chat and embedding lines names) each parse their own lines only; planning, the export
and finalization read the index.  The service runs here in this process, its job too (the fake
engine), so every parse goes through the wire format's one `decode` and is counted."""

from __future__ import annotations

import builtins
import io
import json
from typing import Any

import pytest

from tests.fakes import FakeSession
from tokenmill.jobs.serve.config import ServeConfig
from tokenmill.schemas.wire.openai import request as wire_request
from tokenmill.schemas.wire.openai.objects import batch_status

MODEL = "smollm2-135m"


class _CountingJson:
    """The `json` module, counting `loads` calls."""

    def __init__(self) -> None:
        self.loads_calls = 0

    def loads(self, s: Any, *a: Any, **kw: Any) -> Any:
        self.loads_calls += 1
        return json.loads(s, *a, **kw)

    def __getattr__(self, name: str) -> Any:
        return getattr(json, name)


class _InProcessEngine:
    """An engine process that runs the batch's job right here, with the fake engine session."""

    running = None

    def __init__(self, svc) -> None:
        self.svc = svc

    def alive(self) -> bool:
        return True

    def stop(self, timeout: float | None = None) -> None:
        pass

    def launch(self, batch_id: str, spec: dict[str, Any], db_url: str) -> None:
        """Run the job here through the in-process launcher's path; its job row then says how it
        ended, as the scheduler reads it."""
        from tokenmill.jobs.lifecycle.launchers.inprocess import run_here
        from tokenmill.schemas.config import JobSpec

        self.svc.scheduler.on_engine(MODEL, run_here(JobSpec.model_validate(spec), db_url=db_url, session_factory=FakeSession))


def _line(i: int, kind: str) -> dict[str, Any]:
    if kind == "embedding":
        return {"custom_id": f"q{i}", "method": "POST", "url": "/v1/embeddings",
                "body": {"model": MODEL, "input": f"text {i}"}}
    return {"custom_id": f"q{i}", "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": MODEL, "messages": [{"role": "user", "content": f"hi {i}"}]}}


@pytest.mark.parametrize("kinds,passes", [(("chat",), 1), (("chat", "embedding"), 2)], ids=["chat", "chat+embedding"])
def test_a_served_batchs_input_is_parsed_twice_validation_and_the_pipeline(tmp_path, monkeypatch, kinds, passes):
    """Each line parsed twice, whatever the kinds of request a file mixes; the file opened by
    validation and by each of the job's passes (a mixed file's lines run one pass per engine
    task, and each pass parses its own lines only)."""
    from tokenmill.jobs.serve.service import BatchService

    cfg = ServeConfig(db=f"sqlite:///{tmp_path / 's.db'}", files=str(tmp_path / "files"), work=str(tmp_path / "runs"),
                      models={MODEL: {"sampling": {"max_tokens": 3}}})
    svc = BatchService(cfg)
    engine = _InProcessEngine(svc)
    svc.scheduler._engine = lambda model: engine  # type: ignore[method-assign]
    n = 6
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps(_line(i, kinds[i % len(kinds)])) + ("\n\n" if i == 2 else "\n")
                           for i in range(n)))
    f = svc.add_file("k", "in.jsonl", "batch", str(src), src.stat().st_size, n)
    stored = str(svc.blobs.path(f["id"]))

    counting = _CountingJson()
    monkeypatch.setattr(wire_request, "json", counting)
    opens: list[str] = []
    real_open = builtins.open

    def counting_open(file, *a, **kw):
        if str(file) == stored:
            opens.append(str(file))
        return real_open(file, *a, **kw)

    monkeypatch.setattr(builtins, "open", counting_open)
    monkeypatch.setattr(io, "open", counting_open)

    b = svc.create_batch("k", f["id"], "/v1/chat/completions", "24h", None)["id"]
    svc.scheduler.tick()  # validates (the first parse) and runs the job (the pipeline's: the second)
    svc.scheduler.tick()  # finalizes: the result files into the store
    row = svc.batches.get(b)
    assert batch_status(row) == "completed" and row["request_counts"] == {"total": n, "completed": n, "failed": 0}
    with svc.blobs.open(row["output_file_id"]) as fh:
        outs = [json.loads(x) for x in fh.read().splitlines()]
    assert sorted(o["custom_id"] for o in outs) == [f"q{i}" for i in range(n)]
    assert {o["response"]["body"]["object"] for o in outs} == {{"chat": "chat.completion", "embedding": "list"}[k]
                                                                for k in kinds}
    assert counting.loads_calls == 2 * n, f"{counting.loads_calls} line parses for {n} lines: want validation's and " \
                                          "the pipeline's only"
    assert len(opens) == 1 + passes, opens


def test_both_files_stores_keep_an_inputs_index_beside_it_and_take_files_written_straight_in(tmp_path, request):
    from tokenmill.jobs.serve.blobs import blob_store
    from tokenmill.jobs.serve.finalize import derived_file_id
    from tokenmill.schemas.wire.lines import LineIndex

    for root in (str(tmp_path / "files"), None):
        if root is None:
            s3 = request.getfixturevalue("s3")
            root = f"s3://{s3.buckets['out']}/store"
        blobs = blob_store(root)
        fid = derived_file_id("batch_x", "input")
        src = tmp_path / "in.jsonl"
        src.write_bytes(b'{"a": 1}\n\n')
        blobs.put_file(fid, str(src))
        assert blobs.read_index(fid) is None
        idx = LineIndex()
        idx.add(0, 9, "a", "/v1/completions", "m")
        idx.add(9, 1)
        blobs.put_index(fid, idx.to_bytes())
        got = LineIndex.from_bytes(blobs.read_index(fid) or b"", size=10)
        assert got == idx and got.request_ids() == ["a"] and got.requests == 1
        assert LineIndex.from_bytes(idx.to_bytes(), size=11) is None  # the index of other bytes is refused
        out = derived_file_id("batch_x", "output")
        with blobs.writer(out) as fh:
            fh.write(b"line\n")
        with blobs.open(out) as fh:
            assert fh.read() == b"line\n"
        blobs.delete(fid)
        assert blobs.read_index(fid) is None, root
