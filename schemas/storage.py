"""Job storage: every SQL statement of tokenmill, over SQLite (embedded default)
and PostgreSQL (production); the same contract tests run against both.

`connect(url)` gives the engine for a URL (one per URL per process, the schema
migrated to head on first use); every other function takes that engine:
job rows and run ownership, the pending-job queue's rows, the rows workers
write (outputs, dead letters, batch stats, workers), what resumes, exports,
reports and comparisons read back, and a named lock.
"""

from __future__ import annotations

import datetime as dt
import os
import socket
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterable, Iterator

from sqlalchemy import delete, func, insert, select, update
from sqlalchemy.engine import Engine
from sqlalchemy.exc import IntegrityError, OperationalError, SQLAlchemyError

from tokenmill.schemas import tables as T
from tokenmill.schemas.db import db_engine
from tokenmill.schemas.secrets import mask_url
from tokenmill.schemas.errors import first_line
from tokenmill.schemas.records import (METRIC_COLUMNS, REQUEST_COLUMNS, BatchStats, DeadLetterRow, OutputRow,
                                      StoredRow, metric_values)

#: Rows per chunk when streaming a job's rows out (exports).
CHUNK_ROWS = 5000

MIGRATIONS = Path(__file__).parent / "migrations"
#: A running job whose heartbeat is older than this is taken as dead (killed run).
STALE_AFTER_S = 60.0


class StorageError(RuntimeError):
    """A database problem a user can act on; the message is one line."""


def utcnow() -> dt.datetime:
    return dt.datetime.now(dt.timezone.utc)


def _aware(t: dt.datetime | None) -> dt.datetime | None:
    if t is not None and t.tzinfo is None:  # SQLite returns naive datetimes
        return t.replace(tzinfo=dt.timezone.utc)
    return t


def _alembic_config(conn):
    from alembic.config import Config

    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS))
    cfg.attributes["connection"] = conn
    return cfg


def head_revision() -> str:
    from alembic.script import ScriptDirectory

    return ScriptDirectory.from_config(_alembic_config(None)).get_current_head()


def current_revision(conn) -> str | None:
    from alembic.runtime.migration import MigrationContext

    return MigrationContext.configure(conn).get_current_revision()


def upgrade(engine: Engine) -> str:
    """Bring the schema to head; refuse a database from a newer tokenmill."""
    from alembic import command
    from alembic.script import ScriptDirectory

    script = ScriptDirectory.from_config(_alembic_config(None))
    known = {r.revision for r in script.walk_revisions()}
    head = script.get_current_head()
    for attempt in range(3):
        with engine.begin() as conn:
            cur = current_revision(conn)
            if cur is not None and cur not in known:
                raise StorageError(
                    f"database {mask_url(str(engine.url))} has schema revision {cur!r}, newer than this tokenmill "
                    f"knows (head {head!r}); upgrade tokenmill"
                )
            if cur == head:
                return head
            try:
                command.upgrade(_alembic_config(conn), "head")
                return head
            except (OperationalError, IntegrityError):
                if attempt == 2:  # another process migrated at the same time: look again
                    raise
    return head


_READY: set[str] = set()


def connect(url: str, *, migrate: bool = True) -> Engine:
    """An engine for the URL with the schema at head; unreachable databases raise StorageError."""
    try:
        eng = db_engine(url)
        if migrate and url not in _READY:
            upgrade(eng)
            _READY.add(url)
        elif not migrate:
            with eng.connect():
                pass
        return eng
    except StorageError:
        raise
    except SQLAlchemyError as err:
        # the driver's own message (err.orig), not SQLAlchemy's wrapper with the SQL and a link
        raise StorageError(f"cannot use database {mask_url(url)}: {first_line(getattr(err, 'orig', None) or err)}") from None
    except Exception as err:  # driver import errors, bad URLs
        raise StorageError(f"cannot use database {mask_url(url)}: {first_line(err)}") from None


def owner_tag() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


# ---------------------------------------------------------------- jobs


def get_job(eng: Engine, job_id: str) -> dict[str, Any] | None:
    with eng.connect() as conn:
        row = conn.execute(select(T.jobs).where(T.jobs.c.id == job_id)).mappings().first()
    return dict(row) if row else None


def list_jobs(eng: Engine, limit: int = 20) -> list[dict[str, Any]]:
    order = func.coalesce(T.jobs.c.started_at, T.jobs.c.submitted_at)
    with eng.connect() as conn:
        rows = conn.execute(select(T.jobs).order_by(order.desc(), T.jobs.c.id).limit(limit)).mappings().all()
    return [dict(r) for r in rows]


def _pid_alive(owner: str | None) -> bool:
    if not owner or ":" not in owner:
        return False
    host, pid = owner.rsplit(":", 1)
    if host != socket.gethostname():
        return True  # cannot tell for another host: trust the heartbeat
    try:
        os.kill(int(pid), 0)
        return True
    except (ProcessLookupError, ValueError):
        return False
    except PermissionError:
        return True


def is_live(job: dict[str, Any], now: dt.datetime | None = None) -> bool:
    """A `running` job is live while its owner's heartbeat is fresh and its process exists."""
    if job.get("status") != "running":
        return False
    now = now or utcnow()
    hb = _aware(job.get("heartbeat_at"))
    fresh = hb is not None and (now - hb).total_seconds() < STALE_AFTER_S
    return fresh and _pid_alive(job.get("owner"))


class JobBusy(RuntimeError):
    pass


def claim_job(eng: Engine, job_id: str, values: dict[str, Any]) -> dict[str, Any]:
    """Create the job row, or take over an existing one, as `running` by this process.

    Two runs of one job id at once: the second raises JobBusy.  The claim is a
    compare-and-set on (status, owner, heartbeat) so two racing claimers cannot
    both win."""
    me = owner_tag()
    now = utcnow()
    inserted_first: IntegrityError | None = None
    with eng.begin() as conn:
        row = conn.execute(select(T.jobs).where(T.jobs.c.id == job_id)).mappings().first()
        if row is None:
            try:
                conn.execute(
                    insert(T.jobs).values(
                        id=job_id, status="running", owner=me, heartbeat_at=now, started_at=now,
                        submitted_at=now, cancel_requested=False, **values,
                    )
                )
                return {"resumed": False}
            except IntegrityError as err:
                inserted_first = err  # someone inserted it first: fall through to the take-over path
    with eng.begin() as conn:
        found = conn.execute(select(T.jobs).where(T.jobs.c.id == job_id)).mappings().first()
        if found is None:  # the insert failed for another reason (a NOT NULL column, say), or a delete raced
            raise inserted_first or JobBusy(f"job {job_id!r} vanished while being claimed; run it again")
        row = dict(found)
        if is_live(row):
            raise JobBusy(f"job {job_id!r} is already running (owner {row['owner']}); not starting a second run")
        q = update(T.jobs).where(T.jobs.c.id == job_id, T.jobs.c.status == row["status"])
        q = q.where(T.jobs.c.owner == row["owner"]) if row["owner"] is not None else q.where(T.jobs.c.owner.is_(None))
        res = conn.execute(
            q.values(
                status="running", owner=me, heartbeat_at=now, started_at=row["started_at"] or now,
                finished_at=None, error=None, cancel_requested=False, **values,
            )
        )
        if res.rowcount != 1:
            raise JobBusy(f"job {job_id!r} was claimed by another run at the same moment; not starting a second run")
    return {"resumed": True, "previous_status": row["status"]}


def heartbeat(eng: Engine, job_id: str, run_id: str | None = None) -> None:
    """Mark the job's owner alive (and, given `run_id`, that run: `runs.seen_at`)."""
    with eng.begin() as conn:
        conn.execute(
            update(T.jobs).where(T.jobs.c.id == job_id, T.jobs.c.owner == owner_tag()).values(heartbeat_at=utcnow())
        )
        if run_id is not None:
            conn.execute(update(T.runs).where(T.runs.c.job_id == job_id, T.runs.c.run_id == run_id)
                         .values(seen_at=time.time()))


# ---------------------------------------------------------------- runs of a job (first and resumes)


def start_run(eng: Engine, job_id: str, run_id: str, started_at: float) -> None:
    """Record a run of a job as its launcher starts it (wall clock, time.time())."""
    with eng.begin() as conn:
        _insert_ignore(conn, T.runs, [{"job_id": job_id, "run_id": run_id, "owner": owner_tag(),
                                       "started_at": started_at, "seen_at": started_at, "finished_at": None}])


def finish_run(eng: Engine, job_id: str, run_id: str, finished_at: float) -> None:
    with eng.begin() as conn:
        conn.execute(update(T.runs).where(T.runs.c.job_id == job_id, T.runs.c.run_id == run_id)
                     .values(seen_at=finished_at, finished_at=finished_at))


def job_runs(eng: Engine, job_id: str) -> list[dict[str, Any]]:
    """A job's runs, oldest first."""
    with eng.connect() as conn:
        q = select(T.runs).where(T.runs.c.job_id == job_id).order_by(T.runs.c.started_at, T.runs.c.run_id)
        return [dict(r) for r in conn.execute(q).mappings()]


def finish_job(eng: Engine, job_id: str, **values: Any) -> None:
    with eng.begin() as conn:
        conn.execute(update(T.jobs).where(T.jobs.c.id == job_id).values(finished_at=utcnow(), **values))


def request_cancel(eng: Engine, job_id: str) -> dict[str, Any]:
    job = get_job(eng, job_id)
    if job is None:
        raise StorageError(f"no job with id {job_id!r}")
    with eng.begin() as conn:
        if job["status"] == "pending":
            conn.execute(update(T.jobs).where(T.jobs.c.id == job_id).values(status="cancelled", finished_at=utcnow()))
        elif job["status"] == "running":
            conn.execute(update(T.jobs).where(T.jobs.c.id == job_id).values(cancel_requested=True))
    return get_job(eng, job_id)


def counts(eng: Engine, job_id: str) -> dict[str, int]:
    with eng.connect() as conn:
        ok = conn.execute(select(func.count()).select_from(T.outputs).where(T.outputs.c.job_id == job_id)).scalar()
        bad = conn.execute(
            select(func.count()).select_from(T.dead_letters).where(T.dead_letters.c.job_id == job_id)
        ).scalar()
    return {"succeeded": int(ok or 0), "failed": int(bad or 0)}


def failure_reasons(eng: Engine, job_id: str) -> dict[str, int]:
    with eng.connect() as conn:
        rows = conn.execute(
            select(T.dead_letters.c.reason, func.count())
            .where(T.dead_letters.c.job_id == job_id)
            .group_by(T.dead_letters.c.reason)
        ).all()
    return {r: int(n) for r, n in rows}


def delete_job(eng: Engine, job_id: str) -> None:
    with eng.begin() as conn:
        for t in (T.outputs, T.dead_letters, T.batches, T.workers, T.id_claims, T.runs):  # every table keyed by job_id
            conn.execute(delete(t).where(t.c.job_id == job_id))
        conn.execute(delete(T.jobs).where(T.jobs.c.id == job_id))


# ---------------------------------------------------------------- a named lock (run-pending)


@contextmanager
def named_lock(eng: Engine, name: str, stale_after_s: float = 6 * 3600) -> Iterator[bool]:
    """Yields True if this process holds the lock, False if another live process does."""
    me = owner_tag()
    got = False
    with eng.begin() as conn:
        row = conn.execute(select(T.locks).where(T.locks.c.name == name)).mappings().first()
        if row is not None:
            age = (utcnow() - _aware(row["acquired_at"])).total_seconds()
            if _pid_alive(row["owner"]) and age < stale_after_s:
                got = False
            else:
                conn.execute(delete(T.locks).where(T.locks.c.name == name, T.locks.c.owner == row["owner"]))
                row = None
    if row is None:
        try:
            with eng.begin() as conn:
                conn.execute(insert(T.locks).values(name=name, owner=me, acquired_at=utcnow()))
            got = True
        except IntegrityError:
            got = False
    try:
        yield got
    finally:
        if got:
            with eng.begin() as conn:
                conn.execute(delete(T.locks).where(T.locks.c.name == name, T.locks.c.owner == me))


# ---------------------------------------------------------------- the pending-job queue


def submit_job(eng: Engine, values: dict[str, Any]) -> bool:
    """Insert a job row as given (a `pending` one); False if its id exists already."""
    try:
        with eng.begin() as conn:
            conn.execute(insert(T.jobs).values(**values))
        return True
    except IntegrityError:
        return False


def requeue_job(eng: Engine, job_id: str, from_status: str, values: dict[str, Any]) -> bool:
    """Put a job back in the queue (`pending`, no owner, no cancel request, no error) with
    `values` (its spec, submitted_at), only if its status is still `from_status`: a
    compare-and-set, so a racing submit or run makes this return False."""
    with eng.begin() as conn:
        res = conn.execute(
            update(T.jobs).where(T.jobs.c.id == job_id, T.jobs.c.status == from_status)
            .values(status="pending", owner=None, heartbeat_at=None, finished_at=None, error=None,
                    cancel_requested=False, **values)
        )
    return res.rowcount == 1


def queued_jobs(eng: Engine) -> list[dict[str, Any]]:
    """Jobs `pending` or `running`, in submission order (oldest first; ties by id)."""
    with eng.connect() as conn:
        rows = conn.execute(
            select(T.jobs).where(T.jobs.c.status.in_(("pending", "running")))
            .order_by(T.jobs.c.submitted_at, T.jobs.c.id)
        ).mappings().all()
    return [dict(r) for r in rows]


# ---------------------------------------------------------------- what workers write


def _table(record: type[StoredRow]):
    return T.metadata.tables[record.TABLE]


def _insert_ignore(conn, table, rows: list[dict[str, Any]]) -> int:
    """Bulk insert; rows whose primary key exists are skipped (reruns never duplicate)."""
    if not rows:
        return 0
    dialect = conn.dialect.name
    if dialect == "sqlite":
        from sqlalchemy.dialects.sqlite import insert as dialect_insert
    elif dialect == "postgresql":
        from sqlalchemy.dialects.postgresql import insert as dialect_insert
    else:  # pragma: no cover - other backends: plain insert, one by one on conflict
        n = 0
        for r in rows:
            try:
                with conn.begin_nested():
                    conn.execute(insert(table), [r])
                n += 1
            except IntegrityError:
                pass
        return n
    stmt = dialect_insert(table).on_conflict_do_nothing()
    if dialect == "postgresql":
        # SQLAlchemy batches an ON CONFLICT executemany into multi-row INSERTs
        # ("insertmanyvalues") only with RETURNING; without it psycopg2 sends one
        # statement per row (bench/db_writes.py: several times slower).  RETURNING
        # yields only the rows actually inserted, which is the count we want.
        res = conn.execute(stmt.returning(*table.primary_key.columns), rows)
        return len(res.all())
    res = conn.execute(stmt, rows)
    return res.rowcount if res.rowcount is not None and res.rowcount >= 0 else len(rows)


def insert_rows(eng: Engine, record: type[StoredRow], rows: Iterable[dict[str, Any]]) -> int:
    """Insert rows of a stored-row record (`OutputRow`, `DeadLetterRow`, `BatchStats`, as
    `as_dict()` gives them) in one transaction; rows whose key exists are skipped, so a
    retried bundle or a resumed job never duplicates one.  Returns how many were new."""
    rows = list(rows)
    if not rows:
        return 0
    with eng.begin() as conn:
        return _insert_ignore(conn, _table(record), rows)


def commit_batch(eng: Engine, outputs: list[dict[str, Any]], dead_letters: list[dict[str, Any]],
                 stats: list[dict[str, Any]]) -> None:
    """One finished batch in one transaction: its output rows, the dead letters the engine
    gave, its figures (`OutputRow`, `DeadLetterRow`, `BatchStats` as `as_dict()` gives
    them).  Existing keys are skipped, as in `insert_rows`."""
    with eng.begin() as conn:
        for record, rows in ((OutputRow, outputs), (DeadLetterRow, dead_letters), (BatchStats, stats)):
            if rows:
                _insert_ignore(conn, _table(record), rows)


#: What a worker row's refresh overwrites (a restarted engine, or the same process in a later run).
_WORKER_REFRESH = ("engine_info", "updated_at", "run_id", "device_type", "device_model", "device_count", "cpu_count",
                   "nvml_error", "measure")


def record_worker(eng: Engine, row: dict[str, Any]) -> None:
    """Insert a worker's row; if the worker (job_id, worker) has one, refresh its engine_info
    and what it measured of itself (those of `_WORKER_REFRESH` that `row` carries)."""
    with eng.begin() as conn:
        if _insert_ignore(conn, T.workers, [row]) == 0:
            conn.execute(
                update(T.workers)
                .where(T.workers.c.job_id == row["job_id"], T.workers.c.worker == row["worker"])
                .values(**{k: row[k] for k in _WORKER_REFRESH if k in row})
            )


def update_worker(eng: Engine, job_id: str, worker: str, **values: Any) -> None:
    with eng.begin() as conn:
        conn.execute(update(T.workers).where(T.workers.c.job_id == job_id, T.workers.c.worker == worker).values(**values))


def cancel_requested(eng: Engine, job_id: str) -> bool:
    with eng.connect() as conn:
        return bool(conn.execute(select(T.jobs.c.cancel_requested).where(T.jobs.c.id == job_id)).scalar())


#: Ids per IN (...) list: well under SQLite's 32,766 bound parameters and PostgreSQL's 65,535.
IN_CHUNK = 1000


def _chunks(items: list, n: int = IN_CHUNK) -> Iterator[list]:
    for i in range(0, len(items), n):
        yield items[i:i + n]


def done_in_range(eng: Engine, job_id: str, input_file: int, first_row: int, last_row: int,
                  ids: Iterable[str]) -> tuple[set[str], set[int]]:
    """What a rerun skips of one work unit (rows `first_row..last_row` of one input file):
    (those of `ids` already answered, input rows already answered or dead-lettered).
    Keyed lookups bounded by the unit, never the job's whole key set."""
    o, d = T.outputs.c, T.dead_letters.c
    done_rows: set[int] = set()
    done_ids: set[str] = set()
    with eng.connect() as conn:
        for t in (o, d):
            q = select(t.input_row).where(
                t.job_id == job_id, t.input_file == input_file, t.input_row.between(first_row, last_row))
            done_rows.update(conn.execute(q).scalars())
        for part in _chunks(list(ids)):
            done_ids.update(conn.execute(select(o.id).where(o.job_id == job_id, o.id.in_(part))).scalars())
    return done_ids, done_rows


def claim_ids(eng: Engine, job_id: str, rows: list[tuple[str, int, int]]) -> int:
    """Record (id, input_file, input_row) claims: each id keeps the first row in input
    order that carries it, whatever order work units run in (an upsert that only moves
    a claim to an earlier row), so the claim pass can run in parallel and be re-run."""
    if not rows:
        return 0
    c = T.id_claims.c
    best: dict[str, tuple[int, int]] = {}
    for rid, f, r in rows:  # duplicates inside one call: one statement may not touch a row twice
        if rid not in best or (f, r) < best[rid]:
            best[rid] = (f, r)
    values = [{"job_id": job_id, "id": k, "input_file": f, "input_row": r} for k, (f, r) in best.items()]
    with eng.begin() as conn:
        if conn.dialect.name == "postgresql":
            from sqlalchemy.dialects.postgresql import insert as dialect_insert
        else:
            from sqlalchemy.dialects.sqlite import insert as dialect_insert
        stmt = dialect_insert(T.id_claims)
        ex = stmt.excluded
        earlier = (ex.input_file < c.input_file) | ((ex.input_file == c.input_file) & (ex.input_row < c.input_row))
        stmt = stmt.on_conflict_do_update(
            index_elements=[c.job_id, c.id],
            set_={"input_file": ex.input_file, "input_row": ex.input_row},
            where=earlier,
        )
        for part in _chunks(values):
            conn.execute(stmt, part)
    return len(values)


def id_claims(eng: Engine, job_id: str, ids: Iterable[str]) -> dict[str, tuple[int, int]]:
    """The claiming row (input_file, input_row) of each of `ids` that has one."""
    c = T.id_claims.c
    out: dict[str, tuple[int, int]] = {}
    with eng.connect() as conn:
        for part in _chunks(list(set(ids))):
            q = select(c.id, c.input_file, c.input_row).where(c.job_id == job_id, c.id.in_(part))
            out.update({i: (f, r) for i, f, r in conn.execute(q)})
    return out


# ---------------------------------------------------------------- what exports, reports and tools read


def output_tokens(eng: Engine, job_id: str) -> int:
    with eng.connect() as conn:
        q = select(func.coalesce(func.sum(T.outputs.c.output_tokens), 0)).where(T.outputs.c.job_id == job_id)
        return int(conn.execute(q).scalar())


def stream_rows(eng: Engine, record: type[StoredRow], job_id: str) -> Iterator[list[dict[str, Any]]]:
    """A job's rows of one table in input order (file, then row), in chunks of CHUNK_ROWS."""
    table = _table(record)
    order = (table.c.input_file, table.c.input_row)
    with eng.connect() as conn:
        res = conn.execution_options(stream_results=True, yield_per=CHUNK_ROWS).execute(
            select(table).where(table.c.job_id == job_id).order_by(*order)
        )
        for part in res.mappings().partitions(CHUNK_ROWS):
            yield [dict(r) for r in part]


def request_rows(eng: Engine, job_id: str, columns: tuple[str, ...] = REQUEST_COLUMNS) -> list[dict[str, Any]]:
    """The job's per-request figures (no output text), ordered by finish time."""
    cols = [T.outputs.c[k] for k in columns]
    with eng.connect() as conn:
        q = select(*cols).where(T.outputs.c.job_id == job_id).order_by(T.outputs.c.finished_at, T.outputs.c.id)
        return [dict(r) for r in conn.execute(q).mappings()]


def request_columns(eng: Engine, job_id: str, columns: tuple[str, ...] = METRIC_COLUMNS) -> dict[str, Any]:
    """The job's per-request figures as one float64 numpy array per column (records'
    `metric_values`: None → NaN, a coded column as its code), streamed in chunks: 8 bytes
    a value in the reader, not a Python object per row."""
    from array import array

    import numpy as np

    out = {k: array("d") for k in columns}
    with eng.connect() as conn:
        q = select(*[T.outputs.c[k] for k in columns]).where(T.outputs.c.job_id == job_id)
        for part in conn.execution_options(stream_results=True, yield_per=CHUNK_ROWS).execute(q).partitions():
            for k, vals in zip(columns, zip(*part)):
                out[k].extend(metric_values(k, vals))
    return {k: np.frombuffer(v, dtype=float) if len(v) else np.zeros(0) for k, v in out.items()}


def job_batches(eng: Engine, job_id: str) -> list[dict[str, Any]]:
    with eng.connect() as conn:
        q = select(T.batches).where(T.batches.c.job_id == job_id).order_by(T.batches.c.started_at)
        return [dict(r) for r in conn.execute(q).mappings()]


def job_workers(eng: Engine, job_id: str) -> list[dict[str, Any]]:
    with eng.connect() as conn:
        return [dict(r) for r in conn.execute(select(T.workers).where(T.workers.c.job_id == job_id)).mappings()]


def job_outputs(eng: Engine, job_id: str) -> dict[str, dict[str, Any]]:
    """A job's output texts and references, by id."""
    o = T.outputs.c
    with eng.connect() as conn:
        res = conn.execute(select(o.id, o.text, o.reference).where(o.job_id == job_id))
        return {r.id: {"text": r.text, "reference": r.reference} for r in res}


def engine_info(eng: Engine, job_id: str) -> dict[str, Any] | None:
    """The first worker's `engine_info` of a job (by worker name), or None when it has none."""
    w = T.workers.c
    with eng.connect() as conn:
        row = conn.execute(select(w.engine_info).where(w.job_id == job_id).order_by(w.worker)).first()
    return None if row is None or not row[0] else dict(row[0])
