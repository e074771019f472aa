"""Device leases: each worker process's engine gets its own group of GPUs on its host.

Without them every engine of a host lands on the first visible GPU (CUDA's default): with
eight workers on an eight-GPU host, seven fail vLLM's free-memory check or all eight share
GPU 0 while seven idle.  Before its engine starts, a worker leases a group of
`EngineKind.devices_per_engine` devices and sets `CUDA_VISIBLE_DEVICES` to their UUIDs, so
the engine (and the engine core or tensor-parallel ranks it starts, which inherit the
environment) sees only those.  Only subprocesses started after the lease see it: a process
that had already initialised CUDA itself keeps the devices it saw.

A lease is an exclusive `flock` on one file per device, `<lease dir>/<uuid>.lock`, shared
by every process of the host whatever its `CUDA_VISIBLE_DEVICES`.  The kernel drops the
lock with the last open descriptor of the file: a worker killed by kill -9 or the OOM
killer frees its devices at once, and a forked child (an engine core that outlives its
owner and still holds GPU memory) keeps them until it dies too.  The holder's pid, host
and job are written into the file so a worker that finds no free group says who holds
them.  The lease dir is `TOKENMILL_LEASE_DIR`, else `tokenmill-leases` in the system's
temp dir; processes that share GPUs must share it (a host whose /tmp is per container sets
it to a shared path).

Groups are aligned when they can be (devices [i*n, (i+1)*n) of the visible ones), so the
devices of a tensor-parallel group are neighbours; any free devices otherwise.  A worker
that finds none free polls until `TOKENMILL_LEASE_WAIT_S` (default 600 s) has passed, then
fails in one line (`LeaseUnavailable`).  Two engines never share a device: there is no
shared mode.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import socket
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from tokenmill.transforms.engines.device import host_gpus, select_visible, visible_gpus
from tokenmill.transforms.engines.protocol import EngineStartError

log = logging.getLogger(__name__)

LEASE_DIR_ENV = "TOKENMILL_LEASE_DIR"
LEASE_WAIT_ENV = "TOKENMILL_LEASE_WAIT_S"
DEFAULT_WAIT_S = 600.0
POLL_S = 0.5


class LeaseUnavailable(EngineStartError):
    """No group of free devices could be leased; the message is one line naming the host,
    the group size and who holds the devices."""


def lease_dir() -> Path:
    """Where this host's lease files are (`TOKENMILL_LEASE_DIR`, else under the temp dir)."""
    return Path(os.environ.get(LEASE_DIR_ENV) or Path(tempfile.gettempdir()) / "tokenmill-leases")


def wait_limit_s() -> float:
    """How long a worker waits for a free group (`TOKENMILL_LEASE_WAIT_S`, default 600 s)."""
    raw = os.environ.get(LEASE_WAIT_ENV)
    if not raw:
        return DEFAULT_WAIT_S
    try:
        return max(0.0, float(raw))
    except ValueError:
        raise LeaseUnavailable(f"{LEASE_WAIT_ENV} must be a number of seconds, got {raw!r}") from None


@dataclass
class Lease:
    """Devices held by this process (`devices`: `device.visible_gpus` entries) until `release`
    or the process's end."""

    devices: list[dict[str, Any]]
    _fds: list[int] = field(default_factory=list, repr=False)
    job: str = ""
    """The job the holder note names."""

    @property
    def uuids(self) -> list[str]:
        return [d["uuid"] for d in self.devices]

    @property
    def cuda_visible_devices(self) -> str:
        """The `CUDA_VISIBLE_DEVICES` value that shows exactly these devices, in NVML's order."""
        return ",".join(self.uuids)

    @property
    def held(self) -> bool:
        return bool(self._fds)

    def release(self) -> None:
        """Free the devices (closing the descriptors drops the locks)."""
        fds, self._fds = self._fds, []
        for fd in fds:
            try:
                os.close(fd)
            except OSError:
                pass


def aligned_groups(devices: list[dict[str, Any]], n: int) -> list[list[dict[str, Any]]]:
    """The groups of `n` neighbouring devices, `devices[i*n:(i+1)*n]`: the ones a lease tries first."""
    return [devices[i * n:(i + 1) * n] for i in range(len(devices) // n)] if n > 0 else []


def leasable_groups(n: int, devices: list[dict[str, Any]] | None = None) -> int:
    """How many engines of `n` devices each this host's visible devices make (0 without a GPU)."""
    devices = visible_gpus() if devices is None else devices
    return len(devices) // n if n > 0 else 0


def lock_path(uuid: str) -> Path:
    """A device's lease file (an old driver's MIG UUID, `MIG-GPU-…/1/0`, made one file name)."""
    return lease_dir() / f"{uuid.replace('/', '_')}.lock"


def holder(uuid: str) -> dict[str, Any] | None:
    """What the last holder of a device's lease wrote into its file (pid, host, job), if readable."""
    try:
        return json.loads(lock_path(uuid).read_text() or "null")
    except (OSError, ValueError):
        return None


def _open(path: Path) -> int:
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    except PermissionError:  # another user's file: a read-only descriptor locks it all the same
        return os.open(path, os.O_RDONLY)
    try:
        os.fchmod(fd, 0o666)  # every user's workers share the host's GPUs
    except OSError:
        pass
    return fd


def _try_lock(uuid: str) -> int | None:
    path = lock_path(uuid)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = _open(path)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


def _write_holder(fd: int, job: str) -> None:
    note = json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "job": job, "since": time.time()})
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, note.encode(), 0)
    except OSError:  # a read-only descriptor: the lock holds, the note stays the last writer's
        pass


def try_lease(n: int, devices: list[dict[str, Any]], job: str = "") -> Lease | None:
    """One attempt: the first aligned group of `n` of `devices` whose every lock this process
    takes, else the first `n` free devices; None when fewer than `n` are free."""
    for group in [*aligned_groups(devices, n), devices]:
        lease = Lease([], [])
        for d in group:
            fd = _try_lock(d["uuid"])
            if fd is None and group is not devices:
                break  # an aligned group is taken whole or not at all
            if fd is not None:
                lease.devices.append(d)
                lease._fds.append(fd)
            if len(lease.devices) == n:
                lease.job = job
                for fd in lease._fds:
                    _write_holder(fd, job)
                return lease
        lease.release()
    return None


def _held_by(devices: list[dict[str, Any]]) -> str:
    parts = []
    for d in devices:
        if _try_lock_probe(d["uuid"]):
            continue
        h = holder(d["uuid"]) or {}
        who = f"pid {h.get('pid')} on {h.get('host')}" + (f" (job {h['job']})" if h.get("job") else "")
        parts.append(f"{d['uuid']} by {who if h else 'an unknown process'}")
    return ", ".join(parts) or "none (they were freed while this worker gave up)"


def _try_lock_probe(uuid: str) -> bool:
    """Whether the device's lock is free now (taken and dropped at once)."""
    fd = _try_lock(uuid)
    if fd is None:
        return False
    os.close(fd)
    return True


def acquire(n: int, devices: list[dict[str, Any]], *, job: str = "", wait_s: float | None = None,
            sleep: Callable[[float], None] = time.sleep, clock: Callable[[], float] = time.monotonic) -> Lease:
    """A lease of `n` of `devices`, waiting up to `wait_s` (default `wait_limit_s()`) for one to
    be free; LeaseUnavailable (one line) when the host has too few devices or none came free."""
    host = socket.gethostname()
    if n > len(devices):
        raise LeaseUnavailable(f"an engine needs {n} GPU(s) but host {host} shows {len(devices)} "
                               f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r})")
    wait_s = wait_limit_s() if wait_s is None else wait_s
    deadline = clock() + wait_s
    told = False
    while True:
        lease = try_lease(n, devices, job)
        if lease is not None:
            if told:
                log.info("leased %s on %s after waiting", lease.cuda_visible_devices, host)
            return lease
        if clock() >= deadline:
            raise LeaseUnavailable(
                f"no free group of {n} GPU(s) on host {host} after waiting {wait_s:g} s; held: "
                f"{_held_by(devices)} (lease dir {lease_dir()}, wait limit {LEASE_WAIT_ENV})")
        if not told:
            log.warning("no free group of %d GPU(s) on %s: waiting up to %g s (held: %s)",
                        n, host, wait_s, _held_by(devices))
            told = True
        sleep(POLL_S)


# ---------------------------------------------------------------- the process's lease

_LOCK = threading.Lock()
_HELD: Lease | None = None
_UNSET = object()
#: CUDA_VISIBLE_DEVICES as it was before this process's first lease: the devices it leases from
_BEFORE: Any = _UNSET


def held() -> Lease | None:
    """The lease this process holds for its engine, if any."""
    return _HELD


def process_lease(n: int, *, job: str = "", wait_s: float | None = None) -> Lease | None:
    """This process's lease of `n` devices, taken once and kept for the process's life (a
    restarted engine keeps its devices), with `CUDA_VISIBLE_DEVICES` set to them; None when
    `n` is 0 or this host shows no GPU.  A lease of another size replaces the held one (the
    caller has stopped the engine on it first)."""
    global _HELD, _BEFORE
    if n <= 0:
        return None
    with _LOCK:
        if _HELD is not None and len(_HELD.devices) == n:
            if job != _HELD.job:  # the next job of a long-lived worker (Dask): the note names it
                _HELD.job = job
                for fd in _HELD._fds:
                    _write_holder(fd, job)
            return _HELD
        release_process_lease()
        before = os.environ.get("CUDA_VISIBLE_DEVICES")
        devices = select_visible(host_gpus(), before)
        if not devices:
            return None
        lease = acquire(n, devices, job=job, wait_s=wait_s)
        _BEFORE, _HELD = before, lease
        os.environ["CUDA_VISIBLE_DEVICES"] = lease.cuda_visible_devices
        log.info("engine devices on %s: %s", socket.gethostname(), lease.cuda_visible_devices)
        return lease


def release_process_lease() -> None:
    """Free this process's lease and give back the `CUDA_VISIBLE_DEVICES` it had before."""
    global _HELD, _BEFORE
    if _HELD is None:
        return
    _HELD.release()
    _HELD = None
    if _BEFORE is None:
        os.environ.pop("CUDA_VISIBLE_DEVICES", None)
    elif _BEFORE is not _UNSET:
        os.environ["CUDA_VISIBLE_DEVICES"] = _BEFORE
    _BEFORE = _UNSET
