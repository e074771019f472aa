"""What workers write: output rows, dead letters, batch stats and worker rows, each insert
idempotent; the duplicate-id claims; and what a rerun asks before a work unit runs.

Duplicate ids are settled where rows are written, so no step waits for the whole input:
a unit's rows claim their ids as they are read (`claim_ids`: each id keeps its first row
in input order), and a batch commits an output only for the row that holds its id's
claim (`commit_batch`).  A later row that was answered before its id's first row was
read loses its output when that row claims the id: the output becomes a `duplicate_id`
dead letter in the claiming transaction.  On PostgreSQL the claim rows are locked
between the two (the claim's upsert, the commit's FOR SHARE); SQLite has one writer."""

from __future__ import annotations

import json
import time
from typing import Any, Iterable

from sqlalchemy import and_, delete, or_, select, update

from tokenmill.schemas import tables as T
from tokenmill.schemas.records import (
    DUPLICATE_ID,
    BatchStats,
    DeadLetterRow,
    OutputRow,
    StoredRow,
    WorkerRow,
    duplicate_message,
)
from tokenmill.schemas.storage.cache import mark_used, put_entries
from tokenmill.schemas.storage.database import SqlStore, chunks, dialect_insert, insert_ignore, table, write_lock
from tokenmill.schemas.storage.leases import Lease, LeaseStore


class ResultWriter(SqlStore):
    """The rows a job's workers write, and the keyed lookups that keep a rerun from redoing them."""

    def insert_rows(self, record: type[StoredRow], rows: Iterable[dict[str, Any]]) -> int:
        """Insert rows of a stored-row record (`OutputRow`, `DeadLetterRow`, `BatchStats`, as
        `as_dict()` gives them) in one transaction; rows whose key exists are skipped, so a
        retried bundle or a resumed job never duplicates one.  Returns how many were new."""
        rows = list(rows)
        if not rows:
            return 0
        with self.engine.begin() as conn:
            return insert_ignore(conn, table(record), rows)

    def commit_batch(self, outputs: list[dict[str, Any]], dead_letters: list[dict[str, Any]],
                     stats: list[dict[str, Any]], *, cache_entries: Iterable[dict[str, Any]] = (),
                     cache_used: Iterable[str] = (), lease: Lease | None = None, lease_s: float | None = None) -> int:
        """One finished batch in one transaction: its output rows, the dead letters the engine
        gave, its figures (`OutputRow`, `DeadLetterRow`, `BatchStats` as `as_dict()` gives
        them), the result-cache entries of its answers (`cache_entries`, insert-if-absent) and,
        for rows served from the cache, the keys served (`cache_used`: their hits and last use).
        An output whose id an earlier input row has claimed since the batch was
        deduplicated is stored as that id's `duplicate_id` dead letter instead.  Existing
        keys are skipped, as in `insert_rows`.  With `lease` (a shared job's unit), the commit
        is fenced: LeaseLost, and nothing written, unless the lease still holds the unit
        (`LeaseStore.fence`; `lease_s` renews it).  Returns the outputs turned into dead letters."""
        with self.engine.begin() as conn:
            write_lock(conn)
            if lease is not None:
                LeaseStore.fence(conn, lease, lease_s)
            claims = _claims(conn, outputs[0]["job_id"], [o["id"] for o in outputs], lock=True) if outputs else {}
            keep, lost = [], {}
            for o in outputs:
                first, at = claims.get(o["id"]), (o["input_file"], o["input_row"])
                if first is None or first == at:
                    keep.append(o)
                else:  # one dead letter for a row, whichever of its samples the batch holds
                    lost[at] = _duplicate(o["job_id"], o["id"], *at, first, _ANSWERED_FIRST)
            for record, rows in ((OutputRow, keep), (DeadLetterRow, dead_letters + list(lost.values())), (BatchStats, stats)):
                if rows:
                    insert_ignore(conn, table(record), rows)
            put_entries(conn, list(cache_entries))
            mark_used(conn, cache_used)
        return len(lost)

    def record_worker(self, row: WorkerRow) -> None:
        """Insert a worker's row; if the worker (job_id, worker) has one, overwrite its
        `WorkerRow.REFRESHED` columns with this row's."""
        with self.engine.begin() as conn:
            if insert_ignore(conn, T.workers, [row.as_dict()]) == 0:
                conn.execute(
                    update(T.workers)
                    .where(T.workers.c.job_id == row.job_id, T.workers.c.worker == row.worker)
                    .values(**row.refreshed())
                )

    def update_worker(self, job_id: str, worker: str, **values: Any) -> None:
        """Set some columns of a worker's row (`WorkerRow` fields)."""
        with self.engine.begin() as conn:
            conn.execute(update(T.workers).where(T.workers.c.job_id == job_id, T.workers.c.worker == worker)
                         .values(**values))

    def done_rows(self, job_id: str, input_file: int, first_row: int, last_row: int) -> set[int]:
        """The input rows `first_row..last_row` of one input file already answered or
        dead-lettered: what a rerun leaves unread of a work unit (a keyed range lookup
        bounded by the unit)."""
        done: set[int] = set()
        with self.engine.connect() as conn:
            for t in (T.outputs.c, T.dead_letters.c):
                q = select(t.input_row).where(
                    t.job_id == job_id, t.input_file == input_file, t.input_row.between(first_row, last_row))
                done.update(conn.execute(q).scalars())
        return done

    def settle_done(self, job_id: str, input_file: int, rows: list[tuple[str, int]]) -> tuple[set[int], int]:
        """What a rerun or a late duplicate leaves of a work unit's rows `(id, input_row)` of
        one input file: the input rows still to run.  A row already answered or dead-lettered
        is skipped.  A row whose id another row holds (the id's claim, or an output already
        stored for another row: an earlier row claimed the id after this row passed
        DedupIds) is that id's `duplicate_id` dead letter, written here, so the row ends in
        one place and no engine works on an answer its commit would drop.  Keyed lookups
        bounded by the unit (its row range, its ids), never the job's whole key set.
        Returns (input rows to run, dead letters written)."""
        if not rows:
            return set(), 0
        o = T.outputs.c
        ids = sorted({rid for rid, _ in rows})
        done = self.done_rows(job_id, input_file, min(r for _, r in rows), max(r for _, r in rows))
        with self.engine.begin() as conn:
            first = _claims(conn, job_id, ids)
            for part in chunks(ids):  # an answer stored for a row that has no claim row (a job older than claims)
                q = select(o.id, o.input_file, o.input_row).where(o.job_id == job_id, o.id.in_(part), o.sample == 0)
                for rid, f, r in conn.execute(q):
                    first.setdefault(rid, (f, r))
            run: set[int] = set()
            lost = []
            for rid, r in rows:
                if r in done:
                    continue
                holder = first.get(rid)
                if holder is None or holder == (input_file, r):
                    run.add(r)
                else:
                    lost.append(_duplicate(job_id, rid, input_file, r, holder, _PASSED_DEDUP))
            # insert-if-absent: a claim only ever moves to an earlier row, so this row never holds it again
            insert_ignore(conn, T.dead_letters, lost)
        return run, len(lost)

    def claim_ids(self, job_id: str, rows: list[tuple[str, int, int]]) -> int:
        """Record (id, input_file, input_row) claims: each id keeps the first row in input
        order that carries it, whatever order work units run in (an upsert that only moves
        a claim to an earlier row), so units claim in parallel and a rerun claims again
        harmlessly.  An output already stored for a row that lost its id's claim becomes a
        `duplicate_id` dead letter in the same transaction.  Returns the outputs retracted."""
        if not rows:
            return 0
        c = T.id_claims.c
        best: dict[str, tuple[int, int]] = {}
        for rid, f, r in rows:  # duplicates inside one call: one statement may not touch a row twice
            if rid not in best or (f, r) < best[rid]:
                best[rid] = (f, r)
        # in id order, as commit_batch locks them: two transactions never wait on each other in a cycle
        values = [{"job_id": job_id, "id": k, "input_file": f, "input_row": r} for k, (f, r) in sorted(best.items())]
        retracted = 0
        with self.engine.begin() as conn:
            write_lock(conn)
            stmt = dialect_insert(conn, T.id_claims)
            ex = stmt.excluded
            earlier = (ex.input_file < c.input_file) | ((ex.input_file == c.input_file) & (ex.input_row < c.input_row))
            stmt = stmt.on_conflict_do_update(
                index_elements=[c.job_id, c.id],
                set_={"input_file": ex.input_file, "input_row": ex.input_row},
                where=earlier,
            )
            for part in chunks(values):
                conn.execute(stmt, part)
            for part in chunks(sorted(best)):
                retracted += _retract_losers(conn, job_id, part)
        return retracted

    def id_claims(self, job_id: str, ids: Iterable[str]) -> dict[str, tuple[int, int]]:
        """The claiming row (input_file, input_row) of each of `ids` that has one."""
        with self.engine.connect() as conn:
            return _claims(conn, job_id, ids)


def _claims(conn, job_id: str, ids: Iterable[str], lock: bool = False) -> dict[str, tuple[int, int]]:
    """(input_file, input_row) of each claimed id of `ids`; `lock`: held against a claim
    moving until the transaction ends (FOR SHARE on PostgreSQL)."""
    c = T.id_claims.c
    out: dict[str, tuple[int, int]] = {}
    for part in chunks(sorted(set(ids))):
        q = select(c.id, c.input_file, c.input_row).where(c.job_id == job_id, c.id.in_(part))
        if lock and conn.dialect.name == "postgresql":  # locked in id order (ORDER BY comes first)
            q = q.order_by(c.id).with_for_update(read=True)
        out.update({i: (f, r) for i, f, r in conn.execute(q)})
    return out


def _retract_losers(conn, job_id: str, ids: list[str]) -> int:
    """Outputs of `ids` stored for a row that no longer holds the id's claim: deleted, and
    stored as `duplicate_id` dead letters naming the claiming row."""
    o, c = T.outputs.c, T.id_claims.c
    q = (select(o.id, o.input_file, o.input_row, c.input_file, c.input_row).distinct()  # once for a row's samples
         .join(T.id_claims, and_(c.job_id == o.job_id, c.id == o.id))
         .where(o.job_id == job_id, o.id.in_(ids),
                or_(o.input_file != c.input_file, o.input_row != c.input_row)))
    losers = conn.execute(q).all()
    if not losers:
        return 0
    for i, f, r, _, _ in losers:  # every sample of the losing row, and only that row's
        conn.execute(delete(T.outputs).where(o.job_id == job_id, o.id == i, o.input_file == f, o.input_row == r))
    insert_ignore(conn, T.dead_letters,
                  [_duplicate(job_id, i, f, r, (cf, cr), _ANSWERED_FIRST) for i, f, r, cf, cr in losers])
    return len(losers)


#: Why a settled duplicate passed DedupIds: answered before its id's first row was read (the
#: answer is dropped; its batch's figures still count the work), or caught before it ran.
_ANSWERED_FIRST = "it was read after this row was answered; the answer is dropped"
_PASSED_DEDUP = "it was read after this row passed the duplicate check; this row did not run"


def _duplicate(job_id: str, rid: str, input_file: int, input_row: int, first: tuple[int, int],
               why: str) -> dict[str, Any]:
    """The `duplicate_id` dead letter of a row whose id an earlier row claimed after the row
    passed DedupIds."""
    return DeadLetterRow(
        job_id=job_id, input_file=input_file, input_row=input_row, id=rid, reason=DUPLICATE_ID,
        message=f"{duplicate_message(rid, first)} ({why})",
        raw=json.dumps({"id": rid}, ensure_ascii=False), created_at=time.time(),
    ).as_dict()
