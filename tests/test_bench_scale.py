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
