"""Device leases (transforms/engines/leases.py) on a simulated GPU host: a fake `pynvml`
(tests/fake_gpu_host/pynvml.py) with eight devices, and a test-only engine that needs GPUs
(tests/fake_gpu_host/leasing_engine.py), found by the multi-process DirectRunner's worker
processes through a `tokenmill.engines` entry point written into a folder on their
PYTHONPATH.  Each worker leases its own devices before its engine starts; the engine sees
only those; kill -9 frees them; the job counts each device and its energy once."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from tests.conftest import write_parquet
from tests.fake_gpu_host import leasing_engine
from tests.fakes import FakeNvmlHost
from tests.helpers import job_spec
from tokenmill.schemas import storage as S
from tokenmill.transforms.engines import device, kinds, leases

FAKE = Path(__file__).resolve().parent / "fake_gpu_host"
ROOT = FAKE.parent.parent


def _fake_pynvml():
    spec = importlib.util.spec_from_file_location("pynvml", FAKE / "pynvml.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture
def gpu_host(tmp_path, monkeypatch):
    """This process and its children on a simulated host of eight GPUs (`host0`), leasing in
    a lease dir of their own; the leasing engine registered here and, for worker processes,
    through an entry point on their PYTHONPATH."""
    site = tmp_path / "site"
    dist = site / "tokenmill_fake_gpu_host-0.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: tokenmill-fake-gpu-host\nVersion: 0\n")
    (dist / "entry_points.txt").write_text(
        "[tokenmill.engines]\nleasing = tests.fake_gpu_host.leasing_engine:ENGINE\n")
    path = [str(FAKE), str(site), str(ROOT)] + [p for p in [os.environ.get("PYTHONPATH")] if p]
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(path))
    monkeypatch.setenv("FAKE_GPU_COUNT", "8")
    monkeypatch.setenv("FAKE_GPU_HOST", "host0")
    monkeypatch.setenv(leases.LEASE_DIR_ENV, str(tmp_path / "leases"))
    monkeypatch.setenv(leases.LEASE_WAIT_ENV, "60")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.delenv("TOKENMILL_FORCE_CPU", raising=False)
    monkeypatch.setitem(sys.modules, "pynvml", _fake_pynvml())
    monkeypatch.setattr(leases, "_HELD", None)
    monkeypatch.setattr(leases, "_BEFORE", leases._UNSET)
    kinds.register(leasing_engine.ENGINE)
    yield monkeypatch
    if leases.held() is not None:
        leases.held().release()
    kinds.unregister("leasing")


def uuid(i: int, host: str = "host0") -> str:
    return f"GPU-{host}-{i:04d}"


# ---------------------------------------------------------------- leases, in one process and a few


def test_groups_are_aligned_when_free_and_any_free_devices_otherwise(gpu_host):
    devices = device.visible_gpus()
    a = leases.acquire(2, devices, wait_s=0)
    b = leases.acquire(2, devices, wait_s=0)
    assert (a.uuids, b.uuids) == ([uuid(0), uuid(1)], [uuid(2), uuid(3)])
    a.release()
    assert leases.acquire(2, devices, wait_s=0).uuids == [uuid(0), uuid(1)]  # freed, taken again
    singles = [leases.acquire(1, [devices[i]], wait_s=0) for i in (5, 6)]
    assert leases.acquire(2, devices, wait_s=0).uuids == [uuid(4), uuid(7)]  # no aligned pair left: any two
    with pytest.raises(leases.LeaseUnavailable):
        leases.acquire(1, devices, wait_s=0)
    assert [s.uuids for s in singles] == [[uuid(5)], [uuid(6)]]
    note = leases.holder(uuid(5))
    assert (note["pid"], note["host"]) == (os.getpid(), socket.gethostname())


def test_a_worker_finding_no_free_group_waits_then_fails_in_one_line_naming_host_size_and_holders(gpu_host):
    devices = device.visible_gpus()
    everything = leases.acquire(8, devices, job="job-other-run1", wait_s=0)
    with pytest.raises(leases.LeaseUnavailable) as err:
        leases.acquire(2, devices, wait_s=3.0, sleep=lambda s: None, clock=iter(range(100)).__next__)
    msg = str(err.value)
    assert "\n" not in msg and isinstance(err.value, leases.EngineStartError)
    assert msg.startswith(f"no free group of 2 GPU(s) on host {socket.gethostname()} after waiting 3 s; held: ")
    assert f"{uuid(0)} by pid {os.getpid()} on {socket.gethostname()} (job job-other-run1)" in msg
    # a wait that ends when a holder lets go: the lease is taken then
    waited = []

    def sleep(s):
        waited.append(s)
        if len(waited) == 2:
            everything.release()

    assert leases.acquire(8, devices, wait_s=60, sleep=sleep).uuids == [uuid(i) for i in range(8)]
    assert len(waited) == 2
    with pytest.raises(leases.LeaseUnavailable, match=r"an engine needs 16 GPU\(s\) but host .* shows 8"):
        leases.acquire(16, devices)


def test_the_process_lease_is_kept_for_the_process_and_its_engine_sees_only_its_devices(gpu_host):
    other = leases.acquire(1, device.visible_gpus(), wait_s=0)  # another worker holds GPU 0
    lease = leases.process_lease(2, job="j-r")
    assert lease.uuids == [uuid(2), uuid(3)]
    assert os.environ["CUDA_VISIBLE_DEVICES"] == f"{uuid(2)},{uuid(3)}"
    assert [d["uuid"] for d in device.visible_gpus()] == lease.uuids
    assert leases.process_lease(2, job="j-r") is lease  # a restarted engine keeps its devices
    from tokenmill.transforms.engines.meter import WorkerMeter

    reading = WorkerMeter({"device": "cuda", "engine_kwargs": {"tensor_parallel_size": 2}}).reading()
    assert [g["uuid"] for g in reading["measure"]["gpus"]] == lease.uuids and reading["device_count"] == 2
    bigger = leases.process_lease(4, job="j-r2")  # another size: the old lease goes, the devices of before are leased from
    assert bigger.uuids == [uuid(i) for i in range(4, 8)] and not lease.held
    leases.release_process_lease()
    assert "CUDA_VISIBLE_DEVICES" not in os.environ
    other.release()
    assert leases.process_lease(0) is None  # an engine that needs no GPU leases nothing


def test_a_workers_engine_is_made_on_its_lease_and_a_group_of_another_size_stops_it_first(gpu_host, tmp_path,
                                                                                           monkeypatch):
    from tokenmill.transforms.engines import registry, worker

    monkeypatch.setattr(registry, "_SESSIONS", {})
    cfg = leasing_engine.LeasingConfig(kind="leasing", record_dir=str(tmp_path))
    s = worker.worker_session(cfg, "m", group="job-a")
    assert json.loads((tmp_path / f"{os.getpid()}.json").read_text())["cuda_visible_devices"] == uuid(0)
    assert worker.worker_session(cfg, "m", group="job-b", restart=True) is not s  # a restart keeps the lease
    assert leases.held().uuids == [uuid(0)] and leases.holder(uuid(0))["job"] == "job-b"
    current = registry.sessions()[0]
    wide = worker.worker_session(cfg.model_copy(update={"tensor_parallel_size": 2}), "m", group="job-c")
    assert current.shut and leases.held().uuids == [uuid(0), uuid(1)]
    assert json.loads((tmp_path / f"{os.getpid()}.json").read_text())["cuda_visible_devices"] == f"{uuid(0)},{uuid(1)}"
    registry.shutdown_all()
    assert wide.shut
    leases.release_process_lease()


def test_a_worker_without_gpus_leases_nothing(gpu_host):
    gpu_host.setenv("CUDA_VISIBLE_DEVICES", "")
    assert leases.process_lease(1) is None and os.environ["CUDA_VISIBLE_DEVICES"] == ""


HOLD = """
import sys, time
from tokenmill.transforms.engines import leases
lease = leases.process_lease(int(sys.argv[1]), job="held")
print(lease.cuda_visible_devices, flush=True)
time.sleep(120)
"""


def test_kill_9_of_the_holder_frees_its_devices(gpu_host, tmp_path):
    p = subprocess.Popen([sys.executable, "-c", HOLD, "2"], stdout=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        assert p.stdout.readline().strip() == f"{uuid(0)},{uuid(1)}"  # the subprocess's own fake host
        with pytest.raises(leases.LeaseUnavailable, match=f"{uuid(0)} by pid {p.pid} .*job held"):
            leases.acquire(1, device.visible_gpus()[:2], wait_s=0)
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait(timeout=30)
    assert leases.acquire(2, device.visible_gpus(), wait_s=0).uuids == [uuid(0), uuid(1)]


# ---------------------------------------------------------------- MIG, and what the launcher samples


def test_mig_instances_are_devices_of_their_own():
    host = FakeNvmlHost(count=2, mig={1: 3})
    found = device.describe_devices(host)
    assert [(d["index"], d.get("mig"), d["uuid"]) for d in found] == [
        (0, None, "GPU-00000000-fake"), (1, 0, "MIG-00000001-0000-fake"), (1, 1, "MIG-00000001-0001-fake"),
        (1, 2, "MIG-00000001-0002-fake")]
    assert found[1]["memory_bytes"] == host.memory_total // 8 and "MIG" in found[1]["name"]
    picked = device.select_visible(found, "MIG-00000001-0002-fake,GPU-0")
    assert [d["uuid"] for d in picked] == ["MIG-00000001-0002-fake", "GPU-00000000-fake"]
    assert device.select_visible(found, "1") == [found[1]]  # an index: that GPU's first instance
    assert device.device_handle(host, found[2]) == (1, 1)


def test_a_meter_on_a_mig_instance_reads_its_own_handle_and_no_energy(monkeypatch):
    from tokenmill.transforms.engines.meter import WorkerMeter

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "MIG-00000001-0001")
    r = WorkerMeter({"device": "cuda", "engine_kwargs": {}}, nvml=FakeNvmlHost(count=2, mig={1: 2})).reading()
    (g,) = r["measure"]["gpus"]
    assert g["uuid"] == "MIG-00000001-0001-fake" and r["device_count"] == 1
    assert g["energy_j"] is None and r["measure"]["gpu_energy_j"] is None  # not the whole GPU's energy


def test_the_launchers_sampler_reads_only_the_devices_it_is_shown(monkeypatch):
    from tokenmill.jobs.metrics import hardware as H

    host = FakeNvmlHost(count=8)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert [g["index"] for g in H.nvml_sample(host)] == list(range(8))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-00000003-fake,GPU-00000005-fake")
    s = H.UtilizationSampler(nvml=host, cpu_percent=lambda: 1.0)
    s.sample()
    assert [g["index"] for g in s.summary()["gpus"]] == [3, 5]


# ---------------------------------------------------------------- --workers auto


def test_workers_auto_is_one_engine_per_device_group_and_too_many_workers_are_refused(gpu_host, tmp_path):
    from tokenmill.jobs.cli.common import WORKERS
    from tokenmill.jobs.lifecycle.runner import JobError, resolve_workers

    def spec(workers, tp=1, **runner):
        return job_spec("in.parquet", "out", engine={"kind": "leasing", "tensor_parallel_size": tp},
                        runner={"num_workers": workers, **runner})

    assert resolve_workers(spec("auto")).runner.num_workers == 8
    assert resolve_workers(spec("auto", tp=2)).runner.num_workers == 4
    assert resolve_workers(spec(3, tp=2)).runner.num_workers == 3
    assert spec("auto").derived_job_id() == spec(1).derived_job_id()  # the runner is not the work
    with pytest.raises(JobError, match=r"^runner.num_workers: 5 engines of 2 GPU\(s\) each do not fit host .*'s "
                                       r"8 visible GPUs \(4 engines at most; or give auto\)$"):
        resolve_workers(spec(5, tp=2))
    with pytest.raises(JobError, match="an engine of leasing here needs 16 GPUs but host .* shows 8"):
        resolve_workers(spec("auto", tp=16))
    with pytest.raises(JobError, match="with runner DaskRunner, give the number of workers"):
        resolve_workers(spec("auto", runner="DaskRunner"))
    gpu_host.setenv("TOKENMILL_FORCE_CPU", "1")
    assert resolve_workers(spec("auto")).runner.num_workers == 1  # no GPU: one engine, as before
    assert resolve_workers(spec(9)).runner.num_workers == 9  # CPU workers share the cores, as before
    assert (WORKERS.convert("auto", None, None), WORKERS.convert("3", None, None)) == ("auto", 3)


# ---------------------------------------------------------------- jobs on the simulated host


def _records(d: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(d.glob("*.json"))]


def _job(tmp_path, sqlite_url, workers, tp=1, rows=32, engine_step_s=0.0, **runner):
    from tokenmill.jobs.lifecycle.runner import run_job

    records = tmp_path / "engines"
    records.mkdir(exist_ok=True)
    inp = write_parquet(tmp_path / "in.parquet", [{"id": f"r{i}", "prompt": f"question {i}"} for i in range(rows)])
    spec = job_spec(inp, tmp_path / "out", engine={"kind": "leasing", "tensor_parallel_size": tp,
                                                   "record_dir": str(records), "step_s": engine_step_s},
                    sampling={"max_tokens": 1}, runner={"num_workers": workers, **runner})
    return run_job(spec, db_url=sqlite_url), records


def test_eight_workers_at_tp_1_get_eight_devices_and_the_job_counts_each_device_and_its_energy_once(
        gpu_host, tmp_path, sqlite_url):
    res, records = _job(tmp_path, sqlite_url, "auto")
    assert res.status == "succeeded" and res.succeeded == 32
    engines = _records(records)
    assert len(engines) == 8
    assert all(e["cuda_visible_devices"] == ",".join(e["leased"]) and len(e["leased"]) == 1 for e in engines)
    assert sorted(e["leased"][0] for e in engines) == [uuid(i) for i in range(8)]
    texts = {r["text"] for r in pq.read_table(tmp_path / "out" / "outputs.parquet").to_pylist()}
    assert texts <= {uuid(i) for i in range(8)}  # every engine saw its one device, no other
    workers = S.MetricsReader(S.connect(sqlite_url)).workers(res.job_id)
    metered = [g["uuid"] for w in workers for g in w["measure"]["gpus"]]
    assert sorted(metered) == [uuid(i) for i in range(8)]  # each device metered by its leaseholder alone
    fake = sys.modules["pynvml"]
    for w in workers:
        (g,) = w["measure"]["gpus"]
        watts = fake.power_w(int(g["uuid"][-4:]))
        assert w["measure"]["gpu_energy_j"] == pytest.approx(watts * w["measure"]["window_s"], abs=0.5)
    d = res.metrics["devices"]
    assert d["gpus"] == 8 and d["gpu_models"] == ["NVIDIA L4"]
    assert d["gpu_energy_wh"] == pytest.approx(sum(w["measure"]["gpu_energy_j"] for w in workers) / 3600)


def test_four_workers_at_tp_2_get_two_neighbouring_devices_each(gpu_host, tmp_path, sqlite_url):
    res, records = _job(tmp_path, sqlite_url, "auto", tp=2, rows=16)
    assert res.status == "succeeded"
    engines = _records(records)
    assert sorted(tuple(e["leased"]) for e in engines) == [(uuid(i), uuid(i + 1)) for i in range(0, 8, 2)]
    assert all(e["cuda_visible_devices"] == ",".join(e["leased"]) for e in engines)
    assert res.metrics["devices"]["gpus"] == 8


# Beam's control-stream reader of the killed worker raises in its thread as the worker dies.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_killed_worker_frees_its_device_and_the_retry_takes_it(gpu_host, tmp_path, sqlite_url):
    gpu_host.setenv("FAKE_GPU_COUNT", "2")
    gpu_host.setenv(leases.LEASE_WAIT_ENV, "30")  # a device never freed fails the retry
    (tmp_path / "engines").mkdir()
    (tmp_path / "engines" / "kill-once").write_text("")
    res, records = _job(tmp_path, sqlite_url, 2, rows=8, worker_retries=1)
    assert res.status == "succeeded" and res.succeeded == 8
    (killed,) = [int(p.name.split("-")[1]) for p in records.glob("killed-*")]
    engines = {e["pid"]: e["leased"] for e in _records(records)}
    lost = engines.pop(killed)
    assert any(leased == lost for leased in engines.values())  # a retry's worker leased the dead one's device
    # a device metered by two workers (the dead one's and its successor's) is one GPU of the job
    workers = S.MetricsReader(S.connect(sqlite_url)).workers(res.job_id)
    metered = [g["uuid"] for w in workers for g in w["measure"]["gpus"]]
    assert res.metrics["devices"]["gpus"] == len(set(metered)) <= 2


# ---------------------------------------------------------------- Dask: two simulated hosts


def test_under_dask_each_simulated_host_leases_its_own_devices_to_its_workers(gpu_host, tmp_path, sqlite_url):
    """Two hosts of two GPUs (fake hosts `hostA`, `hostB`, each with its own lease dir), two
    dask workers on each: every engine gets one device of its own host, none shared."""
    from bench.dask_cluster import WORKER_ENV, start_cluster, stop_process

    cluster = start_cluster(tmp_path / "dask-logs", n_workers=0)
    try:
        for host in ("hostA", "hostB"):
            env = {**os.environ, **WORKER_ENV, "FAKE_GPU_HOST": host, "FAKE_GPU_COUNT": "2",
                   leases.LEASE_DIR_ENV: str(tmp_path / f"leases-{host}")}
            for i in range(2):
                with open(tmp_path / "dask-logs" / f"{host}-{i}.log", "wb") as log:
                    cluster.workers.append(subprocess.Popen(
                        [sys.executable, "-m", "distributed.cli.dask_worker", cluster.address, "--name", f"{host}-{i}",
                         "--host", "127.0.0.1", "--nthreads", "1", "--memory-limit", "0", "--no-dashboard",
                         "--no-nanny"], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                        start_new_session=True))
        from distributed import Client

        with Client(cluster.address, timeout=30) as c:
            c.wait_for_workers(4, timeout=120)
        res, records = _job(tmp_path, sqlite_url, 4, rows=16, runner="DaskRunner",
                            pipeline_options=cluster.options(), engine_step_s=0.2)
    except BaseException:
        print(cluster.tail())
        raise
    finally:
        for w in cluster.workers:
            stop_process(w)
        stop_process(cluster.scheduler)
    assert res.status == "succeeded" and res.succeeded == 16
    leased = [e["leased"] for e in _records(records)]
    assert all(len(u) == 1 for u in leased)
    uuids = [u[0] for u in leased]
    assert len(set(uuids)) == len(uuids) and set(uuids) <= {uuid(i, h) for h in ("hostA", "hostB") for i in (0, 1)}
    assert {u.split("-")[1] for u in uuids} == {"hostA", "hostB"}  # both hosts' workers ran engines
    assert res.metrics["devices"]["gpus"] == len(uuids)


def test_a_job_whose_workers_find_every_device_held_fails_with_the_lease_line(gpu_host, tmp_path, sqlite_url,
                                                                                 caplog):
    """The worker's error is one line naming the host and the holders; it fails the job
    (not retried: no worker died)."""
    from tokenmill.jobs.lifecycle.runner import JobError

    gpu_host.setenv("FAKE_GPU_COUNT", "2")
    gpu_host.setenv(leases.LEASE_WAIT_ENV, "0.5")
    held = leases.acquire(2, device.visible_gpus(), job="someone-else", wait_s=0)  # another job holds both
    try:
        with caplog.at_level("ERROR", logger="tokenmill.jobs.lifecycle.runner"), pytest.raises(JobError):
            _job(tmp_path, sqlite_url, 2, rows=4, worker_retries=1)
    finally:
        held.release()
    (failed,) = [r for r in caplog.records if r.getMessage() == "pipeline failed"]
    line = next(x for x in str(failed.exc_info[1]).splitlines() if "LeaseUnavailable: " in x)
    assert line.split("LeaseUnavailable: ", 1)[1].startswith(
        f"no free group of 1 GPU(s) on host {socket.gethostname()} after waiting 0.5 s; held: "
        f"{uuid(0)} by pid {os.getpid()} on {socket.gethostname()} (job someone-else), {uuid(1)} by pid")
