"""`tokenmill serve` from an attacker's side, on loopback, without a key: what one connection
may hold of the server is bounded (jobs/serve/guard.py, docs/SERVING.md "Limits at the HTTP
layer").  One warm server with short timeouts; every loop bounded."""

from __future__ import annotations

import socket
import time
from contextlib import ExitStack

import httpx
import pytest

from tests.serve_server import Server

HEAD_S, BODY_S = 2.0, 1.5
HTTP = {"head_timeout_s": HEAD_S, "body_timeout_s": BODY_S, "min_body_bytes_per_s": 1024, "max_connections": 16,
        "max_connections_per_client": 5}
SLACK_S = 1.5  # the test's own reads and the server's loop, over the documented limit
MIB = 1 << 20


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("limits")
    cfg = {"db": f"sqlite:///{root / 'serve.db'}", "files": str(root / "files"), "work": str(root / "runs"),
           "limits": {"max_file_bytes": 100_000}, "http": HTTP}
    srv = Server(root, cfg).start()
    yield srv
    srv.stop()


def _addr(server) -> tuple[str, int]:
    host, port = server.base_url.removeprefix("http://").split(":")
    return host, int(port)


def _connect(server, source: str = "127.0.0.1", timeout: float = 10.0) -> socket.socket:
    sock = socket.create_connection(_addr(server), timeout=timeout, source_address=(source, 0))
    return sock


def _rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as fh:
        return next(int(line.split()[1]) for line in fh if line.startswith("VmRSS:"))


def _closed_after(sock: socket.socket, limit_s: float) -> tuple[float, bytes]:
    """Seconds until the server closes `sock` (reading what it answers), failing past `limit_s`."""
    start, got = time.monotonic(), b""
    sock.settimeout(limit_s)
    try:
        while chunk := sock.recv(65536):
            got += chunk
    except ConnectionResetError:
        pass
    except TimeoutError:
        pytest.fail(f"still open after {limit_s} s")
    return time.monotonic() - start, got


def _health(server, source: str = "127.0.0.2") -> int:
    with httpx.Client(transport=httpx.HTTPTransport(local_address=source), timeout=5) as c:
        return c.get(f"{server.base_url}/health").status_code


@pytest.mark.parametrize("where", ["header", "url"])
def test_a_32_mib_header_or_url_is_refused_early_and_the_servers_rss_stays_flat(server, where):
    big = b"a" * (32 * MIB)
    head = (b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + big + b"\r\n\r\n" if where == "header"
            else b"GET /health?q=" + big + b" HTTP/1.1\r\nHost: x\r\n\r\n")
    _health(server)
    before = _rss_kib(server.proc.pid)
    for _ in range(20):
        with _connect(server) as sock:
            start = time.monotonic()
            with pytest.raises(OSError):  # the server stops reading and closes long before 32 MiB
                sock.sendall(head)
                sock.shutdown(socket.SHUT_WR)
                _closed_after(sock, 10)
                raise AssertionError("the server read the whole 32 MiB head and answered")
            assert time.monotonic() - start < 5
    assert _health(server) == 200
    grown = _rss_kib(server.proc.pid) - before
    assert grown < 16 * 1024, f"the server's RSS grew by {grown:,} KiB over 20 heads of 32 MiB"


def test_a_long_url_and_too_many_headers_are_refused_in_openais_error_shape(server):
    r = httpx.get(f"{server.base_url}/health", params={"q": "a" * 9000})
    assert r.status_code == 414 and r.json()["error"]["code"] == "url_too_long"
    r = httpx.get(f"{server.base_url}/health", headers={f"x-h{i}": "1" for i in range(120)})
    assert r.status_code == 431 and r.json()["error"]["code"] == "too_many_headers"
    assert _health(server) == 200


def test_a_silent_connection_and_a_trickled_head_are_closed_within_the_head_timeout(server):
    with _connect(server) as sock:
        took, got = _closed_after(sock, HEAD_S + SLACK_S)
        assert took >= HEAD_S - 0.2 and got == b""  # nothing sent: closed without an answer
    with _connect(server) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\n")
        start = time.monotonic()
        with pytest.raises(OSError):
            for _ in range(int((HEAD_S + SLACK_S) / 0.25)):  # a header byte every 0.25 s
                sock.sendall(b"X")
                time.sleep(0.25)
        assert time.monotonic() - start < HEAD_S + SLACK_S
        assert sock.recv(65536).startswith(b"HTTP/1.1 408")


@pytest.mark.parametrize("how", ["paused", "trickled"])
def test_a_slow_upload_body_is_closed_within_the_body_timeout(server, how):
    with _connect(server) as sock:
        sock.sendall(b"POST /v1/files HTTP/1.1\r\nHost: x\r\nContent-Type: multipart/form-data; boundary=b\r\n"
                     b"Content-Length: 90000\r\n\r\n--b\r\n")
        start = time.monotonic()
        if how == "trickled":  # 4 bytes/s, under min_body_bytes_per_s once the grace is over
            with pytest.raises(OSError):
                for _ in range(int((BODY_S + SLACK_S) / 0.25)):
                    sock.sendall(b"x")
                    time.sleep(0.25)
                _closed_after(sock, 0.1)
        else:
            _closed_after(sock, BODY_S + SLACK_S)
        assert time.monotonic() - start < BODY_S + SLACK_S


@pytest.mark.parametrize("path", ["/login", "/v1/files"])
def test_a_chunked_body_over_the_limit_gets_413_not_a_500_or_a_reset(server, path):
    key = server.make_key("uploader")["key"] if path == "/v1/files" else ""  # /login: without a key
    auth = f"Authorization: Bearer {key}\r\nContent-Type: multipart/form-data; boundary=b\r\n" if key else \
        "Content-Type: application/x-www-form-urlencoded\r\n"
    with _connect(server) as sock:
        sock.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\n{auth}Transfer-Encoding: chunked\r\n\r\n".encode())
        part = b'--b\r\nContent-Disposition: form-data; name="file"; filename="x.jsonl"\r\n\r\n' if key else b"k="
        sock.sendall(b"%x\r\n%s\r\n" % (len(part), part))
        chunk = b"a" * 65536
        for _ in range(24):  # 1.5 MiB: over /login's 1 MiB and the upload's 100,000 bytes
            sock.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
        sock.sendall(b"0\r\n\r\n")
        _, got = _closed_after(sock, 10)
    assert got.startswith(b"HTTP/1.1 413"), got[:200]
    assert b"request_too_large" in got
    assert _health(server) == 200


def test_connections_over_the_caps_are_refused_while_health_answers(server):
    with ExitStack() as held:
        for _ in range(HTTP["max_connections_per_client"]):
            held.enter_context(_connect(server, "127.0.0.3"))
        time.sleep(0.2)
        with _connect(server, "127.0.0.3") as extra:
            _, got = _closed_after(extra, 2)
            assert got.startswith(b"HTTP/1.1 503")
        assert _health(server) == 200  # another address still gets in
        for i in range(HTTP["max_connections"] - HTTP["max_connections_per_client"]):
            held.enter_context(_connect(server, f"127.0.1.{i // 4 + 1}"))
        time.sleep(0.2)
        with _connect(server, "127.0.0.9") as extra:
            _, got = _closed_after(extra, 2)
            assert got.startswith(b"HTTP/1.1 503")
    time.sleep(0.3)
    assert _health(server) == 200
