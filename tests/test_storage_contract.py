"""The storage contract: one suite, run against SQLite and the real PostgreSQL server.

`StorageContract` holds the tests; each backend subclasses it with its own `db_url`
fixture (as Dagster's run storage tests do), so a new backend is one subclass."""

import datetime as dt
import multiprocessing as mp
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import pytest
from sqlalchemy import inspect, text

from tests.conftest import write_parquet
from tests.helpers import assert_one_line_error, cli
from tokenmill.schemas import storage as S
from tokenmill.schemas import tables as T
from tokenmill.schemas.db import db_engine
from tokenmill.schemas.records import DeadLetterRow, OutputRow, WorkerRow
from tokenmill.schemas.storage import database


def _fresh(url):
    """Forget what this process knows about the URL, as a new process would."""
    database._READY.discard(url)


def _job_values(**kw):
    v = {"name": "n", "spec": {"input": "x"}, "model": "m", "engine_config": {"max_num_seqs": 8},
         "versions": {"vllm": "0"}, "hardware": {"device": "cpu"}, "runner": "DirectRunner", "total": 3}
    v.update(kw)
    return v


def _output(job_id, i, **kw):
    r = {"job_id": job_id, "id": f"r{i}", "input_file": 0, "input_row": i, "text": f"answer {i}", "finish_reason": "stop",
         "prompt_tokens": 10, "output_tokens": 5, "cached_tokens": 0, "ttft_s": 0.1, "tpot_s": 0.01, "e2e_s": 0.2,
         "queue_s": 0.0, "model": "m", "finished_at": 1000.0 + i}
    r.update(kw)
    return OutputRow(**r).as_dict()


def _dead(job_id, input_file, input_row, **kw):
    return DeadLetterRow(job_id=job_id, input_file=input_file, input_row=input_row, reason="empty_prompt",
                         message="empty", **kw).as_dict()


def _run_one(db_url, inp, out, job_id, barrier):
    from tests.fakes import FakeSession
    from tests.helpers import job_spec
    from tokenmill.jobs.lifecycle.runner import run_job

    spec = job_spec(inp, out, job_id=job_id, sampling={"max_tokens": 3}, batching={"token_budget": 512})
    barrier.wait(timeout=120)  # both processes are imported and ready: start writing together
    t0 = time.time()
    res = run_job(spec, db_url=db_url, session_factory=FakeSession)
    return res.status, res.succeeded, res.failed, t0, time.time()


class StorageContract:
    """What every storage backend must do; a backend's test class subclasses it and gives
    `db_url`, a fresh database of that backend."""

    def test_migrations_run_on_first_use(self, db_url):
        _fresh(db_url)
        eng = S.connect(db_url)
        with eng.connect() as conn:
            assert S.current_revision(conn) == S.head_revision()
            tables = set(inspect(conn).get_table_names())
        assert {"jobs", "outputs", "dead_letters", "batches", "workers", "locks"} <= tables

    def test_claim_finish_and_counts(self, db_url):
        eng = S.connect(db_url)
        assert S.JobStore(eng).claim("j1", _job_values()) == {"resumed": False}
        job = S.JobStore(eng).get("j1")
        assert job["status"] == "running" and job["owner"] == S.owner_tag() and S.is_live(job)
        with pytest.raises(S.JobBusy):
            S.JobStore(eng).claim("j1", _job_values())  # a live run holds it
        S.ResultWriter(eng).insert_rows(OutputRow, [_output("j1", i) for i in range(2)])
        S.ResultWriter(eng).insert_rows(DeadLetterRow, [_dead("j1", 0, 2, id="r2")])
        assert S.MetricsReader(eng).counts("j1") == {"succeeded": 2, "failed": 1}
        assert S.MetricsReader(eng).failure_reasons("j1") == {"empty_prompt": 1}
        S.JobStore(eng).finish("j1", status="partial", heartbeat_at=None, owner=None, **S.MetricsReader(eng).counts("j1"))
        job = S.JobStore(eng).get("j1")
        assert (job["status"], job["total"], job["succeeded"], job["failed"]) == ("partial", 3, 2, 1)
        assert job["finished_at"] is not None and not S.is_live(job)
        assert S.JobStore(eng).claim("j1", _job_values())["resumed"] is True  # a finished job may be rerun
        assert [j["id"] for j in S.JobStore(eng).recent()] == ["j1"]
        assert [r["id"] for r in S.MetricsReader(eng).request_rows("j1")] == ["r0", "r1"]

    def test_a_claim_whose_insert_breaks_a_constraint_raises_that_error(self, db_url):
        # An IntegrityError that is not "someone inserted it first" must not be taken for a race.
        from sqlalchemy.exc import IntegrityError

        eng = S.connect(db_url)
        with pytest.raises(IntegrityError):
            S.JobStore(eng).claim("j-bad", {"total": 3})  # name, spec, model… are NOT NULL
        assert S.JobStore(eng).get("j-bad") is None

    def test_inserts_are_idempotent(self, db_url):
        eng = S.connect(db_url)
        rows = [_output("j2", i) for i in range(5)]
        assert S.ResultWriter(eng).insert_rows(OutputRow, rows[:3]) == 3
        # a retried bundle: the first three again, plus two new
        assert S.ResultWriter(eng).insert_rows(OutputRow, [dict(r, text="different") for r in rows]) == 2  # rows added
        got = {k: v["text"] for k, v in S.MetricsReader(eng).outputs("j2").items()}
        assert len(got) == 5
        assert got["r0"] == "answer 0" and got["r4"] == "different"  # existing rows are kept, not overwritten
        assert S.ResultWriter(eng).insert_rows(DeadLetterRow, [_dead("j2", 0, 7), _dead("j2", 0, 7), _dead("j2", 1, 7)]) == 2
        assert S.MetricsReader(eng).counts("j2") == {"succeeded": 5, "failed": 2}

    def test_delete_job_removes_only_that_job(self, db_url):
        eng = S.connect(db_url)
        S.ResultWriter(eng).insert_rows(OutputRow, [_output("a", 0), _output("b", 0)])
        S.JobStore(eng).delete("a")
        assert S.MetricsReader(eng).counts("a")["succeeded"] == 0 and S.MetricsReader(eng).counts("b")["succeeded"] == 1

    def test_old_database_upgrades_without_losing_rows(self, db_url):
        """A database made by the first release (revision 0001, input_ref as text) with rows in it."""
        from alembic import command

        eng = db_engine(db_url)
        with eng.begin() as conn:
            command.upgrade(S.alembic_config(conn), "0001")
        with eng.begin() as conn:  # plain SQL: the tables as revision 0001 made them
            conn.execute(text("INSERT INTO jobs (id, status, spec, total, succeeded, failed, cancel_requested) "
                              "VALUES ('old', 'succeeded', '{\"input\": \"x\"}', 3, 2, 1, false)"))
            conn.execute(text("INSERT INTO outputs (job_id, id, input_ref, text, error) VALUES "
                              "('old', 'a', '0:10', 'ten', NULL), ('old', 'b', '1:2', 'two', NULL)"))
            conn.execute(text("INSERT INTO dead_letters (job_id, input_ref, id, reason, message) "
                              "VALUES ('old', '0:3', 'c', 'empty_prompt', 'empty')"))
        _fresh(db_url)
        eng = S.connect(db_url)  # migrates on first use
        with eng.connect() as conn:
            assert S.current_revision(conn) == S.head_revision()
        assert S.JobStore(eng).get("old")["succeeded"] == 2
        outs = [(r["id"], r["input_file"], r["input_row"]) for rows in S.MetricsReader(eng).stream_rows(OutputRow, "old") for r in rows]
        assert outs == [("a", 0, 10), ("b", 1, 2)]
        assert S.ResultWriter(eng).done_rows("old", 0, 0, 20) == {3, 10}
        assert S.ResultWriter(eng).insert_rows(DeadLetterRow, [_dead("old", 0, 3)]) == 0  # the new key holds the converted row

    def test_outputs_stored_before_token_count_source_upgrade_as_not_recorded(self, db_url):
        """A database at revision 0005 (no outputs.token_count_source) with an answered row: after
        the upgrade that row reads back with no source, counted "not_recorded", never "engine"."""
        from alembic import command

        eng = db_engine(db_url)
        with eng.begin() as conn:
            command.upgrade(S.alembic_config(conn), "0005")
        with eng.begin() as conn:
            assert "token_count_source" not in {c["name"] for c in inspect(conn).get_columns("outputs")}
            conn.execute(text("INSERT INTO outputs (job_id, id, input_file, input_row, prompt_tokens, output_tokens) "
                              "VALUES ('old', 'a', 0, 0, 10, 5)"))
        _fresh(db_url)
        eng = S.connect(db_url)  # migrates on first use
        S.ResultWriter(eng).insert_rows(OutputRow, [_output("old", 1, token_count_source="local_tokenizer+stream_chunks")])
        got = {r["id"]: r["token_count_source"] for rows in S.MetricsReader(eng).stream_rows(OutputRow, "old") for r in rows}
        assert got == {"a": None, "r1": "local_tokenizer+stream_chunks"}
        assert S.RequestSummary(eng).stats("old").by_source == {
            "local_tokenizer+stream_chunks": {"rows": 1, "prompt": 10, "output": 5},
            "not_recorded": {"rows": 1, "prompt": 10, "output": 5}}

    def test_outputs_stored_before_samples_upgrade_as_sample_0_and_take_more_samples(self, db_url):
        """A database at revision 0007 (outputs keyed by job and id) with an answered row: after
        the upgrade it is sample 0, the same id takes samples 1 and 2, a repeated sample is
        skipped, and the row counts once as answered."""
        from alembic import command

        eng = db_engine(db_url)
        with eng.begin() as conn:
            command.upgrade(S.alembic_config(conn), "0007")
        with eng.begin() as conn:
            conn.execute(text("INSERT INTO outputs (job_id, id, input_file, input_row, text, output_tokens) "
                              "VALUES ('old', 'a', 0, 0, 'first', 5)"))
        _fresh(db_url)
        eng = S.connect(db_url)  # migrates on first use
        w = S.ResultWriter(eng)
        assert w.insert_rows(OutputRow, [_output("old", 0, id="a", sample=k, text=f"s{k}") for k in (0, 1, 2)]) == 2
        got = [(r["id"], r["sample"], r["text"]) for rows in S.MetricsReader(eng).stream_rows(OutputRow, "old") for r in rows]
        assert got == [("a", 0, "first"), ("a", 1, "s1"), ("a", 2, "s2")]
        assert S.MetricsReader(eng).counts("old") == {"succeeded": 1, "failed": 0}
        st = S.RequestSummary(eng).stats("old")
        assert (st.n, st.rows) == (3, 1)

    def test_a_duplicate_ids_samples_become_one_dead_letter(self, db_url):
        eng = S.connect(db_url)
        w = S.ResultWriter(eng)
        w.claim_ids("j-dup-s", [("x", 0, 5)])
        lost = w.commit_batch([_output("j-dup-s", 9, id="x", sample=k) for k in range(3)], [], [])
        assert lost == 1 and S.MetricsReader(eng).counts("j-dup-s") == {"succeeded": 0, "failed": 1}
        w.commit_batch([_output("j-dup-s", 7, id="y", sample=k) for k in range(3)], [], [])
        assert w.claim_ids("j-dup-s", [("y", 0, 1)]) == 1  # the three samples, retracted as one dead letter
        assert S.MetricsReader(eng).counts("j-dup-s") == {"succeeded": 0, "failed": 2}

    def test_migrated_tables_match_the_declared_ones(self, db_url):
        from alembic.autogenerate import compare_metadata
        from alembic.runtime.migration import MigrationContext

        eng = S.connect(db_url)
        with eng.connect() as conn:
            diff = compare_metadata(MigrationContext.configure(conn, opts={"compare_type": True}), T.metadata)
        assert diff == []

    def test_newer_schema_gives_a_one_line_error(self, db_url):
        eng = S.connect(db_url)
        with eng.begin() as conn:
            conn.execute(text("UPDATE alembic_version SET version_num = '9999_from_the_future'"))
        _fresh(db_url)
        with pytest.raises(S.StorageError, match="newer than this tokenmill knows"):
            S.connect(db_url)
        _fresh(db_url)
        for args in (["jobs"], ["status", "x"], ["report", "x", "--no-html"]):
            assert_one_line_error(cli(*args, "--db", db_url), 1, "9999_from_the_future", alone=True)

    def test_two_jobs_writing_at_the_same_time_both_complete_with_every_row(self, db_url, tmp_path, model_path):
        S.connect(db_url)  # migrated once up front, as `tokenmill db upgrade` would
        n = 300
        inputs = []
        for k in ("a", "b"):
            rows = [{"id": f"{k}{i}", "prompt": f"question {i} " * (1 + i % 5)} for i in range(n)]
            inputs.append(str(write_parquet(tmp_path / f"{k}.parquet", rows)))
        ctx = mp.get_context("spawn")
        with ctx.Manager() as mgr, ProcessPoolExecutor(2, mp_context=ctx) as pool:
            barrier = mgr.Barrier(2)
            futs = [pool.submit(_run_one, db_url, inputs[i], str(tmp_path / f"out{i}"), f"job-{k}", barrier)
                    for i, k in enumerate("ab")]
            results = [f.result(timeout=600) for f in futs]
        assert [r[:3] for r in results] == [("succeeded", n, 0), ("succeeded", n, 0)]
        (_, _, _, s0, e0), (_, _, _, s1, e1) = results
        assert max(s0, s1) < min(e0, e1)  # the two runs really overlapped in time
        eng = S.connect(db_url)
        for k in "ab":
            assert S.MetricsReader(eng).counts(f"job-{k}") == {"succeeded": n, "failed": 0}
            ids = {r["id"] for r in S.MetricsReader(eng).request_rows(f"job-{k}")}
            assert ids == {f"{k}{i}" for i in range(n)}
            assert S.JobStore(eng).get(f"job-{k}")["status"] == "succeeded"
        assert Path(tmp_path / "out0" / "outputs.parquet").exists()

    def test_exports_come_back_in_input_order(self, db_url, tmp_path):
        # Rows are stored as (input_file, input_row) integers, so "0:2" comes before "0:10";
        # the files show each row's input_ref as "<file>:<row>", as they always have.
        import pyarrow.parquet as pq

        from tokenmill.jobs.lifecycle.sinks import export_job

        eng = S.connect(db_url)
        S.JobStore(eng).claim("j-order", _job_values(total=14))
        refs = ["1:0", "0:10", "0:2", "1:11", "0:1", "1:3", "0:0", "0:11", "0:3", "1:1", "1:2", "1:10"]
        key = lambda ref: tuple(int(x) for x in ref.split(":"))  # noqa: E731
        S.ResultWriter(eng).insert_rows(OutputRow, [_output("j-order", i, id=f"r-{ref}", input_file=key(ref)[0], input_row=key(ref)[1])
                                                         for i, ref in enumerate(refs)])
        S.ResultWriter(eng).insert_rows(DeadLetterRow, [_dead("j-order", 0, 20, id="d-0:20"), _dead("j-order", 0, 9, id="d-0:9")])
        export_job(eng, "j-order", str(tmp_path / "out"))
        out = pq.read_table(tmp_path / "out" / "outputs.parquet")
        assert out.column("id").to_pylist() == [f"r-{ref}" for ref in sorted(refs, key=key)]
        assert out.column("input_ref").to_pylist() == sorted(refs, key=key)  # the round trip keeps the text
        dead = pq.read_table(tmp_path / "out" / "dead_letters.parquet")
        assert dead.column("id").to_pylist() == ["d-0:9", "d-0:20"]
        assert dead.column("input_ref").to_pylist() == ["0:9", "0:20"]
        assert out.schema.names[:3] == ["job_id", "id", "input_ref"] and "input_file" not in out.schema.names

    def test_settle_done_skips_done_rows_of_the_unit_and_dead_letters_rows_whose_id_another_row_holds(self, db_url):
        eng, w = S.connect(db_url), S.ResultWriter(S.connect(db_url))
        w.insert_rows(OutputRow, [_output("j-done", 0), _output("j-done", 1), _output("other", 5)])
        w.insert_rows(DeadLetterRow, [_dead("j-done", 1, 4), _dead("j-done", 0, 9), _dead("other", 2, 2)])
        w.claim_ids("j-done", [("r3", 0, 2)])
        # outputs r0, r1 sit at file 0 rows 0, 1 (see _output); r0 at row 6 is a late duplicate of row 0,
        # r3 at row 3 one of row 2's claim; r7 at 7 runs; row 9 is done
        assert w.settle_done("j-done", 0, [("r0", 0), ("r1", 1), ("r7", 7), ("r0", 6), ("r3", 3), ("x", 9)]) == ({7}, 2)
        assert w.settle_done("j-done", 0, [("r0", 6), ("r3", 3)]) == (set(), 0)  # dead letters now: done
        assert w.settle_done("j-done", 1, [("r5", 4), ("r5", 5)]) == ({5}, 0)  # another file's row 4 is done
        assert w.settle_done("nothing", 0, [("r0", 0)]) == ({0}, 0)
        assert w.settle_done("nothing", 0, []) == (set(), 0)
        with eng.connect() as conn:
            dead = dict(conn.execute(text(
                "SELECT input_row, message FROM dead_letters WHERE job_id = 'j-done' AND reason = 'duplicate_id'")).all())
        assert dead == {6: "duplicate id 'r0': the row at 0:0 came first (it was read after this row passed the "
                           "duplicate check; this row did not run)",
                        3: "duplicate id 'r3': the row at 0:2 came first (it was read after this row passed the "
                           "duplicate check; this row did not run)"}

    def test_id_claims_keep_the_earliest_row_in_any_order_and_in_big_batches(self, db_url):
        eng = S.connect(db_url)
        S.ResultWriter(eng).claim_ids("j", [("a", 0, 9), ("b", 1, 0)])
        S.ResultWriter(eng).claim_ids("j", [("a", 0, 3), ("b", 1, 5), ("a", 0, 4)])  # a moves earlier, b stays
        S.ResultWriter(eng).claim_ids("j", [("a", 1, 0)])
        S.ResultWriter(eng).claim_ids("other", [("a", 2, 2)])
        assert S.ResultWriter(eng).id_claims("j", ["a", "b", "c"]) == {"a": (0, 3), "b": (1, 0)}
        many = [(f"id{i}", 0, i) for i in range(2500)]  # more than one IN list and one statement
        assert S.ResultWriter(eng).claim_ids("big", many) == 0  # no output retracted
        got = S.ResultWriter(eng).id_claims("big", [f"id{i}" for i in range(0, 2500, 7)])
        assert got == {f"id{i}": (0, i) for i in range(0, 2500, 7)}
        S.JobStore(eng).delete("big")
        assert S.ResultWriter(eng).id_claims("big", ["id0"]) == {}

    def test_a_row_answered_before_its_ids_first_row_was_read_ends_a_duplicate_dead_letter(self, db_url):
        eng, w = S.connect(db_url), S.ResultWriter(S.connect(db_url))
        w.claim_ids("d", [("r9", 0, 9), ("r5", 0, 5)])
        w.commit_batch([_output("d", 9), _output("d", 5), _output("d", 7)], [], [])  # r7 holds no claim: kept
        assert w.claim_ids("d", [("r9", 0, 3), ("r5", 0, 6)]) == 1  # r9's first row is read now; r5 stays
        assert w.commit_batch([_output("d", 9, input_row=3)], [], []) == 0
        # a batch deduplicated before an earlier row claimed its id: that output is not stored
        w.claim_ids("d", [("r5", 0, 1)])
        assert w.commit_batch([_output("d", 5, input_row=2)], [], []) == 1
        with eng.connect() as conn:
            outs = {(i, r) for i, r in conn.execute(text("SELECT id, input_row FROM outputs WHERE job_id = 'd'"))}
            dead = {r: (reason, msg) for r, reason, msg in conn.execute(text(
                "SELECT input_row, reason, message FROM dead_letters WHERE job_id = 'd'"))}
        assert outs == {("r9", 3), ("r7", 7)}  # r5's output at 5 was retracted when row 1 claimed r5
        assert {r: v[0] for r, v in dead.items()} == {9: "duplicate_id", 2: "duplicate_id", 5: "duplicate_id"}
        assert dead[9][1].startswith("duplicate id 'r9': the row at 0:3 came first")
        assert dead[2][1].startswith("duplicate id 'r5': the row at 0:1 came first")

    def test_claims_and_commits_racing_on_several_connections_answer_each_id_once(self, db_url):
        """Rows of 60 ids (1-4 rows each) cut into units of 1-6 rows, claimed and answered
        in a random order by 4 threads, each doing what a worker does with a unit: claim
        its ids, keep the rows that hold their claim (DedupIds), commit them in one batch."""
        import random
        from concurrent.futures import ThreadPoolExecutor

        from tests.unit_steps import random_units

        rows, units = random_units(random.Random(7), 60)
        w = S.ResultWriter(S.connect(db_url))

        def worker(unit):
            w.claim_ids("race", unit)
            claims = w.id_claims("race", [rid for rid, _, _ in unit])
            mine = [(rid, f, r) for rid, f, r in unit if claims.get(rid) == (f, r)]
            w.commit_batch([_output("race", 0, id=rid, input_file=f, input_row=r) for rid, f, r in mine], [], [])
            w.insert_rows(DeadLetterRow, [_dead("race", f, r, id=rid) for rid, f, r in unit if (rid, f, r) not in mine])

        with ThreadPoolExecutor(4) as pool:
            list(pool.map(worker, units))
        with S.connect(db_url).connect() as conn:
            outs = {i: r for i, r in conn.execute(text("SELECT id, input_row FROM outputs WHERE job_id = 'race'"))}
            dead = set(conn.execute(text("SELECT input_row FROM dead_letters WHERE job_id = 'race'")).scalars())
        first = {}
        for rid, _, r in rows:
            first[rid] = min(first.get(rid, r), r)
        assert outs == first  # every id answered once, by its first row
        assert dead == {r for _, _, r in rows} - set(first.values())  # every other row a dead letter

    def test_every_interleaving_of_two_units_sharing_an_id_ends_each_row_in_one_place(self, db_url):
        """Rows 0 and 7 carry one id, in two units.  Each unit claims, deduplicates, skips what is
        done and commits, through the pipeline's own steps; all 70 orders of the two units'
        steps end each row in exactly one place, the id answered by row 0.  Among them: row 7
        claims and commits before row 0 claims (the commit is retracted); row 0 claims between
        row 7's dedup and its commit (the commit finds the claim moved); row 0 claims and
        commits between row 7's dedup and its skip (the skip finds the id answered)."""
        from tests.unit_steps import UnitRun, interleavings, placement_problems, run_interleaved

        rows = [("x", 0, 0), ("x", 0, 7)]
        failed = []
        for n, order in enumerate(interleavings([4, 4])):
            job = f"il-{n}"
            run_interleaved([UnitRun(db_url, job, [rows[0]]), UnitRun(db_url, job, [rows[1]])], order)
            if problems := placement_problems(db_url, job, rows):
                failed.append(f"{order}: {problems}")
        assert failed == [], f"{len(failed)} of 70 orders:\n" + "\n".join(failed)

    def test_both_rows_of_an_id_inside_one_unit_end_one_answer_one_dead_letter(self, db_url):
        from tests.unit_steps import STEPS, UnitRun, placement_problems

        for job, rows in (("one-a", [("x", 0, 0), ("x", 0, 7)]), ("one-b", [("x", 0, 7), ("x", 0, 0)])):
            run = UnitRun(db_url, job, rows)
            for step in STEPS:
                run.step(step)
            assert placement_problems(db_url, job, rows) == []

    def test_three_rows_of_an_id_in_three_units_in_sampled_orders_end_each_in_one_place(self, db_url):
        """Rows 0, 3 and 7 of one id, each in a unit of its own, beside a row of another id:
        120 of the 34,650 orders of their steps, drawn with a fixed seed."""
        import random

        from tests.unit_steps import UnitRun, interleavings, placement_problems, run_interleaved

        units = [[("x", 0, 0)], [("x", 0, 3), ("y", 0, 4)], [("x", 0, 7)]]
        orders = random.Random(42).sample(interleavings([4, 4, 4]), 120)
        failed = []
        for n, order in enumerate(orders):
            job = f"three-{n}"
            run_interleaved([UnitRun(db_url, job, u) for u in units], order)
            if problems := placement_problems(db_url, job, [r for u in units for r in u]):
                failed.append(f"{order}: {problems}")
        assert failed == [], f"{len(failed)} of 120 orders:\n" + "\n".join(failed)

    def test_units_with_random_duplicates_in_four_processes_end_each_row_in_one_place(self, db_url):
        """Stress: 4 processes (not threads), each taking its units' steps in a random interleaving
        with random delays of up to 4 ms, over rows of 40 ids (1-4 rows each) in units of 1-5
        rows; three rounds of fresh jobs.  Every row ends in exactly one place each round."""
        import random

        from tests.unit_steps import placement_problems, random_units, run_units_in_process

        S.connect(db_url)  # migrated here first, as the launcher does before its workers start
        ctx = mp.get_context("spawn")
        with ProcessPoolExecutor(4, mp_context=ctx) as pool:
            for round_ in range(3):
                job = f"stress-{round_}"
                rows, units = random_units(random.Random(round_), 40, files=2, unit_rows=5, positions=10**5)
                shares = [units[k::4] for k in range(4)]
                steps = list(pool.map(run_units_in_process, [db_url] * 4, [job] * 4, shares,
                                      [round_ * 10 + k for k in range(4)]))
                assert sum(steps) == 4 * len(units)
                assert placement_problems(db_url, job, rows) == [], f"round {round_}"

    def test_submit_and_requeue_are_compare_and_set(self, db_url):
        eng = S.connect(db_url)
        values = {"id": "q1", "name": "q1", "status": "pending", "spec": {"input": "x"}, "submitted_at": S.utcnow(),
                  "cancel_requested": False}
        assert S.JobStore(eng).submit(values) is True
        assert S.JobStore(eng).submit(values) is False  # the id exists: nothing changes
        assert [j["id"] for j in S.JobStore(eng).queued()] == ["q1"]
        S.JobStore(eng).finish("q1", status="failed", error="boom")
        assert S.JobStore(eng).queued() == []
        assert S.JobStore(eng).requeue("q1", "cancelled", {"spec": {"input": "y"}}) is False  # not in that status
        assert S.JobStore(eng).get("q1")["status"] == "failed"
        assert S.JobStore(eng).requeue("q1", "failed", {"spec": {"input": "y"}}) is True
        job = S.JobStore(eng).get("q1")
        assert (job["status"], job["spec"], job["error"], job["owner"]) == ("pending", {"input": "y"}, None, None)
        assert S.JobStore(eng).requeue("q1", "failed", {"spec": {"input": "z"}}) is False  # a second racer loses

    def test_the_queue_orders_by_priority_then_age_keeps_served_jobs_apart_and_counts_attempts(self, db_url):
        eng = S.connect(db_url)
        js = S.JobStore(eng)
        t0 = S.utcnow()
        for i, (jid, priority, key) in enumerate([("old", 0, None), ("new", 0, None), ("urgent", 5, None),
                                                   ("served-low", 0, "key_a"), ("served-high", 9, "key_b")]):
            js.submit({"id": jid, "name": jid, "status": "pending", "spec": {}, "cancel_requested": False,
                       "submitted_at": t0 + dt.timedelta(seconds=i), "priority": priority, "api_key": key})
        assert [j["id"] for j in js.queued()] == ["urgent", "old", "new"]  # run-pending's: no served batch's job
        assert [j["id"] for j in js.queued(served=True)] == ["served-high", "served-low"]
        assert js.get("old")["attempts"] == 0
        assert js.add_attempt("old") == 1 and js.add_attempt("old") == 2 and js.add_attempt("old", 3) == 5
        assert js.get("old")["attempts"] == 5 and js.add_attempt("no-such-job") == 0

    def test_worker_rows_cancel_flag_and_engine_info(self, db_url):
        eng = S.connect(db_url)
        S.JobStore(eng).claim("j-w", _job_values())
        row = dict(job_id="j-w", worker="h:1", hostname="h", pid=1, engine_info={"kv": 1}, updated_at=1.0)
        S.ResultWriter(eng).record_worker(WorkerRow(**row))
        S.ResultWriter(eng).record_worker(WorkerRow(**dict(row, engine_info={"kv": 2}, updated_at=2.0)))  # a restarted engine: refreshed
        S.ResultWriter(eng).update_worker("j-w", "h:1", peak_rss_bytes=5)
        (w,) = S.MetricsReader(eng).workers("j-w")
        assert (w["engine_info"], w["updated_at"], w["peak_rss_bytes"]) == ({"kv": 2}, 2.0, 5)
        assert S.MetricsReader(eng).engine_info("j-w") == {"kv": 2} and S.MetricsReader(eng).engine_info("none") is None
        assert S.JobStore(eng).cancel_requested("j-w") is False
        S.JobStore(eng).request_cancel("j-w")
        assert S.JobStore(eng).cancel_requested("j-w") is True
        S.ResultWriter(eng).insert_rows(OutputRow, [_output("j-w", 0, output_tokens=7), _output("j-w", 1, output_tokens=8)])
        assert S.MetricsReader(eng).output_tokens("j-w") == 15 and S.MetricsReader(eng).output_tokens("none") == 0

    def test_the_database_sums_and_ranks_request_figures_as_numpy_does_in_memory(self, db_url):
        """RequestSummary.stats (SQL) gives the figures request_stats (numpy) gives of the
        same rows: sums, rows by count source, and every mean, percentile and max."""
        import random

        import numpy as np

        from tokenmill.jobs.metrics.accounting import request_stats

        eng = S.connect(db_url)
        rnd = random.Random(7)
        sources = ["engine", "local_tokenizer+stream_chunks", None, "from_a_newer_tokenmill", "estimate+stream_chunks"]
        rows = [_output("sum", i, prompt_tokens=rnd.randint(1, 900), output_tokens=rnd.choice([0, rnd.randint(1, 64)]),
                        cached_tokens=None if i % 5 == 0 else rnd.randint(0, 16),
                        ttft_s=None if i % 97 == 3 else rnd.lognormvariate(-3, 1),
                        tpot_s=rnd.choice([None, rnd.random() / 50]), e2e_s=rnd.choice([0.0, rnd.uniform(0.01, 4)]),
                        queue_s=rnd.expovariate(20), token_count_source=sources[i % 5], finished_at=1000 + rnd.random())
                for i in range(2_001)]
        S.ResultWriter(eng).insert_rows(OutputRow, rows)
        got, want = S.RequestSummary(eng).stats("sum"), request_stats(rows)
        assert (got.n, got.prompt, got.output, got.cached, got.cached_known) == (
            want.n, want.prompt, want.output, want.cached, want.cached_known) and got.n == 2_001
        assert got.by_source == want.by_source and list(got.by_source) == list(want.by_source)
        assert list(got.by_source) == ["unknown", "engine", "local_tokenizer+stream_chunks", "estimate+stream_chunks",
                                       "not_recorded"]
        for col, d in want.dists.items():
            assert got.dists[col]["n"] == d["n"], col
            for k in ("p50", "p95", "p99", "max"):
                assert got.dists[col][k] == d[k], (col, k)  # the same two ranked values, interpolated alike
            assert got.dists[col]["mean"] == pytest.approx(d["mean"], rel=1e-12), col
        assert got.mean_request_output_tok_per_s == pytest.approx(want.mean_request_output_tok_per_s, rel=1e-12)
        # the report's histograms: the database's bin counts are numpy's
        ttft = np.array([r["ttft_s"] for r in rows if r["ttft_s"] is not None])
        lo, hi, n = S.RequestSummary(eng).extent("sum", "ttft_s")
        assert (lo, hi, n) == (ttft.min(), ttft.max(), ttft.size)
        counts = S.RequestSummary(eng).histogram("sum", "ttft_s", lo, (hi - lo) / 40, 40)
        assert counts == np.histogram(ttft, bins=np.linspace(lo, hi, 41))[0].tolist()
        toks = S.RequestSummary(eng).histogram("sum", "finished_at", 1000.0, 0.25, 4, weight="output_tokens")
        assert sum(toks) == want.output and len(toks) == 4
        empty = S.RequestSummary(eng).stats("none")
        assert (empty.n, empty.dists["e2e_s"]["n"], empty.dists["e2e_s"]["p95"], empty.by_source) == (0, 0, None, {})
        assert S.RequestSummary(eng).extent("none", "ttft_s") is None

    def test_runs_and_worker_measures(self, db_url):
        eng = S.connect(db_url)
        S.JobStore(eng).claim("j-r", _job_values())
        S.JobStore(eng).start_run("j-r", "aaa111", 100.0)
        S.JobStore(eng).start_run("j-r", "aaa111", 999.0)  # a repeat never moves a run's start
        S.JobStore(eng).heartbeat("j-r", "aaa111")
        S.JobStore(eng).start_run("j-r", "bbb222", 200.0)
        S.JobStore(eng).finish_run("j-r", "bbb222", 260.0)
        first, second = S.JobStore(eng).runs("j-r")
        assert (first["run_id"], first["started_at"], first["finished_at"]) == ("aaa111", 100.0, None)
        assert first["seen_at"] > 200.0  # the heartbeat's wall clock
        assert (second["run_id"], second["seen_at"], second["finished_at"]) == ("bbb222", 260.0, 260.0)
        measure = {"window_s": 5.0, "gpus": [{"index": 3, "energy_j": 1.5}]}
        row = {"job_id": "j-r", "worker": "h:1", "run_id": "aaa111", "device_type": "gpu", "device_model": "NVIDIA L4",
               "device_count": 2, "nvml_error": None, "measure": measure, "engine_info": {}, "updated_at": 1.0}
        S.ResultWriter(eng).record_worker(WorkerRow(**row))
        S.ResultWriter(eng).record_worker(WorkerRow(**dict(row, run_id="bbb222", updated_at=2.0)))  # the same process in a later run
        S.ResultWriter(eng).update_worker("j-r", "h:1", measure=dict(measure, window_s=9.0))
        (w,) = S.MetricsReader(eng).workers("j-r")
        assert (w["run_id"], w["device_count"], w["measure"]["window_s"]) == ("bbb222", 2, 9.0)
        S.JobStore(eng).delete("j-r")
        assert S.JobStore(eng).runs("j-r") == [] and S.MetricsReader(eng).workers("j-r") == []


    def test_result_cache_keeps_the_first_answer_counts_hits_sizes_and_prunes_by_last_use(self, db_url):
        from tokenmill.transforms.cache import cache_entry

        eng = S.connect(db_url)
        store = S.CacheStore(eng)

        def entry(i, fp="f1", text="first", at=100.0):
            row = _output("cold", i, text=text, token_count_source="engine", embedding=b"\x01\x02")
            return cache_entry(row, f"k{i:05d}", fp, at)

        assert store.put([entry(i) for i in range(1500)] + [entry(9000, fp="f2", at=50.0)]) == 1501
        assert store.put([entry(0, text="second")]) == 0  # insert-if-absent: the first answer stays
        found = store.lookup([f"k{i:05d}" for i in range(1500)] + ["missing"])  # IN lists in chunks
        assert len(found) == 1500 and found["k00000"]["answer"]["text"] == "first"
        assert found["k00000"]["job_id"] == "cold" and found["k00000"]["answer"]["embedding"] == "AQI="
        # serving commits the rows with the entries' hits (a key served twice counts twice) in one transaction
        served = [_output("warm", 0, cached_from="cold", worker="cache"), _output("warm", 1, cached_from="cold")]
        S.ResultWriter(eng).commit_batch(served, [], [], cache_used=["k00000", "k00000", "k00001"])
        S.ResultWriter(eng).commit_batch([_output("warm", 2)], [], [], cache_entries=[entry(2, text="again")])
        s = store.stats()
        size = sum(entry(i)["size_bytes"] for i in range(1500)) + entry(9000, fp="f2")["size_bytes"]
        assert (s["entries"], s["hits"], s["bytes"]) == (1501, 3, size)
        assert [g["fingerprint"] for g in s["by_fingerprint"]] == ["f1", "f2"]  # largest first
        assert s["by_fingerprint"][0]["models"] == ["m"] and s["oldest_created_at"] == 50.0
        assert s["last_used_at"] > 1e9 and store.lookup(["k00002"])["k00002"]["answer"]["text"] == "first"
        # the summary counts the served rows apart from the engine's
        st = S.RequestSummary(eng).stats("warm")
        assert (st.n, st.rows, st.output) == (1, 3, 5)
        assert st.cache == {"rows": 2, "samples": 2, "prompt_tokens": 20, "output_tokens": 10,
                            "source_jobs": {"cold": 2}}
        # prune by last use: the served entries stay, the others go; one fingerprint alone
        assert store.prune(200.0, fingerprint="f2") == {"entries": 1, "bytes": entry(9000, fp="f2")["size_bytes"]}
        assert store.prune(200.0)["entries"] == 1498 and set(store.lookup(["k00000", "k00001", "k00002"])) == {
            "k00000", "k00001"}


    # ---------------------------------------------------------------- shared jobs' unit leases

    def test_a_unit_is_held_by_one_holder_until_its_lease_expires_then_taken_over_with_a_higher_epoch(self, db_url):
        leases = S.LeaseStore(S.connect(db_url))
        assert leases.seed("jl", ["u0", "u1"]) == 2 and leases.seed("jl", ["u0", "u1", "u2"]) == 1
        a = leases.take("jl", "u0", "A", lease_s=30)
        assert a is not None and a.epoch == 1
        assert leases.take("jl", "u0", "B", lease_s=30) is None  # held: B skips it
        assert leases.take("jl", "nope", "B", lease_s=30) is None
        assert leases.state("jl") == {"units": 3, "done": 0, "held": 1, "free": 2, "takeovers": 0,
                                      "lost_rows": 0, "lost_output_tokens": 0}
        short = leases.take("jl", "u1", "A", lease_s=0.2)
        time.sleep(0.3)
        assert leases.renew([a, short], lease_s=30) == []  # an expired lease nobody took is still A's
        assert leases.take("jl", "u1", "B", lease_s=30) is None
        expired = leases.take("jl", "u2", "A", lease_s=0.2)
        time.sleep(0.3)
        b = leases.take("jl", "u2", "B", lease_s=30)
        assert b is not None and b.epoch == expired.epoch + 1
        assert leases.renew([expired], lease_s=30) == [expired]  # A learns it lost u2
        assert leases.state("jl")["takeovers"] == 1

    def test_a_commit_under_a_lost_lease_is_refused_and_writes_nothing(self, db_url):
        eng = S.connect(db_url)
        leases, writer = S.LeaseStore(eng), S.ResultWriter(eng)
        leases.seed("jf", ["u0"])
        zombie = leases.take("jf", "u0", "A", lease_s=0.1)
        time.sleep(0.2)
        live = leases.take("jf", "u0", "B", lease_s=30)
        with pytest.raises(S.LeaseLost, match="no longer held by A at epoch 1: now B"):
            writer.commit_batch([_output("jf", 0)], [], [], lease=zombie, lease_s=30)
        assert S.MetricsReader(eng).counts("jf")["succeeded"] == 0
        writer.commit_batch([_output("jf", 0)], [], [], lease=live, lease_s=30)
        assert S.MetricsReader(eng).counts("jf")["succeeded"] == 1
        assert leases.finish(live) and not leases.finish(zombie)
        assert leases.take("jf", "u0", "C", lease_s=30) is None  # done: nobody takes it again
        leases.seed("jh", ["u0", "u1"])
        held = [leases.take("jh", u, "A", lease_s=30) for u in ("u0", "u1")]
        assert leases.hand_back("A") == 2
        with pytest.raises(S.LeaseLost):  # a drained holder's batch still in flight lands nowhere
            writer.commit_batch([_output("jh", 0)], [], [], lease=held[0])
        again = leases.take("jh", "u0", "B", lease_s=30)
        assert again.epoch == held[0].epoch + 2  # handed back (+1), taken (+1)
        leases.add_lost(held[0], rows=3, output_tokens=96)
        assert leases.state("jh")["lost_rows"] == 3 and leases.state("jh")["lost_output_tokens"] == 96

    def test_takers_racing_in_processes_each_unit_goes_to_one_holder(self, db_url):
        leases = S.LeaseStore(S.connect(db_url))
        units = [f"u{i}" for i in range(60)]
        leases.seed("jr", units)
        ctx = mp.get_context("spawn")
        with ProcessPoolExecutor(4, mp_context=ctx) as pool:
            got = list(pool.map(_take_all, [db_url] * 4, [f"H{i}" for i in range(4)]))
        taken = [u for g in got for u in g]
        assert sorted(taken) == sorted(units)  # every unit once: nobody took one another holds
        assert leases.state("jr")["held"] == 60


def _take_all(db_url, holder):
    leases = S.LeaseStore(S.connect(db_url))
    return [u for u in (f"u{i}" for i in range(60)) if leases.take("jr", u, holder, lease_s=60) is not None]


class TestSQLite(StorageContract):
    @pytest.fixture
    def db_url(self, tmp_path):
        return f"sqlite:///{tmp_path / 'contract.db'}"


@pytest.mark.postgres
class TestPostgreSQL(StorageContract):
    @pytest.fixture
    def db_url(self, pg_url):
        return pg_url
