"""A real `tokenmill serve` for the tests: a subprocess on a loopback port, its config in a
temporary folder, keys made with the real `tokenmill keys create`, and the real `openai`
SDK as the client."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
READY = re.compile(r"tokenmill serve: http://([\d.]+):(\d+)/v1")


class Server:
    def __init__(self, root: Path, config: dict[str, Any], env: dict[str, str] | None = None):
        self.root = root
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}  # e.g. TOKENMILL_MODELS: a fresh home
        self.config_path = root / "serve.yaml"
        self.config_path.write_text(yaml.safe_dump(config))
        self.config = config
        self.proc: subprocess.Popen | None = None
        self.base_url = ""
        self.log = root / "server.log"

    @property
    def argv(self) -> list[str]:
        """The server's command: `tokenmill serve` on its config, on any free loopback port."""
        return [sys.executable, "-m", "tokenmill.jobs.cli", "serve", "--config", str(self.config_path), "--port", "0"]

    def start(self, timeout: float = 120.0) -> "Server":
        self.launch()
        return self.wait_ready(timeout)

    def launch(self, **popen: Any) -> "Server":
        """Start the process and return at once (`wait_ready` waits for it to answer)."""
        self._start_at = self.log.stat().st_size if self.log.exists() else 0  # a restart: only its own lines
        self._fh = open(self.log, "ab")
        self.base_url = ""
        self.proc = subprocess.Popen(self.argv, cwd=ROOT, env=self.env, stdout=self._fh, stderr=subprocess.STDOUT,
                                     **popen)
        return self

    def wait_ready(self, timeout: float = 120.0) -> "Server":
        assert self.proc is not None
        deadline = time.time() + timeout
        while time.time() < deadline:
            with open(self.log, "rb") as fh:
                fh.seek(self._start_at)
                m = READY.search(fh.read().decode(errors="replace"))
            if m and self._answers(f"http://{m.group(1)}:{m.group(2)}"):
                self.base_url = f"http://{m.group(1)}:{m.group(2)}"
                return self
            if self.proc.poll() is not None:
                raise RuntimeError(f"tokenmill serve exited {self.proc.returncode}:\n{self.tail()}")
            time.sleep(0.3)
        raise RuntimeError(f"tokenmill serve did not answer in {timeout} s:\n{self.tail()}")

    def _answers(self, url: str) -> bool:
        import httpx

        try:
            return httpx.get(f"{url}/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def tail(self, n: int = 4000) -> str:
        text = self.log.read_text(errors="replace") if self.log.exists() else ""
        return text[-n:]

    def kill9(self) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(30)

    def drain(self, timeout: float = 120.0) -> int:
        """SIGTERM, as a spot notice or `systemctl stop` sends it: the server drains and exits;
        returns its exit code."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)

    def cli(self, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "tokenmill.jobs.cli", *args, "--config", str(self.config_path)],
                              cwd=ROOT, env=self.env, capture_output=True, text=True, timeout=120)

    def make_key(self, name: str, admin: bool = False) -> dict[str, Any]:
        res = self.cli("keys", "create", "--name", name, "--json", *(["--admin"] if admin else []))
        assert res.returncode == 0, res.stderr
        return json.loads(res.stdout)

    def client(self, key: str | None, **kw):
        from openai import OpenAI

        return OpenAI(base_url=f"{self.base_url}/v1", api_key=key or "none", max_retries=0, **kw)


def run_like_the_server(path: Path, tmp_path: Path, out: Path) -> None:
    """`tokenmill run` of the batch file `path` into `out` with the test server's engine config
    (conftest.TEST_ENGINE) and 16 tokens at most: the same greedy answers the server gives."""
    from tests.conftest import TEST_ENGINE

    cmd = [sys.executable, "-m", "tokenmill.jobs.cli", "run", "--input", str(path), "--output", str(out), "--db",
           f"sqlite:///{tmp_path / 'run.db'}", "--max-tokens", "16",
           "--max-num-seqs", str(TEST_ENGINE["max_num_seqs"]), "--max-model-len", str(TEST_ENGINE["max_model_len"]),
           "--gpu-memory-utilization", str(TEST_ENGINE["gpu_memory_utilization"]), "--dtype", TEST_ENGINE["dtype"]]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]


def chat_line(cid: str, content: str, *, model: str = "smollm2-135m", max_tokens: int = 16, **body) -> dict:
    return {"custom_id": cid, "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
                     "temperature": 0, **body}}


def jsonl(path: Path, lines: list[Any]) -> Path:
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return path


def wait_for(client, batch_id: str, statuses=("completed", "failed", "cancelled", "expired"), timeout: float = 600,
             until=None):
    """Poll a batch until its status is one of `statuses` (or `until(batch)` holds)."""
    deadline = time.time() + timeout
    while True:
        b = client.batches.retrieve(batch_id)
        if b.status in statuses or (until is not None and until(b)):
            return b
        if time.time() > deadline:
            raise AssertionError(f"batch {batch_id} still {b.status} after {timeout} s: {b}")
        time.sleep(0.5)


def lines_of(client, file_id: str | None) -> list[dict]:
    if file_id is None:
        return []
    return [json.loads(x) for x in client.files.content(file_id).text.splitlines() if x.strip()]
