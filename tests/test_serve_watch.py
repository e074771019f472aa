"""Webhooks, quotas and usage of a real `tokenmill serve` on loopback (one server for the module,
the real engine on the bundled model, the `openai` SDK as the client): each ending sends one
signed `batch.*` event that the SDK's own verifier accepts, after the receiver refused the
first two attempts; a URL in a refused range is never called; a quota is refused with 429
naming the limit; the usage per key adds up to `tokenmill status --json` of its batches.  The
live page in a real headless Chromium: a running batch's progress advancing, a queued batch
listed before it is a job, a job's page drawing the report's figures (running and finished)
with the estimate beside them, each key seeing only its own."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time

import httpx
import openai
import pytest

from tests.conftest import TEST_ENGINE
from tests.serve_server import ROOT, Server, chat_line, jsonl, wait_for
from tests.webhook_receiver import Receiver
from tokenmill.jobs.serve.page import COOKIE
from tokenmill.schemas import storage as S

PRICE = 3.6  # USD an hour: a cost the usage can be checked against


@pytest.fixture(scope="module")
def receivers():
    ok, refused = Receiver(fail=2), Receiver(host="127.0.0.2")
    yield ok, refused
    ok.close()
    refused.close()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve-watch")
    cfg = {"db": f"sqlite:///{root / 'serve.db'}", "files": str(root / "files"), "work": str(root / "runs"),
           "models": {"smollm2-135m": {"engine": dict(TEST_ENGINE), "sampling": {"max_tokens": 8},
                                       "price_per_hour": PRICE}},
           "webhooks": {"allow_networks": ["127.0.0.1/32"], "first_retry_s": 0.3, "max_retry_s": 1,
                        "retry_for_s": 120, "secret_key_file": str(root / "webhook-secrets.key")}}
    srv = Server(root, cfg).start()
    yield srv
    srv.stop()


def _upload(client, path):
    with open(path, "rb") as fh:
        return client.files.create(file=fh, purpose="batch")


def _verified(key, got, batch_id):
    """Each delivery of the batch's events verified and parsed by the openai SDK (its Standard
    Webhooks signature with the key's secret)."""
    client = openai.OpenAI(api_key="x", webhook_secret=key["webhook_secret"])
    return [client.webhooks.unwrap(body, headers) for headers, body, _ in got
            if json.loads(body)["data"]["id"] == batch_id]


def test_an_ending_sends_one_signed_event_after_two_failed_attempts_recorded_on_the_batch(server, receivers,
                                                                                        tmp_path):
    ok, _ = receivers
    res = server.cli("keys", "create", "--name", "hooked", "--json", "--webhook-url", ok.url)
    assert res.returncode == 0, res.stderr
    key = json.loads(res.stdout)
    assert key["webhook_secret"].startswith("whsec_")
    stored = S.KeyStore(S.connect(server.config["db"])).get(key["id"])["webhook_secret"]
    assert stored.startswith("tmenc1:") and key["webhook_secret"] not in stored  # sealed at rest
    client = server.client(key["key"])
    f = _upload(client, jsonl(tmp_path / "bad.jsonl", [chat_line("a", "hi", model="no-such-model")]))
    b = wait_for(client, client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                                               completion_window="24h").id)
    assert b.status == "failed"
    ok.wait(lambda got: any(code == 200 for _, _, code in got))
    time.sleep(2)  # nothing more comes once it was delivered
    mine = _verified(key, ok.got, b.id)
    assert [e.type for e in mine] == ["batch.failed"] * 3 and len({e.id for e in mine}) == 1
    assert [code for h, _, code in ok.got if h["webhook-id"] == mine[0].id] == [500, 500, 200]
    r = httpx.get(f"{server.base_url}/v1/batches/{b.id}/webhooks", headers={"Authorization": f"Bearer {key['key']}"})
    (ev,) = r.json()["data"]
    assert ev["id"] == mine[0].id and ev["type"] == "batch.failed" and ev["delivered_at"]
    assert [(a["outcome"], a["status_code"]) for a in ev["attempt_log"]] == [
        ("failed", 500), ("failed", 500), ("delivered", 200)]
    other = server.make_key("other")
    r = httpx.get(f"{server.base_url}/v1/batches/{b.id}/webhooks", headers={"Authorization": f"Bearer {other['key']}"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
    assert httpx.get(f"{server.base_url}/v1/batches/{b.id}/webhooks").status_code == 401


def test_a_url_in_a_refused_range_is_never_called(server, receivers, tmp_path):
    _, refused = receivers
    res = server.cli("keys", "create", "--name", "metadata-hook", "--json")
    key = json.loads(res.stdout)
    client = server.client(key["key"])
    f = _upload(client, jsonl(tmp_path / "bad.jsonl", [chat_line("a", "hi", model="no-such-model")]))
    for url in (refused.url, "http://169.254.169.254/latest/meta-data/", "http://[::1]:9/x", "file:///etc/passwd",
                "http://10.0.0.1/x"):
        with pytest.raises(openai.BadRequestError) as err:
            client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h",
                                  metadata={"webhook_url": url})
        assert err.value.body["param"] == "metadata.webhook_url", url
    res = server.cli("keys", "create", "--name", "x", "--webhook-url", refused.url)
    assert res.returncode == 2 and "127.0.0.2" in res.stderr and "allow_networks" in res.stderr
    # a key whose URL went into a refused range after it was set (a name resolving elsewhere now)
    S.KeyStore(S.connect(server.config["db"])).update(key["id"], webhook_url=refused.url)
    b = wait_for(client, client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                                               completion_window="24h").id)
    assert b.status == "failed"
    deadline = time.time() + 30
    while time.time() < deadline:
        data = httpx.get(f"{server.base_url}/v1/batches/{b.id}/webhooks",
                         headers={"Authorization": f"Bearer {key['key']}"}).json()["data"]
        if data and data[0]["gave_up_at"]:
            break
        time.sleep(0.2)
    assert [a["outcome"] for a in data[0]["attempt_log"]] == ["refused"], data
    assert refused.got == []


@pytest.mark.engine
def test_quotas_refuse_with_429_naming_the_limit_and_usage_adds_up_to_the_jobs_accounting(server, receivers,
                                                                                       tmp_path):
    ok, _ = receivers
    key = server.make_key("quota")
    res = server.cli("keys", "quota", key["id"], "--tokens-per-day", "1", "--batches-in-flight", "1")
    assert res.returncode == 0, res.stderr
    client = server.client(key["key"])
    f = _upload(client, jsonl(tmp_path / "ok.jsonl", [chat_line(f"q{i}", f"Say {i}.", max_tokens=8)
                                                      for i in range(3)]))
    first = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h",
                                  metadata={"webhook_url": ok.url})
    with pytest.raises(openai.RateLimitError) as err:
        client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    assert err.value.body["message"].startswith("max_batches_in_flight: this key has 1 batches not ended")
    assert "0 left" in err.value.body["message"] and err.value.body["param"] == "max_batches_in_flight"
    done = wait_for(client, first.id)
    assert done.status == "completed", done
    metrics = S.JobStore(S.connect(server.config["db"])).get(first.id)["metrics"]  # the job's own accounting
    used = metrics["tokens"]["prompt"] + metrics["tokens"]["output"]
    with pytest.raises(openai.RateLimitError) as err:
        client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    msg = err.value.body["message"]
    assert msg.startswith(f"tokens_per_day: this key's batches used {used:,} of its 1 tokens today") and "0 left" in msg
    # the completed batch's event: one delivery after two refused attempts, signed with the key's secret
    ok.wait(lambda got: any(code == 200 and json.loads(body)["data"]["id"] == first.id for _, body, code in got))
    mine = _verified(key, ok.got, first.id)
    assert [e.type for e in mine] == ["batch.completed"] * 3
    # usage: the key's day against the job's own accounting
    res = server.cli("keys", "usage", key["id"], "--json")
    assert res.returncode == 0, res.stderr
    (day,) = json.loads(res.stdout)
    assert (day["batches"], day["lines"], day["lines_answered"]) == (1, 3, 3)
    assert (day["prompt_tokens"], day["output_tokens"]) == (metrics["tokens"]["prompt"], metrics["tokens"]["output"])
    assert day["prompt_tokens"] == done.usage.input_tokens and day["output_tokens"] == done.usage.output_tokens
    assert day["cost"] == pytest.approx(metrics["cost"]["total"]) and day["cost"] > 0
    assert day["engine_hours"] == pytest.approx(metrics["throughput"]["generation_wall_s"] / 3600)
    r = httpx.get(f"{server.base_url}/v1/usage", headers={"Authorization": f"Bearer {key['key']}"})
    assert r.json()["data"] == [{k: v for k, v in day.items() if k not in ("date", "name")}]


# ---------------------------------------------------------------- the live page, in a real headless Chromium

CHROMIUM = "/usr/bin/chromium"


@pytest.fixture(scope="module")
def browser():
    import os

    if not os.path.exists(CHROMIUM):
        pytest.skip(f"no Chromium at {CHROMIUM} (Debian's package `chromium`: apt-get install -y chromium)")
    sync_api = pytest.importorskip("playwright.sync_api", reason="the `playwright` package (the test extra)")
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=["--no-sandbox"])
        yield b
        b.close()


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory):
    return tmp_path_factory.mktemp("artifacts")


def _logged_in(browser, server, key):
    page = browser.new_context(viewport={"width": 1400, "height": 900}).new_page()
    page.goto(f"{server.base_url}/")
    assert page.url.endswith("/login")
    page.fill("input[name=key]", key)
    page.click("button[type=submit]")
    page.wait_for_url(f"{server.base_url}/")
    (cookie,) = [c for c in page.context.cookies() if c["name"] == COOKIE]
    assert cookie["httpOnly"] and cookie["sameSite"] == "Strict"  # no script of any page reads the session
    assert cookie["value"] != key  # a session's random id, never the key
    return page


#: An estimate of the page test's batch (as `tokenmill estimate` stores one), shown beside what happened.
ESTIMATE = {"tokens": {"output": {"value": 3840, "lo": 3500, "hi": 4000}, "prompt": {"value": 4000, "lo": 3900,
                                                                                  "hi": 4100}},
            "generation_wall_s": {"value": 40.0, "lo": 25.0, "hi": 60.0}, "engine": "vllm"}


def _plots_drawn(page, names):
    """Each named figure of the report drawn by plotly.js in the page (its SVG, with bars or lines)."""
    for name in names:
        page.wait_for_selector(f"#plot-{name}[data-drawn] .main-svg", timeout=30_000)
        assert page.query_selector(f"#plot-{name} .main-svg .trace") is not None, name


def test_the_page_needs_a_key_and_a_wrong_one_is_told_so(server, browser, artifacts):
    page = browser.new_context().new_page()
    page.goto(f"{server.base_url}/jobs/anything")
    assert page.url.endswith("/login")
    page.fill("input[name=key]", "tm-not-a-key")
    page.click("button[type=submit]")
    assert "unknown or revoked" in page.inner_text("[role=alert]")
    page.screenshot(path=str(artifacts / "login-refused.png"))
    assert httpx.get(f"{server.base_url}/", follow_redirects=False).status_code == 303
    cookie = page.context.cookies()
    assert not any(c["name"] == COOKIE for c in cookie)


@pytest.mark.engine
def test_the_page_shows_a_running_batch_advancing_and_a_key_sees_only_its_own(server, browser, artifacts, tmp_path):
    alice, bob = server.make_key("page-alice"), server.make_key("page-bob")
    client = server.client(alice["key"])
    lines = [chat_line(f"p{i:03d}", f"Write a long story about the number {i}.", max_tokens=32, ignore_eos=True)
             for i in range(120)]
    b = client.batches.create(input_file_id=_upload(client, jsonl(tmp_path / "p.jsonl", lines)).id,
                              endpoint="/v1/chat/completions", completion_window="24h")
    page = _logged_in(browser, server, alice["key"])
    row = f"tr[data-job='{b.id}']"
    page.wait_for_selector(f"{row}[data-status=running] [data-done]:not([data-done='0'])", timeout=300_000)
    first = int(page.get_attribute(f"{row} [data-done]", "data-done"))
    assert "running a batch" in page.inner_text(f"{row} td:last-child")
    page.screenshot(path=str(artifacts / "jobs-running.png"))
    # a second batch queued behind the first: no job yet, listed as a batch not started
    queued = client.batches.create(input_file_id=_upload(client, jsonl(tmp_path / "q.jsonl", lines[:2])).id,
                                   endpoint="/v1/chat/completions", completion_window="24h")
    # the running job's own page: the report's figures, drawn while it runs, the estimate beside them
    S.EstimateStore(S.connect(server.config["db"])).add(b.id, ESTIMATE, sample_rows=12, total_rows=120)
    job = page.context.new_page()
    refused = []  # what the page's Content-Security-Policy refused (plotly.js is served by the page itself)
    job.on("console", lambda m: refused.append(m.text) if "Content Security Policy" in m.text else None)
    job.goto(f"{server.base_url}/jobs/{b.id}")
    assert job.get_attribute("[data-status]", "data-status") == "running"
    _plots_drawn(job, ("latency", "throughput"))
    assert "output tokens" in job.inner_text("table.estimate")
    traces = [t.get("name") for t in json.loads(job.get_attribute("#plot-throughput", "data-plot"))["data"]]
    assert any(name and name.startswith("estimate:") for name in traces), traces
    job.screenshot(path=str(artifacts / "job-running.png"), full_page=True)
    assert refused == []
    csp = httpx.get(f"{server.base_url}/jobs/{b.id}", headers={"Authorization": f"Bearer {alice['key']}"}).headers[
        "content-security-policy"]
    assert "script-src" not in csp and "default-src 'self'" in csp and "unsafe-eval" not in csp  # scripts: own files
    page.wait_for_selector(f"table.waiting tr[data-batch='{queued.id}']", timeout=30_000)
    page.screenshot(path=str(artifacts / "jobs-waiting.png"), full_page=True)
    client.batches.cancel(queued.id)
    # the page refreshes itself: no reload here
    deadline = time.time() + 120  # read from here: the page's CSP refuses a script the test would evaluate in it
    while int(page.get_attribute(f"{row} [data-done]", "data-done")) <= first:
        assert time.time() < deadline, "the page's progress did not advance"
        time.sleep(0.2)
    assert page.get_attribute(f"{row} [data-done]", "data-total") == "120"
    assert page.inner_text(f"{row} [data-figure=tokens]") not in ("", "-")
    other = _logged_in(browser, server, bob["key"])
    assert other.query_selector(row) is None and b.id not in other.content()
    other.goto(f"{server.base_url}/jobs/{b.id}")
    assert "No such job" in other.inner_text("h1")
    other.screenshot(path=str(artifacts / "jobs-other-key.png"))
    done = wait_for(client, b.id)
    assert done.status == "completed"
    page.goto(f"{server.base_url}/jobs/{b.id}")
    page.wait_for_selector("[data-status=succeeded]")
    _plots_drawn(page, ("latency", "throughput", "cost"))
    shown = {el.get_attribute("data-figure"): json.loads(el.get_attribute("data-value"))
             for el in page.query_selector_all("td[data-figure]")}
    page.screenshot(path=str(artifacts / "job-finished.png"), full_page=True)
    res = subprocess.run([sys.executable, "-m", "tokenmill.jobs.cli", "status", b.id, "--json", "--db",
                          server.config["db"]], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    status = json.loads(res.stdout)
    common = set(shown) & set(status)
    assert {"total", "succeeded", "failed", "output_tok_per_s", "generation_wall_s", "ttft_p50_s"} <= common
    assert {k: shown[k] for k in common} == {k: status[k] for k in common}
    admin = _logged_in(browser, server, server.make_key("page-admin", admin=True)["key"])
    assert admin.query_selector(f"tr[data-job='{b.id}']") is not None
    admin.screenshot(path=str(artifacts / "jobs-admin.png"), full_page=True)


def test_tokenmill_ui_serves_the_page_over_a_database_behind_its_token(server, browser, artifacts):
    proc = subprocess.Popen([sys.executable, "-m", "tokenmill.jobs.cli", "ui", "--db", server.config["db"], "--port",
                             "0"], cwd=ROOT, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stderr.readline()
        m = re.search(r"(http://[\d.]+:\d+)/ \(log in with (\S+)\)", line)
        assert m, line
        url, token = m.groups()
        assert httpx.get(f"{url}/", follow_redirects=False).status_code == 303
        assert httpx.get(f"{url}/", headers={"Authorization": "Bearer tmui-wrong"},
                         follow_redirects=False).status_code == 303
        page = browser.new_context().new_page()
        page.goto(f"{url}/")
        page.fill("input[name=key]", token)
        page.click("button[type=submit]")
        page.wait_for_selector("table.jobs")
        assert int(page.inner_text("[data-count=all]")) == len(S.JobStore(S.connect(server.config["db"])).recent(10**6))
        page.screenshot(path=str(artifacts / "ui.png"), full_page=True)
    finally:
        proc.terminate()
        proc.wait(30)
