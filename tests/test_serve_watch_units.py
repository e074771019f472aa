"""Webhooks, quotas and usage of `tokenmill serve` without a server: which URLs are refused,
the event body and its signature against the `openai` SDK's own verifier and types, the
sender's retries against a receiver on loopback, and the usage and quota counts on both
backends against the jobs' own token totals."""

from __future__ import annotations

import time

import pytest
from sqlalchemy import insert

from tests.webhook_receiver import Receiver
from tokenmill.jobs.serve.config import Limits, Webhooks
from tokenmill.jobs.serve.quotas import Quotas
from tokenmill.jobs.serve.webhooks import (
    Refused,
    WebhookSender,
    check_url,
    event_body,
    event_id,
    new_secret,
    signed_headers,
)
from tokenmill.schemas import storage as S
from tokenmill.schemas import tables as T


def _resolving(*addrs):
    return lambda host, port: list(addrs)


@pytest.mark.parametrize("url,addrs", [
    ("http://127.0.0.1/x", ["127.0.0.1"]),
    ("http://localhost:9000/x", ["::1", "127.0.0.1"]),
    ("http://169.254.169.254/latest/meta-data/", ["169.254.169.254"]),
    ("http://metadata.google.internal/", ["169.254.169.254"]),
    ("http://[fd00:ec2::254]/", ["fd00:ec2::254"]),
    ("http://100.100.100.200/", ["100.100.100.200"]),
    ("https://intranet.example/", ["10.1.2.3"]),
    ("http://mapped.example/", ["::ffff:127.0.0.1"]),
    ("http://half.example/", ["93.184.216.34", "192.168.1.5"]),  # one private answer is enough to refuse
    ("http://0.0.0.0:8080/", ["0.0.0.0"]),
    ("file:///etc/passwd", []),
    ("gopher://example.com/", ["93.184.216.34"]),
    ("https://user:pw@example.com/", ["93.184.216.34"]),
    ("http:///nohost", []),
])
def test_a_url_that_is_not_http_or_not_public_is_refused(url, addrs):
    with pytest.raises(Refused) as err:
        check_url(url, [], _resolving(*addrs))
    assert "\n" not in str(err.value) and str(err.value)


def test_a_public_url_passes_and_allow_networks_opens_a_range():
    check_url("https://hooks.example.com/batches", [], _resolving("93.184.216.34", "2606:2800:220:1::1"))
    check_url("http://127.0.0.1:9000/hook", ["127.0.0.1/32"], _resolving("127.0.0.1"))
    with pytest.raises(Refused):
        check_url("http://127.0.0.2:9000/hook", ["127.0.0.1/32"], _resolving("127.0.0.2"))
    with pytest.raises(Refused, match="allow_networks"):
        check_url("http://10.0.0.7/", ["10.1.0.0/16"], _resolving("10.0.0.7"))


def test_the_event_is_openais_batch_event_and_its_signature_verifies_with_the_openai_sdk():
    from openai import InvalidWebhookSignatureError, OpenAI
    from openai.types.webhooks import BatchCompletedWebhookEvent

    secret = new_secret()
    evt = event_id("batch_abc", "batch.completed")
    assert evt == event_id("batch_abc", "batch.completed") != event_id("batch_abc", "batch.failed")
    body = event_body(evt, "batch.completed", "batch_abc", 1_796_000_000.5)
    headers = signed_headers(secret, evt, body, time.time())
    got = OpenAI(api_key="x", webhook_secret=secret).webhooks.unwrap(body, headers)
    assert isinstance(got, BatchCompletedWebhookEvent) and got.data.id == "batch_abc" and got.id == evt
    assert got.created_at == 1_796_000_000
    with pytest.raises(InvalidWebhookSignatureError):
        OpenAI(api_key="x", webhook_secret=new_secret()).webhooks.unwrap(body, headers)
    with pytest.raises(InvalidWebhookSignatureError):
        OpenAI(api_key="x", webhook_secret=secret).webhooks.unwrap(body.replace("abc", "abd"), headers)


def _ended_batch(eng, batch_id, owner, **kw):
    now = time.time()
    S.BatchStore(eng).add({"id": batch_id, "owner": owner, "endpoint": "/v1/chat/completions",
                           "input_file_id": "file-x", "completion_window": "24h", "created_at": now,
                           "expires_at": now + 3600, "in_progress_at": now, "finalizing_at": now,
                           "completed_at": now, **kw})


def test_the_sender_retries_with_backoff_delivers_once_and_records_every_attempt(tmp_path):
    eng = S.connect(f"sqlite:///{tmp_path / 'w.db'}")
    rx = Receiver(fail=2)
    try:
        secret = new_secret()
        S.KeyStore(eng).add("key_a", "a", "tm-a", webhook_url=rx.url, webhook_secret=secret)
        _ended_batch(eng, "batch_1", "key_a")
        clock = [time.time()]
        sender = WebhookSender(eng, Webhooks(allow_networks=["127.0.0.1/32"], first_retry_s=2, max_retry_s=3,
                                             retry_for_s=100), clock=lambda: clock[0])
        sender.batch_ended("batch_1")
        sender.batch_ended("batch_1")  # a second finalization: no second event
        outcomes = []
        for step in (0, 1.9, 0.2, 2.9, 0.2, 10):  # due at 0, then 2 s later, then min(4, 3) s later
            clock[0] += step
            outcomes.append(sender.send_due())
        assert outcomes == [1, 0, 1, 0, 1, 0]
        assert [code for _, _, code in rx.got] == [500, 500, 200]
        assert len({h["webhook-id"] for h, _, _ in rx.got}) == 1 and len({b for _, b, _ in rx.got}) == 1
        (ev,) = S.WebhookStore(eng).events("batch_1")
        assert [(a["attempt"], a["outcome"], a["status_code"]) for a in ev["attempt_log"]] == [
            (1, "failed", 500), (2, "failed", 500), (3, "delivered", 200)]
        assert ev["delivered_at"] and ev["next_at"] is None and ev["type"] == "batch.completed"
    finally:
        rx.close()


def test_the_sender_gives_up_after_retry_for_s_and_never_calls_a_refused_url(tmp_path):
    eng = S.connect(f"sqlite:///{tmp_path / 'w.db'}")
    failing, refused = Receiver(fail=99), Receiver(host="127.0.0.2")
    try:
        keys = S.KeyStore(eng)
        keys.add("key_a", "a", "tm-a", webhook_url=failing.url, webhook_secret=new_secret())
        keys.add("key_b", "b", "tm-b", webhook_url=refused.url, webhook_secret=new_secret())
        _ended_batch(eng, "batch_a", "key_a")
        _ended_batch(eng, "batch_b", "key_b")
        clock = [time.time()]
        sender = WebhookSender(eng, Webhooks(allow_networks=["127.0.0.1/32"], first_retry_s=1, max_retry_s=1,
                                             retry_for_s=2.5), clock=lambda: clock[0])
        for b in ("batch_a", "batch_b"):
            sender.batch_ended(b)
        for _ in range(6):
            sender.send_due()
            clock[0] += 1.01
        assert refused.got == []
        (b_ev,) = S.WebhookStore(eng).events("batch_b")
        assert [a["outcome"] for a in b_ev["attempt_log"]] == ["refused"] and b_ev["gave_up_at"]
        assert "127.0.0.2" in b_ev["attempt_log"][0]["error"]
        (a_ev,) = S.WebhookStore(eng).events("batch_a")
        assert [a["outcome"] for a in a_ev["attempt_log"]] == ["failed"] * 3 and a_ev["gave_up_at"]
        assert len(failing.got) == 3
    finally:
        failing.close()
        refused.close()


def _output(job_id, row, prompt, output, sample=0):
    return {"job_id": job_id, "input_file": 0, "input_row": row, "sample": sample, "id": f"r{row}",
            "prompt_tokens": prompt, "output_tokens": output}


@pytest.mark.parametrize("backend", ["sqlite", "postgres"])
def test_usage_per_key_per_day_adds_up_to_the_jobs_token_totals_and_a_quota_names_its_limit(backend, request,
                                                                                          tmp_path):
    url = f"sqlite:///{tmp_path / 'u.db'}" if backend == "sqlite" else request.getfixturevalue("pg_url")
    eng = S.connect(url)
    keys = S.KeyStore(eng)
    keys.add("key_a", "a", "tm-a")
    keys.add("key_b", "b", "tm-b")
    _ended_batch(eng, "batch_a1", "key_a")
    _ended_batch(eng, "batch_a2", "key_a")
    _ended_batch(eng, "batch_b1", "key_b")
    _ended_batch(eng, "batch_old", "key_a", created_at=time.time() - 3 * 86400)
    rows = [_output("batch_a1", 0, 10, 5), _output("batch_a1", 0, 10, 7, sample=1), _output("batch_a1", 1, 20, 3),
            _output("batch_a2", 0, 4, 4), _output("batch_b1", 0, 100, 100), _output("batch_old", 0, 9, 9)]
    with eng.begin() as conn:
        conn.execute(insert(T.outputs), rows)
        conn.execute(insert(T.dead_letters), [{"job_id": "batch_a2", "input_file": 0, "input_row": 1, "id": "r1",
                                               "reason": "too_long", "message": "x"}])
    reader = S.MetricsReader(eng)
    want = [reader.token_totals(j) for j in ("batch_a1", "batch_a2")]
    day = int(time.time() // 86400)
    usage = S.UsageStore(eng)
    (today,) = usage.by_day("key_a", since=day * 86400.0)
    assert today["day"] == day and today["batches"] == 2
    assert today["prompt_tokens"] == sum(w["prompt"] for w in want) == 34
    assert today["output_tokens"] == sum(w["output"] for w in want) == 19
    assert (today["lines_answered"], today["lines_failed"], today["lines"]) == (3, 1, 4)
    assert [r["key_id"] for r in usage.by_day(None, since=day * 86400.0)] == ["key_a", "key_b"]
    assert len(usage.by_day("key_a")) == 2  # the old batch's day too
    assert usage.tokens_since("key_a", day * 86400.0) == 53
    keys.update("key_a", tokens_per_day=53)
    quotas = Quotas(eng, Limits(max_batches_in_flight=5))
    over = quotas.over("key_a", in_flight=0)
    assert over is not None and over.limit == "tokens_per_day" and over.left == 0
    assert over.message.startswith("tokens_per_day:") and "53 of its 53" in over.message
    assert quotas.over("key_b", in_flight=4) is None
    over = quotas.over("key_b", in_flight=5)
    assert over is not None and over.limit == "max_batches_in_flight" and "0 left" in over.message
    keys.update("key_a", tokens_per_day=54)
    assert quotas.over("key_a", in_flight=0) is None


def test_over_quota_queue_admits_and_holds_a_batch_while_the_key_runs_its_limit(tmp_path):
    from tokenmill.jobs.serve.service import ApiError

    eng = S.connect(f"sqlite:///{tmp_path / 'q.db'}")
    S.KeyStore(eng).add("key_a", "a", "tm-a")
    now = time.time()
    batches = S.BatchStore(eng)
    for i, started in enumerate((True, False)):
        batches.add({"id": f"batch_{i}", "owner": "key_a", "endpoint": "/v1/chat/completions",
                     "input_file_id": "file-x", "completion_window": "24h", "created_at": now + i,
                     "expires_at": now + 3600, "in_progress_at": now if started else None})
    refuse = Quotas(eng, Limits(max_batches_in_flight=2))
    with pytest.raises(ApiError) as err:
        refuse.admit("key_a")
    assert err.value.status == 429 and err.value.param == "max_batches_in_flight"
    assert not refuse.holds(batches.get("batch_1"))
    queue = Quotas(eng, Limits(max_batches_in_flight=1, over_quota="queue"))
    queue.admit("key_a")  # accepted: held in validating instead
    assert queue.holds(batches.get("batch_1"))  # batch_0 runs: the key is at its one
    batches.set("batch_0", completed_at=now + 5)
    assert not queue.holds(batches.get("batch_1"))
