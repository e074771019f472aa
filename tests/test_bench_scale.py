"""The scale benchmark's parts that need no engine: telling a run's processes
apart (real processes with vLLM-style titles), following a killed worker's
orphaned child, the seeded input with its planted bad rows, and the accounting
that must catch a lost or doubled row."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from bench import scale as SC
from bench.procs import ProcessSampler, classify

SDK = "/venv/bin/python -m apache_beam.runners.worker.sdk_worker_main"


def test_classify_names_beam_and_vllm_processes():
    assert classify(["python", "-m", "tokenmill.jobs.cli", "run"], is_root=True) == "launcher"
    assert classify(["/bin/sh", "-c", SDK]) == "sdk_shell"
    assert classify(SDK.split()) == "sdk_worker"
    assert classify(["VLLM::EngineCore"]) == "engine_core"
    assert classify(["VLLM::Worker_TP0"]) == "engine_worker"
    assert classify(["VLLM::DPCoordinator"]) == "vllm:DPCoordinator"
    spawned = ["python", "-B", "-c", "from multiprocessing.spawn import spawn_main; spawn_main()"]
    assert classify(spawned, parent_kind="engine_core") == "engine_worker"
    assert classify(spawned) == "other"
    assert classify(["python", "-B", "-c", "from multiprocessing.resource_tracker import main;main(3)"]) == "resource_tracker"


def test_classify_names_a_dask_clusters_processes():
    py = "/venv/bin/python"
    assert classify([py, "-m", "distributed.cli.dask_scheduler", "--host", "127.0.0.1"]) == "dask_scheduler"
    assert classify([py, "-m", "distributed.cli.dask_worker", "tcp://127.0.0.1:1", "--nanny"]) == "dask_nanny"
    spawned = [py, "-c", "from multiprocessing.spawn import spawn_main; spawn_main(tracker_fd=5)", "--multiprocessing-fork"]
    assert classify(spawned, parent_kind="dask_nanny") == "dask_worker"  # the process that runs the tasks, before
    assert classify(["dask worker [tcp://127.0.0.1:2]", "", ""]) == "dask_worker"  # and after dask titles it
    assert classify(["dask scheduler [tcp://127.0.0.1:1]", "", ""]) == "dask_scheduler"
    assert SC.RUNNERS["dask"].worker_kind == "dask_worker" and SC.RUNNERS["dask"].cluster is not None


#: a stand-in for an SDK worker: titles a forked child like vLLM titles its engine core
#: (the child keeps the worker's command line until then), prints the child's pid, waits
_WORKER = """
import os, sys, time, setproctitle
pid = os.fork()
if pid == 0:
    time.sleep(1.0)
    setproctitle.setproctitle("VLLM::EngineCore")
    time.sleep(60)
    os._exit(0)
print(pid, flush=True)
time.sleep(60)
"""


def test_sampler_follows_a_forked_engine_core_and_keeps_it_after_its_parent_is_killed():
    launcher = subprocess.Popen([sys.executable, "-c", "import subprocess, sys, time; "
                                 f"p = subprocess.Popen([sys.executable, '-c', {_WORKER!r}, 'apache_beam.runners.worker.sdk_worker_main'], "
                                 "stdout=sys.stdout); time.sleep(60)"], stdout=subprocess.PIPE, text=True)
    core_pid = int(launcher.stdout.readline())
    sampler = ProcessSampler(launcher.pid, every_s=0.1)
    sampler.start()
    try:
        deadline = time.monotonic() + 20  # bounds a hung test; not a speed assertion
        while time.monotonic() < deadline and not sampler.alive("engine_core"):
            time.sleep(0.1)
        (label, pid), = sampler.alive("engine_core")
        assert (label, pid) == ("engine_core-1", core_pid)
        (worker_label, worker_pid), = sampler.alive("sdk_worker")
        assert worker_label == "sdk_worker-1"  # the engine core is not counted as a second worker
        os.kill(worker_pid, signal.SIGKILL)
        time.sleep(1.0)
        assert sampler.alive("engine_core") == [("engine_core-1", core_pid)]
    finally:
        sampler.stop()
        for pid in (core_pid, launcher.pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        launcher.wait()
    procs = {p["label"]: p for p in sampler.processes()}
    assert procs["launcher"]["parent"] is None and procs["sdk_worker-1"]["parent"] == "launcher"
    assert procs["engine_core-1"]["parent"] == "sdk_worker-1" and "orphaned_at_s" in procs["engine_core-1"]
    assert "orphaned_at_s" not in procs["sdk_worker-1"]
    assert procs["engine_core-1"]["peak_rss_mib"] > 0


def test_input_plants_bad_rows_and_duplicate_ids_across_files(tmp_path, monkeypatch):
    monkeypatch.setattr(SC, "ROW_GROUP_MAX", 100)
    meta = SC.make_input(1000, root=tmp_path)
    files = sorted((tmp_path / "input-1000-7").glob("*.parquet"))
    assert len(files) == SC.FILES
    groups = [pq.ParquetFile(f).metadata.row_group(i).num_rows for f in files for i in range(pq.ParquetFile(f).metadata.num_row_groups)]
    assert len(groups) > SC.FILES and max(groups) <= 100 and max(groups) - min(groups) <= 2  # equal units
    t = pa.concat_tables([pq.read_table(f) for f in files]).to_pylist()
    assert len(t) == 1000 and "max_tokens" not in t[0]
    nulls = sum(r["messages"] is None for r in t)
    dups = len(t) - len({r["id"] for r in t})
    assert meta["planted"] == {"empty_prompt": nulls, "duplicate_id": dups} and nulls == 10 and dups == 2
    systems = {m["content"] for r in t if r["messages"] for m in r["messages"] if m["role"] == "system"}
    assert len(systems) == 4  # the bundled sample's shared system prompts
    assert SC.make_input(1000, root=tmp_path) == json.loads((tmp_path / "input-1000-7" / "INPUT.json").read_text())


def _inmemory_input(rows, folder, seed=SC.SAMPLE_SEED):
    """make_input as it was before it streamed (all rows in one list): the reference the
    streamed files must equal, row for row and row group for row group."""
    from bench.datasets import sample_chat_rows

    per_file = -(-rows // SC.FILES)
    group = -(-per_file // -(-per_file // SC.ROW_GROUP_MAX))
    data = sample_chat_rows(rows, seed=seed)
    bad = dups = 0
    for i, r in enumerate(data):
        r.pop("max_tokens")
        r["id"] = f"r{i:07d}"
        if i % SC.BAD_EVERY == SC.BAD_EVERY - 1:
            r["messages"] = None
            bad += 1
        elif i % SC.DUP_EVERY == SC.DUP_EVERY // 2 and i:
            r["id"] = data[i - 1]["id"]
            dups += 1
    folder.mkdir(parents=True)
    schema = pa.schema([("id", pa.string()), ("messages", pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())])))])
    for k in range(SC.FILES):
        part = data[k * per_file:(k + 1) * per_file]
        pq.write_table(pa.Table.from_pylist(part, schema=schema), folder / f"part-{k:03d}.parquet", row_group_size=group)
    return {"empty_prompt": bad, "duplicate_id": dups}


def _groups(path):
    md = pq.ParquetFile(path).metadata
    return [md.row_group(i).num_rows for i in range(md.num_row_groups)]


@pytest.mark.parametrize("rows, group_max, bad_every, dup_every", [
    (5000, 300, SC.BAD_EVERY, SC.DUP_EVERY),  # 4 files of 5 row groups of 250, 50 bad rows, 10 duplicates
    (4999, 300, 7, 11),  # a short last file and last row groups, dense planted rows
    (5, 2, 3, 4),  # files of 2, 2, 1 and no rows
])
def test_streamed_input_equals_the_in_memory_input_file_for_file(tmp_path, monkeypatch, rows, group_max, bad_every, dup_every):
    monkeypatch.setattr(SC, "ROW_GROUP_MAX", group_max)
    monkeypatch.setattr(SC, "BAD_EVERY", bad_every)
    monkeypatch.setattr(SC, "DUP_EVERY", dup_every)
    planted = _inmemory_input(rows, tmp_path / "old")

    import bench.datasets as DS
    drawn, written, behind = [0], [0], []

    def counted(n, seed):
        for r in real_iter(n, seed=seed):
            drawn[0] += 1
            yield r

    def write(self, table, row_group_size=None):
        behind.append(drawn[0] - written[0])  # rows drawn from the generator and not yet written
        written[0] += table.num_rows
        return real_write(self, table, row_group_size=row_group_size)

    real_iter, real_write = DS.iter_chat_rows, pq.ParquetWriter.write_table
    monkeypatch.setattr(DS, "iter_chat_rows", counted)
    monkeypatch.setattr(pq.ParquetWriter, "write_table", write)
    monkeypatch.setattr(DS, "sample_chat_rows", lambda *a, **k: pytest.fail("make_input built the whole list"))
    meta = SC.make_input(rows, root=tmp_path / "new")

    new = tmp_path / "new" / f"input-{rows}-7"
    old_files = sorted(p.name for p in (tmp_path / "old").glob("*.parquet"))
    assert sorted(p.name for p in new.glob("*.parquet")) == old_files and len(old_files) == SC.FILES
    for name in old_files:
        a, b = pq.read_table(tmp_path / "old" / name), pq.read_table(new / name)
        assert b.equals(a), name  # the same rows, ids and planted rows, in the same order
        assert _groups(new / name) == _groups(tmp_path / "old" / name), name
        assert (new / name).read_bytes() == (tmp_path / "old" / name).read_bytes(), name
    assert meta["planted"] == planted and meta["distinct_ids"] == rows - planted["duplicate_id"]
    assert meta["row_group_rows"] == max(g for n in old_files for g in _groups(tmp_path / "old" / n))
    assert max(behind) <= meta["row_group_rows"] and written[0] == drawn[0] == rows  # one row group at a time


def test_iter_chat_rows_yields_sample_chat_rows_lazily():
    from itertools import islice

    from bench.datasets import iter_chat_rows, sample_chat_rows

    assert list(iter_chat_rows(300, seed=3)) == sample_chat_rows(300, seed=3)
    assert list(islice(iter_chat_rows(10**12), 5)) == sample_chat_rows(5)  # a prefix, without the rest
    assert sample_chat_rows() == sample_chat_rows(240, seed=7) and len(sample_chat_rows()) == 240


def _export(out, outputs, dead):
    out.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist([{"id": i, "input_ref": r} for i, r in outputs]), out / "outputs.parquet")
    pq.write_table(pa.Table.from_pylist([{"id": i, "input_ref": r, "reason": why} for i, r, why in dead],
                                        schema=pa.schema([("id", pa.string()), ("input_ref", pa.string()),
                                                          ("reason", pa.string())])), out / "dead_letters.parquet")


@pytest.mark.parametrize("case, ok", [("exact", True), ("row lost", False), ("row twice", False),
                                      ("duplicate not dead-lettered", False)])
def test_accounting_catches_a_lost_or_doubled_row(tmp_path, case, ok):
    inp = {"rows": 4, "distinct_ids": 3, "planted": {"empty_prompt": 1, "duplicate_id": 1}}
    outputs = [("a", "0:0"), ("b", "0:1")]
    dead = [("c", "0:2", "empty_prompt"), ("b", "0:3", "duplicate_id")]
    if case == "row lost":
        outputs = outputs[:1]
    elif case == "row twice":
        outputs.append(("a", "0:0"))
    elif case == "duplicate not dead-lettered":
        dead = dead[:1]
    _export(tmp_path, outputs, dead)
    assert SC.accounting(tmp_path, inp)["ok"] is ok


def test_accounting_without_an_export_says_so(tmp_path):
    acc = SC.accounting(tmp_path, {"rows": 1})
    assert acc["ok"] is False and "did not finish" in acc["note"]


def test_tiny_model_keeps_the_base_tokenizer_and_vocabulary_and_is_built_once(tmp_path, model_path):
    from bench.tinymodel import TINY, tiny_model

    dest = tiny_model(model_path, dest=tmp_path / "tiny")
    cfg = json.loads((dest / "config.json").read_text())
    base = json.loads((Path(model_path) / "config.json").read_text())
    assert {k: cfg[k] for k in TINY} == TINY
    assert cfg["architectures"] == base["architectures"] and cfg["vocab_size"] == base["vocab_size"]
    for f in ("tokenizer.json", "tokenizer_config.json"):
        assert (dest / f).read_bytes() == (Path(model_path) / f).read_bytes()
    weights = dest / "model.safetensors"
    assert weights.stat().st_size < 20 << 20  # 2 layers of 64 and the embeddings, not the base's weights
    mtime = weights.stat().st_mtime_ns
    assert tiny_model(model_path, dest=tmp_path / "tiny") == dest and weights.stat().st_mtime_ns == mtime


def test_a_sized_run_on_a_cluster_runner_starts_its_own_cluster_and_runs_on_it(tmp_path, monkeypatch):
    """`--runner dask`: each sized run starts the runner's cluster before `tokenmill run` and
    stops it after; the run gets the cluster's flags and samples its processes."""
    seen: list = []

    @contextmanager
    def cluster(folder):
        seen.append(("start", folder))
        try:
            yield SC.Attached(("--pipeline-option=--dask_client_address=tcp://127.0.0.1:1",), (101, 102))
        finally:
            seen.append(("stop", folder))

    def run(leg, inp):
        seen.append(("run", leg.attached))
        leg.exit_code = 0
        return leg

    runner = SC.Runner("fake-2", ("--runner", "DaskRunner", "--workers", "2"), worker_kind="dask_worker", cluster=cluster)
    monkeypatch.setattr(SC, "make_input", lambda rows: {"rows": rows})
    monkeypatch.setattr(SC, "tokenmill_run", run)
    monkeypatch.setattr(SC, "leg_report", lambda leg, inp: {"rows_per_s": 1.0, "peak_rss_mib_by_kind": {},
                                                            "accounting": {"ok": True}})
    SC.plain_run("10-rows-fake-2", 10, runner, "model", tmp_path)
    folder = tmp_path / "10-rows-fake-2"
    assert seen == [("start", folder), ("run", SC.Attached(("--pipeline-option=--dask_client_address=tcp://127.0.0.1:1",),
                                                           (101, 102))), ("stop", folder)]
    seen.clear()
    SC.plain_run("10-rows-1-worker", 10, SC.ONE_WORKER, "model", tmp_path)
    assert seen == [("run", SC.Attached())]  # no cluster for the one-worker DirectRunner


def test_sized_runners_keep_the_one_worker_default_and_name_the_dask_runs():
    assert SC.SIZED_RUNNERS["direct-1"] is SC.ONE_WORKER and SC.SIZED_RUNNERS["dask"] is SC.RUNNERS["dask"]
    assert SC.sized_name(2000, SC.ONE_WORKER) == "2000-rows-1-worker"  # as before the option
    assert SC.sized_name(2000, SC.RUNNERS["dask"]) == "2000-rows-dask-2"
    assert "dask_worker" in SC.RUNNERS["dask"].kinds and "sdk_worker" not in SC.RUNNERS["dask"].kinds
    with pytest.raises(SystemExit):
        SC.main(["--runner", "spark"])


def _run(name, rows, runner, peaks, counts, kinds):
    return {"name": name, "rows": rows, "runner": runner, "exit_code": 0, "wall_s": 10.0, "model_load_s": 2.0,
            "rows_per_s": rows / 8, "steady": {"rows_per_s": rows / 7}, "output_tokens": 4 * rows,
            "peak_rss_mib_by_kind": peaks, "processes_by_kind": counts, "rss_kinds": kinds,
            "accounting": {"ok": True, "outputs": rows, "dead_letters": 0}}


def test_targets_and_table_on_dask_compare_each_kinds_largest_peak_and_say_so():
    kinds = list(SC.RUNNERS["dask"].kinds)
    counts = {"launcher": 1, "dask_scheduler": 1, "dask_nanny": 2, "dask_worker": 2, "engine_core": 2}
    runs = {"2000-rows-dask-2": _run("2000-rows-dask-2", 2000, "dask-2", {"launcher": 400.0, "dask_scheduler": 100.0,
                                     "dask_nanny": 90.0, "dask_worker": 900.0, "engine_core": 1400.0}, counts, kinds),
            "4000-rows-dask-2": _run("4000-rows-dask-2", 4000, "dask-2", {"launcher": 410.0, "dask_scheduler": 105.0,
                                     "dask_nanny": 91.0, "dask_worker": 1200.0, "engine_core": 1410.0}, counts, kinds)}
    ts = {t["target"]: t for t in SC.targets(runs, "2000-rows-dask-2", "4000-rows-dask-2", None)}
    worker = ts["peak RSS of the dask_worker (the largest of each run's 2 dask_worker processes): 4,000 rows ÷ 2,000 rows"]
    assert worker["measured"] == round(1200 / 900, 3) and worker["verdict"] == "MISS"
    assert ts["peak RSS of the launcher: 4,000 rows ÷ 2,000 rows"]["verdict"] == "PASS"  # one of it: no "largest"
    assert any(t.startswith("peak RSS of the engine_core (the largest of each run's 2 ") for t in ts)
    assert any(t.startswith("peak RSS of the dask_scheduler:") for t in ts)
    assert not any("dask_nanny" in t or "sdk_worker" in t for t in ts)  # a helper, and no SDK worker on Dask
    table = SC.markdown({"runs": runs, "targets": list(ts.values())})
    assert "launcher / dask scheduler / dask worker / engine core / engine worker |" in table.splitlines()[0]
    assert "| 400.0 / 100.0 / 900.0 / 1400.0 / – |" in table


def test_the_table_of_results_written_before_the_runner_option_keeps_its_columns():
    old = _run("2000-rows-1-worker", 2000, "direct-1", {"launcher": 930.0, "engine_core": 1420.0}, {}, None)
    del old["rss_kinds"], old["processes_by_kind"]
    table = SC.markdown({"runs": {"2000-rows-1-worker": old}, "targets": []})
    assert "launcher / SDK worker / engine core / engine worker |" in table.splitlines()[0]
    assert "| 930.0 / – / 1420.0 / – |" in table
