"""What `tokenmill serve` checks before it listens: every served model passes its engine's own
checks (the ones a batch's job runs before its first row), so a server that answers `/health`
can run a batch of each model, and one that cannot says why at start instead of failing every
batch with the reason only in its log.  A bundled model (`tokenmill models prepare`'s) that is
not prepared yet is prepared here first, as `make demo` does."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Callable

from tokenmill.jobs.modeltools.prepare import is_prepared
from tokenmill.jobs.serve.config import ServeConfig
from tokenmill.schemas.model_sync import is_model_url
from tokenmill.schemas.models import BUILTIN_MODELS, models_dir
from tokenmill.transforms.engines.device import has_nvidia_gpu
from tokenmill.transforms.engines.kinds import engine_of


class NotReady(RuntimeError):
    """A served model cannot run a batch here (one line: the model and what is wrong)."""


def ready_models(cfg: ServeConfig, say: Callable[[str], None]) -> None:
    """Prepare each served bundled model that is missing (saying so in one line), then run each
    served model's engine checks; NotReady with the first model's problems otherwise.  Engines
    whose model is another server's (no local weights) and models given as URLs (synced by each
    job with its own S3 endpoint) are left to the batch's own checks."""
    on_gpu = has_nvidia_gpu()
    for name in cfg.models:
        engine = cfg.job_spec(name, input="x.jsonl", output="out", job_id="check").engine
        kind = engine_of(engine.kind)
        if not kind.local_weights or is_model_url(engine.model):
            continue
        if engine.model in BUILTIN_MODELS and not is_prepared(engine.model):
            _prepare(engine.model, cfg.home() / "logs" / f"prepare-{engine.model}.log", say)
        problems = kind.preflight(engine, on_gpu=on_gpu).problems
        if problems:
            raise NotReady(f"served model {name!r}: " + "; ".join(problems))


def _prepare(model: str, log: Path, say: Callable[[str], None]) -> None:
    """`tokenmill models prepare MODEL`, its own process, its output (the conversion's progress
    bars and library warnings) kept in `log`, so the server's terminal gets one line."""
    say(f"preparing the bundled model {model} into {models_dir() / model} (once, as `tokenmill models prepare "
        f"{model}` does; about 20 s; its output: {log})")
    try:
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "w") as fh:
            done = subprocess.run([sys.executable, "-m", "tokenmill.jobs.cli", "models", "prepare", model],
                                  stdout=fh, stderr=subprocess.STDOUT, check=False)
        last = (log.read_text(errors="replace").strip().splitlines() or ["(no output)"])[-1]
    except OSError as err:
        raise NotReady(f"bundled model {model} cannot be prepared: {err}") from None
    if done.returncode != 0:
        raise NotReady(f"bundled model {model} could not be prepared: {last} (all of it: {log})")
