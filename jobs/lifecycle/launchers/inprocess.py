"""The in-process launcher: a job runs here, through `runner.run_job`, the one place product
code calls it (`tokenmill run`, `run-pending`, tune's trials, and the server's engine
process, which runs each batch's job in its own process this way)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from tokenmill.jobs.lifecycle import runner
from tokenmill.jobs.lifecycle.launchers import Launched, settle
from tokenmill.schemas.config import JobSpec, SpecError, load_spec
from tokenmill.schemas.errors import first_line


def run_here(spec: JobSpec, *, db_url: str | None = None, session_factory=None,
             progress: Callable[[int, int, int], None] | None = None,
             stage: Callable[[str], None] | None = None) -> Launched:
    """Run one job in this process to its end; `progress` and `stage` as `run_job` takes them."""
    # through the module: a test that swaps `runner.run_job` swaps it here too
    return settle(spec.derived_job_id(), lambda: runner.run_job(spec, db_url=db_url, session_factory=session_factory,
                                                                progress=progress, stage=stage))


@dataclass
class InProcessLauncher:
    """The `Launcher` that runs each job in this process before `launch` returns."""

    report: Callable[[Launched], None]
    session_factory: Any = None

    def launch(self, job_id: str, spec: dict[str, Any], db_url: str) -> bool:
        try:
            job = load_spec(spec, source=f"job {job_id}")
        except SpecError as err:  # a stored spec this version cannot read: the job's failure, not the launcher's
            self.report(Launched(job_id, "failed", first_line(err, 1000), raised=True, error=err))
            return True
        self.report(run_here(job, db_url=db_url, session_factory=self.session_factory))
        return True
