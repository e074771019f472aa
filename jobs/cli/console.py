"""The terminal of a command that runs jobs: engine and library output to a per-job log
file, the terminal keeps a line per stage, the row bar and the summary.

vLLM, torch, Beam, Dask and llama-server write to the process's own file descriptors 1
and 2, from this process and from every process it starts (vLLM's engine core, Beam's SDK
workers, multiprocessing's resource tracker), whatever their log level; C++ code writes
there too.  So the log file takes those descriptors for the whole command, engines'
shutdown included, and the terminal is written through copies of the descriptors taken
before.  `-v` leaves everything on the terminal, as before.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from pathlib import Path
from typing import IO

import click


def log_dir() -> Path:
    from tokenmill.schemas.models import tokenmill_home

    return Path(os.environ.get("TOKENMILL_LOG_DIR", tokenmill_home() / "logs"))


def log_path(job_id: str) -> Path:
    """A new log file for one run of `job_id`: `<log dir>/<job id>/<UTC time>.log`."""
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    return log_dir() / job_id / f"{stamp}-{os.getpid()}.log"


class _TerminalWarnings(logging.Handler):
    """tokenmill's own warnings and errors (a retried pipeline, a killed engine) stay on the terminal."""

    def __init__(self, console: "JobConsole"):
        super().__init__(logging.WARNING)
        self.console = console
        self.setFormatter(logging.Formatter("%(levelname)s: %(message)s"))

    def emit(self, record: logging.LogRecord) -> None:
        if record.exc_info:  # the traceback is in the log file; the terminal gets the line
            record = logging.makeLogRecord({**record.__dict__, "exc_info": None, "exc_text": None})
        self.console.line(self.format(record))


class JobConsole:
    """`with JobConsole(job_id, verbose=..., show=...) as con:` — inside, file descriptors 1
    and 2 go to `con.log` (unless verbose); `con.line()` and `con.terminal` reach the
    terminal's stderr, `con.stdout` its stdout."""

    def __init__(self, job_id: str, *, verbose: bool, show: bool):
        self.verbose, self.show = verbose, show
        self.log: Path | None = None if verbose else log_path(job_id)
        self._saved: tuple[int, int] | None = None
        self.terminal: IO[str] = sys.stderr
        self.stdout: IO[str] = sys.stdout
        self._handler: logging.Handler | None = None

    def __enter__(self) -> "JobConsole":
        if self.log is None:
            return self
        self.log.parent.mkdir(parents=True, exist_ok=True)
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        self._saved = (os.dup(1), os.dup(2))
        self.stdout = os.fdopen(os.dup(self._saved[0]), "w", buffering=1)
        self.terminal = os.fdopen(os.dup(self._saved[1]), "w", buffering=1)
        fd = os.open(self.log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
        if os.environ.get("TOKENMILL_VLLM_LEVEL_DEFAULT"):  # the file can hold what vLLM says
            os.environ["VLLM_LOGGING_LEVEL"] = "INFO"
        self._handler = _TerminalWarnings(self)
        logging.getLogger("tokenmill").addHandler(self._handler)
        return self

    def __exit__(self, *exc) -> None:
        if self._saved is None:
            return
        if self._handler is not None:
            logging.getLogger("tokenmill").removeHandler(self._handler)
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        os.dup2(self._saved[0], 1)
        os.dup2(self._saved[1], 2)
        for fd in self._saved:
            os.close(fd)
        for stream in (self.stdout, self.terminal):
            stream.close()
        self._saved = None
        self.stdout, self.terminal = sys.stdout, sys.stderr
        # a job refused before anything started leaves no empty log behind
        if self.log is not None and not self.log_written():
            self.log.unlink(missing_ok=True)

    def log_written(self) -> bool:
        """Whether the log file holds anything yet."""
        if self.log is None:
            return False
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        try:
            return self.log.stat().st_size > 0
        except OSError:
            return False

    @property
    def is_terminal(self) -> bool:
        try:
            return self.terminal.isatty()
        except ValueError:
            return False

    def line(self, text: str) -> None:
        """One line on the terminal (above the row bar, if one is shown)."""
        if not self.show:
            return
        from tqdm import tqdm

        tqdm.write(text, file=self.terminal)

    def stage(self, text: str) -> None:
        self.line(f"· {text}")

    def echo(self, text: str, *, err: bool = False) -> None:
        """The command's own output (the summary, --json): always shown."""
        click.echo(text, file=self.terminal if err else self.stdout)
