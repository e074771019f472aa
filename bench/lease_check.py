"""The device-lease part of `make gpu-check`: two processes each take a lease of one GPU
the way a worker does before its engine starts (transforms/engines/leases.py
`process_lease`), and PyTorch in each must see exactly its own device.

    python -m bench.lease_check            (run by bench/gpu_check.py; PyTorch only, no vLLM)

Each child leases, imports torch (after the lease set `CUDA_VISIBLE_DEVICES`, as the
engine's processes start after it), prints what it sees, and holds the lease until the
parent closes its stdin, so the two leases are held at the same time.  On a one-GPU host
the second child cannot lease (with `TOKENMILL_LEASE_WAIT_S=0` it fails at once) and the
check says that this host has a single device instead of failing.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from bench import gpu_common as G  # first: on a bare clone it makes the folders importable as tokenmill

ROOT = Path(__file__).resolve().parent.parent


def child() -> int:
    """In a child: lease one device, report what torch sees, hold it until stdin closes."""
    from tokenmill.transforms.engines.leases import LeaseUnavailable, process_lease

    try:
        lease = process_lease(1, job="gpu-check")
    except LeaseUnavailable as err:
        print(json.dumps({"refused": str(err)}), flush=True)
        return 0
    if lease is None:
        print(json.dumps({"refused": "no GPU visible to lease"}), flush=True)
        return 0
    import torch

    n = torch.cuda.device_count()
    uuids = []
    for i in range(n):
        u = getattr(torch.cuda.get_device_properties(i), "uuid", None)
        uuids.append(str(u) if u is not None else None)
    print(json.dumps({"leased": lease.uuids, "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
                      "torch_device_count": n, "torch_uuids": uuids}), flush=True)
    sys.stdin.read()  # hold the lease while the other child takes its own
    return 0


def run_children(count: int = 2, timeout_s: float = 120.0) -> list[dict[str, Any]]:
    """Start `count` lease children one after the other (each holding its lease), then let them go."""
    env = {**os.environ, "TOKENMILL_LEASE_WAIT_S": "0"}
    procs, reports = [], []
    try:
        for _ in range(count):
            p = subprocess.Popen([sys.executable, "-m", "bench.lease_check", "--child"], cwd=ROOT, env=env,
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            procs.append(p)
            line = p.stdout.readline() if p.stdout else ""
            reports.append(json.loads(line) if line.strip() else
                           {"error": (p.stderr.read() if p.stderr else "")[-2000:] or "no report"})
    finally:
        for p in procs:
            if p.stdin:
                p.stdin.close()
            try:
                p.wait(timeout_s)
            except subprocess.TimeoutExpired:
                p.kill()
    return reports


def _same(torch_uuid: str | None, nvml_uuid: str) -> bool:
    """torch prints a UUID without NVML's `GPU-` prefix."""
    return torch_uuid is not None and nvml_uuid.removeprefix("GPU-").lower() == torch_uuid.removeprefix("GPU-").lower()


def lease_checks(reports: list[dict[str, Any]], host_gpus: int) -> list[dict[str, Any]]:
    """Each leaseholder's torch sees one device, the one it leased; the leases differ; on a
    one-GPU host the second lease is refused (in one line) instead."""
    check = G.check
    out = []
    held = [r for r in reports if "leased" in r]
    for i, r in enumerate(reports):
        if "leased" in r:
            ok = r["torch_device_count"] == 1 and len(r["leased"]) == 1 and _same(r["torch_uuids"][0], r["leased"][0])
            out.append(check(f"lease {i + 1}: torch sees only its leased device", r["torch_uuids"], r["leased"], ok,
                             "1 device, the leased UUID"))
        elif "refused" in r:
            expected = host_gpus < len(reports) and i >= host_gpus
            out.append(check(f"lease {i + 1}: refused", r["refused"], f"{host_gpus} GPU(s) on this host", expected,
                             "only when every device is leased", "one line" if "\n" not in r["refused"] else "several lines"))
        else:
            out.append(check(f"lease {i + 1}: child ran", r.get("error"), None, False, "a report"))
    leased = [u for r in held for u in r["leased"]]
    if len(held) > 1:
        out.append(check("leases are distinct devices", leased, None, len(set(leased)) == len(leased), "no device twice"))
    return out


def main() -> int:
    """Alone (not from gpu_check): the lease checks as a table; exit 0 pass, 1 fail, 3 no GPU."""
    from tokenmill.transforms.engines.device import visible_gpus

    if "--child" in sys.argv:
        return child()
    why = G.no_gpu_reason()
    if why:
        print(f"lease-check: no NVIDIA GPU here ({why}); nothing to check (exit {G.EXIT_NO_GPU})")
        return G.EXIT_NO_GPU
    checks = lease_checks(run_children(), host_gpus=len(visible_gpus()))
    print(G.table(checks))
    return G.exit_status(checks)


if __name__ == "__main__":
    sys.exit(main())
