"""A stand-in engine for the benchmarks and the replica tests: it answers every request with
`max_tokens` tokens and nothing of a model.

- `step_s: 0` (the default; bench/ceiling.py): every request is answered at the step after it
  was added, so a job measures tokenmill's own work per row.
- `step_s > 0` (bench/replicas.py, tests/test_serve_replicas.py): each step sleeps `step_s`
  and answers the `max_num_seqs` oldest requests, a device that takes a fixed wall time per
  step and no CPU: several `tokenmill serve` replicas on a 2-core machine are then bound by
  simulated device time, as replicas on their own GPUs are, not by the shared cores.

With `TOKENMILL_STANDIN_LOG=<folder>` each process appends one line per request it answers to
its own file there (`<host>-<pid>.log`: request id, a digest of the prompt's token ids,
output tokens), written before the answer is returned: the engine's side of a count of
lines generated twice (a test gives every line its own prompt, so a digest seen twice is a
line the engine generated twice), which no database row can show for a process killed
before it committed.

No product file names it.  It reaches `tokenmill run` and the pipeline's workers through
the `tokenmill.engines` entry point, declared by a metadata folder the benchmark writes
under bench/work (`plugin_dir`: `tokenmill_bench_standin-0.dist-info/entry_points.txt`)
and puts on PYTHONPATH for the processes it starts (`plugin_env`), beside the repository
root that holds `bench`.  Why that way:

- the launcher validates the job spec (`engine.kind`) before anything runs, and every
  worker resolves the engine by its kind again (transforms/engines/worker.py), so an
  in-process `kinds.register` holds for one in-memory worker only; `--workers 2` starts
  SDK worker processes (`python -m apache_beam...sdk_worker_main`) that import nothing of
  the launcher's;
- the entry point group is how the product finds engines anyway (schemas/engine_kinds.py),
  and every child inherits PYTHONPATH, so launcher and SDK workers see the stand-in alike
  with no wrapper script, no sitecustomize and nothing installed into the venv: only the
  processes the benchmark starts see it, and setup.cfg declares nothing of it.

With `TOKENMILL_BENCH_PHASES=<folder>` in the environment the module also starts
bench/phases.py's stack sampler in each process that loads it (the launcher and every
worker): the benchmark's profiled runs split the wall into phases with it.
"""

from __future__ import annotations

import hashlib
import os
import socket
import time
from collections import OrderedDict
from pathlib import Path
from typing import Any, Literal

from pydantic import Field

from tokenmill.schemas.config import EngineConfig
from tokenmill.transforms.engines.kinds import EngineCheck, EngineKind, local_tokenizer
from tokenmill.transforms.engines.protocol import Finished

KIND = "standin"
#: the distribution name of the entry-point metadata (bench/work only)
DIST = "tokenmill_bench_standin"
#: the environment variable that turns the phase sampler on (its value: the folder it writes to)
PHASES_ENV = "TOKENMILL_BENCH_PHASES"
#: the environment variable that turns the generation log on (its value: the folder it writes to)
LOG_ENV = "TOKENMILL_STANDIN_LOG"


class StandinConfig(EngineConfig):
    kind: Literal["standin"] = Field(json_schema_extra={"flag": False})
    step_s: float = Field(0.0, ge=0, le=60, json_schema_extra={"flag": False})
    """Wall seconds each engine step takes, spent sleeping; 0: no wait, and every request is
    answered at the next step (not only `max_num_seqs` of them)."""


def prompt_digest(token_ids) -> str:
    """A request's prompt as the generation log names it: the same prompt, the same digest."""
    return hashlib.blake2b(",".join(map(str, token_ids)).encode(), digest_size=8).hexdigest()


def read_log(folder: Path) -> list[dict[str, Any]]:
    """Every request the stand-in processes that wrote to `folder` answered: `file` (whose),
    `request_id`, `digest`, `output_tokens`; a last line cut short by a kill is left out."""
    out = []
    for path in sorted(Path(folder).glob("*.log")):
        for line in path.read_text().splitlines():
            parts = line.split("\t")
            if len(parts) == 3 and parts[2].isdigit():
                out.append({"file": path.name, "request_id": parts[0], "digest": parts[1],
                            "output_tokens": int(parts[2])})
    return out


class StandinSession:
    """Requests answered in the order they were added, `max_tokens` tokens of one word each,
    their prompt's tokens counted as given: all of them at the next `step()` (`step_s` 0), or
    the `max_num_seqs` oldest after `step_s` of sleep."""

    def __init__(self, cfg: StandinConfig, model_path: str = "", **_start: Any):
        self.max_num_seqs = cfg.max_num_seqs
        self.step_s = cfg.step_s
        self.requests: OrderedDict[str, tuple[float, int, int, str]] = OrderedDict()
        self.killed = False
        folder = os.environ.get(LOG_ENV)
        self._log: int | None = None
        if folder:
            Path(folder).mkdir(parents=True, exist_ok=True)
            # its own file per process, appended with one write per step: a kill -9 loses no
            # line it answered and cuts at most the last one, which read_log skips
            path = Path(folder) / f"{socket.gethostname()}-{os.getpid()}.log"
            self._log = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def add(self, request_id: str, token_ids, sampling: dict[str, Any], *, source=None) -> None:
        digest = prompt_digest(token_ids) if self._log is not None else ""
        self.requests[request_id] = (time.time(), len(token_ids), int(sampling["max_tokens"]), digest)

    def step(self) -> list[Finished]:
        if self.killed:
            raise RuntimeError("the stand-in engine was killed")
        if self.step_s > 0:
            time.sleep(self.step_s)  # the device's time: no CPU spent, the GIL released
            taken = [self.requests.popitem(last=False) for _ in range(min(self.max_num_seqs, len(self.requests)))]
        else:
            taken = list(self.requests.items())
            self.requests.clear()
        now = time.time()
        if self._log is not None and taken:
            os.write(self._log, "".join(f"{rid}\t{d}\t{n}\n" for rid, (_, _, n, d) in taken).encode())
        return [Finished(request_id=rid, text=" ".join(["ok"] * n), finish_reason="length", prompt_tokens=p,
                         output_tokens=n, cached_tokens=None, ttft_s=now - t0, tpot_s=None, e2e_s=now - t0,
                         queue_s=None, finished_at=now)
                for rid, (t0, p, n, _) in taken]

    def num_unfinished(self) -> int:
        return len(self.requests)

    def abort(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self.requests.pop(rid, None)

    def alive(self) -> bool:
        return not self.killed

    def kill(self) -> None:
        self.killed = True

    def info(self) -> dict[str, Any]:
        return {"device": "cpu", "engine": KIND, "load_s": 0.0}

    def shutdown(self) -> None:
        self.requests.clear()
        if self._log is not None:
            os.close(self._log)
            self._log = None


class StandinEngine(EngineKind[StandinConfig]):
    kind = KIND
    config = StandinConfig
    display_name = "Stand-in (bench)"
    summary = "standin (answers at once, or after step_s asleep; bench/standin.py)"
    measures_prefix_cache = False
    local_weights = False
    clocks = {"ttft_s": "stand-in engine: answered at a step after it was added (step_s asleep each)",
              "e2e_s": "stand-in engine: answered at a step after it was added (step_s asleep each)"}

    def session_factory(self):
        return StandinSession

    def preflight(self, cfg: StandinConfig, *, on_gpu: bool) -> EngineCheck:
        """Only the model's tokenizer is needed (Tokenize counts with it); no weights."""
        check = EngineCheck()
        check.model_path = local_tokenizer(KIND, cfg.model, check)
        return check


ENGINE = StandinEngine()


def plugin_dir(root: Path) -> Path:
    """A folder under `root` holding the entry point that declares ENGINE (written once)."""
    folder = root / "standin-plugin"
    meta = folder / f"{DIST}-0.dist-info"
    meta.mkdir(parents=True, exist_ok=True)
    (meta / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {DIST}\nVersion: 0\n")
    (meta / "entry_points.txt").write_text(f"[tokenmill.engines]\n{KIND} = bench.standin:ENGINE\n")
    return folder


def plugin_env(root: Path, repo: Path, *, phases: Path | None = None) -> dict[str, str]:
    """This process's environment with the stand-in's entry point (and `repo`, which holds
    `bench`) first on PYTHONPATH; with `phases`, the phase sampler on, writing there."""
    env = dict(os.environ)
    path = [str(plugin_dir(root)), str(repo), *filter(None, env.get("PYTHONPATH", "").split(os.pathsep))]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(path))
    env.pop(PHASES_ENV, None)
    if phases is not None:
        env[PHASES_ENV] = str(phases)
    return env


if os.environ.get(PHASES_ENV):  # a profiled run: sample this process's stacks from now on
    from bench.phases import start_sampler

    start_sampler(Path(os.environ[PHASES_ENV]))
