"""A shared job (`runner.lease_s`): several processes run one job at once, each work unit under a
lease from the database (schemas/storage/leases.py), every commit fenced; the last participant to
see every unit done finishes the job.  A fake engine and the real PostgreSQL; the replicas of
`tokenmill serve` that run shared jobs are tested in test_serve_replicas.py."""

from __future__ import annotations

import multiprocessing as mp
import time

import pytest

from tests.conftest import write_parquet
from tests.fakes import FakeSession
from tests.helpers import job_spec
from tokenmill.jobs.lifecycle.launchers import settle
from tokenmill.jobs.lifecycle.runner import run_job
from tokenmill.schemas import storage as S

ROWS = 480
GROUP = 40  # rows per row group: 12 units


class SlowSession(FakeSession):
    """20 ms an engine step: long enough for two participants to overlap."""

    def step(self):
        time.sleep(0.02)
        return super().step()


def _spec(tmp_path, inp, job_id):
    return job_spec(inp, tmp_path / f"out-{job_id}", job_id=job_id, engine={"max_num_seqs": 8},
                    sampling={"max_tokens": 2}, batching={"token_budget": 256, "ordering": "none"},
                    runner={"lease_s": 5})


def _input(tmp_path):
    return write_parquet(tmp_path / "in.parquet", [{"id": f"r{i:04d}", "prompt": f"question {i}"} for i in range(ROWS)],
                         row_group_size=GROUP)


def _participant(spec_json: str, db_url: str, out) -> None:
    from tokenmill.schemas.config import JobSpec

    spec = JobSpec.model_validate_json(spec_json)
    done = settle(spec.job_id or "", lambda: run_job(spec, db_url=db_url, session_factory=SlowSession))
    out.put((done.status, done.note))


@pytest.mark.postgres
def test_a_shared_job_run_alone_answers_every_row_and_marks_every_unit_done(tmp_path, pg_url):
    res = run_job(_spec(tmp_path, _input(tmp_path), "alone"), db_url=pg_url, session_factory=FakeSession)
    assert res.status == "succeeded" and res.succeeded == ROWS
    st = S.LeaseStore(S.connect(pg_url)).state("alone")
    assert st["units"] == ROWS // GROUP and st["done"] == st["units"] and st["takeovers"] == 0
    lost = res.metrics["work_lost"]  # nothing died: no engine work was spent on rows nobody kept
    assert (lost["units_taken_over"], lost["rows_refused"], lost["rows_admitted_not_committed"]) == (0, 0, 0)
    from tokenmill.jobs.metrics.report import format_report, load_report

    text = format_report(load_report(S.connect(pg_url), "alone"))
    assert "work lost to failures" in text and "0 units taken over, 0 rows refused" in text


@pytest.mark.postgres
def test_two_participants_share_the_units_every_row_once_and_one_finishes_the_job(tmp_path, pg_url):
    spec = _spec(tmp_path, _input(tmp_path), "shared")
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_participant, args=(spec.model_dump_json(), pg_url, out)) for _ in range(2)]
    for p in procs:
        p.start()
    got = sorted(out.get(timeout=300) for _ in procs)
    for p in procs:
        p.join(30)
    eng = S.connect(pg_url)
    statuses = [s for s, _ in got]
    # the one that found every unit done finished the job; the other left it to it (busy)
    assert statuses == ["busy", "succeeded"] or statuses == ["succeeded", "succeeded"], got
    job = S.JobStore(eng).get("shared")
    assert job["status"] == "succeeded" and job["succeeded"] == ROWS
    assert S.MetricsReader(eng).counts("shared") == {"succeeded": ROWS, "failed": 0}
    holders = S.LeaseStore(eng).holders("shared")
    assert len(holders) == 2 and sum(holders.values()) == ROWS // GROUP, holders  # both engines answered units
    import pandas as pd

    exported = pd.read_parquet(tmp_path / "out-shared" / "outputs.parquet")
    assert len(exported) == ROWS and exported["id"].is_unique
