"""submit / run-pending / validate, exit codes, help examples, overlapping runs."""

from __future__ import annotations

import datetime as dt
import json
import time

import click
import pytest
from sqlalchemy import insert

from tests.conftest import write_parquet
from tests.fakes import FakeSession
from tests.helpers import assert_one_line_error, cli, job_spec, one_error_line
from tokenmill.jobs.cli import main
from tokenmill.jobs.lifecycle import queue as Q
from tokenmill.jobs.lifecycle.launchers.inprocess import run_here
from tokenmill.jobs.lifecycle.runner import run_job
from tokenmill.schemas import storage as S
from tokenmill.schemas import tables as T


def prompts(tmp_path, n=3, name="in.parquet"):
    return write_parquet(tmp_path / name, [{"id": f"r{i}", "prompt": f"question {i}"} for i in range(n)])


def fake_run(db_url):
    return lambda spec: run_here(spec, db_url=db_url, session_factory=FakeSession)


# ---------------------------------------------------------------- submit


def test_submit_prints_the_id_and_records_a_pending_job(tmp_path, any_db_url):
    inp = prompts(tmp_path)
    res = cli("submit", "--input", str(inp), "--output", str(tmp_path / "o"), "--job-id", "nightly-1",
              "--max-tokens", "7", "--db", any_db_url)
    assert res.exit_code == 0, res.output
    assert res.output.strip() == "nightly-1"
    job = S.JobStore(S.connect(any_db_url)).get("nightly-1")
    assert job["status"] == "pending" and job["submitted_at"] is not None and job["started_at"] is None
    assert job["spec"]["sampling"]["max_tokens"] == 7 and job["spec"]["job_id"] == "nightly-1"


def test_submit_stores_local_paths_absolute(tmp_path, sqlite_url, monkeypatch):
    monkeypatch.chdir(tmp_path)
    prompts(tmp_path)
    res = cli("submit", "--input", "in.parquet", "--output", "out", "--job-id", "rel", "--db", sqlite_url)
    assert res.exit_code == 0, res.output
    spec = S.JobStore(S.connect(sqlite_url)).get("rel")["spec"]
    assert (spec["input"], spec["output"]) == (str(tmp_path / "in.parquet"), str(tmp_path / "out"))


def test_submit_twice_is_one_job_and_a_derived_id_is_stable(tmp_path, sqlite_url):
    inp = prompts(tmp_path)
    args = ["submit", "--input", str(inp), "--output", str(tmp_path / "o"), "--db", sqlite_url, "--json"]
    first = json.loads(cli(*args).output)
    second = json.loads(cli(*args).output)
    assert first["job_id"] == second["job_id"] and first["job_id"].startswith("job-")
    assert (first["status"], second["status"]) == ("pending", "already pending")
    assert [j["id"] for j in S.JobStore(S.connect(sqlite_url)).recent()] == [first["job_id"]]


def test_submit_refuses_a_finished_id_and_requeues_a_failed_one(tmp_path, sqlite_url):
    eng = S.connect(sqlite_url)
    spec = job_spec(prompts(tmp_path), tmp_path / "o", job_id="j")
    Q.submit(eng, spec)
    S.JobStore(eng).finish("j", status="succeeded")
    with pytest.raises(Q.QueueError, match="already exists with status 'succeeded'"):
        Q.submit(eng, spec)
    S.JobStore(eng).finish("j", status="failed")
    assert Q.submit(eng, spec).status == "pending"
    assert S.JobStore(eng).get("j")["status"] == "pending"


def test_submit_invalid_spec_names_the_key_path(tmp_path, sqlite_url):
    spec = tmp_path / "job.yaml"
    spec.write_text("input: a.parquet\noutput: out\nbatching:\n  ordering: random\nrunner:\n  num_workers: 0\n")
    res = cli("submit", str(spec), "--db", sqlite_url)
    assert res.exit_code == 2
    err = one_error_line(res)
    assert "batching.ordering" in err and "runner.num_workers" in err
    assert S.JobStore(S.connect(sqlite_url)).recent() == []


def test_submit_of_a_missing_input_fails_at_once_in_one_line(tmp_path, sqlite_url):
    res = cli("submit", "--input", str(tmp_path / "nope.parquet"), "--output", str(tmp_path / "o"),
              "--db", sqlite_url)
    assert_one_line_error(res, 1, "does not exist", "nope.parquet")
    assert S.JobStore(S.connect(sqlite_url)).recent() == []


# ---------------------------------------------------------------- run-pending


def test_run_pending_runs_jobs_in_submission_order_and_resumes_none_twice(tmp_path, any_db_url):
    eng = S.connect(any_db_url)
    order = ["b-second", "a-first", "c-third"]  # ids sort differently from submission order
    for i, jid in enumerate(order):
        Q.submit(eng, job_spec(prompts(tmp_path, 2 + i, f"{jid}.parquet"), tmp_path / jid,
                               job_id=jid, sampling={"max_tokens": 2}))
    seen = []
    outcomes = Q.run_pending(eng, fake_run(any_db_url), on_start=lambda j: seen.append(j["id"]))
    assert seen == order
    assert [(o.job_id, o.status) for o in outcomes] == [(j, "succeeded") for j in order]
    for i, jid in enumerate(order):
        job = S.JobStore(eng).get(jid)
        assert (job["status"], job["total"], job["succeeded"]) == ("succeeded", 2 + i, 2 + i)
        assert (tmp_path / jid / "_SUCCESS.json").exists()
    assert Q.run_pending(eng, fake_run(any_db_url)) == []  # nothing left


def test_run_pending_resumes_a_job_whose_runner_died(tmp_path, sqlite_url):
    eng = S.connect(sqlite_url)
    spec = job_spec(prompts(tmp_path, 3), tmp_path / "o", job_id="orphan")
    Q.submit(eng, spec)
    Q.submit(eng, job_spec(prompts(tmp_path, 2, "b.parquet"), tmp_path / "p", job_id="live"))
    stale = dt.datetime.now(dt.timezone.utc) - dt.timedelta(seconds=S.STALE_AFTER_S + 5)
    now = dt.datetime.now(dt.timezone.utc)
    from sqlalchemy import update

    with eng.begin() as conn:  # `orphan`: killed mid-run; `live`: another runner is on it right now
        conn.execute(update(T.jobs).where(T.jobs.c.id == "orphan").values(status="running", owner="gone:1",
                                                                          heartbeat_at=stale))
        conn.execute(update(T.jobs).where(T.jobs.c.id == "live").values(status="running", owner=S.owner_tag(),
                                                                        heartbeat_at=now))
    outcomes = Q.run_pending(eng, fake_run(sqlite_url))
    assert [(o.job_id, o.status) for o in outcomes] == [("orphan", "succeeded")]
    assert S.JobStore(eng).get("live")["status"] == "running"


def test_one_failing_job_does_not_stop_the_queue(tmp_path, sqlite_url):
    eng = S.connect(sqlite_url)
    Q.submit(eng, job_spec(tmp_path / "gone.parquet", tmp_path / "x", job_id="bad"))
    Q.submit(eng, job_spec(prompts(tmp_path), tmp_path / "y", job_id="good"))
    outcomes = Q.run_pending(eng, fake_run(sqlite_url))
    assert [(o.job_id, o.status) for o in outcomes] == [("bad", "failed"), ("good", "succeeded")]
    assert "does not exist" in outcomes[0].note
    assert S.JobStore(eng).get("bad")["status"] == "failed" and "does not exist" in S.JobStore(eng).get("bad")["error"]


def test_run_pending_cli_exit_code_is_the_most_serious_outcome(tmp_path, sqlite_url, monkeypatch):
    import tokenmill.jobs.lifecycle.runner as runner_mod

    real = runner_mod.run_job
    monkeypatch.setattr(runner_mod, "run_job",
                        lambda spec, session_factory=None, **kw: real(spec, **kw, session_factory=FakeSession))
    eng = S.connect(sqlite_url)
    ok = prompts(tmp_path, 2)
    partial = write_parquet(tmp_path / "p.parquet", [{"id": "a", "prompt": "hi"}, {"id": "b", "prompt": ""}])
    Q.submit(eng, job_spec(ok, tmp_path / "o1", job_id="ok"))
    Q.submit(eng, job_spec(partial, tmp_path / "o2", job_id="part"))
    res = cli("run-pending", "--db", sqlite_url, "--json")
    assert res.exit_code == 3, res.output
    out = json.loads(res.output)
    assert [(j["job_id"], j["status"]) for j in out["jobs"]] == [("ok", "succeeded"), ("part", "partial")]
    assert out["jobs"][1]["summary"]["failed"] == 1
    res = cli("run-pending", "--db", sqlite_url)
    assert res.exit_code == 0 and "no pending jobs" in res.output


def test_second_runner_is_refused_while_the_lock_is_held(sqlite_url):
    eng = S.connect(sqlite_url)
    with S.JobStore(eng).named_lock(Q.LOCK_NAME) as got:
        assert got
        res = cli("run-pending", "--db", sqlite_url)
        assert res.exit_code == 5
        assert "holds the queue lock" in one_error_line(res)
    res = cli("run-pending", "--db", sqlite_url)
    assert res.exit_code == 0  # released


def test_overlapping_run_of_a_live_job_id_refuses_cleanly(tmp_path, sqlite_url):
    """What cron needs: a run still going when the next one fires makes the second exit 5."""
    eng = S.connect(sqlite_url)
    now = dt.datetime.now(dt.timezone.utc)
    with eng.begin() as conn:
        conn.execute(insert(T.jobs).values(id="cron-job", status="running", spec={}, owner=S.owner_tag(),
                                           heartbeat_at=now, started_at=now, submitted_at=now))
    res = cli("run", "--input", str(prompts(tmp_path)), "--output", str(tmp_path / "o"),
              "--job-id", "cron-job", "--db", sqlite_url)
    assert res.exit_code == 5
    assert "already running" in one_error_line(res)
    assert S.JobStore(eng).get("cron-job")["owner"] == S.owner_tag()  # untouched


# ---------------------------------------------------------------- validate


def test_validate_ok_reports_rows_and_model(tmp_path):
    res = cli("validate", "--input", str(prompts(tmp_path, 4)), "--output", str(tmp_path / "o"), "--json")
    assert res.exit_code == 0, res.output
    out = json.loads(res.output)
    assert out["valid"] and out["rows"] == 4 and out["model_path"].endswith("smollm2-135m")


def test_validate_openai_batch_file_lists_endpoints_and_models(tmp_path):
    p = tmp_path / "b.jsonl"
    p.write_text(json.dumps({"custom_id": "a", "method": "POST", "url": "/v1/completions",
                             "body": {"model": "m", "prompt": "x"}}) + "\n")
    res = cli("validate", "--input", str(p), "--output", str(tmp_path / "o"), "--json")
    out = json.loads(res.output)
    assert out["input_format"] == "openai-jsonl" and out["output_format"] == "openai-jsonl"
    assert out["endpoints"] == {"/v1/completions": 1} and out["models"] == {"m": 1}
    assert out["unserved_models"] == {"m": 1}  # the job serves smollm2-135m: that line would be a dead letter
    res = cli("validate", "--input", str(p), "--output", str(tmp_path / "o"))
    assert res.exit_code == 0 and "warning: lines naming another model will be dead letters: 'm' (1 lines)" in res.output


def test_validate_reports_every_problem_on_one_line(tmp_path):
    noprompt = write_parquet(tmp_path / "q.parquet", [{"question": "hi"}])
    res = cli("validate", "--input", str(noprompt), "--output", str(tmp_path / "o"),
              "--model", "no-such-model")
    assert res.exit_code == 1
    err = one_error_line(res)
    assert "unknown model 'no-such-model'" in err and "no 'prompt' or 'messages' column" in err


def test_validate_spec_file_unknown_key_and_range(tmp_path):
    spec = tmp_path / "job.yaml"
    spec.write_text("input: a.parquet\noutput: o\nengine:\n  max_num_seqs: 0\n  gpu_memory_utilisation: 0.3\n")
    res = cli("validate", str(spec))
    assert res.exit_code == 2
    err = one_error_line(res)
    assert "engine.max_num_seqs" in err and "greater than or equal to 1" in err
    assert "engine.gpu_memory_utilisation: unknown key" in err


def test_validate_and_run_refuse_an_fp8_checkpoint_on_cpu_with_the_same_message(tmp_path, model_path,
                                                                              sqlite_url, monkeypatch):
    """validate checks what run checks: the checkpoint's quantization on this device too."""
    from tests.test_quantize import FP8_W, _qconfig_folder
    from tokenmill.jobs.lifecycle.runner import JobError

    monkeypatch.setenv("TOKENMILL_FORCE_CPU", "1")
    ckpt = _qconfig_folder(tmp_path, model_path, FP8_W)
    inp = prompts(tmp_path)
    res = cli("validate", "--input", str(inp), "--output", str(tmp_path / "o"), "--model", str(ckpt))
    line = assert_one_line_error(res, 1, "FP8 weights, which need a CUDA GPU")
    with pytest.raises(JobError) as err:
        run_job(job_spec(inp, tmp_path / "o", engine={"model": str(ckpt)}), db_url=sqlite_url)
    assert line == f"error: {err.value}"


# ---------------------------------------------------------------- help


def _commands(cmd, path):
    yield path, cmd
    if isinstance(cmd, click.Group):
        for name, sub in cmd.commands.items():
            yield from _commands(sub, [*path, name])


def test_every_command_has_help_with_an_example_under_h_and_help():
    names = []
    for path, _ in _commands(main, []):
        for flag in ("-h", "--help"):
            res = cli(*path, flag)
            assert res.exit_code == 0, (path, res.output)
            assert "Example" in res.output, f"`tokenmill {' '.join(path)} {flag}` shows no example"
        names.append(" ".join(path))
    assert {"run", "submit", "run-pending", "validate", "status", "jobs", "cancel"} <= set(names)


# ---------------------------------------------------------------- run: --json, --quiet, progress


def test_run_json_and_quiet_outputs(tmp_path, sqlite_url, monkeypatch):
    import tokenmill.jobs.lifecycle.runner as runner_mod

    real = runner_mod.run_job
    monkeypatch.setattr(runner_mod, "run_job",
                        lambda spec, session_factory=None, **kw: real(spec, **kw, session_factory=FakeSession))
    inp = prompts(tmp_path, 3)
    res = cli("run", "--input", str(inp), "--output", str(tmp_path / "o"), "--job-id", "j1",
              "--db", sqlite_url, "--json")
    assert res.exit_code == 0, res.output
    out = json.loads(res.output)  # nothing but the JSON document on stdout
    assert (out["job_id"], out["status"], out["rows_in"], out["succeeded"]) == ("j1", "succeeded", 3, 3)
    res = cli("run", "--input", str(inp), "--output", str(tmp_path / "o2"), "--job-id", "j2",
              "--db", sqlite_url, "--quiet")
    assert res.exit_code == 0 and res.output == ""


def test_progress_bar_shows_rows_tok_s_and_eta(monkeypatch):
    import io
    import sys

    from tokenmill.jobs.cli import Progress

    buf = io.StringIO()
    monkeypatch.setattr(sys, "stderr", buf)
    p = Progress(enabled=True)
    p(0, 10, 0)
    assert p.bar is None and buf.getvalue() == ""  # the engine loads: no bar, no rate yet
    p(4, 10, 120)
    time.sleep(0.05)
    p(6, 10, 180)
    p.close()
    text = buf.getvalue()
    assert "6/10" in text and "out tok/s" in text
    assert "row/s" in text.split("6/10", 1)[1] and " left" in text  # the rate and the time left
    # a resumed job: the rows earlier runs answered are where the bar starts, not part of its rate
    buf.truncate(0)
    r = Progress(enabled=True)
    r(7, 10, 0)
    r(8, 10, 30)
    assert r.bar is not None and r.bar.initial == 7 and r.bar.n == 8
    r.close()
    silent = Progress(enabled=False)
    silent(4, 10, 120)
    assert silent.bar is None


def test_module_commands_work_through_python_m_and_the_reexec(tmp_path):
    """`tokenmill run-pending` re-executes itself as `python -m tokenmill.jobs.cli`; the
    commands that live in jobs/cli/*.py must be known there too."""
    import subprocess
    import sys

    db = f"sqlite:///{tmp_path / 'q.db'}"
    proc = subprocess.run([sys.executable, "-m", "tokenmill.jobs.cli", "run-pending", "--db", db],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "no pending jobs" in proc.stdout
