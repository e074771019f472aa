"""A webhook receiver on loopback for the tests: records every POST (headers, body, the status
it answered) and answers 500 to the first `fail` attempts of each event (by `webhook-id`), each
answer `delay` seconds after the request (a slow receiver)."""

from __future__ import annotations

import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class Receiver:
    def __init__(self, host: str = "127.0.0.1", fail: int = 0, delay: float = 0.0):
        self.got: list[tuple[dict[str, str], bytes, int]] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("content-length", 0)))
                time.sleep(delay)
                seen = sum(1 for h, _, _ in outer.got if h.get("webhook-id") == self.headers.get("webhook-id"))
                code = 500 if seen < fail else 200
                outer.got.append(({k.lower(): v for k, v in self.headers.items()}, body, code))
                self.send_response(code)
                self.send_header("content-length", "0")
                self.end_headers()

            def log_message(self, *a):
                pass

        self.httpd = ThreadingHTTPServer((host, 0), Handler)
        self.url = f"http://{host}:{self.httpd.server_address[1]}/hook"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def of(self, event_id: str) -> list[tuple[dict[str, str], bytes, int]]:
        return [g for g in self.got if g[0].get("webhook-id") == event_id]

    def wait(self, until, timeout: float = 60.0) -> None:
        deadline = time.time() + timeout
        while not until(self.got):
            if time.time() > deadline:
                raise AssertionError(f"the receiver got {[(g[0].get('webhook-id'), g[2]) for g in self.got]}")
            time.sleep(0.1)

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
