"""The whole pipeline and job lifecycle with a fake engine (the real one: test_e2e_engine.py)."""

import json

import pyarrow.parquet as pq
import pytest

from tests.conftest import write_parquet
from tests.fakes import FakeSession
from tests.helpers import job_spec
from tokenmill.jobs.lifecycle.runner import run_job
from tokenmill.schemas import records as R
from tokenmill.schemas import storage as S
from tokenmill.schemas import tables as T
from tokenmill.schemas.records import OutputRow

ROWS = [
    {"id": "a", "prompt": "What is the capital of France?"},
    {"id": "b", "prompt": "Name a prime number."},
    {"id": "c", "prompt": None},
    {"id": "a", "prompt": "duplicate of a"},
    {"id": "d", "prompt": "Tell me a joke.", "temperature": -1.0},
    {"id": "e", "prompt": "x " * 3000},
]


@pytest.fixture
def inp(tmp_path):
    rows = [dict(r) for r in ROWS]
    for r in rows:
        r.setdefault("temperature", None)
    return write_parquet(tmp_path / "in.parquet", rows)


def test_every_row_ends_in_outputs_or_dead_letters(tmp_path, inp, sqlite_url, model_path):
    res = run_job(job_spec(inp, tmp_path / "out", job_id="job-1", sampling={"max_tokens": 4}),
                  db_url=sqlite_url, session_factory=FakeSession)
    assert (res.total, res.succeeded, res.failed) == (6, 2, 4)
    assert res.status == "partial"
    out = pq.read_table(tmp_path / "out" / "outputs.parquet").to_pylist()
    dead = pq.read_table(tmp_path / "out" / "dead_letters.parquet").to_pylist()
    assert sorted(r["id"] for r in out) == ["a", "b"]
    assert {r["input_ref"] for r in out} == {"0:0", "0:1"}  # the first "a" won
    assert {(d["id"], d["reason"]) for d in dead} == {
        ("c", R.EMPTY_PROMPT), ("a", R.DUPLICATE_ID), ("d", R.BAD_SAMPLING), ("e", R.PROMPT_TOO_LONG),
    }
    assert all(r["prompt_tokens"] > 0 and r["output_tokens"] == 4 for r in out)
    manifest = json.loads((tmp_path / "out" / "_SUCCESS.json").read_text())
    assert manifest["outputs"] == 2 and manifest["dead_letters"] == 4
    eng = S.connect(sqlite_url)
    job = S.JobStore(eng).get("job-1")
    assert job["status"] == "partial" and (job["total"], job["succeeded"], job["failed"]) == (6, 2, 4)
    assert job["metrics"]["failures"]["by_reason"] == {
        R.BAD_SAMPLING: 1, R.DUPLICATE_ID: 1, R.EMPTY_PROMPT: 1, R.PROMPT_TOO_LONG: 1,
    }


def test_rerun_of_a_finished_job_duplicates_nothing(tmp_path, inp, sqlite_url, model_path):
    spec = job_spec(inp, tmp_path / "out", job_id="job-1", sampling={"max_tokens": 4})
    run_job(spec, db_url=sqlite_url, session_factory=FakeSession)
    before = len(FakeSession.instances[-1].added)
    res = run_job(spec, db_url=sqlite_url, session_factory=FakeSession)
    assert res.resumed and (res.succeeded, res.failed) == (2, 4)
    assert len(FakeSession.instances[-1].added) == before  # nothing was sent to the engine again
    assert S.MetricsReader(S.connect(sqlite_url)).counts(spec.derived_job_id())["succeeded"] == 2


def test_resume_answers_only_rows_not_yet_answered(tmp_path, sqlite_url, model_path):
    rows = [{"id": f"r{i}", "prompt": f"question {i}"} for i in range(20)]
    inp = write_parquet(tmp_path / "in.parquet", rows)
    eng = S.connect(sqlite_url)
    # a previous run answered r0..r9 and then died
    S.JobStore(eng).claim("job-r", {"spec": {}, "total": 20})
    S.ResultWriter(eng).insert_rows(OutputRow, [
        OutputRow(job_id="job-r", id=f"r{i}", input_file=0, input_row=i, text="old", prompt_tokens=1, output_tokens=1,
                                    cached_tokens=0).as_dict() for i in range(10)])
    with eng.begin() as c:
        c.execute(T.jobs.update().values(status="running", owner="elsewhere:1", heartbeat_at=None))
    res = run_job(job_spec(inp, tmp_path / "out", job_id="job-r", sampling={"max_tokens": 4}),
                  db_url=sqlite_url, session_factory=FakeSession)
    assert res.resumed and res.succeeded == 20 and res.status == "succeeded"
    sent = FakeSession.instances[-1].added
    assert len(sent) == 10
    out = pq.read_table(tmp_path / "out" / "outputs.parquet").to_pylist()
    assert sorted(r["id"] for r in out) == sorted(f"r{i}" for i in range(20))
    assert sum(r["text"] == "old" for r in out) == 10


def test_second_concurrent_run_of_same_job_refuses(tmp_path, inp, sqlite_url, model_path):
    eng = S.connect(sqlite_url)
    S.JobStore(eng).claim("job-1", {"spec": {}})  # this process holds it, heartbeat fresh
    with pytest.raises(S.JobBusy, match="already running"):
        run_job(job_spec(inp, tmp_path / "out", job_id="job-1", sampling={"max_tokens": 4}),
                db_url=sqlite_url, session_factory=FakeSession)


def test_multiple_files_and_row_groups_keep_stable_refs(tmp_path, sqlite_url, model_path):
    d = tmp_path / "in"
    d.mkdir()
    write_parquet(d / "a.parquet", [{"prompt": f"a{i}"} for i in range(7)], row_group_size=3)
    write_parquet(d / "b.parquet", [{"prompt": f"b{i}"} for i in range(5)], row_group_size=2)
    res = run_job(job_spec(d, tmp_path / "out", job_id="job-1", sampling={"max_tokens": 4}),
                  db_url=sqlite_url, session_factory=FakeSession)
    assert res.succeeded == 12
    ids = sorted(r["id"] for r in pq.read_table(tmp_path / "out" / "outputs.parquet").to_pylist())
    assert ids == sorted([f"row-0-{i}" for i in range(7)] + [f"row-1-{i}" for i in range(5)])


def test_many_units_and_parts_answer_every_row_once_with_duplicates_across_units(tmp_path, sqlite_url, model_path):
    """One file, one row group, cut into many units (small unit_bytes), each unit in parts
    (as for a small job on several workers): duplicates whose first row sits in another
    unit are dead letters, every other row is answered once, by exactly one part."""
    import apache_beam as beam
    from apache_beam.options.pipeline_options import PipelineOptions

    from tokenmill.pipelines.batch import PipelineParts, build_pipeline
    from tokenmill.schemas.config import JobSpec
    from tokenmill.transforms.read import plan_input, plan_units, plan_work

    n = 600
    rows = [{"id": f"r{i}", "prompt": f"Question number {i}: " + "why? " * (40 + i % 13)} for i in range(n)]
    rows += [{"id": "r5", "prompt": "late duplicate of r5"}, {"id": "r599", "prompt": "dup after the first"}]
    inp = write_parquet(tmp_path / "one.parquet", rows, row_group_size=len(rows))
    spec = JobSpec.model_validate(job_spec(inp, tmp_path / "out", job_id="units", sampling={"max_tokens": 2},
                                           batching={"unit_bytes": 1 << 16}, runner={"num_workers": 3}))
    plan = plan_input(str(inp))
    work = plan_work(plan_units(plan, spec.batching.unit_bytes), 3)
    assert len({w.unit.key for w in work}) >= 2 and len(work) >= 6
    eng = S.connect(sqlite_url)
    parts = PipelineParts(job_id="units", run_id="r1", plan=plan, model_name="fake", model_path=model_path,
                          db_url=sqlite_url, session_factory=FakeSession)
    with beam.Pipeline(options=PipelineOptions(["--runner=DirectRunner", "--direct_running_mode=in_memory"])) as p:
        build_pipeline(p, spec, parts)
    assert S.MetricsReader(eng).counts("units") == {"succeeded": n, "failed": 2}
    outs = S.MetricsReader(eng).outputs("units")
    assert sorted(outs) == sorted(f"r{i}" for i in range(n))
    assert S.ResultWriter(eng).settle_done("units", 0, [("r5", 5)]) == (set(), 0)  # the first r5 answered
    assert S.MetricsReader(eng).failure_reasons("units") == {R.DUPLICATE_ID: 2}
    sent = [rid for s in FakeSession.instances for rid in s.added]
    assert len(sent) == n  # no row was generated by two parts
    workers = S.MetricsReader(eng).workers("units")  # the engine-side counters agree with what the engine saw
    assert sum(w["admitted_rows"] for w in workers) == sum(w["generated_rows"] for w in workers) == n
    assert sum(w["generated_tokens"] for w in workers) == 2 * n


def test_every_chunk_step_hands_on_chunks_with_the_chunk_coder_whose_size_estimate_pickles_nothing(
        tmp_path, sqlite_url, model_path, monkeypatch):
    """Beam measures the size of a step's first outputs (and a sample of the rest) with the
    output's coder; a pickling coder pickles the element to measure it, and a chunk is a
    whole unit.  Each chunk step's main output is typed `Chunk`, so Beam picks `ChunkCoder`,
    whose estimate counts the records and pickles nothing."""
    import pickle

    import apache_beam as beam

    from tokenmill.pipelines.batch import PipelineParts, build_pipeline
    from tokenmill.schemas.config import JobSpec
    from tokenmill.schemas.records import Chunk
    from tokenmill.transforms.chunks import NOMINAL_RECORD_BYTES, ChunkCoder
    from tokenmill.transforms.read import plan_input

    inp = write_parquet(tmp_path / "in.parquet", [{"id": f"r{i}", "prompt": f"p{i}"} for i in range(4)])
    spec = JobSpec.model_validate(job_spec(inp, tmp_path / "out", job_id="coder"))
    parts = PipelineParts(job_id="coder", run_id="r1", plan=plan_input(str(inp)), model_name="fake",
                          model_path=model_path, db_url=sqlite_url, session_factory=FakeSession)
    p = beam.Pipeline()
    build_pipeline(p, spec, parts)
    steps = {"ReadUnit", "ClaimRowIds", "ValidateRows", "FirstWins", "ChatTemplateAndCount", "OwnSegment", "DropAnswered"}
    seen: dict[str, object] = {}

    class Visitor(beam.pipeline.PipelineVisitor):
        def visit_transform(self, node):
            label = node.full_label.split("/")
            name = label[1] if len(label) > 1 else ""
            if name in steps and node.outputs:
                seen[name] = node.outputs[None].element_type

    p.visit(Visitor())
    assert seen == {s: Chunk for s in steps}
    assert isinstance(beam.coders.registry.get_coder(Chunk), ChunkCoder)

    chunk = Chunk("u", [{"id": f"r{i}", "prompt": "x" * 1000} for i in range(300)])
    coder = ChunkCoder().get_impl()
    assert ChunkCoder().decode(ChunkCoder().encode(chunk)) == chunk
    monkeypatch.setattr(pickle, "dumps", lambda *a, **k: pytest.fail("the size estimate pickled the chunk"))
    assert coder.estimate_size(chunk) == 300 * NOMINAL_RECORD_BYTES
