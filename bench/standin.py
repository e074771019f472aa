"""A stand-in engine for the pipeline-ceiling benchmark (bench/ceiling.py): it answers every
request at the step after it was added, with `max_tokens` tokens, so a job measures
tokenmill's own work per row and nothing of a model.

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

import os
import time
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


class StandinConfig(EngineConfig):
    kind: Literal["standin"] = Field(json_schema_extra={"flag": False})


class StandinSession:
    """Every request added is answered by the next `step()`: `max_tokens` tokens of one word
    each, its prompt's tokens counted as given."""

    def __init__(self, cfg: StandinConfig, model_path: str = "", **_start: Any):
        self.max_num_seqs = cfg.max_num_seqs
        self.requests: dict[str, tuple[float, int, int]] = {}
        self.killed = False

    def add(self, request_id: str, token_ids, sampling: dict[str, Any], *, source=None) -> None:
        self.requests[request_id] = (time.time(), len(token_ids), int(sampling["max_tokens"]))

    def step(self) -> list[Finished]:
        if self.killed:
            raise RuntimeError("the stand-in engine was killed")
        now = time.time()
        done = [Finished(request_id=rid, text=" ".join(["ok"] * n), finish_reason="length", prompt_tokens=p,
                         output_tokens=n, cached_tokens=None, ttft_s=now - t0, tpot_s=None, e2e_s=now - t0,
                         queue_s=None, finished_at=now)
                for rid, (t0, p, n) in self.requests.items()]
        self.requests.clear()
        return done

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


class StandinEngine(EngineKind[StandinConfig]):
    kind = KIND
    config = StandinConfig
    display_name = "Stand-in (bench)"
    summary = "standin (answers at once; bench/standin.py)"
    measures_prefix_cache = False
    local_weights = False
    clocks = {"ttft_s": "stand-in engine: answered at the step after it was added",
              "e2e_s": "stand-in engine: answered at the step after it was added"}

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
