"""The multi-process DirectRunner, with the one fault of Beam 2.77's that hangs a job put right:
an SDK worker process that dies fails the pipeline instead of stalling it for ever.

With `--direct_running_mode=multi_processing`, Beam's `SubprocessSdkWorkerHandler` starts
each SDK worker (`python -m apache_beam.runners.worker.sdk_worker_main`) and waits on it
in a thread.  When the process dies (kill -9, the OOM killer), that thread raises
`RuntimeError: Worker subprocess exited with return code 137` and ends, but nothing
tells the runner, which waits without a timeout for the dead worker's answer to its
bundle: measured in `make bench-scale`, the job never ended while the surviving worker
finished its work.  Beam's Docker worker handler already does what is missing: when its
container stops, it aborts the worker's control futures.  `WatchedSubprocessSdkWorkerHandler`
does the same for a subprocess, so the runner raises `WorkerDied` and the pipeline fails;
the launcher then runs it again (`runner.worker_retries`), and the new run resumes from
the database (what the dead worker had committed is skipped; what it had in flight is
redone).
"""

from __future__ import annotations

import logging
import threading

from apache_beam.portability import python_urns
from apache_beam.runners.portability import local_job_service
from apache_beam.runners.portability.fn_api_runner import worker_handlers

log = logging.getLogger(__name__)


class WorkerDied(RuntimeError):
    """A worker process of the pipeline died while the pipeline ran (its bundle is lost)."""


class WatchedSubprocessSdkWorkerHandler(worker_handlers.SubprocessSdkWorkerHandler):
    """Beam's subprocess SDK worker handler; an unexpected exit aborts the worker's pending
    instructions (as Beam's `DockerSdkWorkerHandler.watch_container` does) instead of leaving
    the runner waiting on them."""

    def start_worker(self) -> None:
        self.worker = local_job_service.SubprocessSdkWorker(
            self._worker_command_line, self.control_address, self.provision_info, self.worker_id)
        self.worker_thread = threading.Thread(name="run_worker", target=self._run_and_watch, daemon=True)
        self.worker_thread.start()

    def _run_and_watch(self) -> None:
        try:
            self.worker.run()
        except Exception as err:  # Beam raises RuntimeError for a non-zero exit status
            died = WorkerDied(f"SDK worker {self.worker_id} died: {err}")
            log.error("%s; failing the pipeline", died)
            self.control_conn.abort(died)


def watch_sdk_workers() -> None:
    """Run subprocess SDK workers (the multi-process DirectRunner's) under the watched handler.

    Beam keys worker handlers by environment URN in one registry; this replaces the
    subprocess entry, in this process only.  Idempotent."""
    worker_handlers.WorkerHandler.register_environment(
        python_urns.SUBPROCESS_SDK, bytes)(WatchedSubprocessSdkWorkerHandler)


def worker_died(err: BaseException) -> bool:
    """Whether a pipeline failure is (caused by) a worker process's death."""
    seen: set[int] = set()
    e: BaseException | None = err
    while e is not None and id(e) not in seen:
        if isinstance(e, WorkerDied):
            return True
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return False
