"""What workers write: output rows, dead letters, batch stats and worker rows, each insert
idempotent; and what the claim and resume passes ask before a work unit runs."""

from __future__ import annotations

from typing import Any, Iterable

from sqlalchemy import select, update

from tokenmill.schemas import tables as T
from tokenmill.schemas.records import DUPLICATE_ID, BatchStats, DeadLetterRow, OutputRow, StoredRow, WorkerRow
from tokenmill.schemas.storage.database import SqlStore, chunks, dialect_insert, insert_ignore, table


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
                     stats: list[dict[str, Any]]) -> None:
        """One finished batch in one transaction: its output rows, the dead letters the engine
        gave, its figures (`OutputRow`, `DeadLetterRow`, `BatchStats` as `as_dict()` gives
        them).  Existing keys are skipped, as in `insert_rows`."""
        with self.engine.begin() as conn:
            for record, rows in ((OutputRow, outputs), (DeadLetterRow, dead_letters), (BatchStats, stats)):
                if rows:
                    insert_ignore(conn, table(record), rows)

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

    def done_in_range(self, job_id: str, input_file: int, first_row: int, last_row: int,
                      ids: Iterable[str]) -> tuple[set[str], set[int]]:
        """What a rerun skips of one work unit (rows `first_row..last_row` of one input file):
        (those of `ids` already answered, input rows already answered or dead-lettered).
        Keyed lookups bounded by the unit, never the job's whole key set."""
        o = T.outputs.c
        done_ids: set[str] = set()
        with self.engine.connect() as conn:
            for part in chunks(list(ids)):
                done_ids.update(conn.execute(select(o.id).where(o.job_id == job_id, o.id.in_(part))).scalars())
        return done_ids, self.done_rows(job_id, input_file, first_row, last_row)

    def claims_settled(self, job_id: str) -> bool:
        """Whether an earlier run of the job finished its claim pass (every id of the input
        holds its first row): it has an output or a duplicate-id dead letter, which only
        rows past the claim barrier get.  A rerun then neither claims nor waits."""
        with self.engine.connect() as conn:
            for q in (select(T.outputs.c.job_id).where(T.outputs.c.job_id == job_id).limit(1),
                      select(T.dead_letters.c.job_id).where(T.dead_letters.c.job_id == job_id,
                                                           T.dead_letters.c.reason == DUPLICATE_ID).limit(1)):
                if conn.execute(q).first() is not None:
                    return True
        return False

    def claim_ids(self, job_id: str, rows: list[tuple[str, int, int]]) -> int:
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
        with self.engine.begin() as conn:
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
        return len(values)

    def id_claims(self, job_id: str, ids: Iterable[str]) -> dict[str, tuple[int, int]]:
        """The claiming row (input_file, input_row) of each of `ids` that has one."""
        c = T.id_claims.c
        out: dict[str, tuple[int, int]] = {}
        with self.engine.connect() as conn:
            for part in chunks(list(set(ids))):
                q = select(c.id, c.input_file, c.input_row).where(c.job_id == job_id, c.id.in_(part))
                out.update({i: (f, r) for i, f, r in conn.execute(q)})
        return out
