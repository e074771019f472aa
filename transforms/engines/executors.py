"""The executors tokenmill hands vLLM: vLLM's own, whose engine core process exits
when the process that owns the engine dies.

vLLM 0.32 starts its engine core as a multiprocessing child of the process that
created `vllm.LLM` and has nothing that stops it when that owner dies without
shutting it down (SIGKILL, the OOM killer): its ZeroMQ sockets do not notice, and the
core lived on re-parented, holding the model and its KV cache, until killed by hand.
The executor is the one piece of the engine core that tokenmill chooses and vLLM
builds inside that process (`EngineCore.__init__`), so the watch starts there,
before the model loads.

Why not PR_SET_PDEATHSIG: it fires when the *thread* that forked the child exits, and
the engine is created on a Beam bundle thread, which the SDK worker's pool may retire
while the process (and its engine) lives on.  The watch compares the core's parent
pid with its owner's pid instead, which changes only when the owner process is gone.

Imports vLLM: loaded by `vllm_session` when it starts an engine, and by the engine
core process when it unpickles its executor class."""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import threading
import time

from vllm.v1.executor.multiproc_executor import MultiprocExecutor
from vllm.v1.executor.uniproc_executor import UniProcExecutor

log = logging.getLogger(__name__)

#: How often the engine core looks for its owner: the bound on how long it outlives it.
OWNER_POLL_S = 0.5


def exit_with_owner(poll_s: float = OWNER_POLL_S) -> bool:
    """In a process started by `multiprocessing` (vLLM's engine core), start a daemon
    thread that kills this process as soon as its parent is gone (re-parented: its
    parent pid is no longer the one that started it).  Nothing reads what an engine
    core computes once its owner is dead, so it stops at once (SIGKILL, as
    `VllmSession.shutdown` does); the executor's own workers, if any, follow through
    vLLM's death pipe.  False where there is no parent to watch (the main process:
    an engine core running inside its owner)."""
    parent = multiprocessing.parent_process()
    if parent is None or parent.pid is None:
        return False
    owner = parent.pid  # handed over at start, so an owner that died before now is seen too

    def watch() -> None:
        while os.getppid() == owner:
            time.sleep(poll_s)
        log.warning("engine owner process %d is gone; engine process %d exits", owner, os.getpid())
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="tokenmill-owner-watch", daemon=True).start()
    return True


class OwnedUniProcExecutor(UniProcExecutor):
    """vLLM's `UniProcExecutor` (the engine core runs the model itself) in an engine
    core that exits with its owner."""

    kind = "uni"

    def _init_executor(self) -> None:
        exit_with_owner()
        super()._init_executor()


class OwnedMultiprocExecutor(MultiprocExecutor):
    """vLLM's `MultiprocExecutor` (the model runs in worker processes of the engine
    core) in an engine core that exits with its owner; its workers exit with it."""

    kind = "mp"

    def _init_executor(self) -> None:
        exit_with_owner()
        super()._init_executor()
