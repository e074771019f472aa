"""Write: outputs, dead letters and batch stats to the database, in transactions.

The database is the job's durable log: a batch's outputs, its dead letters and its
figures are committed as one transaction when the batch finishes, by the worker that
generated it (`commit_batch`, called by Generate); the other steps' dead letters go
through `WriteDeadLetters`.  Primary keys (job_id, id) for outputs
and (job_id, input_file, input_row) for dead letters and inserts that skip
existing keys, so a retried bundle or a resumed job never duplicates a row.
The Parquet/JSONL files are exported from there at the end of the job
(jobs/lifecycle/export.py).  The SQL itself is schemas/storage/'s (`ResultWriter`).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from typing import Any

import apache_beam as beam

from tokenmill.schemas import storage as S
from tokenmill.schemas.records import DeadLetterRow, FailedRecord, WorkerRow

DEAD_FLUSH_ROWS = 500

log = logging.getLogger(__name__)


def dead_row(job_id: str, d: FailedRecord) -> dict[str, Any]:
    return DeadLetterRow(
        job_id=job_id, input_file=d.input_file, input_row=d.input_row, id=d.id, reason=d.reason,
        message=d.message, raw=d.raw, created_at=time.time(),
    ).as_dict()


def commit_batch(db_url: str, job_id: str, rows: list[dict[str, Any]], dead: list[FailedRecord],
                 stats: dict[str, Any], cache_entries: list[dict[str, Any]] | tuple = (),
                 lease: S.Lease | None = None, lease_s: float | None = None) -> None:
    """One finished batch (Generate's): its outputs, the engine's dead letters, its figures and
    the result-cache entries of its answers (`cache: read-write`), committed together in one
    transaction by the worker that generated it, so
    what a failure loses is the batches in flight on any runner (a runner that does not
    fuse Generate with a writer step would otherwise hold a whole unit's outputs).  With a shared
    job's `lease`, fenced: LeaseLost, nothing written, when the unit is no longer this lease's."""
    S.ResultWriter(S.connect(db_url)).commit_batch(rows, [dead_row(job_id, d) for d in dead], [stats],
                                                   cache_entries=cache_entries, lease=lease, lease_s=lease_s)


def count_lost(db_url: str, lease: S.Lease, rows: list[dict[str, Any]]) -> None:
    """A refused batch's engine work, kept on its unit as work lost to a failure."""
    S.LeaseStore(S.connect(db_url)).add_lost(lease, rows=len({(r["input_file"], r["input_row"]) for r in rows}),
                                             output_tokens=sum(int(r.get("output_tokens") or 0) for r in rows))


class WriteDeadLettersFn(beam.DoFn):
    """Dead letters of a step, buffered: one transaction per `DEAD_FLUSH_ROWS` and at the
    end of a bundle (a rerun finds the rest again: their keys are the input positions)."""

    def __init__(self, db_url: str, job_id: str):
        self._url = db_url
        self._job_id = job_id
        self._buf: list[dict[str, Any]] = []

    def start_bundle(self):
        self._buf = []

    def process(self, d: FailedRecord):
        self._buf.append(dead_row(self._job_id, d))
        if len(self._buf) >= DEAD_FLUSH_ROWS:
            self._flush()

    def finish_bundle(self):
        self._flush()

    def _flush(self):
        if self._buf:
            S.ResultWriter(S.connect(self._url)).insert_rows(DeadLetterRow, self._buf)
            self._buf = []


class WriteDeadLetters(beam.PTransform):
    def __init__(self, db_url: str, job_id: str):
        super().__init__()
        self._url, self._job_id = db_url, job_id

    def expand(self, pcoll):
        return pcoll | "InsertDeadLetters" >> beam.ParDo(WriteDeadLettersFn(self._url, self._job_id))


# ---------------------------------------------------------------- worker bookkeeping


def _rss_peak_bytes() -> int:
    import resource

    # ru_maxrss is KiB on Linux; children covers vLLM's engine-core process.
    own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    kids = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
    try:
        import psutil

        cur = sum(p.memory_info().rss for p in psutil.Process().children(recursive=True))
    except Exception:
        cur = 0
    return int(own + max(kids, cur))


#: (job_id, worker) → the meter of this process's engine for that job (transforms/engines/meter.py)
_METERS: dict[tuple[str, str], Any] = {}


def _meter_reading(job_id: str, worker: str) -> dict[str, Any]:
    m = _METERS.get((job_id, worker))
    if m is None:
        return {}
    try:
        return m.reading()
    except Exception as err:  # never fail a worker for its accounting
        log.warning("worker %s: no accounting reading: %s", worker, err)
        return {}


def record_worker(db_url: str, job_id: str, worker: str, session, started_at: float, run_id: str | None = None,
                  task: str = "generate") -> None:
    """The worker's row, written when its engine is ready: what the engine says (engine_info,
    with the `task` it runs, load_s) and what the worker measures of itself from now on
    (devices, memory, power, energy: engines/meter.py), under `run_id` (the job run it belongs to)."""
    from tokenmill.transforms.engines.meter import WorkerMeter

    try:
        info = session.info()
    except Exception as err:  # a fake engine, or an engine that cannot say
        info = {"error": str(err)}
    info = {"task": task, **info}  # the engine's own word on its task first
    # the checkpoint folder or file the engine loaded (EngineSession.info's `weights_path`)
    model_path = info.get("weights_path")
    if model_path:  # a checkpoint `tokenmill quantize` wrote: its recipe, calibration source and hash
        from tokenmill.schemas.models import checkpoint_summary, quantization_record

        ckpt = checkpoint_summary(quantization_record(model_path))
        if ckpt:
            info["checkpoint"] = ckpt
    for key, old in list(_METERS.items()):  # one engine a process: earlier meters stop sampling (still readable)
        old.stop()
        if key == (job_id, worker) or len(_METERS) > 8:
            del _METERS[key]
    try:
        _METERS[(job_id, worker)] = WorkerMeter(info).start()
    except Exception as err:  # never fail a worker for its accounting
        log.warning("worker %s: cannot measure its devices: %s", worker, err)
    row = WorkerRow(
        job_id=job_id, worker=worker, hostname=worker.split(":")[0], pid=os.getpid(), device=info.get("device"),
        load_s=info.get("load_s"), engine_info=_jsonable(info), peak_rss_bytes=_rss_peak_bytes(),
        started_at=started_at, updated_at=time.time(), run_id=run_id, **_meter_reading(job_id, worker),
    )
    S.ResultWriter(S.connect(db_url)).record_worker(row)


def update_worker_peak(db_url: str, job_id: str, worker: str, **counters: int) -> None:
    """Refresh the worker's row: peak RSS, the counters given, and its meter's reading."""
    S.ResultWriter(S.connect(db_url)).update_worker(job_id, worker, peak_rss_bytes=_rss_peak_bytes(), updated_at=time.time(),
                                                    **_meter_reading(job_id, worker), **counters)


def update_worker_admitted(db_url: str, job_id: str, worker: str, admitted_rows: int) -> None:
    """The worker's admitted count alone, written ahead of a batch's admission (generate.py)."""
    S.ResultWriter(S.connect(db_url)).update_worker(job_id, worker, admitted_rows=admitted_rows)


def cancel_requested(db_url: str, job_id: str) -> bool:
    return S.JobStore(S.connect(db_url)).cancel_requested(job_id)


def _jsonable(v):
    if dataclasses.is_dataclass(v):
        v = dataclasses.asdict(v)
    if isinstance(v, dict):
        return {str(k): _jsonable(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_jsonable(x) for x in v]
    if isinstance(v, (str, int, float, bool)) or v is None:
        return v
    return str(v)
