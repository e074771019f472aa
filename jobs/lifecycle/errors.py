"""The job lifecycle's own error, apart from the runner so that what only reports a job's
failure (the launchers, the estimate) need not import the runner."""

from __future__ import annotations


class JobError(RuntimeError):
    """A job that cannot run or did not finish; the message is one line."""
