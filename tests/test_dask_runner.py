"""The DaskRunner (jobs/lifecycle/dask_runner.py) against a `dask.distributed` scheduler and
two one-thread worker processes on loopback (tests/dask_cluster.py).

The launcher submits the pipeline to the scheduler; each worker process runs whole
bundles (one work unit per task by default) and holds its own engine.  The DoFns below
are module-level so that the scheduler and the workers, which unpickle the task graph,
import them from this module (they run with this checkout as their working folder)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import apache_beam as beam
import pyarrow.parquet as pq
import pytest
from apache_beam.options.pipeline_options import PipelineOptions
from apache_beam.transforms.window import GlobalWindow
from apache_beam.utils.windowed_value import WindowedValue

from tests.conftest import TEST_ENGINE, write_parquet
from tests.dask_cluster import dask_cluster, free_port, start_cluster  # noqa: F401  (dask_cluster: fixture)
from tests.helpers import assert_one_line_error, cli, job_spec
from tokenmill.jobs.lifecycle import preflight as P
from tokenmill.schemas import storage as S

ROOT = Path(__file__).resolve().parents[1]


def dask_spec(tmp_path, *options):
    inp = write_parquet(tmp_path / "in.parquet", [{"id": "a", "prompt": "hi"}])
    return job_spec(inp, tmp_path / "out", runner={"runner": "DaskRunner", "pipeline_options": list(options)})


# ---------------------------------------------------------------- options and preflight (no cluster)


def test_dask_runner_runs_on_tokenmills_runner_one_work_unit_per_task(tmp_path):
    from tokenmill.jobs.lifecycle.dask_runner import DaskRunner

    opts = P.pipeline_options(dask_spec(tmp_path, "--dask_client_address=tcp://127.0.0.1:8786"))
    got = opts.get_all_options(drop_default=True)
    assert got["runner"] == P.DASK_RUNNER and got["partition_size"] == 1 and got["address"] == "tcp://127.0.0.1:8786"
    assert type(beam.Pipeline(options=opts).runner) is DaskRunner


@pytest.mark.parametrize("flag, key, value", [("--dask_npartitions=4", "npartitions", 4),
                                              ("--dask_partition_size=16", "partition_size", 16)])
def test_the_specs_own_partitioning_wins(tmp_path, flag, key, value):
    got = P.pipeline_options(dask_spec(tmp_path, "--dask_client_address=tcp://h:1", flag)).get_all_options(
        drop_default=True)
    assert got[key] == value
    assert got.get("npartitions" if key == "partition_size" else "partition_size") is None


def test_validate_without_a_scheduler_says_which_option_is_missing(tmp_path):
    inp = write_parquet(tmp_path / "in.parquet", [{"id": "a", "prompt": "hi"}])
    res = cli("validate", "--input", inp, "--output", tmp_path / "out", "--runner", "DaskRunner")
    assert_one_line_error(res, 1, "runner DaskRunner needs a scheduler", "--dask_client_address=tcp://HOST:PORT")


def test_a_refused_scheduler_port_is_one_line_at_once(tmp_path):
    port = free_port()  # nothing listens there
    t0 = time.monotonic()
    problems = P.preflight(dask_spec(tmp_path, f"--dask_client_address=tcp://127.0.0.1:{port}"), engine=False).problems
    assert problems == []  # submit: the job may run on a machine that reaches the scheduler
    problems = P.preflight(dask_spec(tmp_path, f"--dask_client_address=tcp://127.0.0.1:{port}")).problems
    assert problems == [f"dask scheduler tcp://127.0.0.1:{port} cannot be reached: Connection refused"]
    assert time.monotonic() - t0 < P.DASK_CONNECT_TIMEOUT_S  # not dask's connect retries (a bound, not a speed target)


def test_a_missing_scheduler_file_is_one_line(tmp_path):
    problems = P.preflight(dask_spec(tmp_path, f"--dask_scheduler_file={tmp_path / 'nope.json'}")).problems
    assert problems == [f"dask scheduler file {str(tmp_path / 'nope.json')!r} does not exist"]


def test_submit_still_needs_a_scheduler_named(tmp_path):
    assert P.preflight(dask_spec(tmp_path), engine=False).problems[0].startswith("runner DaskRunner needs a scheduler")


# ---------------------------------------------------------------- the cluster: preflight


def test_preflight_accepts_the_cluster_and_refuses_a_scheduler_without_workers(dask_cluster, tmp_path):
    assert P.preflight(dask_spec(tmp_path, *dask_cluster.options()), engine=False).problems == []
    P.check_dask(P.pipeline_options(dask_spec(tmp_path, *dask_cluster.options())))
    bare = start_cluster(tmp_path / "bare-logs", n_workers=0)
    try:
        with pytest.raises(ValueError, match=f"^dask scheduler {bare.address} has no workers$"):
            P.check_dask(P.pipeline_options(dask_spec(tmp_path, *bare.options())))
    finally:
        bare.stop()


def test_preflight_names_the_processes_that_cannot_import_the_pipeline(dask_cluster, tmp_path, monkeypatch):
    # What the scheduler and each worker are asked, pointed at a package nobody has.
    monkeypatch.setattr(P, "_IMPORTS_TOKENMILL", P._IMPORTS_TOKENMILL.replace("tokenmill.transforms", "tokenmill_nope"))
    with pytest.raises(ValueError) as err:
        P.check_dask(P.pipeline_options(dask_spec(tmp_path, *dask_cluster.options())))
    head, _, tail = str(err.value).partition(" cannot import tokenmill ")
    assert head.startswith(f"dask scheduler {dask_cluster.address}: ") and tail
    names = head.split(": ", 1)[1].split(", ")  # the scheduler, then each worker by address
    assert names[0] == "scheduler" and len(names) == 3 and all(n.startswith("tcp://127.0.0.1:") for n in names[1:])


# ---------------------------------------------------------------- the cluster: Beam's model


def _record(folder: str, name: str, value) -> None:
    with open(os.path.join(folder, f"{name}.jsonl"), "a") as fh:
        fh.write(json.dumps({"pid": os.getpid(), "value": value}) + "\n")


def _recorded(folder: Path, name: str) -> list[dict]:
    f = folder / f"{name}.jsonl"
    return [json.loads(line) for line in f.read_text().splitlines()] if f.exists() else []


class Record(beam.DoFn):
    def __init__(self, folder: str, name: str):
        self.folder, self.name = folder, name

    def process(self, x):
        _record(self.folder, self.name, x)
        yield x


class SplitOdd(beam.DoFn):
    def process(self, x):
        yield beam.pvalue.TaggedOutput("odd", x) if x % 2 else x


class BufferToFinish(beam.DoFn):
    """Emits every other element from finish_bundle (as Generate emits a bundle's last batch)."""

    def start_bundle(self):
        self.held = []

    def process(self, x):
        if x % 2:
            self.held.append(x)
        else:
            yield x

    def finish_bundle(self):
        for x in self.held:
            yield WindowedValue(x, 0, (GlobalWindow(),))


class Slow(beam.DoFn):
    def process(self, x):
        time.sleep(0.3)  # long enough that one worker cannot take every task before the other starts
        yield x


def _dask_pipeline(cluster, runner: str | None = None, *flags: str) -> beam.Pipeline:
    return beam.Pipeline(options=PipelineOptions([f"--runner={runner or P.DASK_RUNNER}", *cluster.options(), *flags]))


def test_beam_model_on_the_cluster(dask_cluster, tmp_path):
    """Tagged outputs apart, finish_bundle outputs kept, every sink run, side inputs (AsList,
    AsDict of a GroupByKey branch), Reshuffle, Flatten; one element per task on both workers."""
    out = str(tmp_path)
    p = _dask_pipeline(dask_cluster, None, "--dask_partition_size=1")
    nums = p | "Nums" >> beam.Create(range(8)) | "Spread" >> beam.Reshuffle() | "Slow" >> beam.ParDo(Slow())
    split = nums | "Split" >> beam.ParDo(SplitOdd()).with_outputs("odd", main="even")
    split.even | "Even" >> beam.ParDo(Record(out, "even"))
    split.odd | "Odd" >> beam.ParDo(Record(out, "odd"))
    nums | "Buffer" >> beam.ParDo(BufferToFinish()) | "Finished" >> beam.ParDo(Record(out, "finished"))
    groups = (p | "Pairs" >> beam.Create([("a", 1), ("b", 2), ("a", 3)]) | "Group" >> beam.GroupByKey()
              | "Sort" >> beam.MapTuple(lambda k, vs: (k, sorted(vs))))
    tens = p | "Tens" >> beam.Create([10, 20])
    (nums | "WithSides" >> beam.Map(lambda x, d, lst: (x, sorted(d.items()), sorted(lst)),
                                    beam.pvalue.AsDict(groups), beam.pvalue.AsList(tens))
     | "Sides" >> beam.ParDo(Record(out, "sides")))
    ((split.even, split.odd) | "Both" >> beam.Flatten() | "Flat" >> beam.ParDo(Record(out, "flat")))
    assert p.run().wait_until_finish() == "DONE"

    got = {name: Counter(r["value"] for r in _recorded(tmp_path, name)) for name in ("even", "odd", "finished", "flat")}
    assert got["even"] == Counter([0, 2, 4, 6]) and got["odd"] == Counter([1, 3, 5, 7])
    assert got["finished"] == Counter(range(8)) and got["flat"] == Counter(range(8))
    sides = {r["value"][0]: r["value"][1:] for r in _recorded(tmp_path, "sides")}
    assert sides == {x: [[["a", [1, 3]], ["b", [2]]], [10, 20]] for x in range(8)}
    assert {r["pid"] for r in _recorded(tmp_path, "flat")} == set(dask_cluster.worker_pids().values())


def test_beams_own_dask_runner_still_loses_rows(dask_cluster, tmp_path):
    """Why jobs/lifecycle/dask_runner.py exists: Beam's DaskRunner mixes tagged outputs and
    drops finish_bundle's.  When this fails, Beam has fixed it and ours can go."""
    from apache_beam.runners.dask.dask_runner import DaskRunner as BeamDaskRunner

    out = str(tmp_path)
    p = _dask_pipeline(dask_cluster, f"{BeamDaskRunner.__module__}.DaskRunner")
    split = p | beam.Create(range(4)) | beam.ParDo(SplitOdd()).with_outputs("odd", main="even")
    split.odd | "Buffer" >> beam.ParDo(BufferToFinish()) | "Finished" >> beam.ParDo(Record(out, "finished"))
    result = p.run()
    try:
        assert result.wait_until_finish() == "DONE"
    finally:
        result.client.close()  # Beam's result leaves its client open
    # The odd branch saw the even numbers too (tags mixed); the odd ones it held went nowhere.
    assert sorted(r["value"] for r in _recorded(tmp_path, "finished")) == [0, 2]


class Fail(beam.DoFn):
    def process(self, x):
        if x == 3:
            raise ValueError("row 3 is poison")
        yield x


def test_a_failing_step_fails_the_pipeline_with_its_error(dask_cluster):
    p = _dask_pipeline(dask_cluster, None, "--dask_partition_size=1")
    p | beam.Create(range(6)) | beam.ParDo(Fail())
    result = p.run()
    with pytest.raises(ValueError, match="row 3 is poison"):
        result.wait_until_finish()
    assert result.state == "FAILED"
    assert result.client.status == "closed"


# ---------------------------------------------------------------- the cluster: tokenmill jobs


def test_job_with_a_fake_engine_runs_in_the_worker_processes(dask_cluster, tmp_path, sqlite_url):
    from tests.fakes import FakeSession
    from tokenmill.jobs.lifecycle.runner import run_job

    rows = [{"id": f"r{i}", "prompt": f"question {i}"} for i in range(6)] + [{"id": "bad", "prompt": ""},
                                                                            {"id": "r0", "prompt": "again"}]
    inp = write_parquet(tmp_path / "in.parquet", rows, row_group_size=2)
    spec = job_spec(inp, tmp_path / "out", job_id="dask-fake", sampling={"max_tokens": 3},
                    runner={"runner": "DaskRunner", "num_workers": 2, "pipeline_options": dask_cluster.options()})
    res = run_job(spec, db_url=sqlite_url, session_factory=FakeSession)
    assert (res.status, res.succeeded, res.failed) == ("partial", 6, 2)
    assert FakeSession.instances == []  # no engine session was made in the launcher
    workers = S.MetricsReader(S.connect(sqlite_url)).workers("dask-fake")
    assert workers and {w["pid"] for w in workers} <= set(dask_cluster.worker_pids().values())
    out = pq.read_table(tmp_path / "out" / "outputs.parquet").to_pylist()
    assert sorted(r["id"] for r in out) == [f"r{i}" for i in range(6)]
    dead = pq.read_table(tmp_path / "out" / "dead_letters.parquet").to_pylist()
    assert sorted(r["reason"] for r in dead) == ["duplicate_id", "empty_prompt"]


@pytest.mark.engine
def test_tokenmill_run_on_dask_every_row_once_both_workers(dask_cluster, tmp_path, pg_url, model_path):
    """`tokenmill run --runner DaskRunner` with the real engine: each worker process loads its
    own engine, every row is answered once, and both workers answered rows."""
    n = 16
    inp = write_parquet(tmp_path / "in.parquet",
                        [{"id": f"q{i:02d}", "prompt": f"Count on from {i}: {i}, {i + 1},"} for i in range(n)],
                        row_group_size=2)
    cmd = [
        sys.executable, "-m", "tokenmill.jobs.cli", "run", "--input", str(inp), "--output", str(tmp_path / "out"),
        "--db", pg_url, "--job-id", "dask-real", "--runner", "DaskRunner",
        f"--pipeline-option=--dask_client_address={dask_cluster.address}", "--workers", "2",
        "--max-tokens", "8", "--ignore-eos", "--temperature", "0",
        "--max-num-seqs", str(TEST_ENGINE["max_num_seqs"]), "--max-model-len", str(TEST_ENGINE["max_model_len"]),
        # Two engines on one host: each gets its own, smaller share of RAM for its KV cache.
        "--gpu-memory-utilization", "0.1",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert proc.returncode == 0, f"{proc.stderr[-3000:]}\n{dask_cluster.tail()}"
    assert f"rows in {n} / succeeded {n} / failed 0" in proc.stdout

    rows = pq.read_table(tmp_path / "out" / "outputs.parquet").to_pylist()
    assert sorted(r["id"] for r in rows) == [f"q{i:02d}" for i in range(n)]
    assert all(r["output_tokens"] == 8 for r in rows)
    pids = set(dask_cluster.worker_pids().values())
    workers = S.MetricsReader(S.connect(pg_url)).workers("dask-real")
    assert {w["pid"] for w in workers} == pids  # one row per worker process, each its own engine
    assert all(w["load_s"] and w["load_s"] > 0 for w in workers)
    stored = S.MetricsReader(S.connect(pg_url)).request_rows("dask-real", ("id", "worker"))
    answered_by = Counter(int(r["worker"].rsplit(":", 1)[1]) for r in stored)
    assert set(answered_by) == pids, answered_by
