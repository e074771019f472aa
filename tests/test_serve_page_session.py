"""The live page's login from an attacker's side, on a real server on loopback (uvicorn in a
thread, no engine): the cookie is a session, never the key, and `Secure` when the server is
configured behind TLS (or a trusted proxy says https; anyone else's `X-Forwarded-Proto` is
ignored); the session stops working after logout, after its key is revoked and once expired;
a login or logout posted from another site is refused with 403; and a hostile `Host` never
reaches a redirect's `Location`, on any redirecting route of `tokenmill serve` and `tokenmill ui`."""

from __future__ import annotations

import socket
import threading
import time
from contextlib import contextmanager

import httpx
import pytest

from tokenmill.jobs.serve.app import create_app
from tokenmill.jobs.serve.config import ServeConfig
from tokenmill.jobs.serve.page import COOKIE, ui_app
from tokenmill.schemas import storage as S
from tokenmill.schemas import tables as T

KEY, OTHER = "tm-alice-0123456789abcdef", "tm-bob-0123456789abcdef"
UI_TOKEN = "tmui-the-token-0123456789"
HOSTILE = "evil.example"


@contextmanager
def _serving(app, cfg=None):
    """`app` served by uvicorn on a free loopback port (lifespan off: no engine, no scheduler),
    with the proxy settings `tokenmill serve` takes from `cfg` (`tokenmill ui`'s: none)."""
    import uvicorn

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off",
                                           **(cfg.http.proxy_settings() if cfg else {"proxy_headers": False})))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.time() + 30
    while not server.started:
        assert time.time() < deadline and thread.is_alive(), "the server did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()


def _config(tmp_path, http=None, **page):
    return ServeConfig(db=f"sqlite:///{tmp_path / 'serve.db'}", files=str(tmp_path / "files"),
                       work=str(tmp_path / "runs"), page=page, http=http or {})


@pytest.fixture
def serve(tmp_path):
    """A `tokenmill serve` app on loopback (configured behind TLS) with two keys."""
    cfg = _config(tmp_path, behind_tls=True)
    app = create_app(cfg)
    keys = S.KeyStore(app.state.service.eng)
    keys.add("key_alice", "alice", KEY)
    keys.add("key_bob", "bob", OTHER)
    with _serving(app, cfg) as url:
        yield url, app.state.service.eng


def _login(url, secret, **headers):
    return httpx.post(f"{url}/login", data={"key": secret}, headers=headers, follow_redirects=False)


def _page(url, session):
    return httpx.get(f"{url}/", cookies={COOKIE: session}, follow_redirects=False)


def test_the_cookie_is_a_session_not_the_key_and_secure_behind_tls(serve):
    url, eng = serve
    r = _login(url, KEY)
    assert r.status_code == 303 and r.headers["location"] == "/"
    cookie = r.headers["set-cookie"]
    session = r.cookies[COOKIE]
    assert KEY not in cookie and session != KEY and len(session) >= 40
    flags = {f.strip().lower() for f in cookie.split(";")[1:]}
    assert {"httponly", "secure", "samesite=strict", "path=/"} <= flags, cookie
    assert _page(url, session).status_code == 200
    assert _page(url, KEY).status_code == 303  # the key itself is no cookie
    with eng.connect() as conn:  # only the session id's hash is stored, with its key
        (row,) = conn.execute(T.page_sessions.select()).mappings().all()
    assert row["key_id"] == "key_alice" and row["id_hash"] != session and session not in str(dict(row))
    assert row["expires_at"] > time.time() + 3600


def test_secure_follows_a_trusted_proxys_forwarded_proto_only(tmp_path):
    for http, secure in (({}, False), ({"trusted_proxies": ["10.0.0.0/8"]}, False),
                         ({"trusted_proxies": ["127.0.0.1/32"]}, True)):
        cfg = _config(tmp_path / str(len(http) + secure), http=http)
        app = create_app(cfg)
        S.KeyStore(app.state.service.eng).add("key_alice", "alice", KEY)
        with _serving(app, cfg) as url:
            cookie = _login(url, KEY, **{"X-Forwarded-Proto": "https"}).headers["set-cookie"]
        assert ("secure" in cookie.lower()) is secure, (http, cookie)


def test_a_session_stops_working_after_logout_after_its_key_is_revoked_and_once_expired(serve):
    url, eng = serve
    session = _login(url, KEY).cookies[COOKIE]
    kept = _login(url, KEY).cookies[COOKIE]  # a second login: its own session
    out = httpx.post(f"{url}/logout", cookies={COOKIE: session}, follow_redirects=False)
    assert out.status_code == 303 and out.headers["location"] == "/login"
    assert _page(url, session).status_code == 303  # the stolen cookie is dead, not just deleted in the browser
    assert _page(url, kept).status_code == 200
    bob = _login(url, OTHER).cookies[COOKIE]
    assert S.KeyStore(eng).revoke("key_alice") == 1
    assert _page(url, kept).status_code == 303
    assert httpx.get(f"{url}/jobs/anything", cookies={COOKIE: kept}, follow_redirects=False).status_code == 303
    assert _page(url, bob).status_code == 200  # another key's session lives on
    stale = S.SessionStore(eng).open("key_bob", ttl_s=0.05)
    time.sleep(0.1)
    assert _page(url, stale).status_code == 303


@pytest.mark.parametrize("headers", [
    {"Origin": "https://evil.example"},
    {"Origin": "null"},
    {"Sec-Fetch-Site": "cross-site", "Origin": "https://evil.example"},
    {"Sec-Fetch-Site": "same-site"},
    {"Referer": "https://evil.example/attack.html"},
])
def test_a_cross_site_login_or_logout_is_refused(serve, headers):
    url, eng = serve
    r = _login(url, KEY, **headers)
    assert r.status_code == 403 and COOKIE not in r.cookies
    session = _login(url, KEY).cookies[COOKIE]
    r = httpx.post(f"{url}/logout", cookies={COOKIE: session}, headers=headers, follow_redirects=False)
    assert r.status_code == 403 and _page(url, session).status_code == 200
    with eng.connect() as conn:
        assert len(conn.execute(T.page_sessions.select()).all()) == 1  # the refused login opened none


def test_a_same_origin_login_passes(serve):
    url, _ = serve
    host = url.split("://")[1]
    for headers in ({"Origin": url}, {"Sec-Fetch-Site": "same-origin", "Origin": "null"}, {"Referer": f"{url}/login"}):
        assert _login(url, KEY, **{**headers, "Host": host}).status_code == 303, headers


def _redirects(url, session):
    """Every redirecting request of the page and the API, each with a hostile Host."""
    yield "GET", "/", {}
    yield "GET", "/jobs/anything", {}
    yield "GET", "/login/", {}  # the framework's trailing-slash redirect
    yield "GET", "/jobs/anything/", {}
    yield "GET", "/page.css/", {}
    yield "POST", "/login", {"data": {"key": KEY}, "headers": {"Origin": f"http://{HOSTILE}"}}
    yield "POST", "/logout", {"cookies": {COOKIE: session}, "headers": {"Origin": f"http://{HOSTILE}"}}


@pytest.mark.parametrize("host_header", ["Host", "X-Forwarded-Host"])
def test_a_host_header_never_reaches_a_location(serve, tmp_path, host_header):
    url, _ = serve
    session = _login(url, KEY).cookies[COOKIE]
    api = [("GET", "/v1/batches/", {"headers": {"Authorization": f"Bearer {KEY}"}}),
           ("GET", "/v1/files/", {"headers": {"Authorization": f"Bearer {KEY}"}}), ("GET", "/v1/usage/", {})]
    eng = S.connect(f"sqlite:///{tmp_path / 'ui.db'}")
    S.KeyStore(eng).add("key_alice", "alice", KEY)
    with _serving(ui_app(f"sqlite:///{tmp_path / 'ui.db'}", UI_TOKEN)) as ui_url:
        seen = 0
        for base, routes in ((url, [*_redirects(url, session), *api]), (ui_url, list(_redirects(ui_url, session)))):
            for method, path, kw in routes:
                headers = {**kw.pop("headers", {}), host_header: HOSTILE}
                r = httpx.request(method, f"{base}{path}", headers=headers, follow_redirects=False, **kw)
                if r.status_code == 403:  # a login or logout whose Origin is the hostile host's own
                    continue
                assert 300 <= r.status_code < 400, (base, method, path, r.status_code)
                location = r.headers["location"]
                assert HOSTILE not in location and location.startswith("/") and not location.startswith("//"), \
                    (path, location)
                seen += 1
        assert seen >= 10


def test_tokenmill_ui_sessions_are_its_own_tokens_and_end_with_it(tmp_path):
    db = f"sqlite:///{tmp_path / 'ui.db'}"
    with _serving(ui_app(db, UI_TOKEN)) as url:
        r = _login(url, UI_TOKEN)
        session = r.cookies[COOKIE]
        assert UI_TOKEN not in r.headers["set-cookie"] and _page(url, session).status_code == 200
        assert "secure" not in r.headers["set-cookie"].lower()  # plain http on loopback
    with _serving(ui_app(db, "tmui-a-later-token-987654321")) as url:  # a later ui over the same database
        assert _page(url, session).status_code == 303
