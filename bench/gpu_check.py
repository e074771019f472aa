"""GPU check: tokenmill's per-worker meter held against nvidia-smi on a real GPU.

    python -m bench.gpu_check [--out FILE] [--idle-s 8] [--busy-s 20]      (or: make gpu-check)

Needs PyTorch (a CUDA build), nvidia-ml-py, psutil and the driver's `nvidia-smi`;
no vLLM, Beam or database: it imports only the meter (transforms/engines/meter.py), the GPU
detector (engines/device.py), the launcher's hardware description and the price
table, none of which imports more than the standard library, pynvml and psutil.  From a
clone where tokenmill is not installed it uses the clone's code.  About a minute.

On the first GPU this process sees, it
1. holds a known block of device memory (40% of the device, at most 32 GiB) and
   leaves the GPU idle for `--idle-s`, then
2. runs bf16 matmuls back to back for `--busy-s` (after 3 s of warm-up),
measuring each window with `WorkerMeter` (sampling every 0.25 s) while
`nvidia-smi --query-gpu=memory.used,power.draw,utilization.gpu --loop-ms=250` runs
beside it.  The checks (`meter_checks`):
* device memory used, max over each window, within 5% of nvidia-smi's; this
  process's memory (NVML's compute processes) within 5% of
  `nvidia-smi --query-compute-apps`;
* mean power over each window within 10% of nvidia-smi's mean power.draw;
* energy from NVML's total-energy counter over the busy window within 10% of
  nvidia-smi's mean power × the window, and of the meter's own mean power × window;
* utilization: mean ≥ 90% busy and ≤ 10% idle, for the meter and for nvidia-smi;
* the device the meter reads is the one torch computes on (same UUID and model).
3. Then the device accounting (`device_checks`), a subprocess each, with
   `CUDA_VISIBLE_DEVICES` set to that one device's index, and set empty: torch,
   the detector, the launcher's hardware description and the worker's meter each
   see 1 device (the right one; priced as one GPU of its model) and none (a CPU
   worker, priced per vCPU and GiB).
4. Then two device leases (bench/lease_check.py), held at once by two processes
   as two workers hold them: each one's torch sees only its own leased device,
   and the two differ (on a one-GPU host the second is refused in one line).

It prints a table and writes the JSON result (default
bench/results/gpu-check-<UTC stamp>.json).  Exit status: 0 every check passed;
1 a check failed; 2 bad arguments; 3 no NVIDIA GPU here (one line says why,
nothing is written); 4 a GPU is here but the check cannot run (no nvidia-ml-py,
no psutil, torch without CUDA, no nvidia-smi: one line says which).
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if __package__ in (None, ""):  # run as a file: python bench/gpu_check.py
    sys.path.insert(0, str(ROOT))
# bench.gpu_common before any tokenmill import: on a bare clone it makes the folders importable as tokenmill
from bench.common import RESULTS, utc_now, utc_stamp  # noqa: E402
from bench.gpu_common import EXIT_CANNOT_RUN, EXIT_NO_GPU, EXIT_PASS, check, exit_status, no_gpu_reason, table  # noqa: E402
from bench.gpu_common import EXIT_FAIL as EXIT_FAIL  # noqa: E402  (the exit statuses, all five, named here too)
from bench.gpu_common import EXIT_USAGE as EXIT_USAGE  # noqa: E402
from bench.lease_check import lease_checks, run_children  # noqa: E402
from tokenmill.transforms.engines.meter import max_of, mean_of  # noqa: E402  (the meter's own reductions: None-skipping)

MIB = 1 << 20
GIB = 1 << 30
#: limits of the checks (fractions of the reference; utilization in percent)
MEMORY_TOL, POWER_TOL, ENERGY_TOL = 0.05, 0.10, 0.10
BUSY_UTIL_MIN, IDLE_UTIL_MAX = 90.0, 10.0
SMI_FIELDS = ("memory.used", "power.draw", "utilization.gpu")


# ------------------------------------------------------------------ pure parts (tests/test_gpu_check.py)

def _num(v: str) -> float | None:
    v = v.strip()
    try:
        return float(v)
    except ValueError:  # "[N/A]", "[Not Supported]"
        return None


def parse_smi_gpu(line: str) -> dict[str, float | None] | None:
    """One line of `nvidia-smi --query-gpu=memory.used,power.draw,utilization.gpu
    --format=csv,noheader,nounits` (MiB, W, %) → bytes, watts, percent; None for a line
    that is not one."""
    parts = line.strip().split(",")
    if len(parts) != len(SMI_FIELDS):
        return None
    mem, power, util = (_num(p) for p in parts)
    return {"memory_used_bytes": mem * MIB if mem is not None else None, "power_w": power, "util_pct": util}


def parse_smi_apps(text: str, pid: int) -> int | None:
    """Bytes `nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader,nounits`
    lists for `pid` (summed over its lines), None when it lists none."""
    found = None
    for row in csv.reader(io.StringIO(text)):
        if len(row) == 2 and row[0].strip().isdigit() and int(row[0]) == pid:
            mem = _num(row[1])
            if mem is not None:
                found = (found or 0) + int(mem * MIB)
    return found


def within(name: str, value: float | None, ref: float | None, tol: float, note: str = "") -> dict[str, Any]:
    """`value` within `tol` (a fraction) of `ref`; a missing value fails, a missing reference is n/a."""
    limit = f"within {tol:.0%} of reference"
    if ref is None:
        return check(name, value, ref, None, limit, note or "no reference reading")
    if value is None:
        return check(name, value, ref, False, limit, note or "tokenmill read nothing")
    ok = abs(value - ref) <= tol * abs(ref)
    off = f"{(value - ref) / ref:+.1%}" if ref else ""
    return check(name, value, ref, ok, limit, (f"{off} " + note).strip())


def _gib(b: float | None) -> float | None:
    return b / GIB if b is not None else None


def _gpu0(reading: dict[str, Any]) -> dict[str, Any]:
    gpus = (reading.get("measure") or {}).get("gpus") or [{}]
    return gpus[0]


def _uuid(u: str | None) -> str | None:
    """A device UUID without its `GPU-` prefix, lower case (torch gives it bare, NVML prefixed)."""
    if not u:
        return None
    u = str(u).lower()
    return u[4:] if u.startswith("gpu-") else u


def meter_checks(idle: dict[str, Any], busy: dict[str, Any], smi_idle: list[dict[str, Any]],
                 smi_busy: list[dict[str, Any]], smi_process_memory_bytes: int | None,
                 torch_device: dict[str, Any]) -> list[dict[str, Any]]:
    """The meter's readings of the idle and busy windows (`WorkerMeter.reading()`) against
    nvidia-smi's samples taken in the same windows (`parse_smi_gpu`), its process-memory
    line for this process (`parse_smi_apps`, read at the end of the busy window) and
    torch's device (`uuid`, `name`)."""
    out = []
    gi, gb = _gpu0(idle), _gpu0(busy)
    mb = busy.get("measure") or {}
    for label, g, smi in (("idle", gi, smi_idle), ("busy", gb, smi_busy)):
        out.append(within(f"device memory used, max, GiB ({label})", _gib(g.get("memory_used_bytes_max")),
                          _gib(max_of([s["memory_used_bytes"] for s in smi])), MEMORY_TOL))
    procs_note = "" if smi_process_memory_bytes is not None else \
        "nvidia-smi lists no process with this pid (a container's own PID namespace?)"
    out.append(within("this process's GPU memory, max, GiB (busy)", _gib(gb.get("process_memory_bytes_max")),
                      _gib(smi_process_memory_bytes), MEMORY_TOL, procs_note))
    for label, g, smi in (("idle", gi, smi_idle), ("busy", gb, smi_busy)):
        out.append(within(f"mean power, W ({label})", g.get("power_w_mean"),
                          mean_of([s["power_w"] for s in smi]), POWER_TOL))
    window = mb.get("window_s")
    smi_power = mean_of([s["power_w"] for s in smi_busy])
    energy = gb.get("energy_j")
    counter_note = "" if energy is not None else "NVML's energy counter is not supported on this device"
    out.append(within("energy counter, J (busy) vs nvidia-smi mean power × window", energy,
                      smi_power * window if smi_power is not None and window else None, ENERGY_TOL, counter_note))
    out.append(within("energy counter, J (busy) vs the meter's mean power × window", energy,
                      gb.get("energy_j_from_power"), ENERGY_TOL, counter_note))
    for who, busy_u, idle_u in (("tokenmill", gb.get("util_pct_mean"), gi.get("util_pct_mean")),
                                ("nvidia-smi", mean_of([s["util_pct"] for s in smi_busy]),
                                 mean_of([s["util_pct"] for s in smi_idle]))):
        out.append(check(f"utilization, mean % (busy; {who})", busy_u, BUSY_UTIL_MIN,
                         busy_u is not None and busy_u >= BUSY_UTIL_MIN, f">= {BUSY_UTIL_MIN:.0f}"))
        out.append(check(f"utilization, mean % (idle; {who})", idle_u, IDLE_UTIL_MAX,
                         idle_u is not None and idle_u <= IDLE_UTIL_MAX, f"<= {IDLE_UTIL_MAX:.0f}"))
    dev = ((busy.get("measure") or {}).get("gpus") or [{}])[0]
    out.append(check("the device the meter reads is torch's cuda:0 (UUID)", dev.get("uuid"), torch_device.get("uuid"),
                     _uuid(dev.get("uuid")) is not None and _uuid(dev.get("uuid")) == _uuid(torch_device.get("uuid")),
                     "equal"))
    out.append(check("device model", busy.get("device_model"), torch_device.get("name"),
                     bool(busy.get("device_model")) and busy.get("device_model") == torch_device.get("name"), "equal"))
    return out


def device_checks(one: dict[str, Any], none: dict[str, Any], device: dict[str, Any],
                  gpu_usd_per_hour: float) -> list[dict[str, Any]]:
    """What each layer saw with `CUDA_VISIBLE_DEVICES` set to `device`'s index (`one`) and set
    empty (`none`), from `child_report`; `device`: the device under test (`uuid`, `name`);
    `gpu_usd_per_hour`: the price table's figure for one of it."""
    out = []
    cvd = one.get("cuda_visible_devices")
    pre = f"CUDA_VISIBLE_DEVICES={cvd}:"
    want = _uuid(device.get("uuid"))
    out.append(check(f"{pre} torch device count", one.get("torch_device_count"), 1, one.get("torch_device_count") == 1,
                     "equal"))
    out.append(check(f"{pre} torch's cuda:0 is that device", one.get("torch_uuids"), device.get("uuid"),
                     [_uuid(u) for u in one.get("torch_uuids") or []] == [want], "equal"))
    out.append(check(f"{pre} detector (engines/device.py)", one.get("visible_gpus"), [device.get("uuid")],
                     [_uuid(u) for u in one.get("visible_gpus") or []] == [want], "equal"))
    launcher = one.get("launcher") or {}
    out.append(check(f"{pre} launcher's hardware: device type, count", [launcher.get("device_type"),
                     launcher.get("device_count")], ["gpu", 1],
                     [launcher.get("device_type"), launcher.get("device_count")] == ["gpu", 1], "equal"))
    w = one.get("worker") or {}
    seen, want_w = [w.get("device_type"), w.get("device_count"), w.get("device_model")], ["gpu", 1, device.get("name")]
    out.append(check(f"{pre} worker meter: device type, count, model", seen, want_w, seen == want_w, "equal"))
    out.append(check(f"{pre} worker meter reads that device", w.get("gpu_uuids"), [device.get("uuid")],
                     [_uuid(u) for u in w.get("gpu_uuids") or []] == [want], "equal"))
    rate = (one.get("rate") or {}).get("usd_per_hour")
    out.append(check(f"{pre} worker priced, USD/h", rate, gpu_usd_per_hour,
                     rate is not None and abs(rate - gpu_usd_per_hour) < 1e-9, "one GPU of its model"))
    pre = "CUDA_VISIBLE_DEVICES='':"
    out.append(check(f"{pre} torch device count", none.get("torch_device_count"), 0,
                     none.get("torch_device_count") == 0, "equal"))
    out.append(check(f"{pre} detector (engines/device.py)", none.get("visible_gpus"), [],
                     none.get("visible_gpus") == [], "equal"))
    launcher = none.get("launcher") or {}
    out.append(check(f"{pre} launcher's hardware: device type", launcher.get("device_type"), "cpu",
                     launcher.get("device_type") == "cpu", "equal"))
    w = none.get("worker") or {}
    out.append(check(f"{pre} worker meter: device type, count", [w.get("device_type"), w.get("device_count")],
                     ["cpu", None], [w.get("device_type"), w.get("device_count")] == ["cpu", None], "equal"))
    rate = none.get("rate") or {}
    out.append(check(f"{pre} worker priced as", rate.get("source"), "per vCPU and GiB",
                     "cpu_vcpu" in str(rate.get("source")), "CPU prices"))
    return out


# ------------------------------------------------------------------ on the GPU

def cannot_run_reason() -> str | None:
    """What this check itself lacks on a GPU host (None: nothing)."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception as err:
        return f"NVML cannot be read ({type(err).__name__}: {err}); install nvidia-ml-py"
    try:
        import psutil  # noqa: F401  (the meter finds this process's tree, whose GPU memory it reads, with it)
    except ImportError:
        return "psutil is not installed"
    try:
        import torch
    except ImportError:
        return "PyTorch is not installed"
    if not torch.cuda.is_available():
        return f"torch {torch.__version__} sees no CUDA device (a CPU-only build?)"
    try:
        subprocess.run(["nvidia-smi", "-L"], check=True, capture_output=True, timeout=30)
    except (OSError, subprocess.SubprocessError) as err:
        return f"nvidia-smi does not run ({err})"
    return None


class SmiPoller(threading.Thread):
    """`nvidia-smi --query-gpu=… -lms <every_ms>` on one device; `samples`: (time.time(), parsed)."""

    def __init__(self, device_uuid: str, every_ms: int = 250):
        super().__init__(daemon=True, name="gpu-check-nvidia-smi")
        self.proc = subprocess.Popen(
            ["nvidia-smi", f"--query-gpu={','.join(SMI_FIELDS)}", "--format=csv,noheader,nounits",
             "-i", device_uuid, f"--loop-ms={every_ms}"], stdout=subprocess.PIPE, text=True)
        self.samples: list[tuple[float, dict[str, Any]]] = []

    def run(self):
        for line in self.proc.stdout:
            s = parse_smi_gpu(line)
            if s is not None:
                self.samples.append((time.time(), s))

    def between(self, t0: float, t1: float) -> list[dict[str, Any]]:
        return [s for t, s in list(self.samples) if t0 <= t <= t1]

    def stop(self):
        self.proc.terminate()
        self.proc.wait(10)


def _torch_uuid(props) -> str | None:
    u = getattr(props, "uuid", None)  # torch's device properties have it from 2.0 on
    return str(u) if u is not None else None


def child_report(engine_device: str) -> dict[str, Any]:
    """What torch, the detector, the launcher and a worker's meter see in this process
    (run with CUDA_VISIBLE_DEVICES set by the parent); `engine_device`: what the engine would say."""
    import torch

    from tokenmill.jobs.metrics.hardware import describe
    from tokenmill.jobs.metrics.pricing import price_table, worker_rate
    from tokenmill.transforms.engines.device import has_nvidia_gpu, visible_gpus
    from tokenmill.transforms.engines.meter import WorkerMeter

    n = torch.cuda.device_count()
    if engine_device == "auto":  # as vllm_session decides
        engine_device = "cuda" if has_nvidia_gpu() else "cpu"
    meter = WorkerMeter({"device": engine_device, "engine_kwargs": {}}, every_s=0.25)
    reading = meter.reading()
    hw = describe()
    return {
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "torch_device_count": n,
        "torch_uuids": [_torch_uuid(torch.cuda.get_device_properties(i)) for i in range(n)],
        "visible_gpus": [g["uuid"] for g in visible_gpus()],
        "launcher": {k: hw.get(k) for k in ("device", "device_type", "device_count")},
        "worker": {"device_type": reading["device_type"], "device_model": reading["device_model"],
                   "device_count": reading["device_count"], "nvml_error": reading["nvml_error"],
                   "gpu_uuids": [g["uuid"] for g in (reading["measure"]["gpus"] or [])]},
        "rate": worker_rate(reading, price_table()),
    }


def run_child(cvd: str) -> dict[str, Any]:
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": cvd}
    p = subprocess.run([sys.executable, "-m", "bench.gpu_check", "--child"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=120)
    if p.returncode != 0:
        return {"cuda_visible_devices": cvd, "error": (p.stderr or p.stdout).strip()[-2000:]}
    return json.loads(p.stdout.strip().splitlines()[-1])


def measure(idle_s: float, busy_s: float, warm_s: float = 3.0) -> dict[str, Any]:
    """The idle and busy windows on torch's cuda:0, metered and polled by nvidia-smi."""
    import pynvml
    import torch

    from tokenmill.transforms.engines.meter import WorkerMeter

    dev = torch.device("cuda:0")
    props = torch.cuda.get_device_properties(dev)
    torch_device = {"uuid": _torch_uuid(props), "name": props.name, "total_memory_bytes": props.total_memory}
    block_bytes = min(int(0.4 * props.total_memory), 32 * GIB)
    block = torch.ones(block_bytes, dtype=torch.uint8, device=dev)  # written, so it is resident
    n = 8192
    a = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    (a @ b).sum().item()  # cuBLAS initialised before the windows
    torch.cuda.synchronize()

    probe = WorkerMeter({"device": "cuda", "engine_kwargs": {}}, every_s=3600)
    if not probe.devices:
        raise RuntimeError(f"the meter found no device ({probe.nvml_error or 'NVML lists none visible'})")
    meter_dev = probe.devices[0]
    smi = SmiPoller(meter_dev["uuid"])
    smi.start()
    try:
        time.sleep(2.0)  # NVML's utilization is over its last sample period: let the set-up's kernels age out
        m = WorkerMeter({"device": "cuda", "engine_kwargs": {}}, every_s=0.25).start()
        time.sleep(idle_s)
        idle = m.reading()
        m.stop()

        stop = threading.Event()
        done = [0]

        def load():
            while not stop.is_set():
                for _ in range(20):
                    torch.matmul(a, b)
                torch.cuda.synchronize()
                done[0] += 20

        t = threading.Thread(target=load, daemon=True, name="gpu-check-load")
        t.start()
        time.sleep(warm_s)
        m = WorkerMeter({"device": "cuda", "engine_kwargs": {}}, every_s=0.25).start()
        time.sleep(busy_s)
        apps = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits",
                               "-i", meter_dev["uuid"]], capture_output=True, text=True, timeout=30).stdout
        busy = m.reading()
        m.stop()
        stop.set()
        t.join()
    finally:
        smi.stop()
    mi, mb = idle["measure"], busy["measure"]
    del block
    return {
        "torch_device": torch_device,
        "meter_device": meter_dev,
        "driver_version": pynvml.nvmlSystemGetDriverVersion(),
        "load": {"block_bytes": block_bytes, "matmul": f"bf16 {n}x{n} @ {n}x{n}", "matmuls": done[0],
                 "warm_s": warm_s},
        "tokenmill": {"idle": idle, "busy": busy},
        "nvidia_smi": {"idle": smi.between(mi["window_started_at"], mi["window_ended_at"]),
                       "busy": smi.between(mb["window_started_at"], mb["window_ended_at"]),
                       "process_memory_bytes": parse_smi_apps(apps, os.getpid()),
                       "compute_apps": apps},
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="the JSON result (default bench/results/gpu-check-<UTC stamp>.json)")
    ap.add_argument("--idle-s", type=float, default=8.0, help="seconds of the idle window")
    ap.add_argument("--busy-s", type=float, default=20.0, help="seconds of the busy (matmul) window")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(child_report("auto")))
        return 0
    why = no_gpu_reason()
    if why:
        print(f"gpu-check: no NVIDIA GPU here ({why}); nothing to check (exit {EXIT_NO_GPU})")
        return EXIT_NO_GPU
    why = cannot_run_reason()
    if why:
        print(f"gpu-check: a GPU is here but the check cannot run: {why} (exit {EXIT_CANNOT_RUN})")
        return EXIT_CANNOT_RUN

    from tokenmill.jobs.metrics.pricing import gpu_price, price_table

    started, t0 = utc_now(), time.perf_counter()
    m = measure(args.idle_s, args.busy_s)
    checks = meter_checks(m["tokenmill"]["idle"], m["tokenmill"]["busy"], m["nvidia_smi"]["idle"],
                          m["nvidia_smi"]["busy"], m["nvidia_smi"]["process_memory_bytes"], m["torch_device"])
    dev = m["meter_device"]
    one, none = run_child(str(dev["index"])), run_child("")
    checks += device_checks(one, none, dev, gpu_price(dev["name"], price_table())[0])
    from tokenmill.transforms.engines.device import visible_gpus

    leases = run_children()
    checks += lease_checks(leases, host_gpus=len(visible_gpus()))
    status = exit_status(checks)
    doc = {"benchmark": "gpu-check", "started_at": started, "finished_at": utc_now(),
           "wall_s": round(time.perf_counter() - t0, 1),
           "command": " ".join(["python -m bench.gpu_check", *(argv or sys.argv[1:])]),
           "limits": {"memory": MEMORY_TOL, "power": POWER_TOL, "energy": ENERGY_TOL,
                      "busy_util_min_pct": BUSY_UTIL_MIN, "idle_util_max_pct": IDLE_UTIL_MAX},
           "windows_s": {"idle": args.idle_s, "busy": args.busy_s},
           "passed": status == EXIT_PASS, "checks": checks, **m,
           "devices": {"one": one, "none": none}, "leases": leases}
    path = Path(args.out) if args.out else RESULTS / f"gpu-check-{utc_stamp()}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=2, default=str) + "\n")
    print(f"gpu-check on {dev['name']} (NVML index {dev['index']}), driver {m['driver_version']}: "
          f"idle {args.idle_s:g} s, busy {args.busy_s:g} s, {doc['wall_s']} s in all")
    print(table(checks))
    print(f"{'PASS' if status == EXIT_PASS else 'FAIL'}; result: {path}")
    return status


if __name__ == "__main__":
    sys.exit(main())
