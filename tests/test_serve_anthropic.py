"""Anthropic's Message Batches on `tokenmill serve` end to end: one real server for the module on
loopback (the real engine on the bundled model), driven by the real `anthropic` SDK with its
response validation on, every object it returns checked against its own types: a batch
completes, is listed and its results stream; the same prompts answer as an OpenAI chat batch
does; cancel and expiry answer the requests not run `canceled` and `expired`; delete only
once ended; another key 404 and no key 401; bad input refused as Anthropic refuses it with
nothing run; `tokenmill run` of a requests file writes the same results; and kill -9 of the
server mid-batch, then a restart, ends with each custom_id once."""

from __future__ import annotations

import json
import time
from collections import Counter

import anthropic
import httpx
import pytest
from anthropic.types import Message
from anthropic.types.messages import DeletedMessageBatch, MessageBatch, MessageBatchIndividualResponse
from anthropic.types.shared import ErrorResponse

from tests.conftest import TEST_ENGINE
from tests.serve_server import Server, chat_line, jsonl, lines_of, run_like_the_server, wait_for
from tokenmill.schemas import storage as S

pytestmark = pytest.mark.engine

MODEL = "smollm2-135m"
LIMITS = {"max_message_batch_requests": 250, "max_batches_in_flight": 10}
PROMPTS = ["What is the capital of France?", "Name a colour.", "Count to three.", "Say hello in Spanish."]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve-anthropic")
    cfg = {"db": f"sqlite:///{root / 'serve.db'}", "files": str(root / "files"), "work": str(root / "runs"),
           "models": {MODEL: {"engine": dict(TEST_ENGINE), "sampling": {"max_tokens": 16}}}, "limits": LIMITS}
    srv = Server(root, cfg).start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def keys(server):
    return {name: server.make_key(name, admin=name == "admin") for name in ("alice", "bob", "admin")}


def client(server, key: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.base_url, api_key=key, max_retries=0,
                               _strict_response_validation=True)


def req(cid: str, content: str, max_tokens: int = 12, **params) -> dict:
    return {"custom_id": cid, "params": {"model": MODEL, "max_tokens": max_tokens, "temperature": 0,
                                         "messages": [{"role": "user", "content": content}], **params}}


def checked(b) -> MessageBatch:
    """A batch the SDK returned, validated again by its own type from what it read."""
    return MessageBatch.model_validate(b.model_dump(mode="json"))


def wait_ended(c: anthropic.Anthropic, batch_id: str, timeout: float = 900, until=None) -> MessageBatch:
    deadline = time.time() + timeout
    while True:
        b = checked(c.messages.batches.retrieve(batch_id))
        if b.processing_status == "ended" if until is None else until(b):
            return b
        if time.time() > deadline:
            raise AssertionError(f"batch {batch_id} still {b.processing_status} after {timeout} s: {b}")
        time.sleep(0.5)


def results(c: anthropic.Anthropic, batch_id: str) -> dict[str, MessageBatchIndividualResponse]:
    """The batch's results through the SDK's stream, each line validated by its type, once per custom_id."""
    lines = [MessageBatchIndividualResponse.model_validate(r.model_dump(mode="json"))
             for r in c.messages.batches.results(batch_id)]
    ids = [r.custom_id for r in lines]
    assert len(ids) == len(set(ids)), Counter(ids).most_common(3)
    return {r.custom_id: r for r in lines}


def text_of(r: MessageBatchIndividualResponse) -> str:
    assert r.result.type == "succeeded", r
    msg = Message.model_validate(r.result.message.model_dump(mode="json"))
    return msg.content[0].text


def _batch_ids(server) -> set[str]:
    return {b["id"] for b in S.BatchStore(S.connect(server.config["db"])).page(None, limit=10_000)}


def test_a_batch_completes_is_listed_streams_its_results_and_answers_as_an_openai_chat_batch(server, keys, tmp_path):
    alice = client(server, keys["alice"]["key"])
    plain = [req(f"p{i}", q) for i, q in enumerate(PROMPTS)]
    extra = [req("sys", "Who are you?", system=[{"type": "text", "text": "You are a pirate."}], top_k=5,
                 stop_sequences=["\n\n"]),
             req("stop", "What is the capital of France?", stop_sequences=[" "]),
             req("tools", "Weather?", tools=[{"name": "weather", "input_schema": {"type": "object"}}]),
             req("think", "Think.", thinking={"type": "enabled", "budget_tokens": 1024})]
    made = checked(alice.messages.batches.create(requests=plain + extra))
    assert made.id.startswith("msgbatch_") and made.processing_status == "in_progress" and made.results_url is None
    assert made.request_counts.processing == len(plain + extra)
    assert (made.expires_at - made.created_at).total_seconds() == pytest.approx(86400, abs=1)
    # the same prompts as an OpenAI chat batch on the same server
    oai = server.client(keys["alice"]["key"])
    with open(jsonl(tmp_path / "chat.jsonl", [chat_line(f"p{i}", q, max_tokens=12) for i, q in enumerate(PROMPTS)]),
              "rb") as fh:
        f = oai.files.create(file=fh, purpose="batch")
    ob = oai.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    done = wait_ended(alice, made.id)
    assert done.ended_at and done.results_url and done.results_url.endswith(f"/v1/messages/batches/{made.id}/results")
    c = done.request_counts
    assert (c.processing, c.succeeded, c.errored, c.canceled, c.expired) == (0, len(plain) + 2, 2, 0, 0), c
    assert made.id in {b.id for b in alice.messages.batches.list()}
    got = results(alice, made.id)
    assert set(got) == {r["custom_id"] for r in plain + extra}
    for cid in ("tools", "think"):
        err = got[cid].result
        assert err.type == "errored" and err.error.error.type == "invalid_request_error", err
        assert cid[:4] in err.error.error.message
    msg = Message.model_validate(got["p0"].result.message.model_dump(mode="json"))
    assert msg.model == MODEL and msg.role == "assistant" and msg.stop_reason in ("end_turn", "max_tokens")
    assert msg.usage.input_tokens + (msg.usage.cache_read_input_tokens or 0) > 0 and msg.usage.output_tokens > 0
    assert text_of(got["sys"])
    stopped = got["stop"].result.message  # a space ends the text at once: the stop string is named
    assert (stopped.stop_reason, stopped.stop_sequence) == ("stop_sequence", " ") and " " not in text_of(got["stop"])
    chat = {x["custom_id"]: x for x in lines_of(oai, wait_for(oai, ob.id).output_file_id)}
    for i in range(len(PROMPTS)):
        assert text_of(got[f"p{i}"]) == chat[f"p{i}"]["response"]["body"]["choices"][0]["message"]["content"], i
    # the raw stream is JSONL, each line of the SDK's type
    raw = httpx.get(done.results_url, headers={"x-api-key": keys["alice"]["key"]})
    assert raw.status_code == 200
    for line in raw.text.splitlines():
        MessageBatchIndividualResponse.model_validate(json.loads(line))


def test_another_key_gets_404_no_key_401_and_an_admin_sees_the_batch(server, keys):
    alice, bob = client(server, keys["alice"]["key"]), client(server, keys["bob"]["key"])
    b = checked(alice.messages.batches.create(requests=[req("only", "Hi.", max_tokens=4)]))
    for call in (lambda: bob.messages.batches.retrieve(b.id), lambda: bob.messages.batches.cancel(b.id),
                 lambda: bob.messages.batches.delete(b.id)):
        with pytest.raises(anthropic.NotFoundError) as err:
            call()
        assert ErrorResponse.model_validate(err.value.body).error.type == "not_found_error"
    assert b.id not in {x.id for x in bob.messages.batches.list()}
    r = httpx.get(f"{server.base_url}/v1/messages/batches/{b.id}/results", headers={"x-api-key": keys["bob"]["key"]})
    assert r.status_code == 404 and ErrorResponse.model_validate(r.json()).error.type == "not_found_error"
    for headers in ({}, {"x-api-key": "tm-not-a-key"}, {"authorization": "Basic " + keys["alice"]["key"]}):
        r = httpx.get(f"{server.base_url}/v1/messages/batches/{b.id}", headers=headers)
        assert r.status_code == 401 and ErrorResponse.model_validate(r.json()).error.type == "authentication_error"
    with pytest.raises(anthropic.AuthenticationError):
        client(server, "tm-not-a-key").messages.batches.list()
    assert checked(client(server, keys["admin"]["key"]).messages.batches.retrieve(b.id)).id == b.id
    # an OpenAI batch's id is not a message batch's
    oai = server.client(keys["alice"]["key"])
    some = next((x for x in oai.batches.list() if not x.id.startswith("msgbatch_")), None)
    if some is not None:
        with pytest.raises(anthropic.NotFoundError):
            alice.messages.batches.retrieve(some.id)
    wait_ended(alice, b.id)


BAD = [
    ("missing max_tokens", [{"custom_id": "a", "params": {"model": MODEL, "messages": [{"role": "user",
                                                                                         "content": "x"}]}}],
     "requests.0.params.max_tokens"),
    ("duplicate custom_id", [req("a", "x"), req("b", "y"), req("a", "z")], "requests.2.custom_id"),
    ("unknown model", [req("a", "x"), {**req("b", "y"), "params": {**req("b", "y")["params"], "model": "claude-x"}}],
     "requests.1.params.model"),
    ("over the request limit", [req(f"r{i}", "x") for i in range(LIMITS["max_message_batch_requests"] + 1)],
     "requests"),
    ("a bad custom_id", [req("no spaces allowed", "x")], "requests.0.custom_id"),
]


@pytest.mark.parametrize("what,requests,where", BAD, ids=[b[0] for b in BAD])
def test_bad_input_is_refused_with_400_invalid_request_error_and_nothing_runs(server, keys, what, requests, where):
    alice = client(server, keys["alice"]["key"])
    before = _batch_ids(server)
    with pytest.raises(anthropic.BadRequestError) as err:
        alice.messages.batches.create(requests=requests)
    body = ErrorResponse.model_validate(err.value.body)
    assert body.error.type == "invalid_request_error" and body.error.message.startswith(where), body
    assert _batch_ids(server) == before  # no batch, so no job


def test_cancel_mid_batch_answers_the_requests_not_run_canceled_and_delete_waits_for_the_end(server, keys):
    alice = client(server, keys["alice"]["key"])
    n = 240
    b = alice.messages.batches.create(requests=[req(f"c{i:03d}", f"Write a long story about the number {i}.",
                                                    max_tokens=48) for i in range(n)])
    seen = wait_ended(alice, b.id, until=lambda x: x.request_counts.succeeded > 0 or x.processing_status == "ended")
    with pytest.raises(anthropic.BadRequestError):  # not ended: it cannot be deleted
        alice.messages.batches.delete(b.id)
    canceling = checked(alice.messages.batches.cancel(b.id))
    assert canceling.processing_status in ("canceling", "ended") and canceling.cancel_initiated_at
    done = wait_ended(alice, b.id)
    got = results(alice, b.id)
    kinds = Counter(r.result.type for r in got.values())
    assert len(got) == n and kinds["canceled"] > 0 and kinds["succeeded"] >= seen.request_counts.succeeded, kinds
    c = done.request_counts
    assert (c.succeeded, c.errored, c.canceled, c.expired, c.processing) == (
        kinds["succeeded"], kinds["errored"], kinds["canceled"], 0, 0)
    gone = DeletedMessageBatch.model_validate(alice.messages.batches.delete(b.id).model_dump(mode="json"))
    assert gone.id == b.id and gone.type == "message_batch_deleted"
    with pytest.raises(anthropic.NotFoundError):
        alice.messages.batches.retrieve(b.id)
    assert b.id not in {x.id for x in alice.messages.batches.list()}


def test_a_batch_past_its_window_expires_answering_the_requests_not_run_expired(server, keys):
    bob = client(server, keys["bob"]["key"])
    n = 240
    b = checked(bob.messages.batches.create(
        requests=[req(f"e{i:03d}", f"Write a long story about the number {i}.", max_tokens=48) for i in range(n)],
        extra_body={"completion_window": "10s"}))
    assert (b.expires_at - b.created_at).total_seconds() == pytest.approx(10, abs=1)
    done = wait_ended(bob, b.id)
    kinds = Counter(r.result.type for r in results(bob, b.id).values())
    assert sum(kinds.values()) == n and kinds["expired"] > 0 and done.request_counts.expired == kinds["expired"]


def test_tokenmill_run_of_a_requests_file_writes_the_results_the_server_gives(server, keys, tmp_path):
    requests = [req(f"p{i}", q) for i, q in enumerate(PROMPTS)]
    alice = client(server, keys["alice"]["key"])
    served = results(alice, wait_ended(alice, alice.messages.batches.create(requests=requests).id).id)
    path = jsonl(tmp_path / "requests.jsonl", requests)
    out = tmp_path / "run"
    run_like_the_server(path, tmp_path, out)
    ran = {r.custom_id: r for r in (MessageBatchIndividualResponse.model_validate(json.loads(x))
                                    for x in (out / "results.jsonl").read_text().splitlines())}
    assert set(ran) == set(served) and not (out / "outputs.jsonl").exists()
    for cid in served:
        assert text_of(ran[cid]) == text_of(served[cid]), cid


def test_kill_9_of_the_server_mid_batch_then_a_restart_answers_each_custom_id_once(server, keys):
    alice = client(server, keys["alice"]["key"])
    n = 200
    b = alice.messages.batches.create(requests=[req(f"k{i:03d}", f"Write a long story about the number {i}.",
                                                    max_tokens=32) for i in range(n)])
    seen = wait_ended(alice, b.id, until=lambda x: x.request_counts.succeeded > 0 or x.processing_status == "ended")
    assert seen.processing_status == "in_progress" and seen.request_counts.succeeded < n
    server.kill9()
    eng = S.connect(server.config["db"])
    deadline = time.time() + 30  # the engine process leaves with its server
    while time.time() < deadline and S.is_live(S.JobStore(eng).get(b.id)):
        time.sleep(0.5)
    server.start()
    alice = client(server, keys["alice"]["key"])
    done = wait_ended(alice, b.id)
    got = results(alice, b.id)
    assert len(got) == n and {r.result.type for r in got.values()} == {"succeeded"}
    assert done.request_counts.succeeded == n
    with eng.connect() as conn:
        from sqlalchemy import text

        stored = conn.execute(text("SELECT count(*), count(DISTINCT id) FROM outputs WHERE job_id = :j"),
                              {"j": b.id}).one()
    assert tuple(stored) == (n, n)
