"""A job's metrics computed from what the database holds: the one reader that
the job lifecycle (when the job finishes) and reports (of an unfinished job) share."""

from __future__ import annotations

from typing import Any

from tokenmill.jobs.metrics.accounting import job_metrics
from tokenmill.jobs.metrics.pricing import price_table
from tokenmill.schemas import storage as S


def stored_metrics(
    eng,
    job_id: str,
    *,
    total: int,
    hardware: dict[str, Any],
    price_per_hour: float | None,
    engine_config: dict[str, Any],
    token_budget: int | None,
    job_wall_s: float | None = None,
    utilization: dict[str, Any] | None = None,
    prices: dict[str, float] | None = None,
    now: float | None = None,
    cache_mode: str | None = None,
) -> dict[str, Any]:
    """`job_metrics` of the job's stored requests, batches, workers and runs, each worker
    priced for the devices it measured (the price table with the job spec's `prices`
    over it, or the flat `price_per_hour`); `hardware` (the launcher's) prices worker
    rows that measured nothing.  The request figures are summed and ranked by the database
    (`RequestSummary.stats`): memory stays flat whatever the job's size.  `now`: the end
    of a run still going (a report of a live job); `cache_mode`: the run's `cache`."""
    return job_metrics(
        S.RequestSummary(eng).stats(job_id),
        S.MetricsReader(eng).batches(job_id),
        S.MetricsReader(eng).workers(job_id),
        total=total,
        failed_by_reason=S.MetricsReader(eng).failure_reasons(job_id),
        engine_config=engine_config,
        token_budget=token_budget,
        price_per_hour=price_per_hour,
        prices=price_table(prices),
        hardware=hardware,
        device_count=hardware.get("device_count", 1) or 1,
        job_wall_s=job_wall_s,
        utilization=utilization,
        runs=S.JobStore(eng).runs(job_id),
        now=now,
        cache_mode=cache_mode,
    )
