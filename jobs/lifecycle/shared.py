"""A shared job's participant (`runner.lease_s`: the batches of `tokenmill serve` replicas over one
PostgreSQL, docs/SERVING.md "Replicas"): several processes run one job at once, each work unit under a
lease from the database (schemas/storage/leases.py, transforms/leases.py); `run_job` joins the job,
runs it here (`run_shared`) and ends it only where this participant is the one to finish it
(`finisher_or_busy`)."""

from __future__ import annotations

import time
from contextlib import ExitStack
from typing import Any, Callable

from tokenmill.schemas import storage as S
from tokenmill.transforms.leases import draining, holder, holding, lease_key, release
from tokenmill.transforms.read import plan_units

#: What a shared job's metrics say of the engine work no commit kept (`LeaseStore.lost_work`).
WORK_LOST = ("units_taken_over", "rows_refused", "output_tokens_refused", "rows_admitted_not_committed")
#: Passes of a shared job's pipeline one participant runs before it leaves the rest to the others
#: (each pass takes the units free at that moment: expired leases, units handed back).
MAX_SHARED_PASSES = 5
#: A finisher whose lock is older than this while the job still runs is taken as dead (another host's).
FINISH_STALE_S = 600.0

Counters = dict[str, int] | None


def run_shared(run: Any, tasks: list[str], passes: Callable[[Any], Counters]) -> Counters:
    """Run this participant's share of the job (`run`: the runner's RunContext; `passes(run)` runs
    the pipeline once per engine task, `tasks`): seed the job's units (each task's, every
    participant the same), then run the pipeline, which takes a unit's lease before reading it and
    skips the units other participants hold; after a pass the units this process holds are marked
    done where every row is answered, and handed back otherwise; another pass follows while units
    are free (a dead holder's expired, a drained one's handed back), until every unit is done, or
    held by live others, or this process drains.  Returns the passes' counters summed."""
    lease_s = float(run.spec.runner.lease_s or 0)
    store = S.LeaseStore(run.eng)
    units = plan_units(run.plan, run.spec.batching.unit_bytes)
    store.seed(run.job_id, [(lease_key(task, u.key), u.file_index, u.rows.start, len(u.rows))
                            for task in tasks for u in units])
    counters: Counters = None
    try:
        for _ in range(MAX_SHARED_PASSES):
            got = passes(run)
            if got is not None:
                counters = {k: (counters or {}).get(k, 0) + got.get(k, 0) for k in {*(counters or {}), *got}}
            held = holding(run.db_url, run.job_id, lease_s)
            for lease in held.mine():  # done where every row of it is answered, else held until handed back
                held.finish_if_complete(lease)
            st = store.state(run.job_id)
            if st["done"] == st["units"] or not st["free"] or draining() or \
                    S.JobStore(run.eng).cancel_requested(run.job_id):
                break
    finally:
        release(run.db_url, run.job_id)
        store.hand_back(holder(), run.job_id)  # what this process still holds, undone: the others take it
    return counters


def finisher_or_busy(eng, job_id: str, run_id: str, finishing: ExitStack) -> None:
    """Return when this participant is the one to finish the shared job (export, metrics, the
    job row): every unit done (or the job cancelled and no unit held), and the job's finish lock
    taken (held until `finishing` closes); else end this participant's run and raise JobBusy
    (the others finish it)."""
    jobs = S.JobStore(eng)
    st = S.LeaseStore(eng).state(job_id)
    if st["done"] < st["units"] and not (jobs.cancel_requested(job_id) and not st["held"]):
        jobs.finish_run(job_id, run_id, time.time())
        raise S.JobBusy(f"job {job_id}: {st['units'] - st['done']} of {st['units']} units not done "
                        f"({st['held']} held by other participants); they finish it")
    if not finishing.enter_context(jobs.named_lock(f"finish:{job_id}", stale_after_s=FINISH_STALE_S)) \
            or (jobs.get(job_id) or {}).get("status") != "running":
        jobs.finish_run(job_id, run_id, time.time())
        raise S.JobBusy(f"job {job_id}: another participant finishes it")


def work_lost(eng, job_id: str, *, shared: bool) -> dict[str, Any]:
    """The job's `work_lost` metrics: what replicas that died or froze cost in engine work, apart
    from what the job's rows count; a job one run owns has none of these (null)."""
    return S.LeaseStore(eng).lost_work(job_id) if shared else dict.fromkeys(WORK_LOST)
