"""Where a `tokenmill run` process spends its wall: a stack sampler for the pipeline-ceiling
benchmark's profiled runs (bench/ceiling.py), started by bench/standin.py in every process
that loads the stand-in engine (the launcher, and each SDK worker).

Every `EVERY_S` seconds the sampler reads the stacks of the process's threads
(`sys._current_frames`) and charges the interval to one phase (`phase_of`):

- a thread inside a Beam bundle (a `bundle_processor` frame) is the work: its innermost
  frame in one of tokenmill's step modules names the phase (`STEP_FILES`, `STEP_FUNCS`);
  a bundle thread in none of them is Beam's own work between the steps;
- with no bundle running, the main thread: the CLI before `run_job` (start-up), the
  launcher's planning, waiting on the runner, export, accounting, and the exit after it;
  an SDK worker with no bundle is idle.

Frames are matched by file (relative to the repository root) and function name only, so the
product code needs no hook.  The counts go to `<folder>/phases-<pid>.json` every WRITE_EVERY_S
seconds and when the interpreter shuts its threads down (before `atexit`, where the CLI
leaves with `os._exit`); an SDK worker is stopped by its runner, so its last fraction of a
second may be lost.
A Python thread, it takes the GIL about 100 times a second for well under a millisecond:
the benchmark reports the profiled run's wall beside the unprofiled ones, so its cost shows.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from types import FrameType
from typing import Any

EVERY_S = 0.01
WRITE_EVERY_S = 0.2
MAX_DEPTH = 400

#: the phases, in the order a job meets them (reports list them so)
PHASES = (
    "start-up", "planning", "beam", "step set-up", "tokenizer load", "read", "claims", "validate", "tokenize",
    "batching", "generate",
    "engine wait", "write/commit", "worker bookkeeping", "dead letters", "after the pipeline", "export",
    "accounting", "exit", "idle",
)

#: a step module's innermost frame → its phase (paths relative to the repository root)
STEP_FILES = {
    "bench/standin.py": "engine wait",
    "transforms/read.py": "read", "transforms/files.py": "read", "transforms/spill.py": "read",
    "transforms/dedup.py": "claims", "transforms/resume.py": "claims",
    "transforms/validate.py": "validate",
    "transforms/tokenize.py": "tokenize", "transforms/counting.py": "tokenize",
    "transforms/batching.py": "batching",
    "transforms/generate.py": "generate", "transforms/batch_runner.py": "generate", "transforms/answers.py": "generate",
    "transforms/cache.py": "generate",
}
#: (file, function) pairs that name a phase finer than their file does
STEP_FUNCS = {
    ("transforms/counting.py", "load_tokenizer"): "tokenizer load",  # transformers' import and the files
    ("transforms/write.py", "commit_batch"): "write/commit",
    ("transforms/write.py", "dead_row"): "write/commit",
    ("transforms/write.py", "process"): "dead letters",  # WriteDeadLettersFn
    ("transforms/write.py", "finish_bundle"): "dead letters",
}
#: transforms/chunks.py's MapRows runs every row-by-row step: its DoFn's class names the step
CHUNK_CLASSES = {"TokenizeFn": "tokenize", "ValidateFn": "validate"}
#: launcher functions (file, function) that name the phase of everything below them
LAUNCHER_FUNCS = {
    ("jobs/lifecycle/sinks.py", "export_job"): "export",
    ("jobs/lifecycle/runner.py", "compute_metrics"): "accounting",
    ("jobs/lifecycle/reconcile.py", "mismatch_note"): "accounting",
    ("jobs/lifecycle/export.py", "write_marker"): "accounting",
    ("jobs/lifecycle/runner.py", "_run_pipeline"): "beam",
}


def _root() -> str:
    import tokenmill.transforms

    return str(Path(tokenmill.transforms.__path__[0]).resolve().parent) + os.sep


def _stack(frame: FrameType | None, root: str) -> list[tuple[str, str, FrameType]]:
    """(file relative to `root` or as it is, function, frame), innermost first."""
    out = []
    while frame is not None and len(out) < MAX_DEPTH:
        f = frame.f_code.co_filename
        out.append((f[len(root):] if f.startswith(root) else f, frame.f_code.co_name, frame))
        frame = frame.f_back
    return out


def in_bundle(stack: list[tuple[str, str, Any]]) -> bool:
    return any(f.endswith("apache_beam/runners/worker/bundle_processor.py") for f, _, _ in stack)


def step_phase(stack: list[tuple[str, str, Any]]) -> str | None:
    """The phase of a thread in a bundle: its innermost frame in a step module (None: Beam's own)."""
    for f, fn, frame in stack:
        if (f, fn) in STEP_FUNCS:
            return STEP_FUNCS[f, fn]
        if fn == "setup" and f.startswith("transforms/"):  # a DoFn's set-up, once per worker
            return "step set-up"
        if f == "transforms/chunks.py":
            owner = type(frame.f_locals.get("self")).__name__
            return CHUNK_CLASSES.get(owner, owner)
        if f in STEP_FILES:
            return STEP_FILES[f]
        if f == "transforms/write.py":
            return "worker bookkeeping"  # record_worker, update_worker_*, cancel_requested
    return None


def launcher_phase(stack: list[tuple[str, str, Any]], state: dict[str, bool]) -> str:
    """The phase of a main thread with no bundle running (`state` remembers what it has seen)."""
    names = {(f, fn) for f, fn, _ in stack}
    if ("jobs/lifecycle/runner.py", "run_job") not in names:
        if state.get("job"):
            return "exit"
        return "idle" if state.get("worker") else "start-up"
    state["job"] = True
    for key, phase in LAUNCHER_FUNCS.items():
        if key in names:
            if phase == "beam":
                state["pipeline"] = True
            return phase
    return "after the pipeline" if state.get("pipeline") else "planning"


class Sampler(threading.Thread):
    def __init__(self, folder: Path, every_s: float = EVERY_S):
        super().__init__(daemon=True, name="bench-phase-sampler")
        self.folder, self.every_s = folder, every_s
        self.counts: Counter = Counter()
        self.samples = 0
        self.t_first = self.t_last = time.time()
        self.state: dict[str, bool] = {"worker": "sdk_worker_main" in " ".join(sys.argv)}
        self.root = _root()
        self._lock = threading.Lock()
        self._write_lock = threading.Lock()

    def sample(self) -> None:
        frames = sys._current_frames()
        me, main = threading.get_ident(), threading.main_thread().ident
        stacks = {ident: _stack(f, self.root) for ident, f in frames.items() if ident != me}
        bundles = [s for s in stacks.values() if in_bundle(s)]
        if bundles:
            got = [step_phase(s) or "beam" for s in bundles]
        else:
            got = [launcher_phase(stacks.get(main, []), self.state)]
        with self._lock:
            for p in got:
                self.counts[p] += 1 / len(got)
            self.samples += 1
            self.t_last = time.time()

    def run(self) -> None:
        last_write = time.monotonic()
        while True:
            time.sleep(self.every_s)
            try:
                self.sample()
            except Exception:  # a frame gone while read: skip the sample
                continue
            if time.monotonic() - last_write >= WRITE_EVERY_S:
                self.write()
                last_write = time.monotonic()

    def report(self) -> dict[str, Any]:
        import psutil

        with self._lock:
            span = self.t_last - self.t_first
            per = span / self.samples if self.samples else 0.0
            return {"pid": os.getpid(), "role": "worker" if self.state["worker"] else "launcher",
                    "process_started_at": psutil.Process().create_time(), "sampler_started_at": self.t_first,
                    "last_sample_at": self.t_last, "samples": self.samples, "seconds_per_sample": per,
                    "phases_s": {p: round(n * per, 3) for p, n in sorted(self.counts.items(), key=lambda x: -x[1])}}

    def write(self) -> None:
        path = self.folder / f"phases-{os.getpid()}.json"
        tmp = path.with_suffix(".tmp")
        with self._write_lock:  # the sampler's own writes and the one at shutdown
            tmp.write_text(json.dumps(self.report()))
            tmp.replace(path)


_SAMPLER: Sampler | None = None


def start_sampler(folder: Path) -> Sampler:
    """Start this process's sampler once (a second call returns the first)."""
    global _SAMPLER
    if _SAMPLER is None:
        folder.mkdir(parents=True, exist_ok=True)
        _SAMPLER = Sampler(folder)
        _SAMPLER.start()
        # threading's exit hooks run at shutdown before atexit's, where the CLI leaves with os._exit
        threading._register_atexit(_SAMPLER.write)
    return _SAMPLER


def merged(folder: Path) -> list[dict[str, Any]]:
    """Every process's report in `folder`, launcher first."""
    reps = [json.loads(p.read_text()) for p in sorted(folder.glob("phases-*.json"))]
    return sorted(reps, key=lambda r: (r["role"] != "launcher", r["sampler_started_at"]))
