"""What exports, status, reports and the model tools read back of a job: counts, failure
reasons, per-request figures, batches, workers, and its rows streamed in input order."""

from __future__ import annotations

from typing import Any, Iterator, Sequence

from sqlalchemy import case, func, literal, select, union_all

from tokenmill.schemas import tables as T
from tokenmill.schemas.records import REQUEST_COLUMNS, StoredRow, embedding_array
from tokenmill.schemas.storage.database import SqlStore, table

#: Rows per chunk when streaming a job's rows out (exports).
CHUNK_ROWS = 5000


def run_range(run_id: str) -> tuple[str, str]:
    """The batch ids of one run: `[run-, run.)` (a batch id is `<run id>-...`; '.' follows '-')."""
    return f"{run_id}-", f"{run_id}."


class MetricsReader(SqlStore):
    """Read-only queries over one job's rows; each returns plain values or dicts of columns."""

    def counts(self, job_id: str) -> dict[str, int]:
        """Input rows answered (a row's n samples count once) and dead-lettered."""
        o = T.outputs.c
        with self.engine.connect() as conn:
            ok = conn.execute(select(func.count()).select_from(T.outputs).where(o.job_id == job_id, o.sample == 0)).scalar()
            bad = conn.execute(
                select(func.count()).select_from(T.dead_letters).where(T.dead_letters.c.job_id == job_id)
            ).scalar()
        return {"succeeded": int(ok or 0), "failed": int(bad or 0)}

    def failure_reasons(self, job_id: str) -> dict[str, int]:
        with self.engine.connect() as conn:
            rows = conn.execute(
                select(T.dead_letters.c.reason, func.count())
                .where(T.dead_letters.c.job_id == job_id)
                .group_by(T.dead_letters.c.reason)
            ).all()
        return {r: int(n) for r, n in rows}

    def output_tokens(self, job_id: str) -> int:
        with self.engine.connect() as conn:
            q = select(func.coalesce(func.sum(T.outputs.c.output_tokens), 0)).where(T.outputs.c.job_id == job_id)
            return int(conn.execute(q).scalar() or 0)

    def token_totals(self, job_id: str) -> dict[str, int]:
        """A job's tokens summed over its stored answers: `prompt` (once per request), `cached`
        (of those) and `output` (every sample's)."""
        o = T.outputs.c
        first = o.sample == 0
        q = select(func.coalesce(func.sum(case((first, o.prompt_tokens), else_=0)), 0),
                   func.coalesce(func.sum(case((first, o.cached_tokens), else_=0)), 0),
                   func.coalesce(func.sum(o.output_tokens), 0)).where(o.job_id == job_id)
        with self.engine.connect() as conn:
            prompt, cached, output = conn.execute(q).one()
        return {"prompt": int(prompt), "cached": int(cached), "output": int(output)}

    def stream_rows(self, record: type[StoredRow], job_id: str) -> Iterator[list[dict[str, Any]]]:
        """A job's rows of one table in input order (file, then row, then a row's samples), in
        chunks of CHUNK_ROWS."""
        with self.engine.connect() as conn:
            for part in self._in_order(conn, record, job_id).mappings().partitions(CHUNK_ROWS):
                yield [dict(r) for r in part]

    def stream_columns(self, record: type[StoredRow], job_id: str, names: Sequence[str],
                       run_id: str | None = None) -> Iterator[dict[str, list[Any]]]:
        """The columns `names` of a job's rows of one table (of one run's batches with `run_id`:
        outputs only, by `ix_outputs_job_batch`), in the order of `stream_rows`, in chunks of
        CHUNK_ROWS rows, each chunk as name → its values (no dict per row: the exports build
        their files a column at a time)."""
        with self.engine.connect() as conn:
            for part in self._in_order(conn, record, job_id, names, run_id).partitions(CHUNK_ROWS):
                yield dict(zip(names, map(list, zip(*part))))

    def row_count(self, record: type[StoredRow], job_id: str) -> int:
        """A job's rows of one table (an output row per sample)."""
        tbl = table(record)
        with self.engine.connect() as conn:
            return int(conn.execute(select(func.count()).select_from(tbl).where(tbl.c.job_id == job_id)).scalar() or 0)

    @staticmethod
    def _in_order(conn, record: type[StoredRow], job_id: str, names: Sequence[str] | None = None,
                  run_id: str | None = None):
        tbl = table(record)
        order = [tbl.c.input_file, tbl.c.input_row, *([tbl.c.sample] if "sample" in tbl.c else [])]
        q = select(*(tbl.c[n] for n in names)) if names is not None else select(tbl)
        q = q.where(tbl.c.job_id == job_id)
        if run_id is not None:
            lo, hi = run_range(run_id)
            q = q.where(tbl.c.batch_id >= lo, tbl.c.batch_id < hi)
        return conn.execution_options(stream_results=True, yield_per=CHUNK_ROWS).execute(q.order_by(*order))

    def placed_rows(self, job_id: str) -> Iterator[tuple[int, int, str]]:
        """Where each input row of a job ended, in input order: (input_file, input_row, "output" or
        "dead letter"); a row in both tables comes twice.  Streamed (the reconcile's names for
        the rows that do not add up)."""
        o, d = T.outputs.c, T.dead_letters.c
        both = union_all(
            select(o.input_file, o.input_row, literal("output").label("place")).where(o.job_id == job_id, o.sample == 0),
            select(d.input_file, d.input_row, literal("dead letter").label("place")).where(d.job_id == job_id),
        ).subquery()
        q = select(both.c.input_file, both.c.input_row, both.c.place).order_by(both.c.input_file, both.c.input_row)
        with self.engine.connect() as conn:
            for f, r, place in conn.execution_options(stream_results=True, yield_per=CHUNK_ROWS).execute(q):
                yield int(f), int(r), str(place)

    def request_rows(self, job_id: str, columns: tuple[str, ...] = REQUEST_COLUMNS) -> list[dict[str, Any]]:
        """The job's per-request figures (no output text), ordered by finish time."""
        cols = [T.outputs.c[k] for k in columns]
        with self.engine.connect() as conn:
            q = select(*cols).where(T.outputs.c.job_id == job_id).order_by(T.outputs.c.finished_at, T.outputs.c.id)
            return [dict(r) for r in conn.execute(q).mappings()]

    def batches(self, job_id: str) -> list[dict[str, Any]]:
        with self.engine.connect() as conn:
            q = select(T.batches).where(T.batches.c.job_id == job_id).order_by(T.batches.c.started_at)
            return [dict(r) for r in conn.execute(q).mappings()]

    def workers(self, job_id: str) -> list[dict[str, Any]]:
        with self.engine.connect() as conn:
            return [dict(r) for r in conn.execute(select(T.workers).where(T.workers.c.job_id == job_id)).mappings()]

    def outputs(self, job_id: str) -> dict[str, dict[str, Any]]:
        """A job's output texts and references, by id."""
        o = T.outputs.c
        with self.engine.connect() as conn:
            res = conn.execute(select(o.id, o.text, o.reference).where(o.job_id == job_id, o.sample == 0))
            return {r.id: {"text": r.text, "reference": r.reference} for r in res}

    def embedding_dim(self, job_id: str) -> int | None:
        """The dimension of a job's embeddings (float32 values of its first vector); None: it has none."""
        o = T.outputs.c
        with self.engine.connect() as conn:
            blob = conn.execute(select(o.embedding).where(o.job_id == job_id, o.embedding.is_not(None)).limit(1)).scalar()
        return None if blob is None else len(embedding_array(blob))

    def engine_info(self, job_id: str) -> dict[str, Any] | None:
        """The first worker's `engine_info` of a job (by worker name), or None when it has none."""
        w = T.workers.c
        with self.engine.connect() as conn:
            row = conn.execute(select(w.engine_info).where(w.job_id == job_id).order_by(w.worker)).first()
        return None if row is None or not row[0] else dict(row[0])
