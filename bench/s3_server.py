"""A real S3 endpoint on loopback for the benchmarks: moto's server (the WSGI app and
request handler `moto.server.ThreadedMotoServer` runs, in a thread of this process),
counting the body bytes it sends in answer to GetObject requests on chosen keys.

The count is taken where the server writes: each answer's body goes to the socket in
CHUNK-byte pieces, and a piece counts once werkzeug has written and flushed it and asks
for the next.  So `sent` is what left the server (into the kernel's socket buffers; a
client that hangs up mid-answer still got what was in flight), short by less than one
piece per answer cut off; `asked` is what the answers' Content-Length said they would
carry (for a `Range: bytes=N-` request, the rest of the object from N).

    with CountingS3() as s3:
        s3.put_file("bucket", "key", path)
        with s3.env():                    # AWS_ENDPOINT_URL_S3 and test credentials
            ...                           # a `tokenmill run` subprocess reading s3://bucket/key
        got = s3.take()                   # {"get_requests", "bytes_sent", "bytes_asked", ...}; then zero
"""

from __future__ import annotations

import os
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator
from urllib.parse import parse_qsl, unquote

#: Bytes written to the socket at once; the most one cut-off answer's count falls short by.
CHUNK = 64 * 1024
#: Query parameters a GetObject may carry (any other marks a sub-resource: ?tagging, ?acl, ...).
GET_OBJECT_PARAMS = {"versionId", "partNumber"}
#: The standard AWS variables boto3 (and so Beam's S3 filesystem and tokenmill) read.
TEST_CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                    "AWS_DEFAULT_REGION": "us-east-1"}


class CountingS3:
    """moto's S3 server on 127.0.0.1 (a free port), counting GetObject answers on the keys
    given to `put_file` (as `bucket/key`)."""

    def __init__(self) -> None:
        from moto.moto_server.werkzeug_app import MotoRequestHandler
        from moto.server import DomainDispatcherApplication, create_backend_app
        from werkzeug.serving import make_server

        self._lock = threading.Lock()
        self.keys: set[str] = set()
        self.in_flight = 0
        self._zero()
        class Quiet(MotoRequestHandler):
            def log_request(self, *args) -> None:  # not a line per request on the bench's terminal
                pass

        app = DomainDispatcherApplication(create_backend_app)
        self.server = make_server("127.0.0.1", 0, self._counting(app), True, request_handler=Quiet)
        self.endpoint = "http://127.0.0.1:%d" % self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> CountingS3:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.thread.join(timeout=10)

    # ---------------------------------------------------------------- the count

    def _zero(self) -> None:
        self.get_requests = self.bytes_sent = self.bytes_asked = self.cut_off = 0
        self.ranges: list[str] = []

    def take(self, wait_s: float = 10.0) -> dict[str, Any]:
        """The counts since the last `take` (or the start), then zero them; first waits up to
        `wait_s` for answers still being written (a client that just exited)."""
        end = time.monotonic() + wait_s
        while self.in_flight and time.monotonic() < end:
            time.sleep(0.05)
        with self._lock:
            got = {"get_requests": self.get_requests, "bytes_sent": self.bytes_sent, "bytes_asked": self.bytes_asked,
                   "answers_cut_off": self.cut_off, "ranges": self.ranges}
            self._zero()
        return got

    def _counted(self, environ: dict[str, Any]) -> bool:
        if environ["REQUEST_METHOD"] != "GET" or unquote(environ.get("PATH_INFO", "")).lstrip("/") not in self.keys:
            return False
        return all(k in GET_OBJECT_PARAMS for k, _ in parse_qsl(environ.get("QUERY_STRING", ""), keep_blank_values=True))

    def _counting(self, app):
        def counting(environ, start_response):
            if not self._counted(environ):
                return app(environ, start_response)
            asked = []

            def start(status, headers, exc_info=None):
                asked.extend(int(v) for k, v in headers if k.lower() == "content-length" and status[:1] == "2")
                return start_response(status, headers, exc_info)

            body = app(environ, start)
            with self._lock:
                self.get_requests += 1
                self.in_flight += 1
                self.bytes_asked += sum(asked)
                self.ranges.append(environ.get("HTTP_RANGE", "all"))
            return self._pieces(body)

        return counting

    def _pieces(self, body) -> Iterator[bytes]:
        done = False
        try:
            for part in body:
                view = memoryview(part)
                for at in range(0, len(view), CHUNK):
                    piece = view[at:at + CHUNK]
                    yield bytes(piece)
                    with self._lock:  # werkzeug wrote and flushed the piece and asks for the next
                        self.bytes_sent += len(piece)
            done = True
        finally:
            with self._lock:
                self.in_flight -= 1
                self.cut_off += not done  # the client hung up: werkzeug closed this iterator mid-answer
            if hasattr(body, "close"):
                body.close()

    # ---------------------------------------------------------------- use

    def client(self):
        import boto3

        return boto3.client("s3", endpoint_url=self.endpoint, region_name=TEST_CREDENTIALS["AWS_DEFAULT_REGION"],
                            aws_access_key_id=TEST_CREDENTIALS["AWS_ACCESS_KEY_ID"],
                            aws_secret_access_key=TEST_CREDENTIALS["AWS_SECRET_ACCESS_KEY"])

    def put_file(self, bucket: str, key: str, path: Path | str) -> str:
        """Upload `path` to `bucket/key` (the bucket made if new), count GETs on it from now on,
        and give its s3:// URL."""
        c = self.client()
        if bucket not in {b["Name"] for b in c.list_buckets().get("Buckets", [])}:
            c.create_bucket(Bucket=bucket)
        c.upload_file(str(path), bucket, key)
        self.keys.add(f"{bucket}/{key}")
        return f"s3://{bucket}/{key}"

    @contextmanager
    def env(self) -> Iterator[None]:
        """This process's environment (so a subprocess's) pointed at the server: the endpoint
        and test credentials; the previous values back afterwards."""
        want = {**TEST_CREDENTIALS, "AWS_ENDPOINT_URL_S3": self.endpoint}
        before = {k: os.environ.get(k) for k in want}
        os.environ.update(want)
        try:
            yield
        finally:
            for k, v in before.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
