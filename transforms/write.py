"""Write: outputs, dead letters and batch stats to the database, in transactions.

The database is the job's durable log: a batch's outputs are committed as one
transaction when the batch finishes, with primary keys (job_id, id) for outputs
and (job_id, input_ref) for dead letters and inserts that skip existing keys,
so a retried bundle or a resumed job never duplicates a row.  The Parquet/JSONL
files are exported from here at the end of the job (jobs/export.py).
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Any

import apache_beam as beam
from sqlalchemy import select, update

from tokenmill.schemas import tables as T
from tokenmill.schemas.db import db_engine, insert_ignore
from tokenmill.schemas.records import FailedRecord

DEAD_FLUSH_ROWS = 500


def dead_row(job_id: str, d: FailedRecord) -> dict[str, Any]:
    return {
        "job_id": job_id,
        "input_ref": d.input_ref,
        "id": d.id,
        "reason": d.reason,
        "message": d.message,
        "raw": d.raw,
        "created_at": time.time(),
    }


class WriteOutputsFn(beam.DoFn):
    """One element = one finished batch (a list of output rows) = one transaction."""

    def __init__(self, db_url: str):
        self._url = db_url

    def process(self, rows):
        with db_engine(self._url).begin() as conn:
            insert_ignore(conn, T.outputs, rows)
        yield len(rows)


class _BufferedWriteFn(beam.DoFn):
    table: Any = None

    def __init__(self, db_url: str, job_id: str):
        self._url = db_url
        self._job_id = job_id
        self._buf: list[dict[str, Any]] = []

    def to_row(self, element) -> dict[str, Any]:
        raise NotImplementedError

    def start_bundle(self):
        self._buf = []

    def process(self, element):
        self._buf.append(self.to_row(element))
        if len(self._buf) >= DEAD_FLUSH_ROWS:
            self._flush()

    def finish_bundle(self):
        self._flush()

    def _flush(self):
        if self._buf:
            with db_engine(self._url).begin() as conn:
                insert_ignore(conn, self.table, self._buf)
            self._buf = []


class WriteDeadLettersFn(_BufferedWriteFn):
    table = T.dead_letters

    def to_row(self, d: FailedRecord):
        return dead_row(self._job_id, d)


class WriteBatchStatsFn(_BufferedWriteFn):
    table = T.batches

    def to_row(self, stats):
        cols = {c.name for c in T.batches.columns}
        return {k: v for k, v in stats.items() if k in cols}


class WriteToDatabase(beam.PTransform):
    def __init__(self, db_url: str, job_id: str, kind: str):
        super().__init__()
        self._url, self._job_id, self._kind = db_url, job_id, kind

    def expand(self, pcoll):
        if self._kind == "outputs":
            return pcoll | "InsertOutputs" >> beam.ParDo(WriteOutputsFn(self._url))
        fn = {"dead_letters": WriteDeadLettersFn, "batches": WriteBatchStatsFn}[self._kind]
        return pcoll | f"Insert_{self._kind}" >> beam.ParDo(fn(self._url, self._job_id))


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


def record_worker(db_url: str, job_id: str, worker: str, session, started_at: float) -> None:
    try:
        info = session.info()
    except Exception as err:  # a fake engine, or an engine that cannot say
        info = {"error": str(err)}
    row = {
        "job_id": job_id,
        "worker": worker,
        "hostname": worker.split(":")[0],
        "pid": os.getpid(),
        "device": info.get("device"),
        "load_s": info.get("load_s"),
        "engine_info": _jsonable(info),
        "peak_rss_bytes": _rss_peak_bytes(),
        "started_at": started_at,
        "updated_at": time.time(),
    }
    with db_engine(db_url).begin() as conn:
        if insert_ignore(conn, T.workers, [row]) == 0:
            conn.execute(
                update(T.workers)
                .where(T.workers.c.job_id == job_id, T.workers.c.worker == worker)
                .values(engine_info=row["engine_info"], updated_at=row["updated_at"])
            )


def update_worker_peak(db_url: str, job_id: str, worker: str) -> None:
    with db_engine(db_url).begin() as conn:
        conn.execute(
            update(T.workers)
            .where(T.workers.c.job_id == job_id, T.workers.c.worker == worker)
            .values(peak_rss_bytes=_rss_peak_bytes(), updated_at=time.time())
        )


def cancel_requested(db_url: str, job_id: str) -> bool:
    with db_engine(db_url).connect() as conn:
        return bool(conn.execute(select(T.jobs.c.cancel_requested).where(T.jobs.c.id == job_id)).scalar())


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
