"""Reruns skip done work before reading it, and the unit plan covers every row once.

A unit whose rows are all answered or dead-lettered is not opened; a partly done unit
turns only its missing rows into records; a rerun still dead-letters each duplicate
exactly once; a job reads each used column of its input once and no other column."""

import os
import random

import pyarrow as pa
import pyarrow.parquet as pq
from sqlalchemy import delete

from tests.fakes import FakeSession
from tests.helpers import job_spec
from tokenmill.jobs.lifecycle.runner import run_job
from tokenmill.schemas import records as R
from tokenmill.schemas import storage as S
from tokenmill.schemas import tables as T
from tokenmill.schemas.records import OutputRow
from tokenmill.transforms.read import InputPlan, ReadUnitFn, Shard, WorkItem, plan_input, plan_units


def _plan_model(groups: list[int], rows_per_unit: int) -> list[tuple[int, int]]:
    """The plan in plain Python: each row group cut into runs of `rows_per_unit` rows."""
    out, first = [], 0
    for n in groups:
        out += [(first + s, min(rows_per_unit, n - s)) for s in range(0, n, rows_per_unit)]
        first += n
    return out


def test_units_never_overlap_or_skip_rows_for_any_mix_of_row_groups():
    rnd = random.Random(26)
    for _ in range(300):
        files = [[rnd.choice([1, 2, 7, 100, 1000, 8191, 8192, 8193, 20000]) for _ in range(rnd.randint(1, 5))]
                 for _ in range(rnd.randint(1, 3))]
        bpr = rnd.choice([1.0, 50.0, 1000.0, 100000.0])
        budget = rnd.choice([1 << 12, 1 << 16, 1 << 22])
        shards = []
        for fi, groups in enumerate(files):
            first = 0
            for g, n in enumerate(groups):
                shards.append(Shard(fi, f"f{fi}", g, n, first_row=first, bytes_per_row=bpr))
                first += n
        plan = InputPlan(files=[f"f{i}" for i in range(len(files))], shards=shards, columns=["prompt"],
                         total_rows=sum(map(sum, files)))
        units = plan_units(plan, budget)
        per_unit = max(1, min(int(budget // bpr), 8192))
        for fi, groups in enumerate(files):
            got = [(u.rows.start, u.num_rows) for u in units if u.file_index == fi]
            assert got == _plan_model(groups, per_unit)
            covered = [r for u in units if u.file_index == fi for r in u.rows]
            assert covered == list(range(sum(groups)))  # every row once, in order


def _outputs(job_id, rows):
    return [OutputRow(job_id=job_id, id=f"r{i}", input_file=0, input_row=i, text="old", prompt_tokens=1,
                      output_tokens=1, cached_tokens=0).as_dict() for i in rows]


def test_a_partly_done_unit_reads_only_its_missing_rows_and_a_done_unit_is_not_opened(tmp_path, sqlite_url):
    path = tmp_path / "in.parquet"
    pq.write_table(pa.table({"id": [f"r{i}" for i in range(3000)], "prompt": [f"p{i}" for i in range(3000)]}),
                   path, row_group_size=3000)
    a, b = (Shard(0, str(path), 0, 1500, start=s) for s in (0, 1500))  # two units of the one row group
    eng = S.connect(sqlite_url)
    S.ResultWriter(eng).insert_rows(OutputRow, _outputs("j", [*range(0, 1500), *range(1500, 3000, 10)]))
    fn = ReadUnitFn(db_url=sqlite_url, job_id="j")
    (chunk,) = fn.process(WorkItem(b))
    assert [r["_row"] for r in chunk.items] == [i for i in range(1500, 3000) if i % 10]
    assert [r["id"] for r in chunk.items][:2] == [b"r1501", b"r1502"]
    (whole,) = fn.process(WorkItem(b, 0, 2))  # in parts, read whole: each part cuts the unit's same order
    assert len(whole.items) == 1500
    os.remove(path)  # a unit with every row done must not touch its file
    assert list(fn.process(WorkItem(a))) == []


def test_rerun_of_a_90_percent_done_job_generates_only_the_missing_rows_and_dead_letters_duplicates_once(
        tmp_path, sqlite_url, model_path):
    n = 600
    rows = [{"id": f"r{i}", "prompt": f"question {i} " + "why " * 100} for i in range(n)]
    rows += [{"id": "r3", "prompt": "late duplicate of r3"}, {"id": "r590", "prompt": "another duplicate"}]
    inp = tmp_path / "in.parquet"
    pq.write_table(pa.Table.from_pylist(rows), inp, row_group_size=len(rows))
    spec = job_spec(inp, tmp_path / "out", job_id="ninety", sampling={"max_tokens": 2},
                    batching={"unit_bytes": 1 << 16})
    assert len(plan_units(plan_input(str(inp)), 1 << 16)) >= 4  # the duplicates sit in other units
    run_job(spec, db_url=sqlite_url, session_factory=FakeSession)
    eng = S.connect(sqlite_url)
    missing = {f"r{i}" for i in range(0, n, 10)}
    with eng.begin() as c:
        c.execute(delete(T.outputs).where(T.outputs.c.id.in_(missing)))
    def sent():  # what the engines were given, in every session (a worker may keep its session)
        return [rid for s in FakeSession.instances for rid in s.added]

    before = len(sent())
    res = run_job(spec, db_url=sqlite_url, session_factory=FakeSession)
    assert res.resumed and (res.succeeded, res.failed) == (n, 2)
    assert len(sent()) - before == len(missing)  # request ids; the outputs below say which rows
    dead = S.MetricsReader(eng).failure_reasons("ninety")
    assert dead == {R.DUPLICATE_ID: 2}
    assert sorted(S.MetricsReader(eng).outputs("ninety")) == sorted(f"r{i}" for i in range(n))
    read = S.JobStore(eng).get("ninety")["metrics"]["input"]
    assert (read["rows_read"], read["rows_skipped_done"]) == (len(missing), n + 2 - len(missing))


def test_a_job_reads_its_used_columns_once_and_no_other_column(tmp_path, sqlite_url):
    """Many small row groups, ids with duplicates across them and a wide column the job
    does not use: the bytes read are those of the used columns' chunks (and the footer),
    once; a dead letter's raw shows only the used columns."""
    n = 3000
    rows = [{"id": f"r{i % 2900}", "prompt": f"q{i} " * (i % 5 + 1) if i != 7 else "  ",
             "document": f"doc {i} " * 40, "max_tokens": 2} for i in range(n)]
    inp = tmp_path / "in.parquet"
    pq.write_table(pa.Table.from_pylist(rows), inp, row_group_size=250)
    spec = job_spec(inp, tmp_path / "out", job_id="cols")
    res = run_job(spec, db_url=sqlite_url, session_factory=FakeSession)
    assert (res.succeeded, res.failed) == (2899, 101)  # 100 duplicates (the later rows) and one empty prompt
    meta = pq.ParquetFile(inp).metadata
    used = sum(meta.row_group(g).column(c).total_compressed_size for g in range(meta.num_row_groups)
               for c in range(meta.num_columns) if meta.row_group(g).column(c).path_in_schema != "document")
    footer = meta.serialized_size + 8
    read = S.JobStore(S.connect(sqlite_url)).get("cols")["metrics"]["input"]
    assert used <= read["bytes_read"] <= 1.1 * (used + footer), (read, used, footer)
    assert read["bytes_read"] < 0.5 * os.path.getsize(inp)  # the document column is most of the file
    with S.connect(sqlite_url).connect() as c:
        raws = dict(c.execute(T.dead_letters.select().with_only_columns(T.dead_letters.c.input_row, T.dead_letters.c.raw)
                              .where(T.dead_letters.c.job_id == "cols", T.dead_letters.c.reason == R.EMPTY_PROMPT)).all())
    assert set(raws) == {7} and "document" not in raws[7] and '"max_tokens": 2' in raws[7], raws


class _Counted:
    """Bytes read through the reader's files (its own counter counts only inside a pipeline)."""

    total = 0

    def __init__(self, fh):
        self._fh = fh

    def read(self, *args):
        data = self._fh.read(*args)
        _Counted.total += len(data)
        return data

    def __getattr__(self, name):
        return getattr(self._fh, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._fh.close()


def test_a_row_group_cut_into_units_is_read_from_storage_once_and_each_unit_gets_its_own_rows(
        tmp_path, sqlite_url, monkeypatch):
    from tokenmill.transforms import read as RD

    monkeypatch.setenv("TOKENMILL_SPILL_DIR", str(tmp_path / "spill"))
    n = 20_000
    path = tmp_path / "one-group.parquet"
    pq.write_table(pa.table({"id": [f"r{i}" for i in range(n)], "prompt": [f"p{i} " * (i % 7 + 1) for i in range(n)]}),
                   path, row_group_size=n, compression="none")
    units = plan_units(plan_input(str(path)), 1 << 16)
    assert len(units) >= 8 and all(u.spills for u in units)
    real_open = RD.open_file
    monkeypatch.setattr(RD, "open_file", lambda path: _Counted(real_open(path)))
    eng = S.connect(sqlite_url)
    S.ResultWriter(eng).insert_rows(OutputRow, _outputs("g", range(units[-1].rows.start, n)))  # the last unit: done
    fn = ReadUnitFn(db_url=sqlite_url, job_id="g")
    got = [r["_row"] for u in reversed(units[:-1]) for c in fn.process(WorkItem(u)) for r in c.items]
    assert sorted(got) == list(range(units[-1].rows.start)) and len(got) == len(set(got))
    size = os.path.getsize(path)
    assert _Counted.total <= 1.1 * size, (_Counted.total, size)  # once, not once per unit (about 8x)
    assert not list((tmp_path / "spill").rglob("*.arrow"))  # every unit's file read and removed; the done one never written
    # a unit asked for again (a retried bundle) splits the group again and gets the same rows
    (again,) = fn.process(WorkItem(units[1]))
    assert [r["_row"] for r in again.items] == list(units[1].rows)
    assert [r["id"] for r in again.items] == [f"r{i}".encode() for i in units[1].rows]
    # a worker reads a file's footer once: its later units open the file without reading it again
    hits = RD.cached_footer.cache_info().hits
    (one,) = fn.process(WorkItem(units[0], 0, 2))  # in parts: read from the row group, not the spill
    assert len(one.items) == units[0].num_rows and RD.cached_footer.cache_info().hits == hits + 1
    # a rewritten input (planned again, as a new run plans it) is never served from the old split
    assert list((tmp_path / "spill").rglob("*.arrow"))  # the split above left the other units' files
    pq.write_table(pa.table({"id": [f"new{i}" for i in range(n)], "prompt": ["x"] * n}), path, row_group_size=n)
    os.utime(path, (1, 1))
    new = plan_units(plan_input(str(path)), 1 << 16)[2]
    (fresh,) = fn.process(WorkItem(new))
    assert [r["id"] for r in fresh.items] == [f"new{i}".encode() for i in new.rows]
