"""The subprocess launcher: a job run as `tokenmill run` runs it, in a process of its own (its
start-up, imports and engine load its own, its engine gone when it ends), which reports its
stage lines and its `Launched` as JSON lines on a pipe (`REPORT_FD_ENV` names the child's end;
`Reporter` writes them).  This module does not import the runner: the estimate, which the
runner's caps import, launches its sample run through it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Callable

import yaml

from tokenmill.jobs.lifecycle.launchers import Launched

#: The environment variable that names the file descriptor a launched `tokenmill run` reports on.
REPORT_FD_ENV = "TOKENMILL_REPORT_FD"


class Reporter:
    """The child's side: JSON lines on the descriptor its launcher gave it (none: a no-op)."""

    def __init__(self, out: IO[str] | None):
        self.out = out

    @classmethod
    def from_env(cls) -> "Reporter":
        fd = os.environ.pop(REPORT_FD_ENV, None)  # popped: a process this one starts does not report too
        return cls(os.fdopen(int(fd), "w", buffering=1) if fd else None)

    def _send(self, msg: dict[str, Any]) -> None:
        if self.out is not None:
            self.out.write(json.dumps(msg) + "\n")

    def stage(self, line: str) -> None:
        self._send({"stage": line})

    def done(self, launched: Launched) -> None:
        """The run's end (its error's message as the terminal shows it, in `note`)."""
        self._send({"launched": launched.to_json()})
        if self.out is not None:
            self.out.close()
            self.out = None


@dataclass
class SpawnedLauncher:
    """The `Launcher` that runs each job as `python -m tokenmill.jobs.cli run SPEC` and waits
    for it: `stage(line)` for each of its stage lines, `report(launched)` at its end (a child
    that ended without a report: `failed`, `raised`, with its exit status)."""

    report: Callable[[Launched], None]
    stage: Callable[[str], None]
    workdir: Path
    exit_code: int | None = None
    """The last child's exit status."""

    def launch(self, job_id: str, spec: dict[str, Any], db_url: str) -> bool:
        spec_file = self.workdir / f"{job_id}.yaml"
        spec_file.write_text(yaml.safe_dump({k: v for k, v in spec.items() if k != "db"}))
        read, write = os.pipe()
        env = {**os.environ, "TOKENMILL_DB_URL": db_url,  # not on the command line, where `ps` shows it
               REPORT_FD_ENV: str(write)}
        try:
            proc = subprocess.Popen([sys.executable, "-m", "tokenmill.jobs.cli", "run", str(spec_file)],
                                    env=env, pass_fds=(write,), stdout=subprocess.DEVNULL,
                                    stderr=subprocess.DEVNULL)
        finally:
            os.close(write)
        launched = None
        with os.fdopen(read) as lines:
            for line in lines:
                msg = json.loads(line)
                if "stage" in msg:
                    self.stage(msg["stage"])
                elif "launched" in msg:
                    launched = Launched.from_json(msg["launched"])
        self.exit_code = proc.wait()
        self.report(launched or Launched(job_id, "failed", None, raised=True))
        return True
