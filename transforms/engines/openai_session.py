"""The `openai` engine: any OpenAI-compatible HTTP server (vLLM's `vllm serve`, SGLang,
TGI, TensorRT-LLM's `trtllm-serve`, llama.cpp's `llama-server`) behind `EngineSession`.

Each request is one streamed HTTP call, run on one of `max_in_flight` threads:
chat prompts go to `{base_url}/chat/completions`, raw prompts to
`{base_url}/completions`, with `stream_options: {include_usage: true}` so the
server's own token counts come with the last chunk.  A server that sends no `usage`
leaves estimates: the prompt's length as the Tokenize step counted it (a local
tokenizer, the server's /tokenize, or a stated estimate: `token_count`,
transforms/counting.py) and the number of streamed text chunks, and the row's
`token_count_source` says which ("local_tokenizer+stream_chunks",
"server_tokenizer+stream_chunks", "estimate+stream_chunks"; not "engine").  TTFT, TPOT and E2E are
measured here, on the client's clock (a monotonic clock in the worker), from the
answered attempt: they include the network and the server's queue.

A 429, a 5xx, a timeout, a dropped connection or a malformed or truncated stream
is retried with exponential backoff and jitter, up to `max_retries` times; then
the row is finished with a reason code (`rate_limited`, `server_error`,
`request_timeout`, `connection_dropped`, `bad_response`) and Generate makes it a
dead letter.  Another 4xx is the row's own fault (`bad_request`, not retried).
A server that refuses connections (down) after the retries fails the step: the
session is dead, and a new one refuses to start while the server is down, so
the job fails and the unanswered rows are left for the resume.

The API key is read from the environment variable `api_key_env` names, in the
worker, and lives only in the HTTP client's headers: never in the spec, the
database, the logs or `info()`.
"""

from __future__ import annotations

import json
import logging
import queue
import random
import threading
import time
from collections import Counter
from typing import Any

import httpx

from tokenmill.schemas import records as R
from tokenmill.schemas.errors import first_line
from tokenmill.transforms.engines import requests
from tokenmill.transforms.engines.openai_config import BACKOFF_CAP_S, OpenAIConfig, api_key
from tokenmill.transforms.engines.protocol import EngineStartError, Finished

log = logging.getLogger(__name__)

#: Backoff before retry n (0-based): uniform in [d/2, d], d = min(BACKOFF_CAP_S, BACKOFF_BASE_S * 2**n).
BACKOFF_BASE_S = 0.5
#: How long checking the server (/v1/models) may take.
CHECK_TIMEOUT_S = 10.0


def _client(cfg: OpenAIConfig, key: str | None, timeout: float, connections: int) -> httpx.Client:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.Client(
        base_url=cfg.base_url or "", headers=headers,
        timeout=httpx.Timeout(timeout, connect=min(timeout, CHECK_TIMEOUT_S)),
        limits=httpx.Limits(max_connections=connections, max_keepalive_connections=connections),
    )


def served_models(client: httpx.Client, base_url: str) -> list[str]:
    """The model names the server lists (GET /models); EngineStartError (one line) when it
    cannot be reached or does not answer as an OpenAI-compatible server."""
    try:
        r = client.get("/models", timeout=CHECK_TIMEOUT_S)
    except httpx.HTTPError as err:
        raise EngineStartError(f"OpenAI-compatible server {base_url} cannot be reached: {first_line(err) or type(err).__name__}") from None
    if r.status_code in (401, 403):
        raise EngineStartError(f"OpenAI-compatible server {base_url} refused the API key (HTTP {r.status_code} on /models)")
    if r.status_code != 200:
        raise EngineStartError(f"OpenAI-compatible server {base_url} answered HTTP {r.status_code} on /models")
    try:
        return [str(m["id"]) for m in r.json()["data"]]
    except (ValueError, KeyError, TypeError):
        raise EngineStartError(f"{base_url}/models is not an OpenAI model list") from None


def check_server(cfg: OpenAIConfig) -> list[str]:
    """What the preflight and a starting session check: the key variable is set, the
    server answers, and it serves `cfg.model` and each LoRA adapter's served name.  Returns
    the served names; EngineStartError (one line) otherwise."""
    with _client(cfg, api_key(cfg), CHECK_TIMEOUT_S, 1) as client:
        names = served_models(client, cfg.base_url or "")
    if cfg.model not in names:
        raise EngineStartError(f"OpenAI-compatible server {cfg.base_url} does not serve model {cfg.model!r}; "
                               f"it lists {names}")
    missing = {a: served for a, served in sorted(cfg.lora_adapters.items()) if served not in names}
    if missing:
        raise EngineStartError(f"OpenAI-compatible server {cfg.base_url} does not serve the LoRA adapters "
                               f"{missing} (name: served name); it lists {names}")
    return names


class _Retry(Exception):
    """One attempt failed in a way worth retrying; `reason` is the row's code if it stays failed."""

    def __init__(self, reason: str, message: str, wait_s: float | None = None):
        super().__init__(message)
        self.reason, self.wait_s = reason, wait_s


class _Refused(Exception):
    """The server answered 4xx (not 429): the request itself is wrong; not retried."""


class _Down(Exception):
    """No connection could be made: the server is down (or unreachable)."""


def _refusal(error: Any) -> bool:
    """An error object in a stream that is the request's own fault: a 4xx code, not 429."""
    try:
        code = int(error.get("code"))  # not a dict: AttributeError
    except (AttributeError, TypeError, ValueError):
        return False
    return 400 <= code < 500 and code != 429


def _retry_after(r: httpx.Response) -> float | None:
    try:
        return min(BACKOFF_CAP_S, max(0.0, float(r.headers.get("retry-after", ""))))
    except ValueError:
        return None


class OpenAISession:
    """An OpenAI-compatible server driven as an `EngineSession` (see the module docstring)."""

    def __init__(self, cfg: OpenAIConfig, model_path: str = "", *,
                 count_source: str = R.TOKENS_BY_LOCAL_TOKENIZER_AND_STREAM_CHUNKS,
                 dialect: requests.Dialect = "openai", adapter_keys: dict[str | None, dict[str, Any]] | None = None):
        """`model_path`: the local tokenizer's folder, when Tokenize counted the prompts with
        one; `count_source`: the token_count_source of a row the server sends no `usage` for
        (how Tokenize counted them: counting.ROW_SOURCES); `dialect`: how the server is asked
        for structured outputs (requests.http_body); `adapter_keys`: a LoRA adapter's name (None:
        a request naming none) → the body keys that run a request with it (default: `model` its
        served name, as vLLM's server takes it)."""
        t = time.perf_counter()
        self.adapter_keys: dict[str | None, dict[str, Any]] = dict(adapter_keys) if adapter_keys is not None else {
            name: {"model": served} for name, served in cfg.lora_adapters.items()}
        self.cfg = cfg
        self.dialect = dialect
        self.max_num_seqs = cfg.max_in_flight
        check_server(cfg)
        self.count_source = count_source
        self._http = _client(cfg, api_key(cfg), cfg.request_timeout_s, cfg.max_in_flight)
        self.load_s = time.perf_counter() - t
        self._done: queue.Queue[Finished] = queue.Queue()
        self._todo: queue.Queue[tuple[str, dict[str, Any], int, int | None] | None] = queue.Queue()
        self._live: set[str] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._failure: str | None = None
        self.retries: Counter[str] = Counter()
        """Retries made, by the reason of the failed attempt."""
        # Daemon threads, not a ThreadPoolExecutor: its threads are joined at interpreter
        # exit, so a request still waiting on a hung server would hold the worker up to
        # request_timeout_s after the job ended.
        self._threads = [threading.Thread(target=self._serve, daemon=True, name=f"tokenmill-openai-{i}")
                         for i in range(cfg.max_in_flight)]
        for thread in self._threads:
            thread.start()

    # -- EngineSession
    def add(self, request_id: str, token_ids, sampling: dict[str, Any], *, source=None,
            adapter: str | None = None) -> None:
        if source is None:
            raise ValueError("the openai engine sends text: this request has no prompt text or messages")
        if adapter is not None and adapter not in self.adapter_keys:
            raise ValueError(f"adapter {adapter!r} is not declared in engine.lora_adapters")
        if self._stop.is_set():
            raise RuntimeError("the openai session was stopped")
        if self.cfg.task == "embed":
            body = requests.embedding_body(self.cfg.model, source)
        else:
            body = requests.request_body(self.cfg.model, source, sampling, self.dialect)
            body.update(self.adapter_keys.get(adapter, {}))
        with self._lock:
            self._live.add(request_id)
        k = None if self.cfg.task == "embed" else requests.logprobs_wanted(sampling)
        self._todo.put((request_id, body, len(token_ids), k))

    def step(self) -> list[Finished]:
        if self._stop.is_set():
            raise RuntimeError("the openai session was killed")
        if self._failure:
            raise RuntimeError(self._failure)
        got: list[Finished] = []
        try:
            got.append(self._done.get(timeout=0.5))
            while True:
                got.append(self._done.get_nowait())
        except queue.Empty:
            pass
        with self._lock:
            out = [f for f in got if f.request_id in self._live]
            self._live.difference_update(f.request_id for f in out)
        if self._failure:  # what finished before the server went down is kept by the retry of the batch
            raise RuntimeError(self._failure)
        return out

    def num_unfinished(self) -> int:
        with self._lock:
            return len(self._live)

    def abort(self, request_ids: list[str]) -> None:
        with self._lock:
            self._live.difference_update(request_ids)

    def alive(self) -> bool:
        return not self._stop.is_set() and self._failure is None

    def kill(self) -> None:
        self._stop.set()
        self._http.close()  # requests in flight fail at once

    def info(self) -> dict[str, Any]:
        return {
            "device": "remote", "engine": "openai", "base_url": self.cfg.base_url, "model": self.cfg.model,
            "load_s": self.load_s, "max_in_flight": self.cfg.max_in_flight,
            "max_retries": self.cfg.max_retries, "request_timeout_s": self.cfg.request_timeout_s,
            "clock": "client",
        }

    def shutdown(self) -> None:
        self._stop.set()
        for _ in self._threads:
            self._todo.put(None)
        self._http.close()

    # -- one request at a time, on each of `max_in_flight` threads
    def _serve(self) -> None:
        while not self._stop.is_set():
            job = self._todo.get()
            if job is None:
                return
            self._request(*job)

    def _wanted(self, request_id: str) -> bool:
        if self._stop.is_set() or self._failure:
            return False
        with self._lock:
            return request_id in self._live

    def _request(self, request_id: str, body: dict[str, Any], prompt_len: int, k: int | None) -> None:
        """`k`: the alternatives per token asked for (None: no log-probabilities)."""
        attempt = 0
        tried: Counter[str] = Counter()  # this request's retries, by reason: stored with its batch

        def done(f: Finished) -> None:
            f.retries = dict(tried)
            self._done.put(f)

        while self._wanted(request_id):
            try:
                done(self._attempt(request_id, body, prompt_len, k))
                return
            except _Refused as err:
                done(self._failed(request_id, R.BAD_REQUEST, f"server refused the request: {err}"))
                return
            except (_Retry, _Down) as err:
                if not self._wanted(request_id):
                    return
                if attempt >= self.cfg.max_retries:
                    if isinstance(err, _Down):
                        self._failure = (f"OpenAI-compatible server {self.cfg.base_url} is down: {err} "
                                         f"(after {attempt + 1} attempts)")
                        return
                    done(self._failed(request_id, err.reason, f"{err} (after {attempt + 1} attempts)"))
                    return
                reason = "server_down" if isinstance(err, _Down) else err.reason
                tried[reason] += 1
                with self._lock:
                    self.retries[reason] += 1
                d = min(BACKOFF_CAP_S, BACKOFF_BASE_S * 2 ** attempt)
                wait = getattr(err, "wait_s", None)
                self._stop.wait(wait if wait is not None else random.uniform(d / 2, d))
                attempt += 1
            except Exception as err:  # a bug here must not leave the row unfinished
                done(self._failed(request_id, R.ENGINE_ERROR, f"openai engine: {type(err).__name__}: {first_line(err)}"))
                return

    def _embedding(self, request_id: str, answer: Any, prompt_len: int, e2e: float) -> Finished:
        """An /embeddings answer: its vector and its prompt tokens (the server's usage, else Tokenize's count)."""
        try:
            vector = answer["data"][0]["embedding"]
            usage = answer.get("usage") or {}
            prompt_tokens = int(usage["prompt_tokens"]) if "prompt_tokens" in usage else prompt_len
            blob = R.embedding_bytes(vector)
        except (KeyError, IndexError, TypeError, ValueError):
            raise _Retry(R.BAD_RESPONSE, f"not an embeddings answer: {str(answer)[:120]}") from None
        return Finished(request_id=request_id, text=None, finish_reason=None, prompt_tokens=prompt_tokens,
                        output_tokens=0, cached_tokens=None, e2e_s=e2e, finished_at=time.time(), embedding=blob,
                        token_count_source=R.TOKENS_BY_ENGINE if "prompt_tokens" in usage else self.count_source)

    @staticmethod
    def _failed(request_id: str, reason: str, message: str) -> Finished:
        return Finished(request_id=request_id, text="", finish_reason=None, prompt_tokens=0, output_tokens=0,
                        cached_tokens=None, ttft_s=None, tpot_s=None, e2e_s=None, queue_s=None,
                        finished_at=time.time(), error_reason=reason, error=message)

    def _attempt(self, request_id: str, body: dict[str, Any], prompt_len: int, k: int | None) -> Finished:
        chat, embed = "messages" in body, "input" in body
        path = "/embeddings" if embed else "/chat/completions" if chat else "/completions"
        limit = self.cfg.request_timeout_s
        answer: Any = None
        t0 = time.perf_counter()
        pieces: list[str] = []
        logprobs: list[dict[str, Any]] | None = None if k is None else []
        chunks, first, last, finish, usage, done = 0, None, None, None, None, False
        stop: str | None = None  # the stop string that ended the text, where the server says (vLLM's `stop_reason`)
        try:
            with self._http.stream("POST", path, json=body) as r:
                if r.status_code == 429:
                    raise _Retry(R.RATE_LIMITED, "HTTP 429 (rate limited)", _retry_after(r))
                if r.status_code >= 500:
                    raise _Retry(R.SERVER_ERROR, f"HTTP {r.status_code}")
                if r.status_code >= 400:
                    r.read()
                    raise _Refused(f"HTTP {r.status_code}: {first_line(r.text)[:300]}")
                if embed:  # one JSON answer, not a stream
                    answer, done = json.loads(r.read()), True
                for line in () if embed else r.iter_lines():
                    if time.perf_counter() - t0 > limit:
                        raise _Retry(R.REQUEST_TIMEOUT, f"no complete answer within {limit:g} s (request_timeout_s)")
                    if not line.startswith("data:"):
                        continue  # blank lines, SSE comments and event names
                    data = line[5:].strip()
                    if data == "[DONE]":
                        done = True
                        break
                    try:
                        obj = json.loads(data)
                    except ValueError:
                        raise _Retry(R.BAD_RESPONSE, f"malformed JSON in the stream: {data[:80]!r}") from None
                    if not isinstance(obj, dict):
                        raise _Retry(R.BAD_RESPONSE, f"a stream chunk is not a JSON object: {data[:80]!r}")
                    if obj.get("error"):
                        said = first_line(str(obj["error"]))[:300]
                        if _refusal(obj["error"]):  # a 4xx the server put in the stream (vLLM: a bad grammar)
                            raise _Refused(f"error in the stream: {said}")
                        raise _Retry(R.SERVER_ERROR, f"error in the stream: {said}")
                    for c in obj.get("choices") or ():
                        if logprobs is not None and k is not None:
                            logprobs.extend(requests.http_logprobs(c, chat=chat, k=k))
                        piece = (c.get("delta") or {}).get("content") if chat else c.get("text")
                        if piece:
                            now = time.perf_counter()
                            first = first or now
                            last = now
                            chunks += 1
                            pieces.append(piece)
                        finish = c.get("finish_reason") or finish
                        stop = c["stop_reason"] if isinstance(c.get("stop_reason"), str) else stop
                    if obj.get("usage"):
                        usage = obj["usage"]
                    if not self._wanted(request_id):
                        raise _Retry(R.ENGINE_ERROR, "aborted")
        except httpx.ConnectError as err:
            raise _Down(first_line(err) or "connection refused") from None
        except httpx.TimeoutException as err:
            if isinstance(err, httpx.ConnectTimeout):
                raise _Down(f"connect timed out: {first_line(err)}") from None
            raise _Retry(R.REQUEST_TIMEOUT, f"no answer within {limit:g} s (request_timeout_s): {type(err).__name__}") from None
        except (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError) as err:
            raise _Retry(R.CONNECTION_DROPPED, f"connection dropped: {first_line(err) or type(err).__name__}") from None
        except (httpx.DecodingError, UnicodeDecodeError, ValueError) as err:
            raise _Retry(R.BAD_RESPONSE, f"undecodable response: {first_line(err)}") from None
        if embed:
            return self._embedding(request_id, answer, prompt_len, time.perf_counter() - t0)
        if not done:
            raise _Retry(R.BAD_RESPONSE, "the stream ended without [DONE] (truncated)")
        end = time.perf_counter()
        try:
            # without `usage`: Tokenize's prompt length and the text chunks, said per row (count_source)
            prompt_tokens = int(usage["prompt_tokens"]) if usage else prompt_len
            output_tokens = int(usage["completion_tokens"]) if usage else chunks
            cached = ((usage or {}).get("prompt_tokens_details") or {}).get("cached_tokens")
            cached = int(cached) if cached is not None else None
        except (KeyError, TypeError, ValueError):
            raise _Retry(R.BAD_RESPONSE, f"malformed usage in the stream: {str(usage)[:120]}") from None
        ttft = first - t0 if first is not None else None
        tpot = (last - first) / (output_tokens - 1) if first is not None and last is not None and output_tokens > 1 else None
        return Finished(
            request_id=request_id, text="".join(pieces), finish_reason=finish,
            prompt_tokens=prompt_tokens, output_tokens=output_tokens, cached_tokens=cached,
            ttft_s=ttft, tpot_s=tpot, e2e_s=end - t0, queue_s=None, finished_at=time.time(),
            token_count_source=R.TOKENS_BY_ENGINE if usage else self.count_source, logprobs=logprobs,
            stop_sequence=stop,
        )
