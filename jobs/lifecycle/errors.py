"""The job lifecycle's own error, importable by every launcher without the runner."""

from __future__ import annotations


class JobError(RuntimeError):
    """A job that cannot run or did not finish; the message is one line."""
