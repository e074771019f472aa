"""The engines package without an engine: GPU detection, the session registry, the
worker's session set-up, vLLM kwargs and metrics (the real engine has its own tests)."""

from __future__ import annotations

import json
import subprocess
import sys
import types
from types import SimpleNamespace

import pytest

from tests.fakes import FakeSession
from tokenmill.transforms.engines import device, registry, vllm_engine, worker
from tokenmill.transforms.engines import vllm_session as V
from tokenmill.transforms.engines.vllm_config import VllmConfig

# ---------------------------------------------------------------- GPU detection


class NVMLError(Exception):
    pass


def fake_pynvml(n: int, *, init_fails: bool = False) -> types.ModuleType:
    """The slice of pynvml the detector uses, for `n` GPUs with UUIDs GPU-000…, GPU-111…"""
    m = types.ModuleType("pynvml")
    m.NVMLError = NVMLError

    def init():
        if init_fails:
            raise NVMLError("Driver Not Loaded")

    m.nvmlInit = init
    m.nvmlShutdown = lambda: None
    m.nvmlDeviceGetCount = lambda: n
    m.nvmlDeviceGetHandleByIndex = lambda i: i
    m.nvmlDeviceGetUUID = lambda h: f"GPU-{str(h) * 8}-aaaa"
    m.nvmlDeviceGetName = lambda h: b"NVIDIA H100" if h % 2 else "NVIDIA H100"
    m.nvmlDeviceGetMemoryInfo = lambda h: SimpleNamespace(total=80 << 30, used=0, free=80 << 30)
    return m


@pytest.fixture
def eight_gpus(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml(8))
    monkeypatch.delenv("TOKENMILL_FORCE_CPU", raising=False)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    return monkeypatch


def indices() -> list[int]:
    return [g["index"] for g in device.visible_gpus()]


def test_without_cuda_visible_devices_every_gpu_is_visible(eight_gpus):
    assert indices() == list(range(8))
    assert device.has_nvidia_gpu()
    assert device.visible_gpus()[1] == {"index": 1, "uuid": "GPU-11111111-aaaa", "name": "NVIDIA H100",
                                        "memory_bytes": 80 << 30}


@pytest.mark.parametrize("value,expected", [
    ("2,5", [2, 5]),  # two visible of eight
    ("5,2", [5, 2]),  # in CUDA's order, not NVML's
    (" 3 ", [3]),
    ("GPU-77777777-aaaa,GPU-0", [7, 0]),  # UUIDs, whole or a unique prefix
    ("1,9,2", [1]),  # the list ends at the first entry that names no device
    ("1,1", [1]),
])
def test_cuda_visible_devices_selects_those_gpus_in_its_order(eight_gpus, value, expected):
    eight_gpus.setenv("CUDA_VISIBLE_DEVICES", value)
    assert indices() == expected


@pytest.mark.parametrize("value", ["", "-1", "-1,0", "GPU-", "nonsense"])
def test_cuda_visible_devices_empty_or_minus_one_hides_every_gpu(eight_gpus, value):
    eight_gpus.setenv("CUDA_VISIBLE_DEVICES", value)
    assert device.visible_gpus() == [] and not device.has_nvidia_gpu()


def test_force_cpu_hides_every_gpu(eight_gpus):
    eight_gpus.setenv("TOKENMILL_FORCE_CPU", "1")
    assert device.visible_gpus() == [] and not device.has_nvidia_gpu()


def test_no_pynvml_or_no_driver_means_no_gpu(monkeypatch):
    monkeypatch.delenv("TOKENMILL_FORCE_CPU", raising=False)
    monkeypatch.setitem(sys.modules, "pynvml", None)  # `import pynvml` raises ImportError
    assert not device.has_nvidia_gpu()
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml(8, init_fails=True))
    assert not device.has_nvidia_gpu()


def test_hardware_report_counts_the_visible_gpus(eight_gpus):
    from tokenmill.jobs.metrics import hardware as H

    eight_gpus.setenv("CUDA_VISIBLE_DEVICES", "6,4")
    d = H.describe()
    assert (d["device_type"], d["device"], d["device_count"]) == ("gpu", "NVIDIA H100", 2)
    assert [g["index"] for g in d["gpus"]] == [6, 4] and "uuid" not in d["gpus"][0]
    eight_gpus.setenv("CUDA_VISIBLE_DEVICES", "")
    d = H.describe()
    assert (d["device_type"], d["device_count"], d["gpus"]) == ("cpu", 1, [])
    assert H.load_nvml() is None  # nothing visible: the sampler reads no GPU


def test_cli_import_and_gpu_detection_do_not_import_torch_or_vllm():
    code = ("import sys, json; import tokenmill.jobs.cli; from tokenmill.transforms.engines import device, registry;"
            "device.has_nvidia_gpu(); registry.default_factory();"
            "print(json.dumps(['torch' in sys.modules, 'vllm' in sys.modules]))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == [False, False]


# ---------------------------------------------------------------- the registry


class OtherFake(FakeSession):
    pass


@pytest.fixture
def empty_registry(monkeypatch):
    """The registry as a fresh process has it: the real engine that earlier tests of the
    session keep loaded is set aside (and back afterwards), never stopped by these tests."""
    monkeypatch.setattr(registry, "_SESSIONS", {})


def test_one_session_per_factory_a_new_config_replaces_it_other_factories_untouched(empty_registry):
    a, b = VllmConfig(max_num_seqs=4), VllmConfig(max_num_seqs=5)
    s1 = registry.get_session(a, "/m", FakeSession)
    other = registry.get_session(a, "/m", OtherFake)
    assert registry.get_session(a, "/m", FakeSession) is s1  # reused
    s2 = registry.get_session(b, "/m", FakeSession)
    assert s1.shut and s2 is not s1 and s2.max_num_seqs == 5
    assert not other.shut and registry.get_session(a, "/m", OtherFake) is other
    s2.dead = True
    s3 = registry.get_session(b, "/m", FakeSession)  # a dead session is replaced
    assert s2.shut and s3 is not s2
    registry.drop_session(a, "/m", FakeSession)  # another config: not this factory's session
    assert not s3.shut
    registry.drop_session(b, "/m", FakeSession)
    assert s3.shut and registry.sessions() == [other]


def test_shutdown_all_keep_default_stops_every_session_but_the_default_factorys(monkeypatch, empty_registry):
    class DefaultFake(FakeSession):
        pass

    monkeypatch.setattr(V, "VllmSession", DefaultFake)
    cfg = VllmConfig()
    real = registry.get_session(cfg, "/m")
    fake = registry.get_session(cfg, "/m", FakeSession)
    registry.shutdown_all(keep_default=True)
    assert fake.shut and not real.shut and registry.sessions() == [real]
    registry.shutdown_all()
    assert real.shut and registry.sessions() == []


def test_the_default_factory_is_the_vllm_session():
    assert registry.default_factory() is V.VllmSession


# ---------------------------------------------------------------- a worker's session


@pytest.fixture
def claims(monkeypatch):
    """Records CPU-slot claims instead of making them; the default factory is a fake."""
    made: list[tuple[int, str]] = []

    class DefaultFake(FakeSession):
        def __init__(self, cfg=None, model_path="", *, workers=1, job_tokens=None):
            super().__init__(cfg, model_path)
            self.workers = workers

    monkeypatch.setattr(vllm_engine, "claim_cpu_slot", lambda n, group: made.append((n, group)) or (0, [0]))
    monkeypatch.setattr(vllm_engine.ENGINE, "shared_cpu", {})
    monkeypatch.setattr(V, "VllmSession", DefaultFake)
    return made


def test_cpu_workers_of_the_default_engine_claim_one_slot_and_share_the_kv_memory(claims, monkeypatch):
    monkeypatch.setattr(vllm_engine, "has_nvidia_gpu", lambda: False)
    cfg = VllmConfig(gpu_memory_utilization=0.5)
    s = worker.worker_session(cfg, "/m", workers=2, group="job-run")
    assert worker.worker_session(cfg, "/m", workers=2, group="job-run") is s
    assert claims == [(2, "job-run")]  # once per process and run
    assert s.workers == 2  # the engine takes its share of the KV memory (cpu.cpu_kv_cache, tests/test_kv.py)
    s2 = worker.worker_session(cfg, "/m", workers=2, group="job-run", restart=True)
    assert s.shut and s2 is not s and s2.cfg == s.cfg and s2.workers == 2 and claims == [(2, "job-run")]


def test_gpu_workers_fake_factories_and_single_workers_claim_nothing(claims, monkeypatch):
    cfg = VllmConfig()
    monkeypatch.setattr(vllm_engine, "has_nvidia_gpu", lambda: False)
    assert worker.worker_session(cfg, "/m", FakeSession, workers=2, group="g").cfg is cfg
    assert worker.worker_session(cfg, "/m", workers=1, group="g").workers == 1
    monkeypatch.setattr(vllm_engine, "has_nvidia_gpu", lambda: True)
    s = worker.worker_session(cfg, "/m", workers=2, group="gpu")
    assert s.cfg is cfg and s.workers == 1
    assert claims == []


# ---------------------------------------------------------------- vLLM kwargs and metrics

# What the hand-written mapper (before EngineConfig's fields were passed through) produced.
BASE_KWARGS = {
    "model": "/models/m", "tokenizer": "/models/m", "dtype": "auto", "kv_cache_dtype": "auto",
    "enable_prefix_caching": True, "max_num_seqs": 256, "max_model_len": 2048, "gpu_memory_utilization": 0.5,
    "tensor_parallel_size": 1, "enforce_eager": True, "seed": 0, "load_format": "auto", "disable_log_stats": False,
    "pipeline_parallel_size": 1,
}
# On a GPU (issue 25): CUDA graphs on and 0.9 of the device's memory unless the job says otherwise.
GPU_KWARGS = {**BASE_KWARGS, "gpu_memory_utilization": 0.9, "enforce_eager": False}
SPEC = {"method": "ngram", "num_speculative_tokens": 3}


@pytest.mark.parametrize("fields,on_gpu,expected", [
    ({}, True, GPU_KWARGS),
    ({"gpu_memory_utilization": 0.5, "enforce_eager": True}, True, BASE_KWARGS),  # set: kept on a GPU too
    ({"gpu_memory_utilization": 0.3, "enforce_eager": False}, False,
     {**BASE_KWARGS, "dtype": "float32", "gpu_memory_utilization": 0.3, "enforce_eager": False}),
    ({}, False, {**BASE_KWARGS, "dtype": "float32"}),  # CPU: `auto` is the measured dtype
    ({"kv_cache_sized_for": "capacity"}, False, {**BASE_KWARGS, "dtype": "float32"}),  # tokenmill's, not vLLM's
    ({"dtype": "bfloat16", "model": "other-name"}, False, {**BASE_KWARGS, "dtype": "bfloat16"}),
    ({"tokenizer": "/tok", "quantization": "awq", "max_num_batched_tokens": 4096, "kv_cache_memory_bytes": 1 << 30,
      "speculative_config": SPEC, "block_size": 32, "enable_prefix_caching": False, "seed": 7, "max_num_seqs": 16,
      "kv_cache_dtype": "fp8", "tensor_parallel_size": 2, "load_format": "dummy"}, True,
     {**GPU_KWARGS, "tokenizer": "/tok", "quantization": "awq", "max_num_batched_tokens": 4096,
      "kv_cache_memory_bytes": 1 << 30, "speculative_config": SPEC, "block_size": 32, "enable_prefix_caching": False,
      "seed": 7, "max_num_seqs": 16, "kv_cache_dtype": "fp8", "tensor_parallel_size": 2, "load_format": "dummy"}),
    ({"extra": {"swap_space": 2, "max_num_seqs": 8}}, True, {**GPU_KWARGS, "swap_space": 2, "max_num_seqs": 8}),
    ({"scheduling_policy": "priority"}, True, {**GPU_KWARGS, "scheduling_policy": "priority"}),  # a served engine's
])
def test_engine_kwargs_are_the_config_fields_as_the_hand_written_mapper_gave_them(monkeypatch, fields, on_gpu, expected):
    monkeypatch.setattr(V, "cpu_dtype", lambda model_path, kwargs: "float32")
    assert V.engine_kwargs(VllmConfig(**fields), "/models/m", on_gpu=on_gpu) == expected


def test_vllm_metrics_sum_labelled_series():
    s = object.__new__(V.VllmSession)
    series = [("vllm:prefix_cache_queries", 10), ("vllm:prefix_cache_queries", 5), ("vllm:prefix_cache_hits", 3),
              ("vllm:prefix_cache_hits", 4), ("vllm:num_preemptions", 1), ("vllm:num_requests_running", 9)]
    s.llm = SimpleNamespace(get_metrics=lambda: [SimpleNamespace(name=n, value=v) for n, v in series])
    assert s.metrics() == {"prefix_cache_queries": 15.0, "prefix_cache_hits": 7.0, "num_preemptions": 1.0}
