"""Security: credentials never leak, SQL is parameterized, output stays under its root."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
from sqlalchemy import inspect, select

from tests.conftest import PG_URL, write_parquet
from tests.fakes import FakeSession
from tests.helpers import cli, job_spec
from tokenmill.jobs.lifecycle.export import OutputPathError, check_output_root, join
from tokenmill.jobs.lifecycle.runner import JobError, run_job
from tokenmill.schemas import storage as S
from tokenmill.schemas import tables as T

FAKE_SECRET = "wJalrXUtnFEMI/K7MDENG/bPxRfiCYFAKESECRET"
FAKE_KEY_ID = "AKIAFAKEKEYID0000000"
DB_PASSWORD = "pw-Zq81-never-shown"
MALICIOUS_ID = "x'); DROP TABLE jobs;--"


def files_under(root: Path) -> set[Path]:
    return {p for p in root.rglob("*") if p.is_file()}


@pytest.fixture
def pg_url_with_password(pg_url):
    """The fresh test schema, reached with a password in the URL (trust auth ignores it)."""
    assert "://postgres@" in pg_url
    return pg_url.replace("://postgres@", f"://postgres:{DB_PASSWORD}@", 1)


def test_credentials_never_reach_db_rows_logs_outputs_or_cli(tmp_path, pg_url_with_password, monkeypatch, caplog, capsys):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", FAKE_KEY_ID)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", FAKE_SECRET)
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    url = pg_url_with_password
    inp = write_parquet(tmp_path / "in.parquet", [{"id": f"r{i}", "prompt": f"question {i}"} for i in range(5)]
                        + [{"id": "bad", "prompt": None}])
    spec = job_spec(inp, tmp_path / "out", job_id="secure", db=url, sampling={"max_tokens": 3})
    caplog.set_level(logging.DEBUG)
    res = run_job(spec, db_url=url, session_factory=FakeSession)
    assert (res.succeeded, res.failed) == (5, 1)
    texts = [caplog.text, capsys.readouterr().out]
    reports = tmp_path / "reports"
    for cmd in (["status", "secure", "--json"], ["jobs", "--json"], ["status", "secure"],
                ["report", "secure", "--json", "--out", str(reports)]):
        r = cli(*cmd, "--db", url)
        assert r.exit_code == 0, r.output
        texts.append(r.output)
    texts += [p.read_text(errors="replace") for p in files_under(reports)]
    assert texts[-1], "the HTML report was written"
    eng = S.connect(url)
    with eng.connect() as conn:
        for t in (T.jobs, T.outputs, T.dead_letters, T.batches, T.workers):
            rows = [dict(r) for r in conn.execute(select(t)).mappings()]
            assert rows or t is T.workers
            texts.append(json.dumps(rows, default=str))
    job = S.JobStore(eng).get("secure")
    assert job["spec"]["db"].startswith(PG_URL.split("://")[0] + "://postgres:***@")  # kept, but masked
    texts += [p.read_bytes().decode("latin-1") for p in files_under(tmp_path / "out")]
    blob = "\n".join(texts)
    assert "r4" in blob and "secure" in blob  # the things searched do hold the job's data
    for secret in (FAKE_SECRET, DB_PASSWORD):
        assert secret not in blob


def test_unreachable_database_error_masks_the_password(tmp_path):
    url = PG_URL.replace("postgres@", f"postgres:{DB_PASSWORD}@").replace("5432/test", "5432/no_such_db_here")
    r = cli("status", "x", "--db", url)
    assert r.exit_code == 1
    assert r.output.startswith(f"error: cannot use database {PG_URL.split('://')[0]}://postgres:***@")
    assert DB_PASSWORD not in r.output


def test_malicious_row_id_is_stored_verbatim_and_drops_nothing(tmp_path, any_db_url):
    inp = write_parquet(tmp_path / "in.parquet", [{"id": MALICIOUS_ID, "prompt": "hi"}, {"id": "ok", "prompt": "yo"}])
    res = run_job(job_spec(inp, tmp_path / "out", job_id="sqlinj", sampling={"max_tokens": 2}), db_url=any_db_url, session_factory=FakeSession)
    assert res.status == "succeeded" and res.succeeded == 2
    eng = S.connect(any_db_url)
    assert "jobs" in inspect(eng).get_table_names()
    with eng.connect() as conn:
        ids = set(conn.execute(select(T.outputs.c.id).where(T.outputs.c.job_id == "sqlinj")).scalars())
    assert ids == {MALICIOUS_ID, "ok"}
    # and as a command argument
    r = cli("status", MALICIOUS_ID, "--db", any_db_url)
    assert r.exit_code == 1 and r.output.strip() == f"error: no job with id {MALICIOUS_ID!r}"
    r = cli("cancel", MALICIOUS_ID, "--db", any_db_url)
    assert r.exit_code == 1
    assert S.JobStore(eng).get("sqlinj")["status"] == "succeeded"


@pytest.mark.parametrize("output", ["out/../../elsewhere", "../escape", "a/..", "s3://bucket/x/../../y", "s3:///nobucket", ""])
def test_output_root_that_could_escape_is_refused(output):
    with pytest.raises(OutputPathError):
        check_output_root(output)


def test_job_with_dotdot_output_is_refused_before_any_work(tmp_path, sqlite_url):
    inp = write_parquet(tmp_path / "in.parquet", [{"id": "a", "prompt": "hi"}])
    FakeSession.instances.clear()
    out = f"{tmp_path}/out/../../escaped"
    with pytest.raises(JobError, match=r"contains a '\.\.' segment"):
        run_job(job_spec(inp, out, job_id="dots"), db_url=sqlite_url,
                session_factory=FakeSession)
    assert FakeSession.instances == [] and S.JobStore(S.connect(sqlite_url)).get("dots") is None
    assert not (tmp_path.parent / "escaped").exists()


def test_cli_refuses_dotdot_output_in_one_line(tmp_path, sqlite_url):
    inp = write_parquet(tmp_path / "in.parquet", [{"id": "a", "prompt": "hi"}])
    r = cli("run", "--input", inp, "--output", "runs/../../x", "--db", sqlite_url)
    assert r.exit_code == 1
    assert r.output.strip() == "error: output 'runs/../../x' contains a '..' segment; give the folder itself"


def test_ids_and_names_never_become_paths(tmp_path, sqlite_url):
    rows = [{"id": "../../escape", "prompt": "hi"}, {"id": "/etc/passwd", "prompt": "yo"}, {"id": "a/b", "prompt": None}]
    (tmp_path / "work").mkdir()
    inp = write_parquet(tmp_path / "work" / "in.parquet", rows)
    before = files_under(tmp_path)
    res = run_job(job_spec(inp, tmp_path / "work" / "out", job_id="paths", name="../../evil",
                           sampling={"max_tokens": 2}),
                  db_url=sqlite_url, session_factory=FakeSession)
    assert (res.succeeded, res.failed) == (2, 1)
    new = files_under(tmp_path) - before
    out_root = (tmp_path / "work" / "out").resolve()
    # the manifest, and each export a folder of parts (docs/JOBS.md, "Export parts")
    written = {p for p in new if out_root in p.resolve().parents}
    assert {p.resolve().relative_to(out_root).parts[0] for p in written} == {"outputs.parquet", "dead_letters.parquet",
                                                                  "_SUCCESS.json"}
    assert all(len(p.resolve().relative_to(out_root).parts) == 1 or p.name.startswith("part-") for p in written), written
    assert all(p.name.startswith("tokenmill.db") for p in new - written), new - written  # the DB only
    with pytest.raises(OutputPathError):
        join(str(out_root), "../../escape")
