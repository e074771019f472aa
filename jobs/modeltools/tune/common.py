"""What every part of the tune shares: its errors, the reference's key, the mean of a
candidate's runs, and the figures each run is measured by (metrics.catalog's `tune` view)."""

from __future__ import annotations

from typing import Any

from tokenmill.jobs.metrics.catalog import shown_in, values

#: The key of the spec as given among the candidates.
REFERENCE = "ref"


class TuneError(ValueError):
    """A tune that cannot start or go on (bad space, gate or input; the reference failed); one line."""


class CandidateFailed(RuntimeError):
    """One candidate's run failed (the engine would not start, no output): the candidate is
    dropped with this reason and the tune goes on."""


def mean(xs: list[float]) -> float | None:
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


def figures_of(metrics: dict[str, Any]) -> dict[str, Any]:
    """The tune view's figures (the table's columns; "cost" ranks the candidates) plus every
    figure the compare report shows (`headline`, keyed by its path), from a job's metrics."""
    return {**values("tune", metrics), "headline": {f.path: f.value(metrics) for f in shown_in("compare")}}
