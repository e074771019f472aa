"""`tokenmill serve` end to end: one real server per module on loopback (the real engine on the
bundled model), driven by the real `openai` SDK: keys and isolation from the attacker's side,
bad input failing in `validating` with nothing run, limits, a mixed batch against `tokenmill
run`, cancel and expiry keeping finished lines, and `kill -9` of the server mid-batch."""

from __future__ import annotations

import json
import time

import httpx
import openai
import pytest

from tests.conftest import TEST_ENGINE
from tests.serve_server import Server, chat_line, jsonl, lines_of, run_like_the_server, wait_for
from tokenmill.schemas import storage as S

pytestmark = pytest.mark.engine

LIMITS = {"max_file_bytes": 400_000, "max_file_lines": 400, "max_batches_in_flight": 3}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve")
    cfg = {"db": f"sqlite:///{root / 'serve.db'}", "files": str(root / "files"), "work": str(root / "runs"),
           "models": {"smollm2-135m": {"engine": dict(TEST_ENGINE), "sampling": {"max_tokens": 16}}},
           "limits": LIMITS}
    srv = Server(root, cfg).start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def keys(server):
    return {name: server.make_key(name, admin=name == "admin") for name in ("alice", "bob", "carol", "admin")}


def _db(server):
    return S.connect(server.config["db"])


def _upload(client, path):
    with open(path, "rb") as fh:
        return client.files.create(file=fh, purpose="batch")


def test_no_key_a_wrong_key_and_a_revoked_key_get_401_and_health_needs_none(server, keys):
    assert httpx.get(f"{server.base_url}/health").json() == {"status": "ok"}
    for key in (None, "tm-not-a-key"):
        with pytest.raises(openai.AuthenticationError) as err:
            server.client(key).files.list()
        assert err.value.body["code"] == "invalid_api_key"
    r = httpx.get(f"{server.base_url}/v1/batches", headers={"Authorization": f"Basic {keys['alice']['key']}"})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    dave = server.make_key("dave")
    assert server.client(dave["key"]).batches.list().data == []
    res = server.cli("keys", "revoke", dave["id"])
    assert res.returncode == 0, res.stderr
    with pytest.raises(openai.AuthenticationError):
        server.client(dave["key"]).batches.list()
    listed = json.loads(server.cli("keys", "list", "--json").stdout)
    assert {k["name"] for k in listed} >= {"alice", "bob", "dave"} and all("hash" not in k for k in listed)
    assert [k["revoked_at"] is not None for k in listed if k["name"] == "dave"] == [True]


def test_two_keys_cannot_see_each_others_files_or_batches_and_an_admin_sees_both(server, keys, tmp_path):
    alice, bob = server.client(keys["alice"]["key"]), server.client(keys["bob"]["key"])
    f = _upload(alice, jsonl(tmp_path / "a.jsonl", [chat_line("x", "hi", model="no-such-model")]))
    b = alice.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    wait_for(alice, b.id)
    for call in (lambda: bob.files.retrieve(f.id), lambda: bob.files.content(f.id), lambda: bob.files.delete(f.id),
                 lambda: bob.batches.retrieve(b.id), lambda: bob.batches.cancel(b.id),
                 lambda: bob.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                                            completion_window="24h")):
        with pytest.raises(openai.NotFoundError):
            call()
    assert f.id not in {x.id for x in bob.files.list()} and b.id not in {x.id for x in bob.batches.list()}
    assert f.id in {x.id for x in alice.files.list()} and b.id in {x.id for x in alice.batches.list()}
    admin = server.client(keys["admin"]["key"])
    assert admin.files.retrieve(f.id).id == f.id and admin.batches.retrieve(b.id).id == b.id
    assert alice.files.content(f.id).text.startswith('{"custom_id": "x"')  # still there: bob's delete did nothing


def test_no_request_can_reach_a_path_outside_the_files_store(server, keys):
    h = {"Authorization": f"Bearer {keys['alice']['key']}"}
    for path in ("/v1/files/..%2F..%2Fserve.yaml/content", "/v1/files/file-..%2F..%2Fserve/content",
                 "/v1/files/%2Fetc%2Fpasswd/content", "/v1/files/file-000000000000000000000000/content"):
        r = httpx.get(f"{server.base_url}{path}", headers=h)
        assert r.status_code == 404 and "error" in r.json(), (path, r.text)
    r = httpx.get(f"{server.base_url}/v1/files/../../serve.yaml", headers=h)
    assert r.status_code == 404


BAD_FILES = [
    ("not JSON", ['{"custom_id": "a"', chat_line("b", "ok")], 1, "invalid_json_line"),
    ("wrong url", [chat_line("a", "ok"), {**chat_line("b", "ok"), "url": "/v1/images/generations"}], 2, "invalid_url"),
    ("wrong method", [{**chat_line("a", "ok"), "method": "GET"}], 1, "invalid_method"),
    ("duplicate custom_id", [chat_line("a", "ok"), "", chat_line("b", "ok"), chat_line("a", "again")], 4,
     "duplicate_custom_id"),
    ("unknown model", [chat_line("a", "ok"), chat_line("b", "ok", model="gpt-4o")], 2, "model_not_found"),
]


@pytest.mark.parametrize("what,lines,line,code", BAD_FILES, ids=[b[0] for b in BAD_FILES])
def test_a_bad_line_fails_the_batch_in_validating_naming_the_line_and_nothing_runs(server, keys, tmp_path, what,
                                                                                   lines, line, code):
    alice = server.client(keys["alice"]["key"])
    f = _upload(alice, jsonl(tmp_path / "bad.jsonl", lines))
    b = wait_for(alice, alice.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                                             completion_window="24h").id)
    assert b.status == "failed" and b.failed_at and b.in_progress_at is None, b
    assert [(e.code, e.line) for e in b.errors.data][:1] == [(code, line)], b.errors
    assert b.output_file_id is None and b.request_counts.completed == 0
    assert S.JobStore(_db(server)).get(b.id) is None  # no job: nothing ran


def test_limits_are_refused_in_openais_error_shape(server, keys, tmp_path):
    carol = server.client(keys["carol"]["key"])
    big = tmp_path / "big.jsonl"
    big.write_bytes(b'{"custom_id": "x"}\n' * (LIMITS["max_file_bytes"] // 19 + 10))
    with pytest.raises(openai.APIStatusError) as err:  # 413 from the body limit, before the upload is read
        _upload(carol, big)
    assert err.value.status_code in (400, 413) and err.value.body["code"] in ("file_too_large", "request_too_large")
    many = jsonl(tmp_path / "many.jsonl", [chat_line(f"m{i}", "hi") for i in range(LIMITS["max_file_lines"] + 1)])
    with pytest.raises(openai.BadRequestError) as err:
        _upload(carol, many)
    assert err.value.body["code"] == "too_many_lines"
    with pytest.raises(openai.BadRequestError) as err:
        carol.files.create(file=("x.jsonl", b"{}\n"), purpose="fine-tune")
    assert err.value.body["param"] == "purpose"
    f = _upload(carol, jsonl(tmp_path / "one.jsonl", [chat_line("a", "hi", max_tokens=1)]))
    for kw, param in (({"completion_window": "forever"}, "completion_window"), ({"endpoint": "/v1/moderations"},
                                                                                 "endpoint"),
                      ({"metadata": {"k" * 65: "v"}}, "metadata")):
        args = {"input_file_id": f.id, "endpoint": "/v1/chat/completions", "completion_window": "24h", **kw}
        with pytest.raises(openai.BadRequestError) as err:
            carol.batches.create(**args)
        assert err.value.body["param"] == param
    with pytest.raises(openai.NotFoundError):
        carol.batches.create(input_file_id="file-" + "0" * 24, endpoint="/v1/chat/completions", completion_window="24h")
    r = httpx.post(f"{server.base_url}/v1/batches", headers={"Authorization": f"Bearer {keys['carol']['key']}"},
                   content=b'{"input_file_id": "' + b"x" * (2 << 20) + b'"}')
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    r = httpx.post(f"{server.base_url}/v1/batches", headers={"Authorization": f"Bearer {keys['carol']['key']}"},
                   json={"endpoint": "/v1/chat/completions"})
    assert r.status_code == 400 and set(r.json()["error"]) == {"message", "type", "param", "code"}
    made = [carol.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h",
                                 metadata={"priority": "-5"}) for _ in range(LIMITS["max_batches_in_flight"])]
    with pytest.raises(openai.RateLimitError):
        carol.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    for b in made:
        # a one-line batch may already be finalizing (its line answered): it ends completed
        assert carol.batches.cancel(b.id).status in ("cancelling", "cancelled", "finalizing", "completed")
    ended = [wait_for(carol, b.id) for b in made]
    assert {b.status for b in ended} <= {"cancelled", "completed"}
    for b in ended:  # each line in exactly one file
        assert b.request_counts.completed + b.request_counts.failed == b.request_counts.total == 1


def _big_batch(client, tmp_path, n, name, max_tokens=48):
    lines = [chat_line(f"{name}{i:03d}", f"Write a long story about the number {i}.", max_tokens=max_tokens,
                       ignore_eos=True) for i in range(n)]
    return _upload(client, jsonl(tmp_path / f"{name}.jsonl", lines))


def _each_line_once(client, b, n):
    out, err = lines_of(client, b.output_file_id), lines_of(client, b.error_file_id)
    ids = [x["custom_id"] for x in out + err]
    assert len(ids) == len(set(ids)) == n, (len(ids), len(set(ids)), n)
    assert (b.request_counts.total, b.request_counts.completed, b.request_counts.failed) == (n, len(out), len(err))
    return out, err


def test_cancel_mid_batch_keeps_the_finished_lines_and_errors_the_rest(server, keys, tmp_path):
    alice = server.client(keys["alice"]["key"])
    f = _big_batch(alice, tmp_path, 160, "c")
    b = alice.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    seen = wait_for(alice, b.id, until=lambda x: x.request_counts and x.request_counts.completed > 0).request_counts
    cancelling = alice.batches.cancel(b.id)
    assert cancelling.status == "cancelling" and cancelling.cancelling_at
    done = wait_for(alice, b.id)
    assert done.status == "cancelled" and done.cancelled_at, done
    out, err = _each_line_once(alice, done, 160)
    assert len(out) >= seen.completed and 0 < len(err) < 160
    assert {e["error"]["code"] for e in err} == {"batch_cancelled"}
    assert all(o["response"]["status_code"] == 200 for o in out)
    with pytest.raises(openai.ConflictError):
        alice.batches.cancel(b.id)


def test_a_batch_past_its_completion_window_expires_keeping_its_finished_lines(server, keys, tmp_path):
    bob = server.client(keys["bob"]["key"])
    f = _big_batch(bob, tmp_path, 300, "e")
    b = bob.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="10s")
    assert b.expires_at - b.created_at == 10
    done = wait_for(bob, b.id)
    assert done.status == "expired" and done.expired_at, done
    out, err = _each_line_once(bob, done, 300)
    assert out and err and {e["error"]["code"] for e in err} == {"batch_expired"}


def test_a_mixed_batch_completes_with_the_answers_tokenmill_run_gives(server, keys, tmp_path):
    from openai.types import CreateEmbeddingResponse
    from openai.types.chat import ChatCompletion

    schema = {"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]}
    lines = [chat_line(f"chat{i}", q, max_tokens=12) for i, q in enumerate(
        ["What is the capital of France?", "Name a colour.", "Count to three."])]
    lines.append({**chat_line("json", "Answer in JSON: what is 2+2?", max_tokens=24),
                  "body": {**chat_line("json", "Answer in JSON: what is 2+2?", max_tokens=24)["body"],
                           "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}}}})
    lines += [{"custom_id": f"emb{i}", "method": "POST", "url": "/v1/embeddings",
               "body": {"model": "smollm2-135m", "input": t}} for i, t in enumerate(["a cat", "a dog"])]
    path = jsonl(tmp_path / "mixed.jsonl", lines)
    alice = server.client(keys["alice"]["key"])
    t0 = time.time()
    b = wait_for(alice, alice.batches.create(input_file_id=_upload(alice, path).id, endpoint="/v1/chat/completions",
                                             completion_window="24h", metadata={"team": "search"}).id)
    assert b.status == "completed" and b.metadata == {"team": "search"}, b
    assert b.in_progress_at and b.finalizing_at and b.completed_at and b.created_at <= b.completed_at <= time.time()
    assert b.usage.input_tokens > 0 and b.usage.output_tokens > 0
    served = {x["custom_id"]: x for x in lines_of(alice, b.output_file_id)}
    assert set(served) == {line["custom_id"] for line in lines} and b.error_file_id is None
    for cid, x in served.items():  # every body is what the SDK's own types accept
        (CreateEmbeddingResponse if cid.startswith("emb") else ChatCompletion).model_validate(x["response"]["body"])
    assert json.loads(served["json"]["response"]["body"]["choices"][0]["message"]["content"])["answer"]
    # the same file through `tokenmill run`, same engine config: the same greedy answers
    out = tmp_path / "run"
    run_like_the_server(path, tmp_path, out)
    ran = {x["custom_id"]: x for x in map(json.loads, (out / "outputs.jsonl").read_text().splitlines())}
    for cid in served:
        want, got = ran[cid]["response"]["body"], served[cid]["response"]["body"]
        if cid.startswith("emb"):
            a, c = want["data"][0]["embedding"], got["data"][0]["embedding"]
            dot = sum(x * y for x, y in zip(a, c))
            assert dot / (sum(x * x for x in a) ** 0.5 * sum(y * y for y in c) ** 0.5) > 0.999, cid
        else:
            assert got["choices"][0]["message"]["content"] == want["choices"][0]["message"]["content"], cid
    assert time.time() - t0 < 900


def test_kill_9_of_the_server_mid_batch_then_a_restart_completes_every_line_once(server, keys, tmp_path):
    alice = server.client(keys["alice"]["key"])
    n = 200
    f = _big_batch(alice, tmp_path, n, "k", max_tokens=32)
    b = alice.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    seen = wait_for(alice, b.id, until=lambda x: x.request_counts and x.request_counts.completed > 0).request_counts
    assert seen.completed < n
    server.kill9()
    eng = _db(server)
    deadline = time.time() + 30  # the engine process leaves with its server
    while time.time() < deadline and S.is_live(S.JobStore(eng).get(b.id)):
        time.sleep(0.5)
    server.start()
    alice = server.client(keys["alice"]["key"])
    done = wait_for(alice, b.id)
    assert done.status == "completed", done
    out, err = _each_line_once(alice, done, n)
    assert len(out) == n and err == []
    # the engine side: every line has one stored answer, and the engines answered at least every line once
    with eng.connect() as conn:
        from sqlalchemy import text

        stored = conn.execute(text("SELECT count(*), count(DISTINCT id) FROM outputs WHERE job_id = :j"),
                              {"j": b.id}).one()
        generated = conn.execute(text("SELECT sum(generated_rows) FROM workers WHERE job_id = :j"),
                                 {"j": b.id}).scalar()
    assert tuple(stored) == (n, n)
    assert generated >= n


def test_kill_9_of_the_engine_process_mid_batch_starts_another_that_completes_every_line_once(server, keys,
                                                                                               tmp_path):
    import psutil

    bob = server.client(keys["bob"]["key"])
    n = 120
    b = bob.batches.create(input_file_id=_big_batch(bob, tmp_path, n, "p", max_tokens=32).id,
                           endpoint="/v1/chat/completions", completion_window="24h")
    wait_for(bob, b.id, until=lambda x: x.request_counts and x.request_counts.completed > 0)
    engines = [p for p in psutil.Process(server.proc.pid).children() if "spawn" in " ".join(p.cmdline())]
    assert len(engines) == 1, [p.cmdline() for p in engines]
    engines[0].kill()
    done = wait_for(bob, b.id)
    assert done.status == "completed", done
    out, err = _each_line_once(bob, done, n)
    assert len(out) == n and err == []
    assert engines[0].pid not in {p.pid for p in psutil.Process(server.proc.pid).children()}


def test_metrics_need_an_admin_key_and_count_the_batches(server, keys):
    r = httpx.get(f"{server.base_url}/metrics", headers={"Authorization": f"Bearer {keys['alice']['key']}"})
    assert r.status_code == 403 and r.json()["error"]["type"] == "permission_error"
    assert httpx.get(f"{server.base_url}/metrics").status_code == 401
    r = httpx.get(f"{server.base_url}/metrics", headers={"Authorization": f"Bearer {keys['admin']['key']}"})
    assert r.status_code == 200
    assert 'tokenmill_serve_batches{status="completed"}' in r.text
    assert 'tokenmill_serve_engines_loaded{model="smollm2-135m"}' in r.text
    assert 'tokenmill_serve_work_lost{what="units_taken_over"} 0.0' in r.text  # one server: nothing taken over
