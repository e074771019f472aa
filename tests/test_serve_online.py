"""The OpenAI online API of `tokenmill serve` end to end: one real server on loopback for the
module (the real engine on the bundled model), the real `openai` SDK as the client.  Streamed
and whole answers equal `tokenmill run`'s greedy ones; 401, 404, 400 and 429 in OpenAI's error
shape; an online request sent while a batch runs is answered in the same engine and the batch
still answers every line once; a client that leaves mid-stream frees its sequence."""

from __future__ import annotations

import json
import re
import time

import httpx
import openai
import pytest

from tests.conftest import TEST_ENGINE
from tests.serve_server import Server, chat_line, jsonl, lines_of, run_like_the_server, wait_for
from tokenmill.schemas import storage as S

pytestmark = pytest.mark.engine

MODEL = "smollm2-135m"
QUESTIONS = ["What is the capital of France?", "Name a colour.", "Count to three."]
PROMPT = "Once upon a time"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("online")
    cfg = {"db": f"sqlite:///{root / 'serve.db'}", "files": str(root / "files"), "work": str(root / "runs"),
           "models": {MODEL: {"engine": dict(TEST_ENGINE), "sampling": {"max_tokens": 16}}},
           "online": {"max_per_key": 1, "max_queue": 8}}
    srv = Server(root, cfg).start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def keys(server):
    return {name: server.make_key(name, admin=name == "admin") for name in ("alice", "bob", "carol", "dan", "admin")}


def _metric(server, admin_key: str, name: str, **labels: str) -> float | None:
    text = httpx.get(f"{server.base_url}/metrics", headers={"Authorization": f"Bearer {admin_key}"}).text
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    m = re.search(rf"^{name}{{{re.escape(want)}}} (\S+)$", text, re.M)
    return float(m.group(1)) if m else None


def _until(check, timeout: float = 120.0, what: str = ""):
    deadline = time.time() + timeout
    while True:
        got = check()
        if got:
            return got
        if time.time() > deadline:
            raise AssertionError(f"still not so after {timeout} s: {what}")
        time.sleep(0.2)


def test_models_needs_a_key_and_lists_the_served_model(server, keys):
    with pytest.raises(openai.AuthenticationError) as err:
        server.client(None).models.list()
    assert err.value.body["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        server.client(None).chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}])
    assert [m.id for m in server.client(keys["alice"]["key"]).models.list().data] == [MODEL]


def test_an_unknown_model_is_404_and_a_bad_body_400_in_openais_error_shape(server, keys):
    alice = server.client(keys["alice"]["key"])
    with pytest.raises(openai.NotFoundError) as err:
        alice.chat.completions.create(model="no-such-model", messages=[{"role": "user", "content": "hi"}])
    assert err.value.body["code"] == "model_not_found" and err.value.body["param"] == "model"
    with pytest.raises(openai.BadRequestError) as bad:
        alice.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], temperature=5)
    assert bad.value.body["param"] == "body.temperature"
    with pytest.raises(openai.BadRequestError):
        alice.chat.completions.create(model=MODEL, messages="not a list")  # type: ignore[arg-type]
    r = httpx.post(f"{server.base_url}/v1/chat/completions", content=b"{not json",
                   headers={"Authorization": f"Bearer {keys['alice']['key']}"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"


def test_streamed_and_whole_answers_equal_tokenmill_runs_greedy_answers(server, keys, tmp_path):
    from openai.types import Completion
    from openai.types.chat import ChatCompletion

    alice = server.client(keys["alice"]["key"])
    whole, streamed, usage = {}, {}, {}
    for i, q in enumerate(QUESTIONS):
        msgs = [{"role": "user", "content": q}]
        w = alice.chat.completions.create(model=MODEL, messages=msgs, max_tokens=12, temperature=0)
        ChatCompletion.model_validate(w.model_dump())
        whole[f"chat{i}"] = w.choices[0].message.content
        pieces, roles, finish = [], [], None
        for chunk in alice.chat.completions.create(model=MODEL, messages=msgs, max_tokens=12, temperature=0,
                                                   stream=True, stream_options={"include_usage": True}):
            if chunk.usage is not None:
                usage[f"chat{i}"] = chunk.usage
            for c in chunk.choices:
                roles += [c.delta.role] if c.delta.role else []
                pieces.append(c.delta.content or "")
                finish = c.finish_reason or finish
        streamed[f"chat{i}"] = "".join(pieces)
        assert roles == ["assistant"] and finish in ("stop", "length")
        assert usage[f"chat{i}"].completion_tokens == w.usage.completion_tokens > 0
    c = alice.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0)
    Completion.model_validate(c.model_dump())
    whole["cmpl"] = c.choices[0].text
    streamed["cmpl"] = "".join(x.choices[0].text for x in alice.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0, stream=True) if x.choices)
    assert streamed == whole
    # the same requests as a batch file through `tokenmill run`, the same engine config: the same greedy answers
    lines = [chat_line(f"chat{i}", q, max_tokens=12) for i, q in enumerate(QUESTIONS)]
    lines.append({"custom_id": "cmpl", "method": "POST", "url": "/v1/completions",
                  "body": {"model": MODEL, "prompt": PROMPT, "max_tokens": 12, "temperature": 0}})
    path = jsonl(tmp_path / "same.jsonl", lines)
    out = tmp_path / "run"
    run_like_the_server(path, tmp_path, out)
    ran = {x["custom_id"]: x["response"]["body"] for x in map(json.loads, (out / "outputs.jsonl").read_text().splitlines())}
    want = {cid: (b["choices"][0]["text"] if cid == "cmpl" else b["choices"][0]["message"]["content"])
            for cid, b in ran.items()}
    assert whole == want


def test_a_key_past_its_online_limit_gets_429_at_once(server, keys):
    bob = server.client(keys["bob"]["key"])
    long = dict(model=MODEL, messages=[{"role": "user", "content": "Tell a long story."}], max_tokens=400,
                temperature=0, extra_body={"ignore_eos": True})
    with bob.chat.completions.create(stream=True, **long) as held:
        next(iter(held))  # the first request is in the engine
        with pytest.raises(openai.RateLimitError) as err:
            bob.chat.completions.create(**long)
        assert err.value.body["code"] == "rate_limit_exceeded" and "max_per_key" in err.value.body["message"]
        # another key is not held to bob's limit
        carol = server.client(keys["carol"]["key"])
        assert carol.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                             max_tokens=4).choices[0].message.content is not None


def test_a_client_that_leaves_mid_stream_frees_its_sequence_in_the_engine(server, keys):
    dan = server.client(keys["dan"]["key"])
    admin = keys["admin"]["key"]
    stream = dan.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Tell a long story."}],
                                         max_tokens=900, temperature=0, stream=True, extra_body={"ignore_eos": True})
    got = 0
    for _chunk in stream:
        got += 1
        if got == 4:
            break
    assert _metric(server, admin, "tokenmill_serve_online_engine", model=MODEL, what="online") == 1
    stream.close()  # the client leaves
    _until(lambda: _metric(server, admin, "tokenmill_serve_online_engine", model=MODEL, what="online") == 0,
           what="the engine still holds the online request")
    assert _metric(server, admin, "tokenmill_serve_online_engine", model=MODEL, what="engine_unfinished") == 0
    rows = S.OnlineStore(S.connect(server.config["db"])).recent(keys["dan"]["id"])
    assert rows and rows[0]["status"] == 499 and rows[0]["output_tokens"] is None  # ended by the cancel, not answered


def test_an_online_request_while_a_batch_runs_is_answered_and_the_batch_answers_every_line_once(server, keys,
                                                                                                tmp_path):
    alice = server.client(keys["alice"]["key"])
    n = 96
    lines = [chat_line(f"b{i:03d}", f"Write a long story about the number {i}.", max_tokens=48, ignore_eos=True)
             for i in range(n)]
    with open(jsonl(tmp_path / "batch.jsonl", lines), "rb") as fh:
        f = alice.files.create(file=fh, purpose="batch")
    b = alice.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    wait_for(alice, b.id, until=lambda x: x.request_counts and x.request_counts.completed > 0)
    carol = server.client(keys["carol"]["key"])
    answer = carol.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": QUESTIONS[0]}],
                                           max_tokens=12, temperature=0)
    assert answer.choices[0].message.content and answer.usage.completion_tokens > 0
    done = wait_for(alice, b.id)
    assert done.status == "completed", done
    out, err = lines_of(alice, done.output_file_id), lines_of(alice, done.error_file_id)
    ids = [x["custom_id"] for x in out + err]
    assert len(ids) == len(set(ids)) == n and not err
    rows = S.OnlineStore(S.connect(server.config["db"])).recent(keys["carol"]["id"])
    assert rows[0]["status"] == 200 and rows[0]["output_tokens"] == answer.usage.completion_tokens
    assert rows[0]["ttft_s"] is not None and rows[0]["e2e_s"] >= rows[0]["ttft_s"]
