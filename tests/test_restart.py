"""A real `tokenmill run` killed with kill -9 (its whole process tree, engine core
included) mid-run resumes with `--job-id`: answered rows are skipped, the rest
are answered (the engine is sent each unanswered row once and no answered one),
every id ends up exactly once, and each row that asked for n samples has each sample
exactly once.  Real engine, real subprocesses."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psutil
import pyarrow.parquet as pq
import pytest

from tests.conftest import TEST_ENGINE, write_parquet
from tokenmill.schemas import storage as S

pytestmark = pytest.mark.engine
ROWS = 600
JOB = "killed-job"
#: Every SAMPLED-th row asks for N samples (sampled, seeded): n output rows each.
SAMPLED, N = 10, 3


def cli(inp, out, db):
    return [
        sys.executable, "-m", "tokenmill.jobs.cli", "run", "--input", str(inp), "--output", str(out), "--db", db,
        "--job-id", JOB, "--max-tokens", "8", "--max-num-seqs", str(TEST_ENGINE["max_num_seqs"]),
        "--max-model-len", str(TEST_ENGINE["max_model_len"]),
        "--gpu-memory-utilization", str(TEST_ENGINE["gpu_memory_utilization"]), "--token-budget", "256",
    ]


def test_kill_9_of_the_process_tree_mid_run_then_resume(tmp_path, sqlite_url, model_path):
    inp = write_parquet(tmp_path / "in.parquet", [
        {"id": f"q{i:04d}", "prompt": f"Write one word about the number {i}.",
         **({"n": N, "temperature": 0.9, "seed": i} if i % SAMPLED == 0 else {"n": None, "temperature": None, "seed": None})}
        for i in range(ROWS)])
    out = tmp_path / "out"
    proc = subprocess.Popen(cli(inp, out, sqlite_url), start_new_session=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    eng = S.connect(sqlite_url)
    deadline = time.monotonic() + 900  # a bound against a hung test, not a speed assertion
    done = 0
    while time.monotonic() < deadline and proc.poll() is None:
        if S.JobStore(eng).get(JOB) is not None:
            done = S.MetricsReader(eng).counts(JOB)["succeeded"]
            if done >= 40:
                break
        time.sleep(0.2)
    assert proc.poll() is None, f"the run ended before the kill: {proc.communicate()[1][-2000:]}"

    # Freeze the first run (its whole tree) so it cannot finish while the second one
    # starts: its heartbeat stays younger than STALE_AFTER_S for the second run's
    # claim, which comes ~3 s after start.  (Unfrozen, the first run could finish its
    # remaining rows before the second run's claim on a slow machine.)
    launcher = psutil.Process(proc.pid)
    tree = [launcher] + launcher.children(recursive=True)
    assert len(tree) >= 2  # the launcher and vLLM's engine core process at least
    _signal_tree(proc.pid, tree, signal.SIGSTOP)
    frozen_at = time.monotonic()

    # A second run of the same job id while the first is live refuses (overlapping cron).
    second = subprocess.run(cli(inp, tmp_path / "out2", sqlite_url), capture_output=True, text=True, timeout=300)
    assert second.returncode == 5, second.stderr[-2000:]
    assert second.stderr.strip().splitlines()[-1].startswith(f"error: job '{JOB}' is already running")
    assert time.monotonic() - frozen_at < S.STALE_AFTER_S  # else the refusal above proved nothing

    _signal_tree(proc.pid, tree, signal.SIGKILL)
    proc.communicate(timeout=60)
    _, alive = psutil.wait_procs(tree, timeout=60)
    assert all(_is_zombie(p) for p in alive), alive

    before = S.MetricsReader(eng).counts(JOB)["succeeded"]
    assert 40 <= before < ROWS
    assert S.JobStore(eng).get(JOB)["status"] == "running"  # nobody finished it
    assert not (out / "_SUCCESS.json").exists() and not (out / "outputs.parquet").exists()
    first_run = {r["id"]: r["batch_id"] for r in S.MetricsReader(eng).request_rows(JOB, ("id", "batch_id"))}

    rerun = subprocess.run(cli(inp, out, sqlite_url), capture_output=True, text=True, timeout=900)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert f"job {JOB}: succeeded (resumed)" in rerun.stdout
    assert f"rows in {ROWS} / succeeded {ROWS} / failed 0" in rerun.stdout

    rows = pq.read_table(out / "outputs.parquet").to_pylist()
    samples: dict[str, list[int]] = {}
    for r in rows:
        samples.setdefault(r["id"], []).append(r["sample"])
    assert set(samples) == {f"q{i:04d}" for i in range(ROWS)}
    # each row once, and a row that asked for N samples each of them once
    assert all(s == (list(range(N)) if int(i[1:]) % SAMPLED == 0 else [0]) for i, s in samples.items()), samples
    texts = {}
    for r in rows:
        texts.setdefault(r["id"], set()).add(r["text"])
    assert any(len(texts[f"q{i:04d}"]) > 1 for i in range(0, ROWS, SAMPLED))  # seeds i, i+1, i+2: not one answer
    # The outputs table cannot show a row answered twice (its primary key keeps the first
    # answer), so count what each run sent to the engine: every finished batch's `requests`
    # (len of the prompts it fed the engine), keyed by batch id, which names its run.
    final = {r["id"]: r["batch_id"] for r in S.MetricsReader(eng).request_rows(JOB, ("id", "batch_id"))}
    assert all(final[i] == b for i, b in first_run.items())
    _check_the_resume_sent_only_the_unanswered_rows(eng, before)
    assert all(r["output_tokens"] > 0 for r in rows)
    job = S.JobStore(eng).get(JOB)
    assert (job["status"], job["total"], job["succeeded"], job["failed"]) == ("succeeded", ROWS, ROWS, 0)
    assert job["metrics"]["requests"]["samples"] == len(rows) == ROWS + (N - 1) * (ROWS // SAMPLED)
    _check_accounting_of_the_two_runs(eng, job["metrics"])


def _check_the_resume_sent_only_the_unanswered_rows(eng, before: int) -> None:
    """The requests the engine received in each run, from the batches table (one row per
    finished batch, its primary key the batch id, which starts with its run's id, so a
    regenerated row is counted again, unlike in the outputs table).  A batch in flight at the
    kill committed nothing: its rows are not among the `before` answered ones and the resume
    may send them again; a row answered before the kill must not be."""
    from tokenmill.jobs.metrics.accounting import run_of

    first, second = (r["run_id"] for r in S.JobStore(eng).runs(JOB))
    sent: dict[str, int] = {}
    for b in S.MetricsReader(eng).batches(JOB):
        sent[run_of(b["batch_id"])] = sent.get(run_of(b["batch_id"]), 0) + b["requests"]
    assert set(sent) == {first, second}, sent
    assert sent[first] == before  # the killed run's finished batches hold exactly what it answered
    # the resume sent the engine each unanswered row once and no answered one
    assert sent[second] == ROWS - before, (sent, before)
    assert sum(sent.values()) == ROWS


def _check_accounting_of_the_two_runs(eng, m):
    """Throughput and cost count each run's active generation window, not the downtime
    between the kill and the resume (the frozen run, the refused run, the second start)."""
    from tokenmill.jobs.metrics.accounting import run_of

    runs = S.JobStore(eng).runs(JOB)
    assert len(runs) == 2 and runs[0]["finished_at"] is None and runs[1]["finished_at"] is not None
    by_run: dict[str, list] = {}
    for b in S.MetricsReader(eng).batches(JOB):
        by_run.setdefault(run_of(b["batch_id"]), []).append(b)
    assert set(by_run) == {r["run_id"] for r in runs}
    windows = {rid: max(b["finished_at"] for b in bs) - min(b["started_at"] for b in bs) for rid, bs in by_run.items()}
    active = sum(windows.values())
    span = max(b["finished_at"] for bs in by_run.values() for b in bs) - min(
        b["started_at"] for bs in by_run.values() for b in bs)
    assert span > 1.1 * active  # the downtime is large enough that counting it would fail the checks below
    th = m["throughput"]
    assert th["runs"] == 2
    assert th["generation_wall_s"] == pytest.approx(active, rel=0.05)
    assert th["output_tok_per_s"] == pytest.approx(m["tokens"]["output"] / active, rel=0.05)
    per_run = {r["run_id"]: r for r in m["runs"]}
    for rid, w in windows.items():
        assert per_run[rid]["generation_wall_s"] == pytest.approx(w, rel=0.05)
        assert per_run[rid]["model_load_s"] > 0 and per_run[rid]["output_tokens"] > 0
    # one CPU worker a run: cost = Σ over runs of its active window × that worker's hourly price
    rate = {w["run_id"]: w["usd_per_hour"] for w in m["cost"]["workers"]}
    assert set(rate) == set(windows)
    assert m["cost"]["total"] == pytest.approx(sum(windows[r] / 3600 * rate[r] for r in windows), rel=0.05)
    held = {r["run_id"]: (r["finished_at"] or r["seen_at"]) - r["started_at"] for r in runs}
    assert m["cost"]["held"]["total"] == pytest.approx(sum(held[r] / 3600 * rate[r] for r in held), rel=0.05)
    assert m["cost"]["held"]["total"] > m["cost"]["total"]  # start-up, load and export are in the held figure


def _signal_tree(pgid: int, tree: list[psutil.Process], sig: int) -> None:
    os.killpg(pgid, sig)
    for p in tree[1:]:  # children that left the process group too
        try:
            p.send_signal(sig)
        except psutil.NoSuchProcess:
            pass


def _is_zombie(p: psutil.Process) -> bool:
    try:
        return p.status() == psutil.STATUS_ZOMBIE  # dead, waiting for its parent (gone) to be reaped
    except psutil.NoSuchProcess:
        return True


def test_kill_9_of_one_sdk_worker_fails_the_pipeline_over_to_a_retry(tmp_path, sqlite_url):
    """Two SDK workers (multi-process DirectRunner); one is killed with kill -9 mid-run.
    Beam alone waits for ever on the dead worker's bundle; tokenmill fails the pipeline
    and runs it again, resuming: the one `tokenmill run` ends with every id once, and the
    dead worker's engine core does not outlive it."""
    job = "sdk-worker-killed"
    inp = write_parquet(tmp_path / "in.parquet",
                        [{"id": f"w{i:04d}", "prompt": f"Name a colour for the number {i}."} for i in range(ROWS)])
    out = tmp_path / "out"
    argv = [a if a != JOB else job for a in cli(inp, out, sqlite_url)] + ["--workers", "2"]
    # Output to files, not pipes: a process that outlived the run would hold a pipe open.
    with open(tmp_path / "stdout", "w") as so, open(tmp_path / "stderr", "w") as se:
        proc = subprocess.Popen(argv, start_new_session=True, stdout=so, stderr=se)
    eng = S.connect(sqlite_url)
    deadline = time.monotonic() + 900  # a bound against a hung test, not a speed assertion
    try:
        while time.monotonic() < deadline and proc.poll() is None:
            if S.JobStore(eng).get(job) is not None and S.MetricsReader(eng).counts(job)["succeeded"] >= 40:
                break
            time.sleep(0.2)
        assert proc.poll() is None, f"the run ended before the kill: {(tmp_path / 'stderr').read_text()[-2000:]}"
        workers = [p for p in psutil.Process(proc.pid).children(recursive=True)
                   if "sdk_worker_main" in " ".join(p.cmdline()) and p.name().startswith("python")]
        assert len(workers) == 2, workers
        victim = workers[0]
        its_engine = victim.children(recursive=True)
        victim.kill()
        proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    stderr = (tmp_path / "stderr").read_text()
    assert proc.returncode == 0, stderr[-3000:]
    assert "died" in stderr and "running the pipeline again" in stderr, stderr[-3000:]
    rows = pq.read_table(out / "outputs.parquet").to_pylist()
    ids = [r["id"] for r in rows]
    assert len(ids) == len(set(ids)) == ROWS and set(ids) == {f"w{i:04d}" for i in range(ROWS)}
    j = S.JobStore(eng).get(job)
    assert (j["status"], j["succeeded"], j["failed"]) == ("succeeded", ROWS, 0)
    _, alive = psutil.wait_procs(its_engine, timeout=30)
    for p in alive:
        p.kill()
    assert not [p for p in alive if not _is_zombie(p)], f"the dead worker's engine outlived it: {alive}"
