"""The lease part of `make gpu-check` (bench/lease_check.py) without a GPU: its verdicts on
fabricated child reports, and its one line where there is no GPU."""

import subprocess
import sys
from pathlib import Path

from bench import lease_check as L

ROOT = Path(__file__).resolve().parent.parent
A, B = "GPU-aaaa-1111", "GPU-bbbb-2222"


def _passed(checks):
    return [c["status"] == "pass" for c in checks]


def _seen(uuid, count=1, torch_uuid=None):
    return {"leased": [uuid], "torch_device_count": count, "torch_uuids": [torch_uuid or uuid.removeprefix("GPU-")]}


def test_two_leases_on_their_own_devices_pass():
    checks = L.lease_checks([_seen(A), _seen(B)], host_gpus=8)
    assert _passed(checks) == [True, True, True]


def test_a_lease_whose_torch_sees_another_or_more_devices_fails():
    assert L.lease_checks([_seen(A, torch_uuid="bbbb-2222"), _seen(B)], host_gpus=8)[0]["status"] == "fail"
    assert L.lease_checks([_seen(A, count=2), _seen(B)], host_gpus=8)[0]["status"] == "fail"


def test_the_same_device_leased_twice_fails():
    assert L.lease_checks([_seen(A), _seen(A)], host_gpus=8)[-1]["status"] == "fail"


def test_a_refused_second_lease_passes_only_on_a_one_gpu_host():
    refused = {"refused": "host h: no free group of 1 GPU(s) after 0 s: GPU-aaaa leased by pid 7"}
    assert _passed(L.lease_checks([_seen(A), refused], host_gpus=1)) == [True, True]
    assert _passed(L.lease_checks([_seen(A), refused], host_gpus=8)) == [True, False]


def test_without_a_gpu_it_says_so_in_one_line_and_exits_3():
    env = {"PATH": "/usr/bin:/bin", "CUDA_VISIBLE_DEVICES": ""}
    p = subprocess.run([sys.executable, "-m", "bench.lease_check"], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 3, p.stderr
    assert p.stdout.strip().splitlines() == [
        "lease-check: no NVIDIA GPU here (CUDA_VISIBLE_DEVICES='' hides every device); nothing to check (exit 3)"]
