"""Accounting measured in the worker (transforms/engines/meter.py) and priced per worker
(jobs/metrics/accounting.py job_cost): a fake NVML host stands in for the GPUs."""

import logging
import os

import pytest

from tests.fakes import FakeNvmlHost, FakeSession
from tokenmill.jobs.metrics.accounting import JobTerms, JobWork, job_metrics, run_figures
from tokenmill.jobs.metrics.pricing import price_table
from tokenmill.schemas import storage as S
from tokenmill.transforms.engines.meter import WorkerMeter, bound_cpu_count, engine_device_count


class Clock:
    def __init__(self, t=1000.0):
        self.t = t

    def __call__(self):
        return self.t


def _gpu_info(tp=1, pp=1):
    return {"device": "cuda", "engine_kwargs": {"tensor_parallel_size": tp, "pipeline_parallel_size": pp}}


def test_a_worker_uses_the_visible_devices_narrowed_to_tp_times_pp(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "5,2")  # two visible of eight
    clock = Clock()
    host = FakeNvmlHost(count=8, name="NVIDIA L4", power_w=70.0, procs=[(os.getpid(), 3 * 2**30), (999_999, 2**30)],
                        clock=clock)
    m = WorkerMeter(_gpu_info(tp=2), nvml=host, clock=clock)
    clock.t += 100.0
    r = m.reading()
    assert (r["device_type"], r["device_model"], r["device_count"], r["nvml_error"]) == ("gpu", "NVIDIA L4", 2, None)
    me = r["measure"]
    assert [g["index"] for g in me["gpus"]] == [5, 2]  # CUDA's order, not NVML's
    assert me["window_s"] == 100.0
    assert me["gpus"][0]["energy_j"] == pytest.approx(70.0 * 100)  # NVML's counter, mJ -> J
    assert me["gpu_energy_j"] == pytest.approx(2 * 70.0 * 100)
    assert me["gpus"][0]["energy_j_from_power"] == pytest.approx(70.0 * 100)
    assert me["gpus"][0]["util_pct_mean"] == 95.0 and me["gpus"][0]["power_w_mean"] == 70.0
    # this worker's processes only (999999 is someone else's); device memory counts everybody's
    assert me["gpus"][0]["process_memory_bytes_max"] == 3 * 2**30
    assert me["gpus"][0]["memory_used_bytes_max"] == 5 * 2**30
    assert me["gpu_process_memory_bytes_max"] == 6 * 2**30  # both devices
    assert WorkerMeter(_gpu_info(tp=1), nvml=host).device_count == 1  # one of the two visible
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    m = WorkerMeter(_gpu_info(), nvml=host)
    assert m.devices == [] and m.device_count == 1  # hidden devices: the engine's count, not the host's


def test_engine_device_count_is_tp_times_pp():
    assert engine_device_count(_gpu_info(tp=4, pp=2)) == 8
    assert engine_device_count({}) == 1


def test_a_gpu_worker_whose_nvml_cannot_be_read_says_so_and_stays_a_gpu_worker(caplog):
    class Broken:
        def nvmlDeviceGetCount(self):
            raise RuntimeError("NVML_ERROR_DRIVER_NOT_LOADED")

    with caplog.at_level(logging.WARNING, logger="tokenmill.transforms.engines.meter"):
        r = WorkerMeter(_gpu_info(tp=2), nvml=Broken()).reading()
    assert r["device_type"] == "gpu" and r["device_count"] == 2 and r["device_model"] is None
    assert r["nvml_error"].startswith("NVML cannot be read (RuntimeError: NVML_ERROR_DRIVER_NOT_LOADED")
    assert len([x for x in caplog.records if "NVML cannot be read" in x.getMessage()]) == 1
    assert "\n" not in caplog.records[0].getMessage()
    m = job_metrics(JobWork([], [], [{"worker": "h:1", "run_id": "r", **r}]),
                    JobTerms(total=0, engine_config={}, token_budget=None, price_per_hour=None, prices=price_table()))
    (w,) = m["cost"]["workers"]
    assert w["usd_per_hour"] == pytest.approx(2 * 2.99)  # priced as GPUs (H100 fallback), never as CPU
    assert "GPU model unknown" in w["source"]
    assert m["devices"]["nvml_errors"] == [f"h:1: {r['nvml_error']}"]


def test_a_cpu_worker_counts_its_bound_cores_and_its_process_tree(monkeypatch):
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0-3,6")
    assert bound_cpu_count() == 5
    r = WorkerMeter({"device": "cpu"}, nvml=None).reading()
    assert (r["device_type"], r["cpu_count"], r["device_count"], r["nvml_error"]) == ("cpu", 5, None, None)
    assert r["measure"]["peak_tree_rss_bytes"] > 0 and r["measure"]["gpus"] is None
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "auto")
    assert bound_cpu_count() == len(os.sched_getaffinity(0))


def _worker(name, run, reading, load_s=10.0):
    return {"worker": name, "run_id": run, "load_s": load_s, **reading}


def test_a_pool_of_gpu_workers_is_priced_per_worker_and_summed(monkeypatch):
    """Two L4 workers (one GPU each of a host's eight, each shown only the device it leased,
    engines/leases.py) and one CPU worker: devices, memory, energy and cost per worker and
    for the job; each GPU and its energy counted once."""
    clock = Clock()
    host = FakeNvmlHost(count=8, name="NVIDIA L4", power_w=50.0, procs=[(os.getpid(), 2**30)], clock=clock)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-00000000-fake")  # as worker a's lease sets it
    gpu_a = WorkerMeter(_gpu_info(), nvml=host, clock=clock)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-00000001-fake")
    gpu_b = WorkerMeter(_gpu_info(), nvml=host, clock=clock)
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0-1")
    cpu = WorkerMeter({"device": "cpu"}, nvml=None)
    clock.t += 60.0
    workers = [_worker("a:1", "r1", gpu_a.reading()), _worker("b:1", "r1", gpu_b.reading()),
               _worker("c:1", "r1", cpu.reading())]
    batches = [
        {"batch_id": "r1-0.0-x-0", "worker": "a:1", "started_at": 0.0, "finished_at": 60.0, "requests": 10,
         "output_tokens": 600},
        {"batch_id": "r1-1.0-x-0", "worker": "b:1", "started_at": 0.0, "finished_at": 30.0, "requests": 5,
         "output_tokens": 300},
        {"batch_id": "r1-2.0-x-0", "worker": "c:1", "started_at": 0.0, "finished_at": 36.0, "requests": 1,
         "output_tokens": 100},
    ]
    runs = [{"run_id": "r1", "started_at": -20.0, "seen_at": 70.0, "finished_at": 70.0}]
    rows = [{"prompt_tokens": 10, "output_tokens": 100, "cached_tokens": 0} for _ in range(10)]
    m = job_metrics(JobWork(rows, batches, workers, failed_by_reason={}, runs=runs),
                    JobTerms(total=10, engine_config={}, token_budget=None, price_per_hour=None,
                             prices=price_table({"cpu_gib": 0.0})))
    d = m["devices"]
    assert [g["index"] for w in workers[:2] for g in w["measure"]["gpus"]] == [0, 1]  # not GPU 0 twice
    assert d["gpus"] == 2 and d["gpu_models"] == ["NVIDIA L4"] and d["vcpus"] == 2
    assert d["gpu_energy_wh"] == pytest.approx(2 * 50.0 * 60 / 3600)
    assert d["gpu_process_memory_bytes_max"] == 2**30
    c = m["cost"]
    per = {w["worker"]: w for w in c["workers"]}
    assert per["a:1"]["generation_cost"] == pytest.approx(60 / 3600 * 0.80)
    assert per["b:1"]["generation_cost"] == pytest.approx(30 / 3600 * 0.80)
    assert per["c:1"]["generation_cost"] == pytest.approx(36 / 3600 * 2 * 0.031611)
    gen = (60 + 30) / 3600 * 0.80 + 36 / 3600 * 2 * 0.031611
    assert c["total"] == pytest.approx(gen)
    held = 90 / 3600 * (2 * 0.80 + 2 * 0.031611)  # the run held every worker 90 s
    assert c["held"]["total"] == pytest.approx(held)
    assert c["per_1m_output_tokens"] == pytest.approx(gen / 1000 * 1e6)
    assert c["held"]["per_1m_output_tokens"] == pytest.approx(held / 1000 * 1e6)
    assert c["held"]["basis"].startswith("everything the job held its devices for")


def test_a_resumed_job_counts_each_runs_active_window_not_the_downtime_between():
    batches = [
        {"batch_id": "aaa111-0.0-x-0", "worker": "h:1", "started_at": 100.0, "finished_at": 110.0, "requests": 4,
         "output_tokens": 40},
        {"batch_id": "aaa111-0.1-x-0", "worker": "h:1", "started_at": 110.0, "finished_at": 120.0, "requests": 4,
         "output_tokens": 40},
        # killed at ~125, resumed at 1000
        {"batch_id": "bbb222-1.0-y-0", "worker": "h:2", "started_at": 1030.0, "finished_at": 1050.0, "requests": 8,
         "output_tokens": 80},
    ]
    workers = [{"worker": "h:1", "run_id": "aaa111", "load_s": 15.0, "started_at": 80.0, "updated_at": 120.0},
               {"worker": "h:2", "run_id": "bbb222", "load_s": 25.0, "started_at": 1005.0, "updated_at": 1050.0}]
    runs = [{"run_id": "aaa111", "started_at": 70.0, "seen_at": 125.0, "finished_at": None},
            {"run_id": "bbb222", "started_at": 1000.0, "seen_at": 1060.0, "finished_at": 1060.0}]
    per = run_figures(batches, workers, runs)
    assert [(r["run_id"], r["generation_wall_s"], r["output_tokens"], r["model_load_s"], r["held_s"], r["finished"])
            for r in per] == [("aaa111", 20.0, 80, 15.0, 55.0, False), ("bbb222", 20.0, 80, 25.0, 60.0, True)]
    rows = [{"prompt_tokens": 1, "output_tokens": 10, "cached_tokens": 0} for _ in range(16)]
    m = job_metrics(JobWork(rows, batches, workers, failed_by_reason={}, runs=runs),
                    JobTerms(total=16, engine_config={}, token_budget=None, price_per_hour=3.6))
    th = m["throughput"]
    assert th["generation_wall_s"] == 40.0  # not 1050 - 100
    assert th["output_tok_per_s"] == pytest.approx(160 / 40.0)
    assert th["model_load_s"] == 40.0 and th["runs"] == 2  # each run loaded its model
    assert m["cost"]["total"] == pytest.approx(40.0 / 3600 * 3.6)
    assert m["cost"]["held"]["total"] == pytest.approx((55.0 + 60.0) / 3600 * 3.6)


def test_a_run_of_two_passes_counts_each_passs_window_and_both_engines_loads():
    """A batch file of chat and embeddings lines: a generate pass, then the embed engine loads
    (12 s, no batch running) and its pass runs; the run's generation wall is 10 + 5 s, not 27."""
    batches = [
        {"batch_id": "aaa111-0.0-x-0", "worker": "h:1", "started_at": 100.0, "finished_at": 110.0, "requests": 4,
         "output_tokens": 40},
        {"batch_id": "aaa111-0.0-y-0", "worker": "h:1/embed", "started_at": 122.0, "finished_at": 127.0,
         "requests": 6, "output_tokens": 0},
    ]
    workers = [{"worker": "h:1", "run_id": "aaa111", "load_s": 20.0, "engine_info": {"task": "generate"}},
               {"worker": "h:1/embed", "run_id": "aaa111", "load_s": 12.0, "engine_info": {"task": "embed"}}]
    (run,) = run_figures(batches, workers, [{"run_id": "aaa111", "started_at": 70.0, "finished_at": 130.0}])
    assert (run["generation_wall_s"], run["model_load_s"], run["requests"]) == (15.0, 32.0, 10)
    m = job_metrics(JobWork([{"prompt_tokens": 1, "output_tokens": 10, "cached_tokens": 0}] * 4, batches, workers),
                    JobTerms(total=10, engine_config={"task": "embed"}, token_budget=None, price_per_hour=3.6))
    assert m["engine"]["task"] == "generate+embed"
    assert job_metrics(JobWork([], batches[:1], workers[:1]), JobTerms(
        total=4, engine_config={"task": "embed"}, token_budget=None, price_per_hour=3.6,
    ))["engine"]["task"] == "generate"  # what ran, not the config


def test_the_worker_row_carries_what_the_worker_measured(sqlite_url, monkeypatch):
    from tokenmill.transforms.write import record_worker, update_worker_peak

    monkeypatch.setenv("TOKENMILL_FORCE_CPU", "1")  # the fake engine names no device: a CPU worker here

    record_worker(sqlite_url, "jm", "h:7", FakeSession(), started_at=1.0, run_id="abc123")
    update_worker_peak(sqlite_url, "jm", "h:7", admitted_rows=3)
    (w,) = S.MetricsReader(S.connect(sqlite_url)).workers("jm")
    assert w["run_id"] == "abc123" and w["admitted_rows"] == 3
    assert w["device_type"] == "cpu" and w["cpu_count"] == bound_cpu_count()
    assert w["measure"]["peak_tree_rss_bytes"] > 0 and w["measure"]["window_s"] >= 0


def test_a_batchs_figures_are_committed_with_its_outputs_when_it_finishes(sqlite_url):
    """A run killed mid-bundle keeps the figures of its finished batches (its generation window)."""
    from tokenmill.schemas.records import BatchStats
    from tokenmill.transforms.write import commit_batch

    commit_batch(sqlite_url, "jb", [], [], BatchStats(job_id="jb", batch_id="abc123-0.0-x-0", worker="h:1",
                                                     requests=2, started_at=1.0, finished_at=2.0).as_dict())
    assert [b["batch_id"] for b in S.MetricsReader(S.connect(sqlite_url)).batches("jb")] == ["abc123-0.0-x-0"]


def test_a_device_metered_by_a_worker_and_its_retry_is_one_gpu_of_the_job():
    from tokenmill.jobs.metrics.devices import gpu_count

    def row(worker, *uuids, count=None):
        return {"worker": worker, "device_type": "gpu", "device_count": count or len(uuids),
                "measure": {"gpus": [{"uuid": u} for u in uuids]}}

    dead, retry = row("h1:100", "GPU-a"), row("h1:200", "GPU-a")
    assert gpu_count([dead, retry, row("h1:101", "GPU-b")]) == 2
    assert gpu_count([row("h1:1", "GPU-a"), row("h2:1", "GPU-a")]) == 2  # the same UUID on two hosts: two devices
    assert gpu_count([row("h1:1", "GPU-a", "GPU-b"), {"worker": "h3:1", "device_type": "gpu", "device_count": 4}]) == 6
