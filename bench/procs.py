"""The processes of a `tokenmill run` tree, told apart and sampled.

`classify` names what a process is from its command line (vLLM sets process
titles with setproctitle, Beam's DirectRunner starts its SDK workers as
`python -m apache_beam.runners.worker.sdk_worker_main` under `/bin/sh -c`);
`ProcessSampler` reads the RSS and CPU time of every process in the tree every
`every_s` seconds and keeps each one's series and peak (and its CPU seconds at its
last sample: up to `every_s` of a process's last work is not seen) under a stable label
(`launcher`, `sdk_worker-1`, `engine_core-2`, ...: kind and order of first
sight).  Killed processes' children that outlive them are followed too.  A
runner whose workers look different adds a rule to `RULES`; one whose workers
are not the launcher's children (a dask cluster) hands their processes to the
sampler as further roots (`also`).
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable

import psutil

MiB = 1 << 20

#: (kind, test on the command line's parts); the first match wins; the launcher
#: (the root) and vLLM's titled processes are recognised before these.
RULES: list[tuple[str, Callable[[list[str]], bool]]] = [
    # DirectRunner multi_processing: `sh -c "python -m ...sdk_worker_main"` → python
    ("sdk_shell", lambda c: bool(c) and c[0].endswith("sh") and any("sdk_worker_main" in p for p in c)),
    ("sdk_worker", lambda c: any("sdk_worker_main" in p for p in c)),
    ("resource_tracker", lambda c: any("resource_tracker" in p for p in c)),
    # a dask cluster (bench/dask_cluster.py): dask titles its scheduler `dask scheduler [ADDRESS]`
    # and the worker that runs the tasks `dask worker [ADDRESS]`; that worker is a child of
    # `python -m distributed.cli.dask_worker ... --nanny`, the nanny, which keeps its command
    # line (before its title the worker is the nanny's multiprocessing spawn, below)
    ("dask_scheduler", lambda c: bool(c) and c[0].startswith("dask scheduler")
     or any("distributed.cli.dask_scheduler" in p for p in c)),
    ("dask_worker", lambda c: bool(c) and c[0].startswith("dask worker")),
    ("dask_nanny", lambda c: any("distributed.cli.dask_worker" in p for p in c)),
]

#: vLLM process titles (`VLLM::<title>`, vllm.utils.system_utils.set_process_title) → kind
VLLM_TITLES = {"EngineCore": "engine_core", "Worker": "engine_worker"}

#: kinds whose memory the scale targets compare (the rest are small helpers)
MAIN_KINDS = ("launcher", "sdk_worker", "engine_core", "engine_worker")


def classify(cmdline: list[str], *, is_root: bool = False, parent_kind: str | None = None) -> str:
    if is_root:
        return "launcher"
    if cmdline and cmdline[0].startswith("VLLM::"):
        title = cmdline[0].split()[0][len("VLLM::"):]
        for prefix, kind in VLLM_TITLES.items():
            if title.startswith(prefix):
                return kind
        return f"vllm:{title}"
    for kind, test in RULES:
        if test(cmdline):
            return kind
    # an engine core's child before it sets its title, a nanny's worker (multiprocessing spawn)
    spawned = {"engine_core": "engine_worker", "dask_nanny": "dask_worker"}
    if parent_kind in spawned and any("multiprocessing" in p for p in cmdline):
        return spawned[parent_kind]
    return "other"


@dataclass
class Proc:
    pid: int
    kind: str
    parent_pid: int | None
    first_s: float
    last_s: float = 0.0
    peak_rss: int = 0
    cpu_s: float = 0.0  # its own user + system CPU seconds at its last sample (not its children's)
    orphaned_s: float | None = None  # when it was first seen outside the tree (its parent died)
    samples: list[tuple[float, int]] = field(default_factory=list)
    cpu_samples: list[tuple[float, float]] = field(default_factory=list)  # (seconds, its own CPU seconds)


class ProcessSampler(threading.Thread):
    """RSS of every process under `root_pid`, per process, every `every_s` seconds.

    A process that leaves the tree (its parent was killed and it was re-parented)
    is still sampled while it lives, and marked orphaned.  `also`: further roots
    whose trees are sampled the same way (a cluster's scheduler and workers, which
    outlive the run by design)."""

    def __init__(self, root_pid: int, every_s: float = 0.5, also: list[int] | tuple[int, ...] = ()):
        super().__init__(daemon=True, name="bench-rss-sampler")
        self.root = psutil.Process(root_pid)
        self.also = [psutil.Process(pid) for pid in also]
        self.every_s = every_s
        self.t0 = time.monotonic()
        self.wall0 = time.time()  # the epoch time of t0: callers' stamps are epoch times
        self.procs: dict[int, Proc] = {}
        self._handles: dict[int, psutil.Process] = {}
        self._lock = threading.Lock()
        self._halt = threading.Event()

    @staticmethod
    def _trees(roots: list[psutil.Process]) -> list[psutil.Process]:
        out = []
        for r in roots:
            try:
                out += [r, *r.children(recursive=True)]
            except psutil.Error:
                pass
        return out

    def sample(self) -> None:
        now = time.monotonic() - self.t0
        tree = self._trees([self.root, *self.also])
        in_tree = {p.pid for p in tree}
        for p in tree:
            self._handles.setdefault(p.pid, p)
        with self._lock:
            for pid, p in list(self._handles.items()):
                try:
                    cmdline, rss, ppid, cpu = p.cmdline(), p.memory_info().rss, p.ppid(), p.cpu_times()
                    if p.status() == psutil.STATUS_ZOMBIE:
                        raise psutil.ZombieProcess(pid)
                except psutil.Error:
                    del self._handles[pid]
                    continue
                parent = self.procs.get(ppid)
                # classified every time: a forked child keeps its parent's command line
                # until it sets its own title
                kind = classify(cmdline, is_root=pid == self.root.pid, parent_kind=parent.kind if parent else None)
                rec = self.procs.get(pid)
                if rec is None:
                    rec = self.procs[pid] = Proc(pid, kind, ppid, now)
                elif kind != "other":  # an exiting process's command line reads empty: keep what it was
                    rec.kind = kind
                if pid not in in_tree and rec.orphaned_s is None:
                    rec.orphaned_s = now
                rec.last_s = now
                rec.peak_rss = max(rec.peak_rss, rss)
                rec.cpu_s = cpu.user + cpu.system
                rec.cpu_samples.append((now, rec.cpu_s))
                rec.samples.append((now, rss))

    def run(self) -> None:
        while not self._halt.wait(self.every_s):
            self.sample()

    def stop(self) -> None:
        self._halt.set()
        self.join(timeout=10)

    # ---- what the benchmark reads

    def _ordered(self) -> list[Proc]:
        return sorted(self.procs.values(), key=lambda r: (r.first_s, r.pid))

    def labels(self) -> dict[int, str]:
        """`launcher`, then `<kind>-<n>` in order of first sight: stable names for one run."""
        out: dict[int, str] = {}
        n: Counter = Counter()
        for r in self._ordered():
            if r.kind == "launcher":
                out[r.pid] = "launcher"
            else:
                n[r.kind] += 1
                out[r.pid] = f"{r.kind}-{n[r.kind]}"
        return out

    def alive(self, kind: str) -> list[tuple[str, int]]:
        """(label, pid) of the processes of `kind` seen in the latest round, oldest first."""
        with self._lock:
            latest = max((r.last_s for r in self.procs.values()), default=0.0)
            labels = self.labels()
            return [(labels[r.pid], r.pid) for r in self._ordered()
                    if r.kind == kind and r.last_s >= latest - 2 * self.every_s]

    def busiest(self, kind: str, over_s: float = 1.0) -> tuple[str, int] | None:
        """The live process of `kind` that used the most CPU (itself and its children) over
        the next `over_s` seconds: one that is still working, not one done with its share."""

        def cpu(pid: int) -> float:
            try:
                p = psutil.Process(pid)
                return sum(sum(q.cpu_times()[:2]) for q in [p, *p.children(recursive=True)])
            except psutil.Error:
                return float("-inf")

        cands = self.alive(kind)
        if not cands:
            return None
        before = {pid: cpu(pid) for _, pid in cands}
        time.sleep(over_s)
        return max(cands, key=lambda c: cpu(c[1]) - before[c[1]])

    def still_running(self) -> list[str]:
        """Labels of the processes (the root aside) alive now: what a run left behind.  The
        `also` trees (a cluster and the engines its workers keep for the next job) are not,
        but a process orphaned out of them is."""
        out = []
        with self._lock:
            labels = self.labels()
            pids = list(self.procs)
        kept = {p.pid for p in self._trees(self.also)}
        for pid in pids:
            if pid == self.root.pid or pid in kept:
                continue
            try:
                if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                    out.append(labels[pid])
            except psutil.Error:
                pass
        return sorted(out)

    def processes(self) -> list[dict]:
        with self._lock:
            labels = self.labels()
            return [{"label": labels[r.pid], "kind": r.kind, "pid": r.pid, "parent": labels.get(r.parent_pid),
                     "peak_rss_mib": round(r.peak_rss / MiB, 1), "cpu_s_sampled": round(r.cpu_s, 2), "seen_s": [round(r.first_s, 1), round(r.last_s, 1)],
                     **({"orphaned_at_s": round(r.orphaned_s, 1)} if r.orphaned_s is not None else {})}
                    for r in self._ordered()]

    def cpu_s_between(self, start: float, end: float) -> float:
        """CPU seconds every sampled process used between two epoch times (each process's
        reading at its last sample before each; up to `every_s` of a process that ended
        inside the window is not seen)."""
        a, b = start - self.wall0, end - self.wall0

        def at(samples: list[tuple[float, float]], t: float) -> float:
            return max((c for s, c in samples if s <= t), default=0.0)

        with self._lock:
            return sum(at(r.cpu_samples, b) - at(r.cpu_samples, a) for r in self.procs.values())

    def series(self, min_mib: float = 50.0) -> dict[str, list[list[float]]]:
        """[[seconds, MiB], ...] per process; helpers that never reach `min_mib` are left out."""
        with self._lock:
            labels = self.labels()
            return {labels[r.pid]: [[round(t, 1), round(b / MiB, 1)] for t, b in r.samples]
                    for r in self._ordered() if r.peak_rss >= min_mib * MiB}
