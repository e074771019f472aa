"""The online routes of `tokenmill serve` in process, over a stand-in for the model's engine
process (the real one: tests/test_serve_online.py): the answer's shape against the `openai`
package's own types, whole and streamed as server-sent events, refusals in OpenAI's error shape
(401, 404, 400, 429 per key) and each request recorded with its key."""

from __future__ import annotations

import json
import threading
import time
from typing import Any

import pytest
from starlette.testclient import TestClient

from tokenmill.jobs.serve.app import create_app
from tokenmill.jobs.serve.config import ServeConfig
from tokenmill.jobs.serve.online_engine import Cancel, Done, Submit, Text
from tokenmill.jobs.serve.service import BatchService
from tokenmill.schemas import storage as S

KEY, OTHER = "tm-online-a", "tm-online-b"


class StandIn:
    """A model's engine process as the router sees it: each `Submit` answered at once with the
    text "Hello" in two pieces, unless its prompt says HOLD (one piece, then nothing until
    cancelled) or TOO_LONG (refused as the engine refuses a prompt over the model's length)."""

    def __init__(self):
        self.sent: list[Any] = []
        self.router: Any = None
        self.loaded, self.running = False, None

    def alive(self) -> bool:
        return True

    def send_online(self, msg: Any) -> bool:
        self.sent.append(msg)
        if isinstance(msg, Submit):
            body = json.dumps(msg.fields)
            if "TOO_LONG" in body:
                self.router.on_message("m", Done(msg.id, None, "prompt has 9999 tokens; the limit is ...", 400))
                return True
            self.router.on_message("m", Text(msg.id, "Hel"))
            if "HOLD" not in body:
                self.router.on_message("m", Text(msg.id, "lo"))
                self.router.on_message("m", Done(msg.id, {
                    "text": "Hello", "finish_reason": "stop", "prompt_tokens": 5, "output_tokens": 2,
                    "cached_tokens": 0, "ttft_s": 0.01, "tpot_s": 0.002, "e2e_s": 0.02, "finished_at": time.time()}))
        return True


@pytest.fixture()
def served(tmp_path):
    cfg = ServeConfig(db=f"sqlite:///{tmp_path / 'db.sqlite'}", files=str(tmp_path / "files"),
                      work=str(tmp_path / "runs"), models={"m": {}}, online={"max_per_key": 1})
    svc = BatchService(cfg)
    svc.start = svc.stop = lambda: None  # type: ignore[method-assign]
    keys = S.KeyStore(svc.eng)
    a, b = keys.add("key_a", "a", KEY), keys.add("key_b", "b", OTHER)
    app = create_app(cfg, svc)
    engine = StandIn()
    engine.router = app.state.online
    svc.scheduler.engine = lambda model: engine  # type: ignore[method-assign]
    svc.scheduler.engines["m"] = engine  # type: ignore[assignment]
    with TestClient(app) as client:
        yield client, engine, svc, a, b


def _post(client, path: str, body: dict, key: str | None = KEY, **kw):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return client.post(path, json=body, headers=headers, **kw)


def _events(text: str) -> list[Any]:
    out = []
    for block in text.split("\n\n"):
        if block.startswith("data: "):
            data = block[len("data: "):]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0}


def test_a_whole_chat_completion_is_the_sdks_own_type_and_is_recorded_with_its_key(served):
    from openai.types import Completion
    from openai.types.chat import ChatCompletion

    client, engine, svc, a, _ = served
    r = _post(client, "/v1/chat/completions", CHAT)
    assert r.status_code == 200, r.text
    c = ChatCompletion.model_validate(r.json())
    assert c.choices[0].message.content == "Hello" and c.usage.completion_tokens == 2 and c.model == "m"
    sub = engine.sent[0]
    assert isinstance(sub, Submit) and sub.fields["messages"] == CHAT["messages"] and sub.fields["max_tokens"] == 4
    r = _post(client, "/v1/completions", {"model": "m", "prompt": "Once", "max_tokens": 4})
    assert Completion.model_validate(r.json()).choices[0].text == "Hello"
    rows = S.OnlineStore(svc.eng).recent(a["id"])
    assert [(x["endpoint"], x["status"], x["output_tokens"]) for x in rows] == [
        ("/v1/completions", 200, 2), ("/v1/chat/completions", 200, 2)]
    assert all(x["ttft_s"] is not None and x["e2e_s"] >= x["ttft_s"] for x in rows)


def test_a_streamed_chat_completion_is_server_sent_chunks_ending_done(served):
    from openai.types.chat import ChatCompletionChunk

    client, *_ = served
    r = _post(client, "/v1/chat/completions", {**CHAT, "stream": True, "stream_options": {"include_usage": True}})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = _events(r.text)
    assert events[-1] == "[DONE]"
    chunks = [ChatCompletionChunk.model_validate(e) for e in events[:-1]]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "Hello"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == 7
    assert len({c.id for c in chunks}) == 1
    r = _post(client, "/v1/completions", {"model": "m", "prompt": "Once", "stream": True})
    assert "".join(e["choices"][0]["text"] for e in _events(r.text)[:-1]) == "Hello"


def test_refusals_are_in_openais_error_shape(served):
    client, engine, *_ = served
    r = _post(client, "/v1/chat/completions", CHAT, key=None)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert client.get("/v1/models").status_code == 401
    r = _post(client, "/v1/chat/completions", {**CHAT, "model": "gpt-9"})
    assert r.status_code == 404 and r.json()["error"] == {
        "message": "The model `gpt-9` does not exist (served: m)", "type": "invalid_request_error", "param": "model",
        "code": "model_not_found"}
    for bad, param in (({"temperature": 5}, "body.temperature"), ({"n": 2}, "n"), ({"messages": "hi"}, None),
                       ({"tools": [{"type": "function"}]}, None)):
        r = _post(client, "/v1/chat/completions", {**CHAT, **bad})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (bad, r.text)
    for stream in (False, True):  # refused by the engine before any text: a status, streamed or not
        r = _post(client, "/v1/chat/completions", {**CHAT, "stream": stream,
                                                   "messages": [{"role": "user", "content": "TOO_LONG"}]})
        assert r.status_code == 400 and "9999 tokens" in r.json()["error"]["message"]
    # what the server refused itself never reached the engine: only the two TOO_LONG requests did
    assert [m.fields["messages"][0]["content"] for m in engine.sent if isinstance(m, Submit)] == ["TOO_LONG"] * 2
    models = client.get("/v1/models", headers={"Authorization": f"Bearer {KEY}"}).json()
    assert models["object"] == "list" and [m["id"] for m in models["data"]] == ["m"]


def test_a_key_at_its_online_limit_gets_429_at_once_and_another_key_does_not(served):
    client, engine, svc, a, _ = served
    held = {**CHAT, "messages": [{"role": "user", "content": "HOLD"}]}
    answers: list[Any] = []
    t = threading.Thread(target=lambda: answers.append(_post(client, "/v1/chat/completions", held)))
    t.start()
    deadline = time.time() + 30
    while not [m for m in engine.sent if isinstance(m, Submit)]:  # the held request is in the engine
        assert time.time() < deadline, "the held request never reached the engine"
        time.sleep(0.01)
    r = _post(client, "/v1/chat/completions", CHAT)
    assert r.status_code == 429 and r.json()["error"]["code"] == "rate_limit_exceeded"
    assert "max_per_key" in r.json()["error"]["message"] and r.json()["error"]["type"] == "rate_limit_error"
    assert _post(client, "/v1/chat/completions", CHAT, key=OTHER).status_code == 200
    first = next(m for m in engine.sent if isinstance(m, Submit))
    engine.router.on_message("m", Done(first.id, None, "the engine was stopped", 500))  # the held one ends
    t.join(30)
    assert answers[0].status_code == 500 and answers[0].json()["error"]["type"] == "server_error"
    assert _post(client, "/v1/chat/completions", CHAT).status_code == 200  # its place is free again
    assert not [m for m in engine.sent if isinstance(m, Cancel)]
