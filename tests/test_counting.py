"""How a job counts its prompts before they are sent (transforms/counting.py): the server's
own /tokenize (vLLM's and llama-server's shapes, on the test server), a local tokenizer, or
the stated estimate; which one `engine.token_count: auto` picks; and each row saying which
its counts came from when the server sends no `usage`."""

from __future__ import annotations

from array import array

import pyarrow.parquet as pq
import pytest

from tests.conftest import write_parquet
from tests.helpers import job_spec
from tests.openai_server import FaultServer
from tokenmill.jobs.lifecycle.runner import JobError, run_job
from tokenmill.schemas import records as R
from tokenmill.schemas import storage as S
from tokenmill.schemas.records import PromptRecord
from tokenmill.transforms import counting as C
from tokenmill.transforms.engines import openai_engine
from tokenmill.transforms.engines.openai_config import OpenAIConfig
from tokenmill.transforms.engines.protocol import EngineStartError

CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is two plus two?"}]


def rec(prompt: str | None = None, messages=None) -> PromptRecord:
    return PromptRecord(id="a", input_file=0, input_row=0, prompt=prompt, messages=messages)


@pytest.fixture(autouse=True)
def _no_wait(monkeypatch):
    monkeypatch.setattr(C, "RETRY_WAIT_S", 0.0)


def test_the_servers_root_is_its_api_root_without_v1():
    assert C.server_root("http://h:8000/v1") == C.server_root("http://h:8000/v1/") == "http://h:8000"
    assert C.server_root("https://h/api") == "https://h/api"


def test_the_estimate_is_one_token_per_four_bytes_and_keeps_shared_prefixes_alike():
    e = C.EstimateEncoder()
    assert len(e.encode(rec("abcdefgh"))) == 2 and len(e.encode(rec("abcdefghi"))) == 3
    assert len(e.encode(rec("é" * 4))) == 2  # bytes of UTF-8, not characters
    one, two = e.encode(rec("shared prefix text, then A")), e.encode(rec("shared prefix text, then B"))
    assert one[:6] == two[:6] and one != two
    assert e.encode(rec(messages=CHAT)) == e.encode(rec("system: Be brief.\nuser: What is two plus two?\n"))


@pytest.mark.parametrize("style", ["vllm", "llama.cpp"])
def test_the_servers_tokenize_is_found_and_counts_prompts_and_conversations(style):
    with FaultServer(tokenize=style) as server:
        root = C.server_root(server.base_url)
        assert C.probe_server(root, "test-model", None) == style
        enc = C.TokenCounter("server", root=root, model="test-model", style=style).open()
        assert len(enc.encode(rec("one two three"))) == 3
        assert len(enc.encode(rec(messages=CHAT))) == 5  # the test server counts the last message's words
        with pytest.raises(ValueError, match=r"refused the prompt: HTTP 400"):
            enc.encode(rec("[[badtok]] no"))  # the row's fault: Tokenize makes it a dead letter
    with FaultServer() as bare:
        assert C.probe_server(C.server_root(bare.base_url), "test-model", None) is None


def test_a_tokenize_that_fails_is_retried_then_fails_the_step():
    with FaultServer(tokenize="vllm", tokenize_500=2) as server:
        enc = C.TokenCounter("server", root=C.server_root(server.base_url), model="test-model", style="vllm").open()
        assert len(enc.encode(rec("a b"))) == 2 and server.tokenized == {"a b": 1}  # after two 500s
        server.tokenize_500 = 100
        with pytest.raises(RuntimeError, match=r"did not answer after 4 attempts \(HTTP 500\)"):
            enc.encode(rec("a b c"))


def _cfg(server: FaultServer, **kw) -> OpenAIConfig:
    return OpenAIConfig(kind="openai", base_url=server.base_url, model=kw.pop("model", "test-model"), **kw)


def test_auto_picks_the_tokenizer_given_then_the_server_then_the_model_folder_then_the_estimate(model_path):
    def local(name):
        return model_path if name == "smollm2-135m" else None

    with FaultServer(tokenize="vllm") as tok_server, FaultServer() as bare, FaultServer(model="smollm2-135m") as named:
        pick = openai_engine.token_counter
        assert pick(_cfg(tok_server, tokenizer="smollm2-135m"), local) == C.TokenCounter.local(model_path, "smollm2-135m")
        got = pick(_cfg(tok_server), local)
        assert (got.source, got.style, got.model, got.row_source) == (
            "server", "vllm", "test-model", R.TOKENS_BY_SERVER_TOKENIZER_AND_STREAM_CHUNKS)
        assert pick(_cfg(named, model="smollm2-135m"), local) == C.TokenCounter.local(model_path, "smollm2-135m")
        assert pick(_cfg(bare), local).row_source == R.TOKENS_BY_ESTIMATE_AND_STREAM_CHUNKS
        # asked for, and not there: one line
        with pytest.raises(EngineStartError, match="engine.token_count server: .*/tokenize does not answer"):
            pick(_cfg(bare, token_count="server"), local)
        with pytest.raises(EngineStartError, match="engine.token_count tokenizer: no local tokenizer 'test-model'"):
            pick(_cfg(tok_server, token_count="tokenizer"), local)
        assert pick(_cfg(tok_server, token_count="estimate", tokenizer="smollm2-135m"), local).source == "estimate"


@pytest.mark.parametrize("tokenize, source", [("vllm", R.TOKENS_BY_SERVER_TOKENIZER_AND_STREAM_CHUNKS),
                                              (None, R.TOKENS_BY_ESTIMATE_AND_STREAM_CHUNKS)])
def test_a_job_on_a_server_model_with_no_local_tokenizer_says_how_each_row_was_counted(
        tokenize, source, tmp_path, sqlite_url):
    """The real pipeline, no `engine.tokenizer`: rows with the server's `usage` say "engine",
    the others the way Tokenize counted them (the server's /tokenize, or the estimate), and a
    prompt the server's tokenizer refuses is a dead letter with its reason."""
    prompts = {"u": "one two three four", "n": "[[nousage]] five six seven", "chat": None}
    rows = [{"id": k, "prompt": p, "messages": None} for k, p in prompts.items() if p]
    rows.append({"id": "chat", "prompt": None, "messages": '[{"role": "user", "content": "[[nousage]] hi there"}]'})
    if tokenize:
        rows.append({"id": "bad", "prompt": "[[badtok]] x", "messages": None})
    inp = write_parquet(tmp_path / "in.parquet", rows)
    with FaultServer(tokenize=tokenize) as server:
        spec = job_spec(inp, tmp_path / "out", job_id=f"count-{tokenize}", sampling={"max_tokens": 8},
                        engine={"kind": "openai", "base_url": server.base_url, "model": "test-model"})
        res = run_job(spec, db_url=sqlite_url)
        asked = {t: n for t, n in server.tokenized.items() if t != C.PROBE_TEXT}  # Tokenize's, not the probes'
        assert asked == ({"one two three four": 1, "[[nousage]] five six seven": 1, "[[nousage]] hi there": 1}
                         if tokenize else {})  # once a row (the refused one not counted)
    assert (res.succeeded, res.failed) == (3, 1 if tokenize else 0), res
    out = {r["id"]: r for r in pq.read_table(tmp_path / "out" / "outputs.parquet").to_pylist()}
    assert out["u"]["token_count_source"] == R.TOKENS_BY_ENGINE and out["u"]["prompt_tokens"] == 4
    est = C.EstimateEncoder()
    want_n = 4 if tokenize else len(est.encode(rec(prompts["n"])))
    want_chat = 3 if tokenize else len(est.encode(rec(messages=[{"role": "user", "content": "[[nousage]] hi there"}])))
    assert (out["n"]["token_count_source"], out["n"]["prompt_tokens"]) == (source, want_n)
    assert (out["chat"]["token_count_source"], out["chat"]["prompt_tokens"]) == (source, want_chat)
    if tokenize:
        dead = pq.read_table(tmp_path / "out" / "dead_letters.parquet").to_pylist()
        assert [(d["id"], d["reason"]) for d in dead] == [("bad", R.BAD_REQUEST)]
        assert "refused the prompt: HTTP 400" in dead[0]["message"]
    m = S.JobStore(S.connect(sqlite_url)).get(f"count-{tokenize}")["metrics"]
    assert {k: v["rows"] for k, v in m["tokens"]["by_count_source"].items()} == {"engine": 1, source: 2}


def test_a_server_whose_tokenize_stops_answering_fails_the_job_and_leaves_the_rows(tmp_path, sqlite_url):
    inp = write_parquet(tmp_path / "in.parquet", [{"id": "a", "prompt": "[[tok500]] a b"}])
    with FaultServer(tokenize="vllm") as server:
        spec = job_spec(inp, tmp_path / "out", job_id="count-down", sampling={"max_tokens": 8},
                        engine={"kind": "openai", "base_url": server.base_url, "model": "test-model",
                                "token_count": "server"})
        with pytest.raises(JobError, match="did not answer after 4 attempts"):
            run_job(spec, db_url=sqlite_url)
    assert S.MetricsReader(S.connect(sqlite_url)).counts("count-down")["succeeded"] == 0


def test_a_chunk_encoded_in_one_call_gives_each_row_the_ids_of_encoding_it_alone(model_path):
    """Tokenize encodes a chunk at once (`LocalEncoder.encode_many`): every row gets the ids
    `encode` gives it alone, and a conversation its template rejects fails only its own row."""
    from tokenmill.transforms.tokenize import RecordRules, TokenizeFn

    enc = C.TokenCounter.local(model_path).open()
    rows = [rec(messages=CHAT), rec("a plain prompt, special tokens and all"),
            rec(messages=[{"role": "system", "content": "Answer in French."}, {"role": "user", "content": "Hello?"},
                          {"role": "assistant", "content": "Bonjour."}, {"role": "user", "content": "And then?"}]),
            rec(messages=[{"role": "user", "content": "ünïcödé ✓ " * 20}]), rec("")]
    alone = [enc.encode(r) for r in rows]
    assert [ids if isinstance(ids, Exception) else list(ids) for ids in enc.encode_many(rows)] == alone
    assert all(ids for ids in alone[:4]) and len(set(map(tuple, alone))) == len(alone)

    class Rejecting:  # a template that raises for one conversation: the batch call fails, each row is tried
        def __init__(self, tok):
            self.tok = tok

        def apply_chat_template(self, conv, **kw):
            if any("REJECT" in m["content"] for c in (conv if isinstance(conv[0], list) else [conv]) for m in c):
                raise ValueError("the template rejects this conversation")
            return self.tok.apply_chat_template(conv, **kw)

        def __call__(self, *a, **kw):
            return self.tok(*a, **kw)

    bad = rec(messages=[{"role": "user", "content": "REJECT me"}])
    got = C.LocalEncoder(Rejecting(enc.tokenizer)).encode_many([rows[0], bad, rows[1]])
    assert list(got[0]) == alone[0] and list(got[2]) == alone[1] and isinstance(got[1], ValueError)

    fn = TokenizeFn(C.TokenCounter.local(model_path), RecordRules(2048, 8, 16, 4))
    fn._encoder = C.LocalEncoder(Rejecting(enc.tokenizer))
    fn.start_bundle()
    assert not list(fn.process(R.Chunk(unit="u", items=[r for r in (rows[0], bad, rows[2])])))  # out with the next
    out = list(fn.finish_bundle())  # or at the bundle's end, in the global window
    fn.teardown()
    dead = [o.value.value for o in out if hasattr(o, "tag")]
    (ok,) = [o.value for o in out if not hasattr(o, "tag")]
    assert [list(p.token_ids) for p in ok.items] == [alone[0], alone[2]]
    assert [(d.id, d.reason) for d in dead] == [(bad.id, R.BAD_MESSAGES)]


def test_a_large_chunk_is_tokenized_on_a_thread_per_core_with_the_ids_of_one_call(model_path, monkeypatch):
    """A chunk of at least two slices of `MIN_THREAD_SLICE` texts is tokenized on one thread
    per core the process may use, each taking a contiguous slice: the ids, in order, are
    those of one tokenizer call, for conversations and plain prompts alike."""
    import threading

    monkeypatch.setattr(C, "MIN_THREAD_SLICE", 8)
    monkeypatch.setattr(C, "allowed_cores", lambda: [0, 1, 2])
    enc = C.TokenCounter.local(model_path).open()
    rows = [rec(messages=[{"role": "system", "content": f"System {i % 3}."}, {"role": "user", "content": f"Q{i} " * (i % 7)}])
            for i in range(40)] + [rec(f"plain prompt {i} " * (1 + i % 5)) for i in range(30)]
    calls: list[tuple[str, int]] = []
    backend = enc.tokenizer.backend_tokenizer

    class Watched:  # the fast tokenizer, noting which thread encodes how many texts
        def encode_batch(self, texts, **kw):
            calls.append((threading.current_thread().name, len(texts)))
            return backend.encode_batch(texts, **kw)

    monkeypatch.setattr(type(enc.tokenizer), "backend_tokenizer", property(lambda self: Watched()), raising=False)
    got = enc.encode_many(rows)
    monkeypatch.undo()
    # 40 conversations in slices of 14, 14, 12 and 30 prompts in slices of 10, each slice encoded
    # at most MIN_THREAD_SLICE texts at a time (a chunk's Encodings are never all held at once)
    assert sorted(n for _, n in calls) == [2, 2, 2, 4, 6, 6, 8, 8, 8, 8, 8, 8]
    assert all(name.startswith("tokenize") for name, _ in calls)
    assert all(isinstance(ids, array) and ids.typecode == "i" for ids in got)  # 4 bytes a token, as the record keeps them
    assert [list(ids) for ids in got] == [enc.encode(r) for r in rows]


def test_one_encoder_and_one_ahead_thread_per_process_and_a_forked_child_makes_its_own(model_path):
    """A Dask worker runs Tokenize's setup for every task: the encoder (with its thread pool) and
    the tokenize-ahead thread are made once per process, so tasks do not make new threads.  A
    forked child inherits the objects but not their threads, and makes its own."""
    import os

    from tokenmill.transforms.tokenize import ahead_thread

    texts = [f"text {i}" for i in range(2 * C.MIN_THREAD_SLICE)]  # enough for the pool, on 2 cores or more
    enc = C.TokenCounter.local(model_path).open()
    assert C.TokenCounter.local(model_path).open() is enc
    assert ahead_thread() is ahead_thread()
    want = ahead_thread().submit(enc.ids, texts, special=False).result(timeout=60)
    pid = os.fork()
    if pid == 0:  # the child: exit 0 only when both work on threads of its own
        ok = False
        try:
            child_enc = C.TokenCounter.local(model_path).open()
            got = ahead_thread().submit(child_enc.ids, texts, special=False).result(timeout=30)
            ok = child_enc is not enc and got == want
        finally:
            os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


def test_each_worker_sharing_a_host_tokenizes_on_its_share_of_the_cores(model_path, monkeypatch):
    """Two workers of a 4-core host each encode on 2 threads, not 4 (four tokenizing threads a
    worker would share the cores with the other worker's); more workers than cores: one thread."""
    from tokenmill.transforms import tokenize as T

    monkeypatch.setattr(T, "allowed_cores", lambda: [0, 1, 2, 3])
    threads = {}
    for workers in (1, 2, 3, 8):
        fn = T.TokenizeFn(C.TokenCounter.local(model_path), T.RecordRules(2048, 8, 16, 4), workers)
        fn.setup()
        threads[workers] = fn._encoder.threads
    assert threads == {1: 4, 2: 2, 3: 1, 8: 1}
    texts = [f"text {i}" for i in range(4 * C.MIN_THREAD_SLICE)]
    one = C.TokenCounter.local(model_path).open(threads=1)
    assert one is not C.TokenCounter.local(model_path).open(threads=2)
    assert [list(x) for x in one.ids(texts, special=False)] == [
        list(x) for x in C.TokenCounter.local(model_path).open(threads=2).ids(texts, special=False)]
    assert one._pool is None  # one thread: encoded on the caller's own


def test_a_tokenizer_is_loaded_as_autotokenizer_loads_it_and_later_without_its_lookup_or_torch(model_path, tmp_path,
                                                                                               monkeypatch):
    """The first load of a folder goes through AutoTokenizer and keeps the class it chose; a later
    load (another process) imports that class alone: the same tokenizer (its backend, its chat
    template's ids), without importing torch (AutoTokenizer's lookup does)."""
    import json
    import os
    import subprocess
    import sys

    monkeypatch.setenv("TOKENMILL_HOME", str(tmp_path))
    monkeypatch.setattr(C, "_TOKENIZERS", {})
    first = C.load_tokenizer(model_path)
    (kept,) = json.loads((tmp_path / "tokenizer_classes.json").read_text()).values()
    assert kept == f"{type(first).__module__}:{type(first).__qualname__}"
    probe = ("import sys, json; from tokenmill.transforms.counting import load_tokenizer; "
             f"t = load_tokenizer({model_path!r}); "
             "print(json.dumps([type(t).__qualname__, 'torch' in sys.modules, t.backend_tokenizer.to_str(), "
             "t.apply_chat_template([{'role': 'user', 'content': 'Hi?'}], add_generation_prompt=True, tokenize=False)]))")
    got = json.loads(subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True,
                                    env={**os.environ, "TOKENMILL_HOME": str(tmp_path)}).stdout.splitlines()[-1])
    assert got[:2] == [type(first).__qualname__, False]
    assert got[2] == first.backend_tokenizer.to_str()
    assert got[3] == first.apply_chat_template([{"role": "user", "content": "Hi?"}], add_generation_prompt=True,
                                               tokenize=False)
