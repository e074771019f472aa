"""A job's metrics computed from what the database holds: the one reader that
the job lifecycle (when the job finishes) and reports (of an unfinished job) share."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from tokenmill.jobs.metrics.accounting import JobTerms, JobWork, job_metrics
from tokenmill.jobs.metrics.pricing import price_table
from tokenmill.schemas import storage as S


def stored_metrics(eng, job_id: str, terms: JobTerms, merged: bool = False) -> dict[str, Any]:
    """`job_metrics` of the job's stored requests, batches, workers and runs, each worker
    priced for the devices it measured: here `terms.prices` is the job spec's `prices`, laid
    over the price table (or the flat `price_per_hour`), and `terms.hardware` (the launcher's)
    prices worker rows that measured nothing and gives the device count.  The request figures
    are summed and ranked by the database (`RequestSummary.stats`): memory stays flat whatever
    the job's size.  With `merged` (a job's end), they are its runs' stored summaries merged, each
    run read once (`RunSummaries.merged`: a rerun reads only the rows it added; time percentiles
    within `merged.ALPHA`), unless those do not add up to the stored rows."""
    reader = S.MetricsReader(eng)
    stats = (S.RunSummaries(eng).merged(job_id) if merged else None) or S.RequestSummary(eng).stats(job_id)
    work = JobWork(stats, reader.batches(job_id), reader.workers(job_id),
                   failed_by_reason=reader.failure_reasons(job_id), runs=S.JobStore(eng).runs(job_id))
    hardware = terms.hardware or {}
    return job_metrics(work, replace(terms, prices=price_table(terms.prices), hardware=hardware,
                                     device_count=hardware.get("device_count", 1) or 1))
