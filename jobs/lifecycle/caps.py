"""Cost and time caps (`max_cost`, `max_hours` in a job spec; docs/ESTIMATE.md).

A capped job needs an estimate (`tokenmill estimate`, jobs/estimate/): the newest one stored
for its id, else one made before the run.  What a cap is checked against is the job's whole
bill: what its earlier runs held (a resumed job) plus this run so far, plus the estimate of
what is left (the estimate's fixed part while the engine has not answered yet, its per-row
part times the rows still to answer).  Before the run, a job whose prediction exceeds a cap
does not start (one line); while it runs, the launcher's heartbeat checks every few seconds,
and a job about to cross a cap is stopped as a cancel is: the batches in flight finish, every
finished row is kept, and a rerun with a higher cap resumes it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable

from tokenmill.jobs.estimate import make_estimate
from tokenmill.jobs.metrics.runs import run_end
from tokenmill.schemas import storage as S
from tokenmill.schemas.config import JobSpec


class CapError(RuntimeError):
    """A capped job that may not start (one line)."""


@dataclass(frozen=True)
class Bill:
    """A job's cost (USD) and held hours: spent so far and predicted for the rest."""

    spent_usd: float
    spent_h: float
    rest_usd: float
    rest_h: float

    @property
    def cost(self) -> float:
        return self.spent_usd + self.rest_usd

    @property
    def hours(self) -> float:
        return self.spent_h + self.rest_h


def capped(spec: JobSpec) -> bool:
    return spec.max_cost is not None or spec.max_hours is not None


def held_seconds(runs: list[dict[str, Any]], now: float | None = None, current: str | None = None) -> float:
    """Seconds the job's runs held their devices: each run from its start to its finish, or
    to its last heartbeat for a run that was killed; the run `current` up to `now`."""
    now = time.time() if now is None else now
    total = 0.0
    for r in runs:
        end = run_end(r, now if r.get("run_id") == current else None)
        total += max(0.0, (r["started_at"] if end is None else end) - r["started_at"])
    return total


def bill(estimate: dict[str, Any], *, rows_left: int, held_s: float, fixed_spent_s: float = 0.0) -> Bill:
    """The job's bill from its estimate: `held_s` spent at the estimate's hourly price, and the
    rest: what is left of the fixed part (start-up, model load, export: `fixed_spent_s` of it
    spent by this run already; all of it once its engine answers) plus the per-row part for
    the rows left."""
    price = float(estimate.get("price_per_hour") or 0.0)
    fixed, per_row = estimate.get("fixed") or {}, estimate.get("per_row") or {}
    fixed_s = float(fixed.get("held_s") or 0.0)
    fixed_left_s = max(0.0, fixed_s - fixed_spent_s)
    fixed_left_usd = float(fixed.get("cost_usd") or 0.0) * (fixed_left_s / fixed_s if fixed_s > 0 else 0.0)
    rest_s = rows_left * float(per_row.get("held_s") or 0.0) + fixed_left_s
    rest_usd = rows_left * float(per_row.get("cost_usd") or 0.0) + fixed_left_usd
    return Bill(spent_usd=held_s * price / 3600, spent_h=held_s / 3600, rest_usd=rest_usd, rest_h=rest_s / 3600)


def crossed(spec: JobSpec, b: Bill) -> str | None:
    """Which cap the bill crosses, in words (None: within both)."""
    if spec.max_cost is not None and b.cost > spec.max_cost:
        return (f"max_cost ${spec.max_cost:g}: ${b.cost:.4f} (${b.spent_usd:.4f} spent, ${b.rest_usd:.4f} "
                f"estimated for the rest)")
    if spec.max_hours is not None and b.hours > spec.max_hours:
        return (f"max_hours {spec.max_hours:g}: {b.hours:.3f} h ({b.spent_h:.3f} h spent, {b.rest_h:.3f} h "
                f"estimated for the rest)")
    return None


def refusal(spec: JobSpec, estimate: dict[str, Any], *, rows_left: int, held_s: float) -> str | None:
    """Why a capped job may not start (one line), or None."""
    over = crossed(spec, bill(estimate, rows_left=rows_left, held_s=held_s))
    if over is None:
        return None
    cost = estimate.get("cost_usd") or {}
    interval = f" (the whole job's estimate: ${cost.get('value', 0):.4f}, interval ${cost.get('lo', 0):.4f}-" \
               f"${cost.get('hi', 0):.4f})" if cost else ""
    return (f"job {spec.derived_job_id()} not started: {rows_left:,} rows left would cross {over}{interval}; "
            f"raise the cap or run fewer rows")


class CapWatch:
    """The running job's caps, checked from the launcher's heartbeat: `check()` says, once,
    why the job must stop (None while it fits)."""

    def __init__(self, spec: JobSpec, estimate: dict[str, Any], *, total_rows: int, held_before_s: float,
                 done: Callable[[], int], clock: Callable[[], float] = time.time):
        self.spec, self.estimate, self.total_rows = spec, estimate, total_rows
        self.held_before_s, self._done, self._clock = held_before_s, done, clock
        self._t0 = clock()
        self._done0: int | None = None
        self.reason: str | None = None

    def check(self) -> str | None:
        if self.reason is not None:
            return None
        done = self._done()
        if self._done0 is None:
            self._done0 = done
        this_run = self._clock() - self._t0
        started = done > self._done0  # this run's engine answers: its start-up is behind it
        b = bill(self.estimate, rows_left=max(0, self.total_rows - done), held_s=self.held_before_s + this_run,
                 fixed_spent_s=float("inf") if started else this_run)
        over = crossed(self.spec, b)
        if over is not None:
            self.reason = f"stopped before crossing {over}; rerun with a higher cap to resume"
        return self.reason


def before_start(spec: JobSpec, job_id: str, eng, db_url: str, total_rows: int, say: Callable[[str], None], *,
                 stored_only: bool = False) -> tuple[dict[str, Any], float]:
    """A capped job's estimate (the newest stored for its id, else one made now on a sample of
    its rows, unless `stored_only`) and the seconds its earlier runs held; CapError (one line)
    when the rows left would cross a cap."""
    stored = S.EstimateStore(eng).latest(job_id)
    if stored is not None and stored.get("total_rows") in (None, total_rows):
        estimate = stored["estimate"]
    elif stored_only:
        raise CapError(f"job {job_id} has a cap (max_cost/max_hours) and no estimate: run tokenmill estimate first")
    else:
        say("estimating the job's cost and time for its cap (tokenmill estimate: a sample of its rows)")
        estimate = make_estimate(spec.model_copy(update={"max_cost": None, "max_hours": None}), db_url=db_url,
                                 stage=say)
    c = S.MetricsReader(eng).counts(job_id)
    held = held_seconds(S.JobStore(eng).runs(job_id))
    why = refusal(spec, estimate, rows_left=max(0, total_rows - c["succeeded"] - c["failed"]), held_s=held)
    if why:
        raise CapError(why)
    return estimate, held
