"""An engine core dies with the process that owns it: a real `VllmSession` in a child
process, the child killed with SIGKILL (no exit handler runs), and its engine
processes must be gone within seconds instead of living on re-parented, holding the
model and its KV cache.  Both executors tokenmill starts on CPU.  Real engine, real
processes.  And the other way round: a process that owns an engine core exits
(its engines stop before multiprocessing joins its children), with fakes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import psutil
import pytest

from tests.conftest import TEST_ENGINE

pytestmark = pytest.mark.engine

#: A small KV cache: the test is about processes, not memory.
ENGINE = dict(TEST_ENGINE, kv_cache_memory_bytes=128 << 20)

OWNER = """
import json, sys, time
from tokenmill.transforms.engines.vllm_config import VllmConfig
from tokenmill.transforms.engines.vllm_session import VllmSession

s = VllmSession(VllmConfig(model=sys.argv[1], **json.loads(sys.argv[2])), sys.argv[1])
print("ENGINE", json.dumps({"engine_pids": [p.pid for p in s._procs], "executor": s.executor}), flush=True)
time.sleep(600)
"""


#: executor → the core binding that gives it: an explicit list runs the model in the
#: engine core ("uni"); "auto" leaves vLLM-CPU's worker process under the core ("mp").
BINDS = {"uni": "0", "mp": "auto"}


@pytest.mark.cpu_only
@pytest.mark.parametrize("executor", sorted(BINDS))
def test_engine_processes_exit_when_their_owner_is_killed(tmp_path, model_path, executor):
    err = tmp_path / "owner.stderr"
    env = dict(os.environ, VLLM_CPU_OMP_THREADS_BIND=BINDS[executor])
    owner = subprocess.Popen([sys.executable, "-c", OWNER, model_path, json.dumps(ENGINE)], env=env,
                             stdout=subprocess.PIPE, stderr=err.open("w"), text=True, start_new_session=True)
    engine: list[psutil.Process] = []
    try:
        line = next((ln for ln in owner.stdout if ln.startswith("ENGINE ")), "")  # up, or the owner failed
        assert line, f"the owner failed to start its engine: {err.read_text()[-3000:]}"
        started = json.loads(line.split(" ", 1)[1])
        assert started["executor"] == executor
        engine = [psutil.Process(pid) for pid in started["engine_pids"]]
        assert len(engine) == {"uni": 1, "mp": 2}[executor]  # the engine core (and its worker)

        os.kill(owner.pid, signal.SIGKILL)
        owner.wait(timeout=30)
        gone, alive = psutil.wait_procs(engine, timeout=10)
        assert not alive, f"engine process(es) {[p.pid for p in alive]} outlived their owner by 10 s"
    finally:
        for p in [owner, *engine]:
            try:
                p.kill()
            except (psutil.Error, ProcessLookupError):
                pass
        try:
            os.killpg(owner.pid, signal.SIGKILL)  # anything else the owner started
        except ProcessLookupError:
            pass


#: A session made before multiprocessing was first imported, then one that owns a
#: non-daemonic multiprocessing child (as vLLM's engine core is); the process exits.
EXIT_ORDER = """
import multiprocessing, time
from tokenmill.transforms.engines.vllm_config import VllmConfig
from tokenmill.transforms.engines import registry
from tests.fakes import FakeSession


class ChildSession(FakeSession):
    def __init__(self, cfg, model_path):
        super().__init__(cfg, model_path)
        self.child = multiprocessing.get_context("spawn").Process(target=time.sleep, args=(600,))
        self.child.start()
        print("CHILD", self.child.pid, flush=True)

    def shutdown(self):
        self.child.kill()
        self.child.join()


registry.get_session(VllmConfig(), "/m", FakeSession)
registry.get_session(VllmConfig(), "/m", ChildSession)
"""


def test_a_process_whose_engine_is_a_multiprocessing_child_exits_whatever_was_imported_first():
    # multiprocessing joins its non-daemonic children for ever at exit; the engines
    # must be stopped before that even when the registry's exit handler was registered
    # before multiprocessing was imported (a fake session made first, as in the tests).
    proc = subprocess.Popen([sys.executable, "-c", EXIT_ORDER], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err[-2000:]
        assert out.startswith("CHILD ")
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
