"""How a job counts its prompts' tokens before any engine work (the Tokenize step).

An engine that runs the model in the worker (vLLM) is given the token ids counted here,
so the count is exact.  An engine that is sent text (an OpenAI-compatible server) counts
the prompt itself and says so in `usage`; the count here still sizes, orders and batches
the prompts, and stands in for the server's where it sends no `usage`.  Three ways:

- `local`: a tokenizer folder on this machine (Hugging Face files), with its chat template;
- `server`: the server's own tokenizer, `POST /tokenize` at the server's root (vLLM and
  SGLang: `{"model", "prompt" | "messages"}`; llama-server: `{"content"}`, with its chat
  template applied by `POST /apply-template`);
- `estimate`: one token per `ESTIMATE_BYTES` bytes of UTF-8 text (a stated estimate:
  English text runs at about 4 bytes a token in most tokenizers, other scripts differ).

Each output row without the server's own counts says which (records.TOKEN_COUNT_SOURCES).
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import os
import threading
import time
from array import array
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any, Literal, Protocol, Sequence, cast

import httpx

from tokenmill.schemas import records as R
from tokenmill.schemas.errors import first_line
from tokenmill.schemas.model_home import locked_record, read_record, tokenmill_home
from tokenmill.schemas.records import PromptRecord
from tokenmill.transforms.engines.device import allowed_cores

#: UTF-8 bytes counted as one token by the `estimate` counter.
ESTIMATE_BYTES = 4
#: How long one /tokenize call may take, and how often a failed one is tried again.
TOKENIZE_TIMEOUT_S = 30.0
TOKENIZE_RETRIES = 3
#: The wait before retry n of a failed /tokenize: RETRY_WAIT_S * 2**n.
RETRY_WAIT_S = 0.5
#: What `probe_server` asks the server to tokenize.
PROBE_TEXT = "Hello"
#: A chunk's texts are tokenized on several threads (one a core this process may run on) in
#: slices of at least this many prompts: the fast tokenizer's Rust code runs without the GIL.
MIN_THREAD_SLICE = 1024

Source = Literal["local", "server", "estimate"]
Style = Literal["vllm", "llama.cpp"]

#: The token_count_source of a row whose server sent no `usage`, by counter.
ROW_SOURCES: dict[str, str] = {
    "local": R.TOKENS_BY_LOCAL_TOKENIZER_AND_STREAM_CHUNKS,
    "server": R.TOKENS_BY_SERVER_TOKENIZER_AND_STREAM_CHUNKS,
    "estimate": R.TOKENS_BY_ESTIMATE_AND_STREAM_CHUNKS,
}


class CountRefused(ValueError):
    """The server's tokenizer refused this row's prompt (HTTP 4xx): the row's own fault."""


class Encoder(Protocol):
    def encode(self, rec: PromptRecord) -> list[int]:
        """The prompt's token ids (chat template applied to messages); ValueError when the
        row itself cannot be counted (a conversation its template rejects)."""
        ...

    def encode_many(self, recs: list[PromptRecord]) -> list[Sequence[int] | Exception]:
        """Each prompt's token ids, or the exception that row's `encode` raises (a
        RuntimeError, the counter itself failing, is raised)."""
        ...


def encode_each(encoder: Encoder, recs: list[PromptRecord]) -> list[Sequence[int] | Exception]:
    """`encode_many` row by row: every row's ids or its own exception."""
    out: list[Sequence[int] | Exception] = []
    for rec in recs:
        try:
            out.append(encoder.encode(rec))
        except RuntimeError:  # the counter (a server) does not answer: the step fails
            raise
        except Exception as err:
            out.append(err)
    return out


@dataclass(frozen=True)
class TokenCounter:
    """Where the Tokenize step counts tokens (picklable: it travels to the workers)."""

    source: Source
    model_path: str | None = None
    """`local`: the tokenizer's folder."""
    root: str | None = None
    """`server`: the server's root URL (its OpenAI API root without `/v1`)."""
    model: str | None = None
    """`server`: the model name the server serves; `local`: the model (or tokenizer) name
    or URL `model_path` came from, which a worker on another host resolves there."""
    style: Style | None = None
    """`server`: the shape of its /tokenize (see the module docstring)."""
    api_key_env: str | None = None
    """`server`: the environment variable holding the API key, if it needs one."""

    @classmethod
    def local(cls, model_path: str, model: str | None = None) -> "TokenCounter":
        return cls("local", model_path=model_path, model=model)

    @property
    def row_source(self) -> str:
        """The token_count_source of a row whose counts the server did not send."""
        return ROW_SOURCES[self.source]

    def describe(self) -> str:
        if self.source == "local":
            return f"tokens counted by the local tokenizer {self.model_path}"
        if self.source == "server":
            return f"tokens counted by the server's tokenizer ({self.root}/tokenize, {self.style})"
        return f"tokens estimated at one per {ESTIMATE_BYTES} bytes of UTF-8 text (no tokenizer)"

    def open(self, threads: int | None = None) -> Encoder:
        """The encoder of this counter in this process; `threads`: how many threads a local
        tokenizer encodes a chunk on (None: one per core this process may use)."""
        if self.source == "local":
            return local_encoder(str(self.model_path), threads)
        if self.source == "server":
            key = os.environ.get(self.api_key_env) if self.api_key_env else None
            return ServerEncoder(_client(str(self.root), key), str(self.model), self.style or "vllm")
        return EstimateEncoder()


_TOKENIZERS: dict[str, Any] = {}


@functools.cache
def local_encoder(model_path: str, threads: int | None = None) -> "LocalEncoder":
    """The process's one encoder of a tokenizer (per thread count), with its one thread pool.  A
    Dask worker runs a step's setup for every task: an encoder (and pool) made per task grew the
    worker's peak memory with the job's length (docs/BENCHMARKS.md, "What grew in the Dask worker")."""
    return LocalEncoder(load_tokenizer(model_path), threads)


os.register_at_fork(after_in_child=local_encoder.cache_clear)  # a forked child has the pool, not its threads


def load_tokenizer(model_path: str):
    tok = _TOKENIZERS.get(model_path)
    if tok is None:
        tok = _TOKENIZERS[model_path] = _load_tokenizer(model_path)
    return tok


def _load_tokenizer(model_path: str):
    """The folder's tokenizer as `AutoTokenizer` loads it.  AutoTokenizer's choice of class is
    kept (`tokenizer_classes.json` under tokenmill's home, keyed by the folder, its tokenizer
    and model configs and transformers' version) and later loads import that class alone:
    AutoTokenizer's own lookup imports the model-config machinery and with it torch, about 3 s
    of CPU a process on a 2-core Xeon, paid again by every worker (docs/BENCHMARKS.md,
    "Pipeline ceiling").  Any failure of the kept class (a class that is gone, a folder's own
    code) falls back to AutoTokenizer."""
    key = _tokenizer_key(model_path)
    module, _, name = str(_kept_classes().get(key, "")).partition(":")
    if module.startswith("transformers.") and name:
        try:
            return getattr(importlib.import_module(module), name).from_pretrained(model_path, local_files_only=True)
        except (ImportError, AttributeError):
            pass
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_path, local_files_only=True)
    _keep_class(key, f"{type(tok).__module__}:{type(tok).__qualname__}")
    return tok


def _classes_file() -> Path:
    return tokenmill_home() / "tokenizer_classes.json"


def _tokenizer_key(model_path: str) -> str:
    h = hashlib.sha256(str(Path(model_path).resolve()).encode())
    for name in ("tokenizer_config.json", "config.json"):
        try:
            h.update((Path(model_path) / name).read_bytes())
        except OSError:
            h.update(b"-")
    try:
        h.update(metadata.version("transformers").encode())
    except metadata.PackageNotFoundError:
        pass
    return h.hexdigest()[:24]


def _kept_classes() -> dict[str, Any]:
    return read_record(_classes_file())


def _keep_class(key: str, name: str) -> None:
    try:
        with locked_record(_classes_file()) as known:
            known[key] = name
    except OSError:  # a read-only home: every load goes through AutoTokenizer
        pass


def encode(tokenizer, rec: PromptRecord) -> list[int]:
    if rec.messages is not None:
        ids = tokenizer.apply_chat_template(rec.messages, add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "keys"):  # BatchEncoding in newer transformers
            ids = ids["input_ids"]
        return list(ids)
    return list(tokenizer(rec.prompt, add_special_tokens=True)["input_ids"])


class LocalEncoder:
    def __init__(self, tokenizer: Any, threads: int | None = None):
        self.tokenizer = tokenizer
        self.threads = threads
        """Threads a chunk is encoded on (None: one per core this process may use): a worker's
        share of the host's cores when several workers share it."""
        self._pool: ThreadPoolExecutor | None = None
        self._pool_made = threading.Lock()  # one encoder serves every step of its process

    def encode(self, rec: PromptRecord) -> list[int]:
        return encode(self.tokenizer, rec)

    def encode_many(self, recs: list[PromptRecord]) -> list[Sequence[int] | Exception]:
        """The chunk's conversations rendered in one call and tokenized in one call of the fast
        tokenizer (without special tokens, as `apply_chat_template(tokenize=True)` does; plain
        prompts with them): the ids `encode` gives row by row, at about half its cost per row
        (`apply_chat_template` per row pays its own checks and a tokenizer call each).  When a conversation
        fails, the rows are taken one by one, so only that row gets its exception."""
        out: list[Sequence[int] | Exception | None] = [None] * len(recs)
        for chat in (True, False):
            at = [i for i, r in enumerate(recs) if (r.messages is not None) == chat]
            if not at:
                continue
            got: list[Sequence[int]] | list[Sequence[int] | Exception]
            try:
                if chat:  # rendered, then tokenized as apply_chat_template(tokenize=True) does: no special tokens added
                    texts = self.tokenizer.apply_chat_template([recs[i].messages for i in at],
                                                               add_generation_prompt=True, tokenize=False)
                    got = self.ids(list(texts), special=False)
                else:
                    got = self.ids([cast(str, recs[i].prompt) for i in at], special=True)
            except Exception:
                got = encode_each(self, [recs[i] for i in at])
            for i, ids in zip(at, got):
                out[i] = ids
        return [x if x is not None else ValueError("not encoded") for x in out]

    def ids(self, texts: list[str], *, special: bool) -> list[Sequence[int]]:
        """The texts' token ids, as the tokenizer's own call gives them.  A fast tokenizer's
        `encode_batch` (which releases the GIL) runs on `threads` threads (one per usable core by default), each on
        a contiguous slice of at least `MIN_THREAD_SLICE` texts, and each thread encodes its
        slice `MIN_THREAD_SLICE` texts at a time, keeping only their ids as `array("i")`:
        a whole chunk's `Encoding`s (tokens, offsets, masks: about 100 bytes a token) and
        Python ints (36 bytes a token) are never held at once (the peaks it lowered:
        docs/BENCHMARKS.md, "The Dask worker again" and "The piecewise encoding in the ceiling")."""
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        if backend is None:
            return self.tokenizer(texts, add_special_tokens=special)["input_ids"]

        def encode(part: list[str]) -> list[Sequence[int]]:
            return [array("i", e.ids) for i in range(0, len(part), MIN_THREAD_SLICE)
                    for e in backend.encode_batch(part[i:i + MIN_THREAD_SLICE], add_special_tokens=special)]

        most = self.threads or len(allowed_cores())
        threads = min(most, len(texts) // MIN_THREAD_SLICE)
        if threads <= 1:
            return encode(texts)
        with self._pool_made:  # one thread a core of its share, made once; a chunk uses as many as it has slices
            if self._pool is None:
                self._pool = ThreadPoolExecutor(most, thread_name_prefix="tokenize")
        step = -(-len(texts) // threads)
        slices = [texts[i:i + step] for i in range(0, len(texts), step)]
        return [ids for part in self._pool.map(encode, slices) for ids in part]


class EstimateEncoder:
    """One pseudo-token per `ESTIMATE_BYTES` bytes of the prompt's UTF-8 text (messages as
    "role: content" lines): the same text gives the same ids, so shared prefixes still group."""

    def encode_many(self, recs: list[PromptRecord]) -> list[Sequence[int] | Exception]:
        return encode_each(self, recs)

    def encode(self, rec: PromptRecord) -> list[int]:
        text = rec.prompt if rec.messages is None else "".join(f"{m['role']}: {m['content']}\n" for m in rec.messages)
        data = (text or "").encode()
        return [int.from_bytes(data[i:i + ESTIMATE_BYTES], "little") & 0x7FFFFFFF
                for i in range(0, len(data), ESTIMATE_BYTES)]


class ServerEncoder:
    """The server's own tokenizer over HTTP (a 4xx: the row's fault, CountRefused; no answer
    after the retries: RuntimeError, which fails the step and leaves the rows to a resume)."""

    def __init__(self, client: httpx.Client, model: str, style: Style):
        self.client, self.model, self.style = client, model, style

    def encode_many(self, recs: list[PromptRecord]) -> list[Sequence[int] | Exception]:
        return encode_each(self, recs)

    def encode(self, rec: PromptRecord) -> list[int]:
        if self.style == "vllm":
            body: dict[str, Any] = {"model": self.model}
            if rec.messages is None:
                body.update(prompt=rec.prompt, add_special_tokens=True)
            else:
                body.update(messages=rec.messages, add_generation_prompt=True, add_special_tokens=False)
            return _tokens(self._post("/tokenize", body))
        text = rec.prompt
        if rec.messages is not None:
            text = str(self._post("/apply-template", {"messages": rec.messages}).get("prompt", ""))
        return _tokens(self._post("/tokenize", {"content": text, "add_special": True}))

    def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        for attempt in range(TOKENIZE_RETRIES + 1):
            try:
                r = self.client.post(path, json=body)
            except httpx.HTTPError as err:
                problem = f"{type(err).__name__}: {first_line(err)}"
            else:
                if r.status_code == 200:
                    return r.json()
                if 400 <= r.status_code < 500 and r.status_code != 429:
                    raise CountRefused(f"the server's {path} refused the prompt: HTTP {r.status_code} {r.text[:160]}")
                problem = f"HTTP {r.status_code}"
            if attempt < TOKENIZE_RETRIES:
                time.sleep(RETRY_WAIT_S * 2 ** attempt)
        raise RuntimeError(f"the server's {path} did not answer after {TOKENIZE_RETRIES + 1} attempts ({problem})")


def _tokens(answer: dict[str, Any]) -> list[int]:
    tokens = answer.get("tokens")
    if not isinstance(tokens, list):
        raise RuntimeError(f"the server's /tokenize answered without a token list: {str(answer)[:120]}")
    return [int(t["id"]) if isinstance(t, dict) else int(t) for t in tokens]


def _client(root: str, key: str | None) -> httpx.Client:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.Client(base_url=root, headers=headers, timeout=TOKENIZE_TIMEOUT_S)


def server_root(base_url: str) -> str:
    """The server's root from its OpenAI API root (`http://h:8000/v1` → `http://h:8000`)."""
    base = base_url.rstrip("/")
    return base[: -len("/v1")] if base.endswith("/v1") else base


def probe_server(root: str, model: str, key: str | None) -> Style | None:
    """Which /tokenize the server at `root` has (vLLM-style first, then llama-server's),
    or None when it has none that answers with token ids."""
    with _client(root, key) as client:
        for style, body in (("vllm", {"model": model, "prompt": PROBE_TEXT}), ("llama.cpp", {"content": PROBE_TEXT})):
            try:
                r = client.post("/tokenize", json=body, timeout=10.0)
                if r.status_code == 200 and _tokens(r.json()):
                    return style  # type: ignore[return-value]
            except (httpx.HTTPError, ValueError, RuntimeError, TypeError):
                continue
    return None
