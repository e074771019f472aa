"""Launchers: where a job the coordinator took from the queue runs, and what each reports.

One protocol (`Launcher`), one implementation per place a run can go, as Dagster's run
launchers are: in this process (`inprocess`: `tokenmill run`, `run-pending`, tune's trials),
a warm engine process of the server (`jobs/serve/engines.py`), a process of its own
(`spawned`: the estimate's sample run).  Each reports the run's end as one `Launched`, and
what happens beside it as typed events (`EngineLoaded`, `ProcessDied`), never as tuples or
scraped lines.  `settle` is the path every launcher's run goes through: the one place that
turns a run's result or exception into a `Launched`."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Callable, Literal, Protocol, Union

from tokenmill.schemas import storage as S
from tokenmill.schemas.errors import first_line

Status = Literal["succeeded", "partial", "failed", "cancelled", "busy"]
#: A run's statuses that end its job with every row answered or dead-lettered.
DONE: tuple[str, ...] = ("succeeded", "partial")


@dataclass(frozen=True)
class Launched:
    """The end of one run of a job, whichever launcher ran it."""

    job_id: str
    status: Status
    """succeeded, partial, failed or cancelled as the job ended; `busy` when another live run
    holds the job (not a failure: it is run again later)."""
    note: str | None = None
    """The job's note, or the error's first line for a run that raised."""
    raised: bool = False
    """The run did not reach its end (an exception, a dead process): it may be tried again."""
    result: Any = field(default=None, compare=False)
    """The runner's JobResult, where the run ended in this process."""
    error: BaseException | None = field(default=None, compare=False, repr=False)
    """The exception a run in this process raised."""

    def portable(self) -> "Launched":
        """The same report without the in-process parts: what crosses a pipe or a file."""
        return replace(self, result=None, error=None)

    def to_json(self) -> dict[str, Any]:
        return {"job_id": self.job_id, "status": self.status, "note": self.note, "raised": self.raised}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "Launched":
        return cls(str(data["job_id"]), data["status"], data.get("note"), bool(data.get("raised")))


@dataclass(frozen=True)
class EngineLoaded:
    """A warm engine process loaded its engine (`loaded`) or unloaded it after idling."""

    model: str
    loaded: bool


@dataclass(frozen=True)
class ProcessDied:
    """The process running `job_id` (None: it ran none) is gone without a report."""

    model: str
    job_id: str | None


Event = Union[Launched, EngineLoaded, ProcessDied]


class Launcher(Protocol):
    """Runs one job the coordinator handed it; its end is reported as a `Launched`."""

    def launch(self, job_id: str, spec: dict[str, Any], db_url: str) -> bool:
        """Hand the job (its stored spec) over: False when the launcher cannot take it now
        (its process is gone), and the job stays queued.  The run's `Launched` is reported
        to the launcher's `report` callback (a synchronous launcher: before this returns)."""
        ...


def settle(job_id: str, run: Callable[[], Any]) -> Launched:
    """Run `run()` (a job's run, returning the runner's JobResult) and report how it ended:
    the result's status and note; `busy` for storage.JobBusy; `failed` and `raised` for any
    other exception, kept in `error` for a caller that tells them apart."""
    try:
        result = run()
    except S.JobBusy as err:
        return Launched(job_id, "busy", first_line(err, 1000), error=err)
    except Exception as err:  # one run's failure is its report, not the launcher's
        return Launched(job_id, "failed", first_line(err, 1000), raised=True, error=err)
    return Launched(job_id, result.status, result.note, result=result)
