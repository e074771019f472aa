"""Bad input, one case per row of the reliability issue, each with its exact outcome.

Per-row problems become dead letters with a reason code and message while the
rest of the job is answered; whole-input problems stop the job with one line
before any engine work.  The fake engine serves these (its hang and crash are
triggered by a per-row `max_tokens` marker); the real engine's poison-row path
has its own test at the end.
"""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.conftest import TEST_ENGINE, write_parquet
from tests.fakes import FakeSession, PoisonedVllm
from tests.helpers import cli, job_spec, one_error_line, stale_output_job
from tokenmill.jobs.lifecycle.runner import JobError, run_job
from tokenmill.schemas import records as R
from tokenmill.schemas import storage as S

HANG_MAX_TOKENS = 777  # the fake engine never finishes such a request
CRASH_MAX_TOKENS = 666  # the fake engine dies on such a request


class MisbehavingSession(FakeSession):
    """FakeSession whose engine hangs or dies on marked requests."""

    def add(self, request_id, token_ids, sampling):
        super().add(request_id, token_ids, sampling)
        if sampling["max_tokens"] == HANG_MAX_TOKENS:
            self.reqs[request_id]["left"] = float("inf")
        if sampling["max_tokens"] == CRASH_MAX_TOKENS:
            self.reqs[request_id]["ids"].append(-1)

    def __init__(self, cfg=None, model_path="", **kw):
        super().__init__(cfg, model_path, poison_token=-1, **kw)


def msgs(*pairs):
    return json.dumps([{"role": r, "content": c} for r, c in pairs])


# (case, row fields, expected reason, exact start of the message). Each row gets its own id.
PER_ROW = [
    ("null prompt", {"prompt": None}, R.EMPTY_PROMPT, "prompt is null"),
    ("empty prompt", {"prompt": "   "}, R.EMPTY_PROMPT, "prompt is empty"),
    ("messages bad JSON", {"messages": '[{"role": "user", "content": '}, R.BAD_MESSAGES, "messages is not valid JSON"),
    ("messages unknown role", {"messages": msgs(("wizard", "hi"))}, R.BAD_MESSAGES,
     "messages[0].role must be one of ['system', 'user', 'assistant', 'tool', 'developer'], got 'wizard'"),
    ("messages missing content", {"messages": json.dumps([{"role": "user"}])}, R.BAD_MESSAGES, "messages[0] has no content"),
    ("messages not a list", {"messages": json.dumps({"role": "user", "content": "hi"})}, R.BAD_MESSAGES,
     "messages must be a non-empty list of {role, content}"),
    ("prompt over the length limit", {"prompt": "word " * 2000}, R.PROMPT_TOO_LONG, "prompt has "),
    ("negative temperature", {"prompt": "hi", "temperature": -0.5}, R.BAD_SAMPLING, "temperature must be >= 0, got -0.5"),
    ("max_tokens zero", {"prompt": "hi", "max_tokens": 0.0}, R.BAD_SAMPLING, "max_tokens must be an integer > 0, got 0.0"),
    ("max_tokens negative", {"prompt": "hi", "max_tokens": -3.0}, R.BAD_SAMPLING, "max_tokens must be an integer > 0, got -3.0"),
    ("top_p zero", {"prompt": "hi", "top_p": 0.0}, R.BAD_SAMPLING, "top_p must be in (0, 1], got 0.0"),
    ("top_p above one", {"prompt": "hi", "top_p": 1.5}, R.BAD_SAMPLING, "top_p must be in (0, 1], got 1.5"),
    ("engine hangs on the row", {"prompt": "hang here", "max_tokens": float(HANG_MAX_TOKENS)}, R.ENGINE_TIMEOUT,
     "engine hung on this row: batch still unfinished after"),
    ("engine dies on the row", {"prompt": "crash here", "max_tokens": float(CRASH_MAX_TOKENS)}, R.ENGINE_ERROR,
     "engine failed on this row: EngineCore died"),
]
# Cases that need a column type of their own live in files of their own.
NON_STRING = ("non-string prompt", R.BAD_PROMPT_TYPE, "prompt must be a string, got int: 42")
BAD_UTF8 = ("invalid UTF-8", R.INVALID_UTF8, "prompt is not valid UTF-8 (byte 3)")
DUPLICATE = ("duplicate id", R.DUPLICATE_ID, "duplicate id 'dup': the row at 0:")
GOOD = [f"good-{i}" for i in range(6)]


def case_id(name: str) -> str:
    return name.replace(" ", "-")


def main_rows():
    cols = ("prompt", "messages", "temperature", "max_tokens", "top_p")
    rows = [{"id": g, "prompt": f"Say the number {i}."} for i, g in enumerate(GOOD[:3])]
    rows += [{"id": case_id(name), **fields} for name, fields, _, _ in PER_ROW]
    rows += [{"id": "dup", "prompt": "first wins"}, {"id": "dup", "prompt": "second is a dead letter"}]
    rows += [{"id": g, "prompt": f"Say the number {i}."} for i, g in enumerate(GOOD[3:], 3)]
    return [{"id": r["id"], **{c: r.get(c) for c in cols}} for r in rows]


@pytest.fixture(scope="module")
def bad_job(tmp_path_factory):
    d = tmp_path_factory.mktemp("bad")
    inp = d / "in"
    inp.mkdir()
    write_parquet(inp / "a.parquet", main_rows())
    write_parquet(inp / "b.parquet", [{"id": case_id(NON_STRING[0]), "prompt": 42}])
    # a writer that put raw bytes into a string column: Parquet does not check UTF-8
    raw = pa.array([b"ok \xff\xfe bytes"], type=pa.binary()).view(pa.string())
    pq.write_table(pa.table({"id": [case_id(BAD_UTF8[0])], "prompt": raw}), inp / "c.parquet")
    db = f"sqlite:///{d / 'db.sqlite'}"
    spec = job_spec(inp, d / "out", job_id="bad-input", engine={"max_model_len": 1024}, sampling={"max_tokens": 4},
                    batching={"batch_timeout_s": 0.5})
    res = run_job(spec, db_url=db, session_factory=MisbehavingSession)
    out = {r["id"]: r for r in pq.read_table(d / "out" / "outputs.parquet").to_pylist()}
    dead = pq.read_table(d / "out" / "dead_letters.parquet").to_pylist()
    return res, out, dead, db


EXPECTED = [(name, reason, msg) for name, _, reason, msg in PER_ROW] + [NON_STRING, BAD_UTF8]


@pytest.mark.parametrize("name,reason,message", EXPECTED, ids=[e[0] for e in EXPECTED])
def test_bad_row_is_one_dead_letter_with_reason(bad_job, name, reason, message):
    _, out, dead, _ = bad_job
    mine = [d for d in dead if d["id"] == case_id(name)]
    assert len(mine) == 1, mine
    assert mine[0]["reason"] == reason
    assert mine[0]["message"].startswith(message), mine[0]["message"]
    assert case_id(name) not in out


def test_duplicate_id_first_wins_rest_dead_letter(bad_job):
    _, out, dead, _ = bad_job
    assert out["dup"]["input_ref"] == f"0:{3 + len(PER_ROW)}"
    mine = [d for d in dead if d["id"] == "dup"]
    assert len(mine) == 1 and mine[0]["reason"] == DUPLICATE[1]
    assert mine[0]["message"].startswith(DUPLICATE[2]) and mine[0]["input_ref"] == f"0:{4 + len(PER_ROW)}"


def test_bad_rows_do_not_fail_the_job_and_every_row_is_accounted_for(bad_job):
    res, out, dead, db = bad_job
    total = 3 + len(PER_ROW) + 2 + 3 + 2
    assert res.status == "partial"
    assert (res.total, res.succeeded, res.failed) == (total, len(GOOD) + 1, len(EXPECTED) + 1)
    assert sorted(out) == sorted(GOOD + ["dup"])  # the rows around the hang and the crash were answered
    refs = [r["input_ref"] for r in out.values()] + [d["input_ref"] for d in dead]
    assert len(refs) == len(set(refs)) == total
    job = S.JobStore(S.connect(db)).get("bad-input")
    assert (job["status"], job["total"], job["succeeded"], job["failed"]) == ("partial", total, len(out), len(dead))


# ---------------------------------------------------------------- whole-input problems


def _not_parquet(d):
    p = d / "in.parquet"
    p.write_text("id,prompt\n1,hello\n")
    return p


def _truncated(d):
    full = write_parquet(d / "full.parquet", [{"id": str(i), "prompt": f"p{i}"} for i in range(100)])
    p = d / "in.parquet"
    p.write_bytes(full.read_bytes()[: full.stat().st_size // 2])
    full.unlink()
    return p


def _empty_folder(d):
    p = d / "in"
    p.mkdir()
    return p


WHOLE_INPUT = [
    ("missing path", lambda d: d / "nope.parquet", "input '{p}' does not exist"),
    ("empty folder", _empty_folder, "input '{p}' matched no *.parquet files"),
    ("glob matching nothing", lambda d: d / "*.parquet", "input '{p}' matched no *.parquet files"),
    ("not a Parquet file", _not_parquet, "input file '{p}' is not a readable Parquet file: "),
    ("truncated Parquet file", _truncated, "input file '{p}' is not a readable Parquet file: "),
    ("no prompt column", lambda d: write_parquet(d / "in.parquet", [{"question": "hi", "idx": 1}]),
     "input file '{p}' has no 'prompt' or 'messages' column; columns found: question, idx"),
]


@pytest.mark.parametrize("name,make,message", WHOLE_INPUT, ids=[w[0] for w in WHOLE_INPUT])
def test_whole_input_problem_stops_before_engine_work(tmp_path, sqlite_url, name, make, message):
    p = make(tmp_path)
    FakeSession.instances.clear()
    spec = job_spec(p, tmp_path / "out", job_id="whole")
    with pytest.raises(JobError) as err:
        run_job(spec, db_url=sqlite_url, session_factory=FakeSession)
    text = str(err.value)
    assert text.startswith(message.format(p=p)), text
    assert "\n" not in text
    assert FakeSession.instances == []  # no engine was started
    assert S.JobStore(S.connect(sqlite_url)).get("whole") is None  # nor was the job claimed
    assert not (tmp_path / "out").exists()


def test_whole_input_problem_is_one_cli_line(tmp_path, sqlite_url):
    p = _truncated(tmp_path)
    res = cli("run", "--input", str(p), "--output", str(tmp_path / "o"), "--db", sqlite_url)
    assert res.exit_code == 1
    line = one_error_line(res, alone=True)
    assert line.startswith(f"error: input file '{p}' is not a readable Parquet file"), res.output


def test_empty_dataset_succeeds_with_zero_rows_and_says_so(tmp_path, sqlite_url):
    p = tmp_path / "in.parquet"
    pq.write_table(pa.table({"id": pa.array([], pa.string()), "prompt": pa.array([], pa.string())}), p)
    res = run_job(job_spec(p, tmp_path / "out", job_id="empty"), db_url=sqlite_url, session_factory=FakeSession)
    assert (res.status, res.total, res.succeeded, res.failed) == ("succeeded", 0, 0, 0)
    assert res.note == "the input has no rows: nothing to do"
    assert pq.read_table(tmp_path / "out" / "outputs.parquet").num_rows == 0
    assert json.loads((tmp_path / "out" / "_SUCCESS.json").read_text())["outputs"] == 0


# ---------------------------------------------------------------- the real engine


@pytest.mark.engine
def test_real_engine_poison_row_is_isolated_and_the_rest_answered(tmp_path, sqlite_url, model_path):
    # The real engine, wrapped so that its step fails while the marked row is in it.
    rows = [{"id": f"r{i}", "prompt": f"Count to {i}."} for i in range(7)]
    rows.insert(3, {"id": "x-POISON-x", "prompt": f"This row breaks the engine: {PoisonedVllm.MARKER}."})
    inp = write_parquet(tmp_path / "in.parquet", rows)
    spec = job_spec(inp, tmp_path / "out", job_id="poison", engine=TEST_ENGINE, sampling={"max_tokens": 4},
                    batching={"ordering": "none"})
    res = run_job(spec, db_url=sqlite_url, session_factory=PoisonedVllm)
    assert (res.status, res.total, res.succeeded, res.failed) == ("partial", 8, 7, 1)
    dead = pq.read_table(tmp_path / "out" / "dead_letters.parquet").to_pylist()
    assert [(d["id"], d["reason"]) for d in dead] == [("x-POISON-x", R.ENGINE_ERROR)]
    out = pq.read_table(tmp_path / "out" / "outputs.parquet").to_pylist()
    assert sorted(r["id"] for r in out) == sorted(f"r{i}" for i in range(7))
    assert all(r["output_tokens"] > 0 and r["text"] for r in out)


@pytest.mark.engine
@pytest.mark.parametrize("sig", ["SIGSTOP", "SIGKILL"])
def test_real_engine_core_that_freezes_or_dies_mid_batch_is_restarted_and_the_batch_answered(
        tmp_path, sqlite_url, model_path, sig, caplog):
    # SIGSTOP on vLLM's engine core: the step in progress never returns (no deadline check
    # between steps can see it); the watchdog kills the engine after batch_timeout_s.
    # SIGKILL (the OOM killer, a segfault): vLLM's own client would wait for ever; the
    # death watch fails the step at once.  Either way a fresh engine starts and the
    # batch is answered there: nothing is lost or doubled.
    import signal
    import threading
    import time

    from tokenmill.transforms.engines import registry as E

    signum = getattr(signal, sig)

    rows = [{"id": f"f{i}", "prompt": f"Name a colour, number {i}."} for i in range(24)]
    inp = write_parquet(tmp_path / "in.parquet", rows)
    spec = job_spec(inp, tmp_path / "out", job_id="frozen", engine=TEST_ENGINE,
                    sampling={"max_tokens": 32, "ignore_eos": True},
                    batching={"ordering": "none", "batch_timeout_s": 20 if sig == "SIGSTOP" else 600})
    frozen: list[int] = []

    def freeze_when_busy():
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline and not frozen:
            for sess in E.sessions():
                if getattr(sess, "_procs", None) and sess.num_unfinished() > 0:
                    for proc in sess._procs:
                        proc.send_signal(signum)
                        frozen.append(proc.pid)
                    break
            time.sleep(0.01)

    t = threading.Thread(target=freeze_when_busy, daemon=True)
    t.start()
    caplog.set_level("WARNING", logger="tokenmill")
    res = run_job(spec, db_url=sqlite_url)
    t.join(timeout=5)
    assert frozen, "the engine was never seen busy"
    said = caplog.text
    if sig == "SIGSTOP":  # the watchdog ended the step
        assert "engine step blocked past batch_timeout_s; killing the engine" in said
    else:  # the death watch failed the step (not the 600 s batch deadline)
        assert "exited; failing the step in progress" in said and "blocked past" not in said
    assert (res.status, res.total, res.succeeded, res.failed) == ("succeeded", 24, 24, 0)
    out = pq.read_table(tmp_path / "out" / "outputs.parquet").to_pylist()
    assert sorted(r["id"] for r in out) == sorted(r["id"] for r in rows)
    assert all(r["output_tokens"] == 32 for r in out)
    [live] = E.sessions()
    assert not set(frozen) & {p.pid for p in live._procs}  # a new engine answered the batch


def test_row_count_mismatch_fails_the_job_loudly(tmp_path, sqlite_url):
    # The same job id reused on a different input: a stale output makes the counts disagree.
    eng = S.connect(sqlite_url)
    stale_output_job(eng, "reused")
    inp = write_parquet(tmp_path / "in.parquet", [{"id": "a", "prompt": "hi"}, {"id": "b", "prompt": "yo"}])
    res = run_job(job_spec(inp, tmp_path / "out", job_id="reused", sampling={"max_tokens": 2}),
                  db_url=sqlite_url, session_factory=FakeSession)
    assert res.status == "failed"
    msg = ("row count mismatch: 2 input rows but 3 outputs + 0 dead letters = 3; "
           "0:9 (output) is not an input row")
    assert res.note == msg
    job = S.JobStore(eng).get("reused")
    assert (job["status"], job["error"]) == ("failed", msg)
    st = cli("status", "reused", "--json", "--db", sqlite_url)
    assert json.loads(st.output)["reconciled"] is False
