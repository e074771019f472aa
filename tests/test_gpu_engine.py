"""The vLLM engine's GPU path, checked on any machine: the executor that ends the engine
core with its owner on a GPU too, and the tensor / pipeline split refused before any
engine starts when the model cannot take it (here on the bundled model's 9 attention
heads, 3 KV heads and 30 layers)."""

from __future__ import annotations

import json

import pytest

from tests.helpers import assert_one_line_error, cli
from tokenmill.schemas.config import load_spec
from tokenmill.transforms.engines import checks
from tokenmill.transforms.engines import vllm_session as V
from tokenmill.transforms.engines.protocol import EngineStartError
from tokenmill.transforms.engines.vllm_config import VllmConfig


@pytest.mark.parametrize("kwargs, want", [
    ({"tensor_parallel_size": 1}, "uni"),
    ({"tensor_parallel_size": 2}, "mp"),
    ({"tensor_parallel_size": 1, "pipeline_parallel_size": 2}, "mp"),
    ({"tensor_parallel_size": 4, "distributed_executor_backend": "ray"}, None),  # the job's choice stays
])
def test_on_a_gpu_the_engine_core_still_exits_with_its_owner(kwargs, want):
    executor = V._owned_executor(kwargs, None, on_gpu=True)
    assert (executor.kind if executor else None) == want


def test_the_bundled_models_shape_is_read_from_its_config(model_path):
    assert checks.model_shape(model_path) == {"heads": 9, "kv_heads": 3, "layers": 30}


@pytest.mark.parametrize("tp, pp, problem", [
    (2, 1, "tensor_parallel_size 2 does not divide model smollm2-135m's 9 attention heads"),
    (1, 31, "pipeline_parallel_size 31 exceeds model smollm2-135m's 30 layers"),
    (3, 1, None),   # 9 heads, 3 KV heads: 3 each
    (9, 1, None),   # one head each; the 3 KV heads replicated 3 times
    (1, 30, None),
])
def test_a_split_the_model_cannot_take_is_refused_on_any_device(model_path, tp, pp, problem):
    cfg = VllmConfig(tensor_parallel_size=tp, pipeline_parallel_size=pp)
    if problem is None:
        checks.check_parallel_split(cfg, model_path)
        return
    for on_gpu in (True, False):  # the model's refusal comes before the device's
        with pytest.raises(EngineStartError, match=problem.replace("'", ".")):
            checks.check_engine_config(cfg, on_gpu=on_gpu, model_path=model_path)


def test_kv_heads_that_neither_divide_nor_are_divided_are_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(
        {"num_attention_heads": 12, "num_key_value_heads": 4, "num_hidden_layers": 2}))
    with pytest.raises(EngineStartError, match="tensor_parallel_size 6 and model .*'s 4 KV heads"):
        checks.check_parallel_split(VllmConfig(tensor_parallel_size=6), str(tmp_path))
    checks.check_parallel_split(VllmConfig(tensor_parallel_size=4), str(tmp_path))


def test_validate_refuses_tensor_parallel_2_on_the_bundled_model_in_one_line(tmp_path):
    from tests.conftest import write_parquet

    inp = write_parquet(tmp_path / "in.parquet", [{"id": "a", "prompt": "hi"}])
    spec = tmp_path / "job.yaml"
    spec.write_text("engine:\n  tensor_parallel_size: 2\n")
    res = cli("validate", str(spec), "--input", str(inp), "--output", str(tmp_path / "o"), catch_exceptions=False)
    assert_one_line_error(res, 1, "tensor_parallel_size 2 does not divide", "9 attention heads")


def test_unset_gpu_defaults_do_not_move_a_specs_job_id():
    # the defaults are device-dependent now (None), and an unset key is not hashed
    a = load_spec({"input": "a", "output": "b"})
    b = load_spec({"input": "a", "output": "b", "engine": {"gpu_memory_utilization": None, "enforce_eager": None}})
    assert a.derived_job_id() == b.derived_job_id() == load_spec({"input": "a", "output": "b"}).derived_job_id()
    assert a.engine.memory_share(on_gpu=True) == 0.9 and a.engine.memory_share(on_gpu=False) == 0.5
    assert a.engine.devices() == 1 and VllmConfig(tensor_parallel_size=2, pipeline_parallel_size=2).devices() == 4
