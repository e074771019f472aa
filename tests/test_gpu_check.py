"""The GPU check (bench/gpu_check.py) without a GPU: its comparisons on readings of the
real meter over a fake NVML host and on fabricated nvidia-smi samples, the device
accounting of a real subprocess with CUDA_VISIBLE_DEVICES empty, and its no-GPU exit."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench import gpu_check as G
from tests.fakes import FakeNvmlHost
from tokenmill.transforms.engines.meter import WorkerMeter

ROOT = Path(__file__).resolve().parent.parent
GIB = 2**30
UUID = "GPU-00000000-fake"


class Clock:
    def __init__(self, t=1000.0):
        self.t = t

    def __call__(self):
        return self.t


def _window(power_w, util_pct, seconds=20.0):
    """A meter reading over `seconds` of a one-GPU fake host (this process holds 30 GiB on it)."""
    clock = Clock()
    host = FakeNvmlHost(count=1, name="NVIDIA H200", power_w=power_w, util_pct=util_pct,
                        procs=[(os.getpid(), 30 * GIB)], memory_total=141 * GIB, clock=clock)
    m = WorkerMeter({"device": "cuda", "engine_kwargs": {}}, nvml=host, clock=clock)
    for _ in range(int(seconds / 0.25)):
        clock.t += 0.25
        m.sample()
    return m.reading()


def _smi(power_w, util_pct, used=31 * GIB, n=80):
    return [{"memory_used_bytes": used, "power_w": power_w, "util_pct": util_pct} for _ in range(n)]


TORCH = {"uuid": "00000000-fake", "name": "NVIDIA H200"}  # torch gives the UUID without "GPU-"


def _by_name(checks):
    return {c["check"]: c for c in checks}


def test_smi_lines_are_parsed_to_bytes_watts_percent_and_unsupported_fields_are_none():
    assert G.parse_smi_gpu("40536, 312.45, 100\n") == {"memory_used_bytes": 40536 * 2**20, "power_w": 312.45,
                                                        "util_pct": 100.0}
    assert G.parse_smi_gpu("40536, [N/A], 0") == {"memory_used_bytes": 40536 * 2**20, "power_w": None,
                                                   "util_pct": 0.0}
    assert G.parse_smi_gpu("memory.used [MiB], power.draw [W]") is None
    apps = "1234, 30720\n999, 1024\n1234, 512\n"
    assert G.parse_smi_apps(apps, 1234) == (30720 + 512) * 2**20
    assert G.parse_smi_apps(apps, 42) is None
    assert G.parse_smi_apps("No running processes found\n", 1234) is None


def test_a_meter_that_agrees_with_nvidia_smi_passes_every_check():
    checks = G.meter_checks(_window(75.0, 0.0), _window(690.0, 100.0), _smi(74.0, 0.0), _smi(700.0, 99.0),
                            30 * GIB, TORCH)
    assert [c["check"] for c in checks if c["status"] != "pass"] == []
    assert len(checks) == 13
    assert G.exit_status(checks) == G.EXIT_PASS
    table = G.table(checks)
    assert table.count("PASS") == 13 and "energy counter" in table


def test_each_disagreement_fails_its_own_check():
    idle, busy = _window(75.0, 3.0), _window(690.0, 100.0)
    # nvidia-smi 20% more power in the busy window: power and the energy-vs-smi check fail, energy-vs-meter holds
    c = _by_name(G.meter_checks(idle, busy, _smi(75.0, 3.0), _smi(828.0, 99.0), 30 * GIB, TORCH))
    assert c["mean power, W (busy)"]["status"] == "fail"
    assert c["energy counter, J (busy) vs nvidia-smi mean power × window"]["status"] == "fail"
    assert c["energy counter, J (busy) vs the meter's mean power × window"]["status"] == "pass"
    assert c["mean power, W (idle)"]["status"] == "pass"
    assert G.exit_status(list(c.values())) == G.EXIT_FAIL
    # device memory 6% apart, this process's memory 6% apart
    c = _by_name(G.meter_checks(idle, busy, _smi(75.0, 3.0, used=33 * GIB), _smi(690.0, 99.0, used=33 * GIB),
                                32 * GIB, TORCH))
    assert c["device memory used, max, GiB (busy)"]["status"] == "fail"
    assert c["device memory used, max, GiB (idle)"]["status"] == "fail"
    assert c["this process's GPU memory, max, GiB (busy)"]["status"] == "fail"
    # a load that did not keep the GPU busy, an idle GPU that was not idle, another device than torch's
    c = _by_name(G.meter_checks(_window(75.0, 40.0), _window(690.0, 60.0), _smi(75.0, 40.0), _smi(690.0, 60.0),
                                30 * GIB, {"uuid": "11111111-other", "name": "NVIDIA H200"}))
    for name in ("utilization, mean % (busy; tokenmill)", "utilization, mean % (idle; tokenmill)",
                 "utilization, mean % (busy; nvidia-smi)", "utilization, mean % (idle; nvidia-smi)",
                 "the device the meter reads is torch's cuda:0 (UUID)"):
        assert c[name]["status"] == "fail", name


def test_a_meter_that_read_nothing_fails_and_a_missing_reference_is_not_judged():
    idle, busy = _window(75.0, 0.0), _window(690.0, 100.0)
    for g in busy["measure"]["gpus"]:
        g["energy_j"] = None  # a device without NVML's energy counter
        g["power_w_mean"] = None
    c = _by_name(G.meter_checks(idle, busy, _smi(75.0, 0.0), _smi(690.0, 99.0), None, TORCH))
    assert c["energy counter, J (busy) vs nvidia-smi mean power × window"]["status"] == "fail"
    assert "not supported" in c["energy counter, J (busy) vs nvidia-smi mean power × window"]["note"]
    assert c["mean power, W (busy)"]["status"] == "fail"
    # nvidia-smi listed no process with our pid (a container's PID namespace): nothing to compare
    assert c["this process's GPU memory, max, GiB (busy)"]["status"] == "n/a"
    assert "PID namespace" in c["this process's GPU memory, max, GiB (busy)"]["note"]


def _one(**over):
    one = {"cuda_visible_devices": "0", "torch_device_count": 1, "torch_uuids": ["00000000-fake"],
           "visible_gpus": [UUID], "launcher": {"device": "NVIDIA H200", "device_type": "gpu", "device_count": 1},
           "worker": {"device_type": "gpu", "device_model": "NVIDIA H200", "device_count": 1, "nvml_error": None,
                      "gpu_uuids": [UUID]},
           "rate": {"usd_per_hour": 3.99, "units": "1 × NVIDIA H200", "source": "price table entry 'h200'"}}
    one.update(over)
    return one


@pytest.fixture(scope="module")
def no_devices():
    """A real child of the check with CUDA_VISIBLE_DEVICES empty (here: torch, NVML-less detector, meter, prices)."""
    return G.run_child("")


def test_with_no_visible_device_every_layer_sees_a_cpu_worker(no_devices):
    assert "error" not in no_devices, no_devices.get("error")
    assert no_devices["torch_device_count"] == 0 and no_devices["visible_gpus"] == []
    assert no_devices["worker"]["device_type"] == "cpu" and no_devices["launcher"]["device_type"] == "cpu"
    device = {"index": 0, "uuid": UUID, "name": "NVIDIA H200"}
    checks = G.device_checks(_one(), no_devices, device, 3.99)
    assert [c["check"] for c in checks if c["status"] != "pass"] == []


def test_device_accounting_that_counts_the_host_or_the_wrong_device_fails(no_devices):
    device = {"index": 0, "uuid": UUID, "name": "NVIDIA H200"}
    bad = _one(launcher={"device_type": "gpu", "device_count": 8}, worker={
        "device_type": "gpu", "device_model": "NVIDIA H200", "device_count": 1, "gpu_uuids": ["GPU-11111111-other"]},
        rate={"usd_per_hour": 8 * 3.99})
    c = _by_name(G.device_checks(bad, no_devices, device, 3.99))
    failed = sorted(k for k, v in c.items() if v["status"] == "fail")
    assert failed == ["CUDA_VISIBLE_DEVICES=0: launcher's hardware: device type, count",
                      "CUDA_VISIBLE_DEVICES=0: worker meter reads that device",
                      "CUDA_VISIBLE_DEVICES=0: worker priced, USD/h"]
    gpu_none = {**no_devices, "worker": {"device_type": "gpu", "device_count": 1},
                "rate": {"source": "price table entry 'h200'"}}
    c = _by_name(G.device_checks(_one(), gpu_none, device, 3.99))
    assert c["CUDA_VISIBLE_DEVICES='': worker meter: device type, count"]["status"] == "fail"
    assert c["CUDA_VISIBLE_DEVICES='': worker priced as"]["status"] == "fail"
    # a child that crashed fails its rows rather than passing them
    c = G.device_checks({"cuda_visible_devices": "0", "error": "Traceback ..."}, no_devices, device, 3.99)
    assert sum(x["status"] == "fail" for x in c) == 7


def _run_check(tmp_path, **env):
    e = {**os.environ, **env}
    out = tmp_path / "r.json"
    p = subprocess.run([sys.executable, "-X", "importtime", "-m", "bench.gpu_check", "--out", str(out)], cwd=ROOT,
                       env=e, capture_output=True, text=True, timeout=120)
    imported = [line.split("|")[-1].strip() for line in p.stderr.splitlines() if line.startswith("import time:")]
    return p, out, imported


def test_with_every_device_hidden_it_says_so_in_one_line_and_exits_3(tmp_path):
    p, out, imported = _run_check(tmp_path, CUDA_VISIBLE_DEVICES="")
    assert p.returncode == G.EXIT_NO_GPU == 3
    assert p.stdout.splitlines() == [
        "gpu-check: no NVIDIA GPU here (CUDA_VISIBLE_DEVICES='' hides every device); nothing to check (exit 3)"]
    assert not out.exists()
    assert "tokenmill.transforms.engines.meter" in imported
    heavy = [m for m in imported if m.split(".")[0] in ("vllm", "apache_beam", "sqlalchemy", "torch", "pandas")]
    assert heavy == []


@pytest.mark.skipif(Path("/proc/driver/nvidia/gpus").is_dir() and any(Path("/proc/driver/nvidia/gpus").iterdir()),
                    reason="an NVIDIA GPU is here")
def test_on_a_machine_without_a_gpu_it_says_so_in_one_line_and_exits_3(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("CUDA_VISIBLE_DEVICES", "TOKENMILL_FORCE_CPU")}
    p = subprocess.run([sys.executable, "-m", "bench.gpu_check", "--out", str(tmp_path / "r.json")], cwd=ROOT,
                       env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 3
    assert p.stdout.splitlines() == ["gpu-check: no NVIDIA GPU here (no NVIDIA driver with a GPU "
                                     "(/proc/driver/nvidia/gpus is absent or empty)); nothing to check (exit 3)"]
    assert not (tmp_path / "r.json").exists()


def test_importing_the_meter_pulls_in_no_engine_runner_or_database():
    p = subprocess.run([sys.executable, "-c", "import sys, tokenmill.transforms.engines.meter, "
                        "tokenmill.jobs.metrics.pricing, tokenmill.jobs.metrics.hardware; print(sorted(sys.modules))"],
                       capture_output=True, text=True, timeout=60, check=True)
    mods = json.loads(p.stdout.replace("'", '"'))
    assert [m for m in mods if m.split(".")[0] in ("vllm", "apache_beam", "sqlalchemy", "torch")] == []
