"""Webhooks, quotas and usage of `tokenmill serve` without a server: which URLs are refused,
the event body and its signature against the `openai` SDK's own verifier and types, the
sender's retries against a receiver on loopback, and the usage and quota counts on both
backends against the jobs' own token totals."""

from __future__ import annotations

import re
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


def _end(eng, sender, batch_id, owner, status="completed"):
    """A batch made finalizing, then ended by the sender (its ending and its event at once)."""
    _ended_batch(eng, batch_id, owner, completed_at=None)
    return sender.end_batch(S.BatchStore(eng).get(batch_id), status, **{f"{status}_at": time.time()})


def test_the_sender_retries_with_backoff_delivers_once_and_records_every_attempt(tmp_path):
    eng = S.connect(f"sqlite:///{tmp_path / 'w.db'}")
    rx = Receiver(fail=2)
    try:
        secret = new_secret()
        S.KeyStore(eng).add("key_a", "a", "tm-a", webhook_url=rx.url, webhook_secret=secret)
        clock = [time.time()]
        sender = WebhookSender(eng, Webhooks(allow_networks=["127.0.0.1/32"], first_retry_s=2, max_retry_s=3,
                                             retry_for_s=100), clock=lambda: clock[0])
        assert _end(eng, sender, "batch_1", "key_a")
        # a second finalization: the batch has ended, no second event
        assert not sender.end_batch(S.BatchStore(eng).get("batch_1"), "completed", completed_at=time.time())
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
        clock = [time.time()]
        sender = WebhookSender(eng, Webhooks(allow_networks=["127.0.0.1/32"], first_retry_s=1, max_retry_s=1,
                                             retry_for_s=2.5), clock=lambda: clock[0])
        for b, k in (("batch_a", "key_a"), ("batch_b", "key_b")):
            assert _end(eng, sender, b, k)
        for _ in range(6):
            sender.send_due()
            clock[0] += 1.01
        assert refused.got == []
        (b_ev,) = S.WebhookStore(eng).events("batch_b")
        assert [a["outcome"] for a in b_ev["attempt_log"]] == ["refused"] and b_ev["gave_up_at"]
        # the key reads its attempts: told why, never what its host resolved to
        assert "not a public address" in b_ev["attempt_log"][0]["error"]
        assert "127.0.0.2" not in b_ev["attempt_log"][0]["error"]
        (a_ev,) = S.WebhookStore(eng).events("batch_a")
        assert [a["outcome"] for a in a_ev["attempt_log"]] == ["failed"] * 3 and a_ev["gave_up_at"]
        assert len(failing.got) == 3
    finally:
        failing.close()
        refused.close()


def test_delivery_connects_to_the_address_it_checked_with_the_name_as_host_resolving_once(tmp_path):
    eng = S.connect(f"sqlite:///{tmp_path / 'w.db'}")
    rx = Receiver()
    try:
        port = rx.httpd.server_address[1]
        asked = []

        def resolve(host, p):  # `.invalid` never resolves (RFC 6761): only this answer can reach the receiver
            asked.append(host)
            return ["127.0.0.1"]

        S.KeyStore(eng).add("key_a", "a", "tm-a", webhook_url=f"http://hooks.invalid:{port}/hook",
                            webhook_secret=new_secret())
        sender = WebhookSender(eng, Webhooks(allow_networks=["127.0.0.1/32"]), resolve=resolve)
        assert _end(eng, sender, "batch_1", "key_a")
        assert sender.send_due() == 1
        ((headers, _, code),) = rx.got
        assert code == 200 and headers["host"] == f"hooks.invalid:{port}"
        assert asked == ["hooks.invalid"]  # one resolution, checked and connected to: no second one to rebind
        (ev,) = S.WebhookStore(eng).events("batch_1")
        assert [a["outcome"] for a in ev["attempt_log"]] == ["delivered"]
    finally:
        rx.close()


def test_a_name_that_resolves_to_loopback_by_delivery_is_refused_and_never_called(tmp_path):
    """The attacker registers a name that resolves to a public address, then points it at the
    server's own loopback (DNS rebinding); and a name that is loopback outright (`localhost`)."""
    eng = S.connect(f"sqlite:///{tmp_path / 'w.db'}")
    rx = Receiver()
    try:
        port = rx.httpd.server_address[1]
        answers = iter([["93.184.216.34"], ["127.0.0.1"]])
        rebinding = WebhookSender(eng, Webhooks(), resolve=lambda host, p: next(answers))
        url = f"http://rebind.example:{port}/hook"
        assert rebinding.check_batch_url(url) is None  # public when the batch named it
        S.KeyStore(eng).add("key_a", "a", "tm-a", webhook_secret=new_secret())
        _ended_batch(eng, "batch_1", "key_a", completed_at=None, metadata={"webhook_url": url})
        assert rebinding.end_batch(S.BatchStore(eng).get("batch_1"), "completed", completed_at=time.time())
        assert rebinding.send_due() == 1
        (ev,) = S.WebhookStore(eng).events("batch_1")
        assert [a["outcome"] for a in ev["attempt_log"]] == ["refused"] and ev["gave_up_at"]
        assert "not a public address" in ev["attempt_log"][0]["error"] and "127.0.0.1" not in ev["attempt_log"][0]["error"]
        # `localhost`, resolved by this host's own resolver at delivery
        S.KeyStore(eng).add("key_b", "b", "tm-b", webhook_url=f"http://localhost:{port}/hook",
                            webhook_secret=new_secret())
        sender = WebhookSender(eng, Webhooks())
        assert sender.check_batch_url(f"http://localhost:{port}/hook") is not None
        assert _end(eng, sender, "batch_2", "key_b")
        assert sender.send_due() == 1
        (ev,) = S.WebhookStore(eng).events("batch_2")
        assert [a["outcome"] for a in ev["attempt_log"]] == ["refused"]
        assert "not a public address" in ev["attempt_log"][0]["error"]  # what the key reads names no address
        assert rx.got == []
    finally:
        rx.close()


def test_signing_secrets_are_sealed_at_rest_under_a_0600_key_file_and_still_sign(tmp_path):
    import os

    from openai import OpenAI

    from tokenmill.jobs.serve.webhooks import SEALED, SecretBox, SecretError, key_path

    eng = S.connect(f"sqlite:///{tmp_path / 'w.db'}")
    rx = Receiver()
    try:
        cfg = Webhooks(allow_networks=["127.0.0.1/32"], secret_key_file=str(tmp_path / "serve" / "wh.key"))
        signing = new_secret()
        stored = SecretBox(key_path(cfg)).seal(signing)
        assert stored.startswith(SEALED) and signing not in stored and signing[6:] not in stored
        assert len(stored) <= T.api_keys.c.webhook_secret.type.length  # the column a plain secret had: no migration
        assert os.stat(tmp_path / "serve" / "wh.key").st_mode & 0o777 == 0o600
        S.KeyStore(eng).add("key_a", "a", "tm-a", webhook_url=rx.url, webhook_secret=stored)
        sender = WebhookSender(eng, cfg)
        assert _end(eng, sender, "batch_1", "key_a")
        assert sender.send_due() == 1
        ((headers, body, code),) = rx.got
        assert code == 200 and OpenAI(api_key="x", webhook_secret=signing).webhooks.unwrap(body, headers).data.id == "batch_1"
        assert sender.box.open("whsec_stored-before") == "whsec_stored-before"  # a plain one from before: as it is
        # the database without the key file (copied elsewhere): nothing it holds signs an event
        elsewhere = WebhookSender(eng, Webhooks(allow_networks=["127.0.0.1/32"],
                                                secret_key_file=str(tmp_path / "other.key")))
        with pytest.raises(SecretError, match="another key file"):
            elsewhere.box.open(stored)
        assert _end(eng, elsewhere, "batch_2", "key_a")
        assert elsewhere.send_due() == 1 and len(rx.got) == 1
        (ev,) = S.WebhookStore(eng).events("batch_2")
        assert [a["outcome"] for a in ev["attempt_log"]] == ["refused"]
        os.chmod(tmp_path / "serve" / "wh.key", 0o644)  # a key file others may read is not used
        with pytest.raises(SecretError, match="chmod 600"):
            SecretBox(key_path(cfg)).open(stored)
    finally:
        rx.close()


#: Run in a process of its own: a real BatchService ends a cancelled batch and is SIGKILLed
#: at the statement that inserts the batch's webhook event, after the ending's update.
_KILLED_WHILE_ENDING = """
import os, signal, sys
from sqlalchemy import event
from tokenmill.jobs.serve.config import ServeConfig
from tokenmill.jobs.serve.service import BatchService

svc = BatchService(ServeConfig.model_validate_json(sys.argv[1]))
def kill(conn, cursor, statement, *a):
    if statement.lstrip().upper().startswith("INSERT INTO WEBHOOK_EVENTS"):
        os.kill(os.getpid(), signal.SIGKILL)
event.listen(svc.eng, "before_cursor_execute", kill)
svc.scheduler.tick()
print("not killed")
"""


@pytest.mark.parametrize("backend", ["sqlite", "postgres"])
def test_a_server_killed_while_ending_a_batch_loses_no_event_and_its_restart_makes_exactly_one(backend, request,
                                                                                            tmp_path):
    import json
    import subprocess
    import sys

    from tests.serve_server import ROOT, chat_line
    from tokenmill.jobs.serve.config import ServeConfig
    from tokenmill.jobs.serve.objects import batch_status
    from tokenmill.jobs.serve.service import BatchService

    url = f"sqlite:///{tmp_path / 'k.db'}" if backend == "sqlite" else request.getfixturevalue("pg_url")
    rx = Receiver()
    try:
        cfg = ServeConfig(db=url, files=str(tmp_path / "files"), work=str(tmp_path / "runs"), models={"m": {}},
                          webhooks={"allow_networks": ["127.0.0.1/32"]})
        svc = BatchService(cfg)
        S.KeyStore(svc.eng).add("key_a", "a", "tm-a", webhook_url=rx.url, webhook_secret=new_secret())
        src = tmp_path / "in.jsonl"
        src.write_text(json.dumps(chat_line("a", "hi", model="m")) + "\n")
        f = svc.add_file("key_a", "in.jsonl", "batch", str(src), src.stat().st_size, 1)
        b = svc.create_batch("key_a", f["id"], "/v1/chat/completions", "24h", None)["id"]
        svc.cancel_batch("key_a", b)  # the next tick finalizes it: cancelled, every line an error line
        res = subprocess.run([sys.executable, "-c", _KILLED_WHILE_ENDING, cfg.model_dump_json()], cwd=ROOT,
                             capture_output=True, text=True, timeout=120)
        assert res.returncode == -9, res.stdout + res.stderr
        row = svc.batches.get(b)
        assert batch_status(row) == "finalizing" and row["cancelled_at"] is None  # the ending was not kept...
        assert S.WebhookStore(svc.eng).events(b) == []  # ...and neither was its event: both or neither
        for _ in range(2):  # restarted, and restarted again: one ending, one event
            again = BatchService(cfg)
            again.scheduler.tick()
            assert batch_status(again.batches.get(b)) == "cancelled"
            (ev,) = S.WebhookStore(again.eng).events(b)
            assert ev["type"] == "batch.cancelled"
            again.webhooks.send_due()
        assert [(h["webhook-id"], code) for h, _, code in rx.got] == [(ev["id"], 200)]
    finally:
        rx.close()


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


def test_the_page_lists_batches_that_are_no_job_yet_each_key_its_own(tmp_path):
    from fastapi.testclient import TestClient

    from tokenmill.jobs.serve.page import ui_app

    db = f"sqlite:///{tmp_path / 'p.db'}"
    eng = S.connect(db)
    keys, batches = S.KeyStore(eng), S.BatchStore(eng)
    keys.add("key_a", "a", "tm-aaaa")
    keys.add("key_b", "b", "tm-bbbb")
    now = time.time()
    for i, (owner, extra) in enumerate((("key_a", {}), ("key_a", {"in_progress_at": now, "model": "m", "lines": 7}),
                                        ("key_b", {}), ("key_a", {"failed_at": now}))):
        batches.add({"id": f"batch_{i}", "owner": owner, "endpoint": "/v1/chat/completions", "input_file_id": "file-x",
                     "completion_window": "24h", "created_at": now - 60 + i, "expires_at": now + 3600, **extra})
    client = TestClient(ui_app(db, "tmui-token"))

    def shown(secret):
        r = client.get("/", headers={"Authorization": f"Bearer {secret}"})
        assert r.status_code == 200
        return {m.group(1): m.group(2) for m in re.finditer(r'<tr data-batch="([^"]+)" data-status="([^"]+)"', r.text)}

    # validating, and validated but queued for its engine (no job row yet); an ended one is not waiting
    assert shown("tm-aaaa") == {"batch_0": "validating", "batch_1": "in_progress"}
    assert shown("tm-bbbb") == {"batch_2": "validating"}
    assert shown("tmui-token") == {"batch_0": "validating", "batch_1": "in_progress", "batch_2": "validating"}


@pytest.mark.parametrize("v4", ["127.0.0.1", "10.1.2.3", "169.254.169.254", "192.168.7.9"])
@pytest.mark.parametrize("form", ["::ffff:{}", "::{}", "64:ff9b::{}", "64:ff9b:1::{}", "2002:{:04x}:{:04x}::1",
                                  "2001:0:5db8:1::{:04x}:{:04x}"])
def test_every_ipv6_form_embedding_a_private_ipv4_is_refused_without_naming_an_address(form, v4):
    import ipaddress

    n = int(ipaddress.IPv4Address(v4))
    if form.startswith("2002:"):  # 6to4: the IPv4 address in bits 16-48
        addr = form.format(n >> 16, n & 0xFFFF)
    elif form.startswith("2001:0:"):  # Teredo: the client's IPv4 address, inverted, in the last 32 bits
        addr = form.format((~n >> 16) & 0xFFFF, ~n & 0xFFFF)
    else:
        addr = form.format(v4)
    with pytest.raises(Refused) as err:
        check_url("https://hooks.example.com/x", [], _resolving(addr))
    msg = str(err.value)
    assert "not a public address" in msg
    assert not re.search(r"\d+\.\d+\.\d+\.\d+|[0-9a-f]*:[0-9a-f]*:", msg), msg


def test_the_same_forms_of_a_public_ipv4_pass():
    check_url("https://hooks.example.com/x", [], _resolving("64:ff9b::93.184.216.34", "2002:5db8:d822::1"))
