"""The `openai` engine against a real HTTP server on loopback (tests/openai_server.py),
which injects the faults: each row ends answered or dead-lettered with its reason,
retries as configured, the preflight refusals, and the API key kept out of everything."""

from __future__ import annotations

import json
import logging
from collections import Counter

import pyarrow.parquet as pq
import pytest
from sqlalchemy import text

from tests.conftest import write_parquet
from tests.helpers import assert_one_line_error, cli, job_spec
from tests.openai_server import FaultServer, answer_for
from tokenmill.jobs.lifecycle.runner import JobError, run_job
from tokenmill.schemas import records as R
from tokenmill.schemas import storage as S
from tokenmill.schemas.config import load_spec
from tokenmill.schemas.records import Batch, TokenizedPrompt
from tokenmill.transforms.batch_runner import BatchRunner, GenerateConfig
from tokenmill.transforms.engines import openai_session as O
from tokenmill.transforms.engines import requests
from tokenmill.transforms.engines.protocol import EngineStartError

KEY = "sk-test-7f3a9c1e5b2d4860a1b2c3d4e5f60718"
KEY_VAR = "TOKENMILL_TEST_OPENAI_KEY"


@pytest.fixture(autouse=True)
def _fast_backoff(monkeypatch):
    monkeypatch.setattr(O, "BACKOFF_BASE_S", 0.01)


@pytest.fixture
def server(monkeypatch):
    monkeypatch.setenv(KEY_VAR, KEY)
    with FaultServer(api_key=KEY, hang_s=5.0) as s:
        yield s


def engine_cfg(server: FaultServer, **kw) -> O.OpenAIConfig:
    keys = dict(kind="openai", base_url=server.base_url, model="test-model", api_key_env=KEY_VAR,
                max_in_flight=4, request_timeout_s=2.0, max_retries=2)
    return O.OpenAIConfig(**{**keys, **kw})


def prompt(i: int, source) -> TokenizedPrompt:
    return TokenizedPrompt(id=f"r{i}", input_file=0, input_row=i, token_ids=[1, 2, 3], prefix_key="k",
                           max_tokens=8, source=source)


def run_rows(cfg: O.OpenAIConfig, sources: list) -> tuple[dict, dict]:
    """Every source through BatchRunner and one OpenAISession: (answered rows, dead letters) by id."""
    from tokenmill.schemas.config import BatchingConfig, SamplingDefaults

    session = O.OpenAISession(cfg)
    gcfg = GenerateConfig(job_id="j", run_id="r", model_name=cfg.model, model_path="", engine=cfg,
                          sampling=SamplingDefaults(), batching=BatchingConfig(batch_timeout_s=60))
    runner = BatchRunner(gcfg, lambda: session, lambda: session)
    prompts = [prompt(i, s) for i, s in enumerate(sources)]
    rows, dead, stats = {}, {}, []
    try:
        for r, d, st in runner.run([Batch("b0", prompts[:len(prompts) // 2]), Batch("b1", prompts[len(prompts) // 2:])]):
            rows.update((x["id"], x) for x in r)
            dead.update((x.id, x) for x in d)
            stats.append(st)
    finally:
        session.shutdown()
    run_rows.session, run_rows.stats = session, stats
    return rows, dead


def test_chat_and_raw_prompts_are_streamed_and_measured_at_the_client(server):
    chat = [{"role": "user", "content": "What is two plus two?"}]
    rows, dead = run_rows(engine_cfg(server), [chat, "Once upon a time"])
    assert not dead
    assert rows["r0"]["text"] == "".join(answer_for("What is two plus two?"))
    assert rows["r1"]["text"] == "".join(answer_for("Once upon a time"))
    # the server's usage (its prompt_tokens: words), not tokenmill's count (3 token ids here)
    assert (rows["r0"]["prompt_tokens"], rows["r1"]["prompt_tokens"]) == (5, 4)
    for r in rows.values():
        assert r["output_tokens"] == 4
        assert 0 < r["ttft_s"] <= r["e2e_s"] and r["tpot_s"] is not None
        assert r["queue_s"] is None and r["cached_tokens"] is None  # not measurable over HTTP: null, not 0
        assert r["finish_reason"] == "length"
    assert set(server.auth) == {f"Bearer {KEY}"}


def test_without_usage_in_the_stream_each_row_says_its_counts_are_the_local_tokenizers_and_the_chunks(server):
    chat = [{"role": "user", "content": "What is two plus two?"}]
    rows, dead = run_rows(engine_cfg(server), [chat, "[[nousage]] Once upon a time",
                                               [{"role": "user", "content": "[[nousage]] Hello there"}]])
    assert not dead
    # the server's usage: its prompt_tokens (words) and completion_tokens
    assert (rows["r0"]["prompt_tokens"], rows["r0"]["output_tokens"]) == (5, 4)
    assert rows["r0"]["token_count_source"] == R.TOKENS_BY_ENGINE == "engine"
    for rid in ("r1", "r2"):  # no usage: Tokenize's 3 token ids and the 4 streamed text chunks
        assert (rows[rid]["prompt_tokens"], rows[rid]["output_tokens"]) == (3, 4)
        assert rows[rid]["token_count_source"] == R.TOKENS_BY_LOCAL_TOKENIZER_AND_STREAM_CHUNKS \
            == "local_tokenizer+stream_chunks"


def test_request_body_maps_the_sampling_keys():
    s = {"max_tokens": 7, "temperature": 0.5, "top_p": 0.9, "seed": None, "stop": ["\n"], "min_tokens": None,
         "ignore_eos": False}
    chat = requests.request_body("m", [{"role": "user", "content": "hi"}], s)
    assert chat == {"model": "m", "stream": True, "stream_options": {"include_usage": True}, "max_tokens": 7,
                    "messages": [{"role": "user", "content": "hi"}], "temperature": 0.5, "top_p": 0.9, "stop": ["\n"]}
    raw = requests.request_body("m", "hi", {**s, "seed": 3, "min_tokens": 2, "ignore_eos": True})
    assert raw["prompt"] == "hi" and "messages" not in raw
    assert (raw["seed"], raw["min_tokens"], raw["ignore_eos"]) == (3, 2, True)


FAULTS = [
    # prompt, (answered?, reason), attempts the server saw (max_retries=2: at most 3)
    ("fine", None, 1),
    ("[[429*2]] busy, then fine", None, 3),
    ("[[500*1]] one 5xx, then fine", None, 2),
    ("[[drop*1]] dropped once", None, 2),
    ("[[badjson*2]] broken twice", None, 3),
    ("[[429]] always busy", R.RATE_LIMITED, 3),
    ("[[500]] always failing", R.SERVER_ERROR, 3),
    ("[[hang]] never answers", R.REQUEST_TIMEOUT, 3),
    ("[[drop]] always dropped", R.CONNECTION_DROPPED, 3),
    ("[[badjson]] always broken", R.BAD_RESPONSE, 3),
    ("[[trunc]] always truncated", R.BAD_RESPONSE, 3),
]


def test_each_fault_is_retried_then_answered_or_dead_lettered_with_its_reason(server):
    sources = [p if i % 2 else [{"role": "user", "content": p}] for i, (p, _, _) in enumerate(FAULTS)]
    rows, dead = run_rows(engine_cfg(server, request_timeout_s=0.5), sources)
    assert len(rows) + len(dead) == len(FAULTS) and not set(rows) & set(dead)
    for i, (p, reason, attempts) in enumerate(FAULTS):
        rid = f"r{i}"
        assert server.attempts[p] == attempts, p
        if reason is None:
            assert rid in rows and rows[rid]["text"] == "".join(answer_for(p)), p
        else:
            assert dead[rid].reason == reason, (p, dead[rid].message)
            assert "after 3 attempts" in dead[rid].message
    retried = run_rows.session.retries
    assert retried[R.RATE_LIMITED] == 2 + 2 and retried[R.SERVER_ERROR] == 1 + 2
    assert retried[R.REQUEST_TIMEOUT] == 2 and retried[R.CONNECTION_DROPPED] == 1 + 2
    assert retried[R.BAD_RESPONSE] == 2 + 2 + 2
    # what is stored: each batch's retries by reason, summing to the session's count
    stored = Counter()
    for st in run_rows.stats:
        stored.update(st["retries"])
    assert stored == retried and all(st["retries"] is not None for st in run_rows.stats)


def test_no_retries_when_max_retries_is_zero_and_4xx_is_not_retried(server):
    rows, dead = run_rows(engine_cfg(server, max_retries=0), ["[[500*1]] once", "fine"])
    assert dead["r0"].reason == R.SERVER_ERROR and server.attempts["[[500*1]] once"] == 1
    assert "r1" in rows
    # a model the server does not serve (here: a 404 answer) is the request's fault: no retry
    session = O.OpenAISession(engine_cfg(server))
    session.cfg = engine_cfg(server, model="other")
    try:
        session.add("x", [1], {"max_tokens": 4}, source="refused")
        got = []
        while not got:
            got = session.step()
        assert got[0].error_reason == R.BAD_REQUEST and server.attempts["refused"] == 0
    finally:
        session.shutdown()


def test_requests_in_flight_stay_within_max_in_flight(server):
    rows, dead = run_rows(engine_cfg(server, max_in_flight=3), [f"[[slow]] {i}" for i in range(12)])
    assert len(rows) == 12 and not dead
    assert 2 <= server.max_in_flight <= 3


def test_a_server_that_goes_down_kills_the_session_and_a_new_one_refuses_to_start(server):
    cfg = engine_cfg(server, max_retries=1)
    session = O.OpenAISession(cfg)
    server.stop()
    try:
        session.add("a", [1], {"max_tokens": 4}, source="hello")
        with pytest.raises(RuntimeError, match="is down"):
            for _ in range(20):
                session.step()
        assert not session.alive()
    finally:
        session.shutdown()
    with pytest.raises(EngineStartError, match="cannot be reached"):
        O.OpenAISession(cfg)


# ---------------------------------------------------------------- preflight


@pytest.fixture
def one_row(tmp_path):
    return write_parquet(tmp_path / "in.parquet", [{"id": "a", "prompt": "hi"}])


def _validate(base_url: str, one_row, tmp_path, *extra, model: str = "test-model"):
    return cli("validate", "--input", str(one_row), "--output", str(tmp_path / "o"), "--engine", "openai",
               "--base-url", base_url, "--model", model, "--tokenizer", "smollm2-135m", *extra, catch_exceptions=False)


def test_preflight_accepts_a_good_server_and_refuses_each_bad_config_in_one_line(server, one_row, tmp_path, monkeypatch):
    ok = _validate(server.base_url, one_row, tmp_path, "--api-key-env", KEY_VAR)
    assert ok.exit_code == 0, ok.output
    assert f"model test-model at {server.base_url} (tokens counted by the local tokenizer " in ok.output
    # a server that is down
    with FaultServer() as other:
        down = other.base_url
    res = _validate(down, one_row, tmp_path, "--api-key-env", KEY_VAR)
    assert_one_line_error(res, 1, "cannot be reached", down)
    # a model the server does not list
    res = _validate(server.base_url, one_row, tmp_path, "--api-key-env", KEY_VAR, model="no-such-model")
    assert_one_line_error(res, 1, "does not serve model 'no-such-model'", "test-model")
    # no local tokenizer, no /tokenize on this server: counted by the stated estimate...
    def untokenized(*extra):
        return cli("validate", "--input", str(one_row), "--output", str(tmp_path / "o"), "--engine", "openai",
                   "--base-url", server.base_url, "--model", "test-model", "--api-key-env", KEY_VAR, *extra,
                   catch_exceptions=False)
    res = untokenized()
    assert res.exit_code == 0 and "tokens estimated at one per 4 bytes" in res.output, res.output
    # ...unless the job insists on a tokenizer or on the server's counts
    assert_one_line_error(untokenized("--token-count", "tokenizer"), 1, "no local tokenizer 'test-model'",
                          "engine.tokenizer")
    assert_one_line_error(untokenized("--token-count", "server"), 1, "/tokenize does not answer with token ids")
    # the key's variable is not set
    monkeypatch.delenv(KEY_VAR)
    res = _validate(server.base_url, one_row, tmp_path, "--api-key-env", KEY_VAR)
    assert_one_line_error(res, 1, f"engine.api_key_env names {KEY_VAR}, which is not set")
    # a wrong key
    monkeypatch.setenv(KEY_VAR, "sk-wrong")
    res = _validate(server.base_url, one_row, tmp_path, "--api-key-env", KEY_VAR)
    assert_one_line_error(res, 1, "refused the API key")
    assert KEY not in res.output and "sk-wrong" not in res.output


def test_run_against_a_down_server_fails_before_any_row_is_read(tmp_path, one_row, sqlite_url, monkeypatch):
    with FaultServer() as other:
        down = other.base_url
    spec = tmp_path / "job.yaml"
    spec.write_text("engine:\n  tokenizer: smollm2-135m\n")
    res = cli("run", str(spec), "--input", str(one_row), "--output", str(tmp_path / "o"), "--engine", "openai",
              "--base-url", down, "--model", "m", "--db", sqlite_url, "--job-id", "down", catch_exceptions=False)
    assert_one_line_error(res, 1, "cannot be reached")
    eng = S.connect(sqlite_url)
    assert S.JobStore(eng).get("down") is None  # refused before the job was claimed


def test_spec_keys_and_their_refusals():
    base = {"input": "a", "output": "b"}
    assert load_spec(base).engine.kind == "vllm"
    from tokenmill.schemas.config import SpecError

    with pytest.raises(SpecError, match="kind openai needs base_url"):
        load_spec({**base, "engine": {"kind": "openai"}})
    with pytest.raises(SpecError, match="engine.base_url: unknown key"):  # a key of another engine
        load_spec({**base, "engine": {"base_url": "http://x/v1"}})
    with pytest.raises(SpecError, match="engine.dtype: unknown key"):
        load_spec({**base, "engine": {"kind": "openai", "base_url": "http://x/v1", "dtype": "float32"}})
    with pytest.raises(SpecError) as err:  # a key pasted where the variable's name goes is not echoed
        load_spec({**base, "engine": {"kind": "openai", "base_url": "http://x/v1", "api_key_env": KEY}})
    assert KEY not in str(err.value) and "api_key_env" in str(err.value)
    # a row's retries must end before its batch counts as hung (batching.batch_timeout_s)
    http = {"kind": "openai", "base_url": "http://x/v1"}
    assert load_spec({**base, "engine": http}).engine.http_worst_case_s() == 4 * 300 + 3 * 30
    with pytest.raises(SpecError, match="a row may take 2490 s over its 4 attempts.*batch_timeout_s 1800"):
        load_spec({**base, "engine": {**http, "request_timeout_s": 600}})
    load_spec({**base, "engine": {**http, "request_timeout_s": 600}, "batching": {"batch_timeout_s": 3600}})
    with pytest.raises(SpecError) as err:  # a whole-spec error does not echo the spec (its db URL, ...)
        load_spec({**base, "db": "postgresql://u:hunter2@h/db", "engine": {**http, "request_timeout_s": 600}})
    assert "hunter2" not in str(err.value)
    # the vLLM engine is never handed the openai keys
    from tokenmill.transforms.engines.vllm_config import VllmConfig
    from tokenmill.transforms.engines.vllm_session import engine_kwargs

    kw = engine_kwargs(VllmConfig(dtype="float32"), "/m", on_gpu=True)
    assert not {"kind", "base_url", "api_key_env", "max_in_flight", "request_timeout_s", "max_retries"} & set(kw)


# ---------------------------------------------------------------- end to end


@pytest.mark.postgres
def test_end_to_end_every_id_once_with_reasons_and_no_key_anywhere(server, tmp_path, pg_url, caplog, capfd):
    caplog.set_level(logging.DEBUG)
    rows = []
    for i in range(24):
        p = f"row {i}: tell me something"
        if i % 6 == 1:
            p = "[[429*1]] " + p
        if i % 6 == 2:
            p = "[[500]] " + p
        if i % 6 == 3:
            p = "[[drop*2]] " + p
        if i % 6 == 4:
            p = "[[trunc]] " + p
        rows.append({"id": f"id{i}", "messages": json.dumps([{"role": "user", "content": p}])} if i % 2
                    else {"id": f"id{i}", "messages": None, "prompt": p})
    # a raw-text column and a chat column in one file: messages JSON where set, else the prompt
    inp = write_parquet(tmp_path / "in.parquet", rows)
    spec = job_spec(inp, tmp_path / "out", job_id="oai-e2e", sampling={"max_tokens": 8},
                    batching={"token_budget": 64},
                    engine={"kind": "openai", "base_url": server.base_url, "model": "test-model",
                            "tokenizer": "smollm2-135m", "api_key_env": KEY_VAR, "max_in_flight": 4,
                            "max_retries": 2, "request_timeout_s": 5})
    res = run_job(spec, db_url=pg_url)
    assert res.total == 24 and res.succeeded + res.failed == 24
    out = pq.read_table(tmp_path / "out" / "outputs.parquet").to_pylist()
    dead = pq.read_table(tmp_path / "out" / "dead_letters.parquet").to_pylist()
    ids = [r["id"] for r in out] + [d["id"] for d in dead]
    assert sorted(ids) == sorted(f"id{i}" for i in range(24))  # every id once
    assert {d["id"]: d["reason"] for d in dead} == {
        **{f"id{i}": R.SERVER_ERROR for i in range(2, 24, 6)}, **{f"id{i}": R.BAD_RESPONSE for i in range(4, 24, 6)}}
    for r in out:
        src = next(x for x in rows if x["id"] == r["id"])
        content = src["prompt"] if src.get("prompt") else json.loads(src["messages"])[0]["content"]
        assert r["text"] == "".join(answer_for(content))
        assert r["model"] == "test-model" and r["queue_s"] is None and r["ttft_s"] > 0
    for src in rows:
        content = src["prompt"] if src.get("prompt") else json.loads(src["messages"])[0]["content"]
        want = {"[[429*1]]": 2, "[[500]]": 3, "[[drop*2]]": 3, "[[trunc]]": 3}
        assert server.attempts[content] == next((n for m, n in want.items() if content.startswith(m)), 1), content
    m = S.JobStore(S.connect(pg_url)).get("oai-e2e")["metrics"]
    assert m["clocks"]["ttft_s"].startswith("client clock") and m["latency_s"]["queue"]["n"] == 0
    assert m["prefix_cache"]["hit_rate"] is None and m["tokens"]["cached"] is None  # unknown, not 0
    # retried attempts by reason, stored with the batches: 4 rows × (429 once; 500 twice more; two drops; two truncated)
    assert m["failures"]["retries_by_reason"] == {R.BAD_RESPONSE: 8, R.CONNECTION_DROPPED: 8, R.RATE_LIMITED: 4,
                                                  R.SERVER_ERROR: 8}
    rep = cli("report", "oai-e2e", "--db", pg_url, catch_exceptions=False)
    assert rep.exit_code == 0 and "client clock (worker, monotonic), HTTP engine" in rep.output, rep.output
    assert "retried attempts (HTTP engine)" in rep.output and "rate_limited 4" in rep.output, rep.output
    # the key: in no table, not in the stored spec, not in the logs, not in the worker's engine info
    eng = S.connect(pg_url)
    with eng.connect() as conn:
        names = [r[0] for r in conn.execute(text("SELECT table_name FROM information_schema.tables "
                                                  "WHERE table_schema = current_schema()"))]
        # every value in full (a Row's repr shortens long ones)
        dump = json.dumps({n: [list(r) for r in conn.execute(text(f'SELECT * FROM "{n}"'))] for n in names}, default=str)
        assert "jobs" in names and '"test-model"' in dump
        assert KEY not in dump, dump[max(0, dump.find(KEY) - 300):dump.find(KEY) + 100]
        assert KEY_VAR in dump
    assert S.JobStore(eng).get("oai-e2e")["spec"]["engine"]["api_key_env"] == KEY_VAR
    captured = capfd.readouterr()
    assert KEY not in caplog.text and KEY not in captured.out + captured.err
    assert KEY not in "".join(p.read_text(errors="replace") for p in (tmp_path / "out").rglob("*") if p.is_file()
                              and p.suffix != ".parquet")


def test_a_job_counts_its_rows_by_where_their_token_counts_came_from(server, tmp_path, sqlite_url, model_path):
    """A server that sends `usage` for some rows and none for others (every third): each row
    exported and stored says which, and the job's figures count the rows each way."""
    from tokenmill.schemas.records import PromptRecord
    from tokenmill.transforms.counting import encode, load_tokenizer

    prompts = {f"id{i}": ("[[nousage]] " if i % 3 == 0 else "") + f"row {i}: tell me something" for i in range(12)}
    inp = write_parquet(tmp_path / "in.parquet", [{"id": k, "prompt": p} for k, p in prompts.items()])
    spec = job_spec(inp, tmp_path / "out", job_id="oai-src", sampling={"max_tokens": 8},
                    batching={"token_budget": 64},
                    engine={"kind": "openai", "base_url": server.base_url, "model": "test-model",
                            "tokenizer": "smollm2-135m", "api_key_env": KEY_VAR, "max_in_flight": 4})
    res = run_job(spec, db_url=sqlite_url)
    assert (res.status, res.succeeded) == ("succeeded", 12)
    tok = load_tokenizer(model_path)
    local = {f"id{i}" for i in range(0, 12, 3)}
    want = {}  # id -> (source, prompt tokens)
    for rid, p in prompts.items():
        if rid in local:  # the job's own tokenizer (what Tokenize counted), not the server's 5 words
            n = len(encode(tok, PromptRecord(id=rid, input_file=0, input_row=0, prompt=p)))
            assert n != len(p.split())
            want[rid] = ("local_tokenizer+stream_chunks", n)
        else:
            want[rid] = ("engine", len(p.split()))  # the fake server's usage counts words
    out = pq.read_table(tmp_path / "out" / "outputs.parquet").to_pylist()
    assert {r["id"]: (r["token_count_source"], r["prompt_tokens"]) for r in out} == want
    assert all(r["output_tokens"] == 4 for r in out)  # usage's completion_tokens, or the 4 text chunks
    eng = S.connect(sqlite_url)
    with eng.connect() as conn:  # the database's outputs table holds the same
        stored = dict(conn.execute(text("SELECT id, token_count_source FROM outputs WHERE job_id = 'oai-src'")).all())
    assert stored == {k: v[0] for k, v in want.items()}
    m = S.JobStore(eng).get("oai-src")["metrics"]
    assert m["tokens"]["by_count_source"] == {
        "engine": {"rows": 8, "prompt": sum(v[1] for k, v in want.items() if k not in local), "output": 32},
        "local_tokenizer+stream_chunks": {"rows": 4, "prompt": sum(v[1] for k, v in want.items() if k in local),
                                          "output": 16},
    }
    assert "for 8 of 12 rows" in m["throughput"]["counts"] and "estimates" in m["throughput"]["counts"]
    st = cli("status", "oai-src", "--db", sqlite_url, "--json", catch_exceptions=False)
    assert json.loads(st.output)["rows_by_token_count_source"] == {"engine": 8, "local_tokenizer+stream_chunks": 4}
    st = cli("status", "oai-src", "--db", sqlite_url, catch_exceptions=False)
    assert "rows_by_token_count_source: engine: 8, local_tokenizer+stream_chunks: 4" in st.output, st.output
    rep = cli("report", "oai-src", "--db", sqlite_url, "--no-html", catch_exceptions=False)
    assert "engine 8, local_tokenizer+stream_chunks 4" in rep.output, rep.output


@pytest.mark.postgres
def test_a_server_that_dies_mid_job_leaves_the_unanswered_rows_for_the_resume(server, tmp_path, pg_url):
    import threading
    import time

    rows = [{"id": f"id{i}", "prompt": f"[[slow]] row {i}"} for i in range(24)]
    inp = write_parquet(tmp_path / "in.parquet", rows)
    spec = job_spec(inp, tmp_path / "out", job_id="oai-resume", sampling={"max_tokens": 8},
                    batching={"token_budget": 64},
                    engine={"kind": "openai", "base_url": server.base_url, "model": "test-model",
                            "tokenizer": "smollm2-135m", "api_key_env": KEY_VAR, "max_in_flight": 3,
                            "max_retries": 2, "request_timeout_s": 5})

    def kill_after(n: int) -> None:
        while server.answered < n:
            time.sleep(0.005)
        server.stop()

    killer = threading.Thread(target=kill_after, args=(6,))
    killer.start()
    with pytest.raises(JobError, match="cannot be reached|is down"):
        run_job(spec, db_url=pg_url)
    killer.join()
    eng = S.connect(pg_url)
    first = S.MetricsReader(eng).counts("oai-resume")
    # what finished batches answered is kept; nothing is dead-lettered for the outage
    assert first["succeeded"] < 24 and first["failed"] == 0
    assert S.JobStore(eng).get("oai-resume")["status"] == "failed"
    with FaultServer(api_key=KEY, port=server.port) as again:
        res = run_job(spec, db_url=pg_url)
    assert res.status == "succeeded" and (res.succeeded, res.failed) == (24, 0)
    out = pq.read_table(tmp_path / "out" / "outputs.parquet").to_pylist()
    assert sorted(r["id"] for r in out) == sorted(f"id{i}" for i in range(24))  # each id once
    assert again.answered == 24 - first["succeeded"]  # the resume asked only for what was missing


def test_kill_9_of_a_run_then_resume_answers_each_id_once(server, tmp_path, sqlite_url):
    """A real `tokenmill run --engine openai` killed with kill -9 mid-run, then run again; every
    fifth row asks for 3 samples: after the resume each has each sample once."""
    import os
    import signal
    import subprocess
    import sys
    import time

    n = 60
    inp = write_parquet(tmp_path / "in.parquet", [
        {"id": f"q{i:02d}", "prompt": f"[[slow]] row {i}", **({"n": 3, "seed": i} if i % 5 == 0 else {"n": None, "seed": None})}
        for i in range(n)])
    out = tmp_path / "out"
    argv = [sys.executable, "-m", "tokenmill.jobs.cli", "run", "--input", str(inp), "--output", str(out),
            "--db", sqlite_url, "--job-id", "oai-kill", "--engine", "openai", "--base-url", server.base_url,
            "--model", "test-model", "--tokenizer", "smollm2-135m", "--api-key-env", KEY_VAR,
            "--max-tokens", "8", "--token-budget", "64"]
    proc = subprocess.Popen(argv, start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    eng = S.connect(sqlite_url)
    deadline = time.monotonic() + 300  # a bound against a hung test, not a speed assertion
    while time.monotonic() < deadline and proc.poll() is None:
        if S.JobStore(eng).get("oai-kill") is not None and S.MetricsReader(eng).counts("oai-kill")["succeeded"] >= 8:
            break
        time.sleep(0.05)
    assert proc.poll() is None, f"the run ended before the kill: {proc.communicate()[1][-2000:]}"
    os.killpg(proc.pid, signal.SIGKILL)
    _, err = proc.communicate(timeout=60)
    assert KEY not in err
    before = {r["id"] for r in S.MetricsReader(eng).request_rows("oai-kill", ("id",))}
    assert 8 <= len(before) < n
    rerun = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert f"rows in {n} / succeeded {n} / failed 0" in rerun.stdout
    assert KEY not in rerun.stdout + rerun.stderr
    samples: dict[str, list[int]] = {}
    for r in pq.read_table(out / "outputs.parquet").to_pylist():
        samples.setdefault(r["id"], []).append(r["sample"])
    # each id once, each of a sampled row's samples once
    assert samples == {f"q{i:02d}": ([0, 1, 2] if i % 5 == 0 else [0]) for i in range(n)}
    for i in range(n):  # rows committed before the kill were not asked again
        asked, k = server.attempts[f"[[slow]] row {i}"], 3 if i % 5 == 0 else 1
        assert asked == k if f"q{i:02d}" in before else k <= asked <= 2 * k, (i, asked)
