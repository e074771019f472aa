"""Work units: the input cut into slices whose number follows the data, read back exactly."""

import pyarrow as pa
import pyarrow.parquet as pq

from tests.test_batching import tp
from tokenmill.transforms.batching import segment
from tokenmill.transforms.read import MAX_UNIT_ROWS, plan_input, plan_units, plan_work, read_unit


def write(path, n, row_group_size, start=0):
    ids = [f"r{start + i}" for i in range(n)]
    pq.write_table(pa.table({"id": ids, "prompt": [f"prompt {i} " + "x" * 100 for i in range(n)]}), path,
                   row_group_size=row_group_size)
    return ids


def rows_of(units):
    return [(r["_file_index"], r["_row"], r["id"].decode() if isinstance(r["id"], bytes) else r["id"])
            for u in units for r in read_unit(u)]


def test_one_big_row_group_is_split_into_units_that_read_back_every_row_once(tmp_path):
    ids = write(tmp_path / "a.parquet", 5000, row_group_size=5000)
    plan = plan_input(str(tmp_path / "a.parquet"))
    assert len(plan.shards) == 1
    units = plan_units(plan, unit_bytes=64 << 10)  # ~64 KiB of ~110-byte rows: ~600 rows a unit
    assert len(units) > 5
    got = rows_of(units)
    assert [g[2] for g in got] == ids
    assert [g[1] for g in got] == list(range(5000))  # file-level row numbers, in order, none twice


def test_units_span_files_and_row_groups_with_file_level_row_numbers(tmp_path):
    write(tmp_path / "a.parquet", 1000, row_group_size=300)
    write(tmp_path / "b.parquet", 700, row_group_size=256, start=1000)
    plan = plan_input(str(tmp_path))
    units = plan_units(plan, unit_bytes=16 << 10)
    got = rows_of(units)
    assert sorted((f, r) for f, r, _ in got) == [(0, r) for r in range(1000)] + [(1, r) for r in range(700)]
    assert {i for _, _, i in got} == {f"r{i}" for i in range(1700)}
    assert len({u.key for u in units}) == len(units)


def test_unit_count_follows_the_input_not_the_workers(tmp_path):
    write(tmp_path / "a.parquet", 40_000, row_group_size=40_000)
    plan = plan_input(str(tmp_path / "a.parquet"))
    units = plan_units(plan)
    assert len(units) == -(-40_000 // MAX_UNIT_ROWS)  # by the row cap: a 10x bigger input has 10x the units
    assert sum(u.num_rows for u in units) == 40_000
    assert len(plan_work(units, workers=2)) == len(units)  # enough units: one work item each


def test_small_inputs_are_split_into_parts_so_every_worker_gets_work(tmp_path):
    write(tmp_path / "a.parquet", 1000, row_group_size=1000)
    units = plan_units(plan_input(str(tmp_path / "a.parquet")))
    assert len(units) == 1
    assert [(w.part, w.parts) for w in plan_work(units, workers=1)] == [(0, 1)]
    four = plan_work(units, workers=4)
    assert [(w.part, w.parts) for w in four] == [(k, 8) for k in range(8)]  # two items per worker


def test_segments_of_a_unit_cover_it_once_balanced_by_tokens():
    prompts = [tp(i, [i % 7] * (5 + i % 11)) for i in range(200)]
    for parts in (1, 2, 3, 8):
        segs = [segment(prompts, k, parts) for k in range(parts)]
        assert [p.id for s in segs for p in s] == [p.id for p in prompts]  # contiguous, in order, each once
        loads = [sum(p.budget_tokens for p in s) for s in segs]
        assert max(loads) - min(loads) <= 2 * max(p.budget_tokens for p in prompts)


def test_units_cover_the_plan_exactly(tmp_path):
    write(tmp_path / "a.parquet", 2345, row_group_size=1000)
    plan = plan_input(str(tmp_path / "a.parquet"))
    units = plan_units(plan, unit_bytes=32 << 10)
    assert sum(u.num_rows for u in units) == plan.total_rows == 2345


def test_a_unit_its_worker_cannot_read_fails_in_one_line_naming_the_host_and_the_input(tmp_path):
    import socket

    import pytest

    from tokenmill.schemas.errors import first_line
    from tokenmill.transforms.read import InputUnreadable, ReadUnitFn, WorkItem

    write(tmp_path / "a.parquet", 10, row_group_size=10)
    (unit,) = plan_units(plan_input(str(tmp_path / "a.parquet")), unit_bytes=1 << 20)
    (tmp_path / "a.parquet").rename(tmp_path / "moved.parquet")  # planned here; gone where the worker reads
    with pytest.raises(InputUnreadable) as err:
        list(ReadUnitFn().process(WorkItem(unit)))
    line = first_line(err.value)
    assert line.startswith(f"worker on host {socket.gethostname()}: input {str(tmp_path / 'a.parquet')!r} "
                           "cannot be read here: ")
    assert "\n" not in str(err.value)
