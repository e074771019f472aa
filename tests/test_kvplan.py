"""kv-plan: KV cache and weights sizes from a model's config.json."""

import json
from pathlib import Path

import pytest

from tests.helpers import cli, job_spec
from tokenmill.jobs.modeltools import kvplan as K

SMOL = {"hidden_size": 576, "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64,
        "intermediate_size": 1536, "num_hidden_layers": 30, "vocab_size": 49152, "tie_word_embeddings": True,
        "dtype": "bfloat16"}


def test_kv_bytes_follow_the_formula_with_kv_heads_not_query_heads():
    p = K.plan(SMOL, max_model_len=2048, batch=8)
    assert p["kv_bytes_per_token"] == 2 * 30 * 3 * 64 * 2 == 23040
    assert p["kv_cache_bytes"] == 23040 * 2048 * 8
    assert p["mha_kv_bytes_per_token"] == 2 * 30 * 9 * 64 * 2
    assert p["attention"] == "GQA" and p["gqa_saving"] == 3.0


def test_kv_dtype_sets_bytes_per_element():
    assert K.plan(SMOL, max_model_len=1, kv_cache_dtype="fp8")["kv_bytes_per_token"] == 11520
    assert K.plan(SMOL, max_model_len=1, dtype="float32")["kv_bytes_per_token"] == 46080
    # kv dtype auto follows the model dtype, an explicit one wins
    assert K.plan(SMOL, max_model_len=1, dtype="float32", kv_cache_dtype="fp8")["kv_bytes_per_token"] == 11520


def test_mha_and_mqa_models():
    mha = dict(SMOL, num_key_value_heads=None)
    assert K.plan(mha, max_model_len=1)["attention"] == "MHA" and K.plan(mha, max_model_len=1)["gqa_saving"] == 1.0
    mqa = dict(SMOL, num_key_value_heads=1)
    p = K.plan(mqa, max_model_len=1)
    assert p["attention"] == "MQA" and p["gqa_saving"] == 9.0


def test_largest_batch_that_fits_in_memory():
    p = K.plan(SMOL, max_model_len=2048, batch=100, memory=1 << 30)
    assert p["max_tokens_in_memory"] == (1 << 30) // 23040
    assert p["max_batch_in_memory"] == (1 << 30) // (23040 * 2048) == 22
    assert p["fits"] is False
    assert K.plan(SMOL, max_model_len=2048, batch=22, memory=1 << 30)["fits"] is True


def test_weights_estimate_matches_the_checkpoint_on_disk(model_path):
    cfg = json.loads((Path(model_path) / "config.json").read_text())
    on_disk = sum(f.stat().st_size for f in Path(model_path).glob("*.safetensors"))
    est = K.weights_bytes(cfg, "bfloat16")
    assert abs(est - on_disk) / on_disk < 0.01
    assert K.weights_bytes(cfg, "float32") == 2 * est
    w8, w4 = K.weights_bytes(cfg, "bfloat16", "w8a8-int8"), K.weights_bytes(cfg, "bfloat16", "w4a16", 64)
    assert est > w8 > w4


def test_unknown_dtype_is_a_plan_error():
    with pytest.raises(K.PlanError, match="unknown kv_cache_dtype 'int3'"):
        K.plan(SMOL, max_model_len=16, kv_cache_dtype="int3")


def test_compare_with_engine_capacity():
    p = K.plan(SMOL, max_model_len=1024, batch=32, dtype="float32")
    e = K.compare_with_engine(p, {"kv_cache_tokens": 68352, "kv_bytes_per_token": 46080, "max_model_len": 1024})
    assert e["engine_max_sequences_at_max_len"] == 66
    assert e["bytes_per_token_match"] and e["plan_batch_fits_engine"]
    p = K.plan(SMOL, max_model_len=1024, batch=67, dtype="float32")
    assert not K.compare_with_engine(p, {"kv_cache_tokens": 68352, "kv_bytes_per_token": 46080})["plan_batch_fits_engine"]


def test_cli_json_and_text(model_path):
    res = cli("kv-plan", "--model", model_path, "--max-model-len", "2048", "--batch", "64",
              "--memory", "1GiB", "--json")
    assert res.exit_code == 0, res.output
    p = json.loads(res.output)
    assert p["kv_cache_bytes"] == 23040 * 2048 * 64 and p["max_batch_in_memory"] == 22
    res = cli("kv-plan", "-m", model_path, "-l", "2048", "--batch", "64", "--memory", "1GiB")
    assert res.exit_code == 0
    assert "GQA saves 3.0×" in res.output and "does NOT fit" in res.output


def test_cli_bad_memory_and_missing_args_are_one_line(model_path):
    res = cli("kv-plan", "-m", model_path, "-l", "512", "--memory", "lots")
    assert res.exit_code == 2 and res.output.strip().startswith("error: --memory")
    res = cli("kv-plan", "-m", model_path)
    assert res.exit_code == 2 and "--max-model-len" in res.output


def test_cli_job_option_reads_the_engine_info_of_a_job(tmp_path, sqlite_url):
    from tests.conftest import write_parquet
    from tests.fakes import FakeSession
    from tokenmill.jobs.lifecycle.runner import run_job

    inp = write_parquet(tmp_path / "in.parquet", [{"id": "a", "prompt": "hi"}])
    run_job(job_spec(inp, tmp_path / "o", job_id="kvj", sampling={"max_tokens": 2}),
            db_url=sqlite_url, session_factory=FakeSession)
    res = cli("kv-plan", "--job", "kvj", "-l", "100", "--db", sqlite_url, "--json")
    assert res.exit_code == 0, res.output
    e = json.loads(res.output)["engine"]
    assert e["engine_kv_cache_tokens"] == 1000 and e["engine_max_sequences_at_max_len"] == 10
    res = cli("kv-plan", "--job", "nope", "-l", "100", "--db", sqlite_url)
    assert res.exit_code == 1 and "no job with id 'nope'" in res.output
