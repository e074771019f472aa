"""The result cache across jobs (docs/CACHE.md): what is cacheable, what goes into a key, the
checkpoint's content hash, serving, the `openai` refusal, `tokenmill cache stats|prune`; and
one real-engine rerun on the tiny model (cold, warm with 10% new rows, another dtype, another
sampling key, a resume).  The store's statements are in the storage contract
(tests/test_storage_contract.py)."""

from __future__ import annotations

import json
import os
import shutil
import time
from array import array

import pyarrow.parquet as pq
import pytest

from tests.conftest import TEST_ENGINE, write_parquet
from tests.fakes import FakeSession
from tests.helpers import assert_one_line_error, cli, job_spec
from tokenmill.jobs.lifecycle.preflight import preflight
from tokenmill.jobs.lifecycle.runner import run_job
from tokenmill.schemas import storage as S
from tokenmill.schemas.config import SamplingDefaults
from tokenmill.schemas.records import TokenizedPrompt
from tokenmill.transforms import cache as C
from tokenmill.transforms.engines import identity as I
from tokenmill.transforms.engines.vllm_config import VllmConfig

# ---------------------------------------------------------------- keys


def test_only_greedy_or_seeded_requests_are_cacheable():
    assert C.deterministic({"temperature": 0.0})
    assert C.deterministic({"temperature": 0})
    assert C.deterministic({"temperature": 0.8, "seed": 7})
    assert not C.deterministic({"temperature": 0.8, "seed": None})
    assert not C.deterministic({})  # no temperature said: the engine's default, unknown


def _fp(**settings):
    base = {"dtype": "float32", "quantization": None, "kv_cache_dtype": "auto"}
    return I.fingerprint(kind="vllm", versions={"vllm": "0.1"}, checkpoint="c" * 64, settings={**base, **settings})


def _key(fp=None, ids=(1, 2, 3), source=None, sample=0, **sampling):
    s = {"temperature": 0.0, "max_tokens": 16, "seed": None, "top_p": 1.0, **sampling}
    return C.request_key(fp or _fp(), array("i", ids), source, s, sample)


def test_each_thing_that_decides_an_answer_changes_the_key():
    k = _key()
    assert _key() == k and _key(temperature=0) == k  # 0 and 0.0 are one value
    changed = {
        "dtype": _key(fp=_fp(dtype="bfloat16")),
        "checkpoint": _key(fp=I.fingerprint(kind="vllm", versions={"vllm": "0.1"}, checkpoint="d" * 64,
                                            settings={"dtype": "float32", "quantization": None,
                                                      "kv_cache_dtype": "auto"})),
        "engine version": _key(fp=I.fingerprint(kind="vllm", versions={"vllm": "0.2"}, checkpoint="c" * 64,
                                                settings={"dtype": "float32", "quantization": None,
                                                          "kv_cache_dtype": "auto"})),
        "kv dtype": _key(fp=_fp(kv_cache_dtype="fp8")),
        "prompt": _key(ids=(1, 2, 4)),
        "source text": _key(source="hello"),
        "max_tokens": _key(max_tokens=17),
        "a structured constraint": _key(regex="[0-9]+"),
        "seed": _key(seed=1),
        "sample index": _key(sample=1),
    }
    assert k not in changed.values()
    assert len(set(changed.values())) == len(changed), changed


def _prompt(**sampling):
    return TokenizedPrompt(id="a", input_file=0, input_row=0, token_ids=array("i", [5, 6]), prefix_key="",
                           max_tokens=8, sampling=sampling, samples=sampling.get("n", 1))


def test_a_rows_samples_have_keys_only_when_deterministic_and_sample_i_is_seeded_seed_plus_i():
    d = SamplingDefaults()
    assert C.prompt_keys("f", d, _prompt(temperature=0.7)) is None
    keys = C.prompt_keys("f", d, _prompt(temperature=0.7, seed=10, n=3))
    assert len(set(keys)) == 3
    one = dict(d.model_dump(), temperature=0.7, seed=11, max_tokens=8)
    del one["n"]
    assert keys[1] == C.request_key("f", array("i", [5, 6]), None, one, 1)
    assert len(C.prompt_keys("f", d, _prompt())) == 1  # the job's default: greedy


def test_the_dtype_the_engine_runs_is_in_the_settings_not_auto():
    cfg = VllmConfig(dtype="auto", max_num_seqs=4)
    s = I.answer_settings(cfg, "bfloat16")
    assert s["dtype"] == "bfloat16" and "max_num_seqs" not in s  # how fast, not which answer
    assert I.answer_settings(cfg.model_copy(update={"max_num_seqs": 64}), "bfloat16") == s
    assert I.answer_settings(cfg, "half")["dtype"] == "float16"  # vLLM's other name, one key


# ---------------------------------------------------------------- the checkpoint's content hash


@pytest.fixture
def tiny_copy(tmp_path):
    from bench.tinymodel import tiny_model

    dest = tmp_path / "tiny"
    shutil.copytree(tiny_model(), dest)
    return dest


def test_a_checkpoint_is_hashed_once_per_file_version_and_a_changed_weight_file_misses(tiny_copy, tmp_path,
                                                                                       monkeypatch):
    monkeypatch.setenv("TOKENMILL_HOME", str(tmp_path / "home"))
    read: list[str] = []
    real = I._hash_file
    monkeypatch.setattr(I, "_hash_file", lambda f: read.append(f.name) or real(f))
    cfg = VllmConfig(model=str(tiny_copy), dtype="float32")
    first = I.engine_fingerprint(cfg, str(tiny_copy))
    assert "model.safetensors" in read and "config.json" in read
    read.clear()
    assert I.engine_fingerprint(cfg, str(tiny_copy)) == first and read == []  # kept under path + identity
    # the same bytes elsewhere: the same checkpoint (the hash is of the content, not the path)
    other = shutil.copytree(tiny_copy, tmp_path / "elsewhere")
    assert I.engine_fingerprint(cfg, str(other)) == first
    assert I.engine_fingerprint(cfg.model_copy(update={"dtype": "bfloat16"}), str(tiny_copy)) != first
    # one byte of the weights changed in place, size and mtime put back: it is read again and misses
    w = tiny_copy / "model.safetensors"
    st = w.stat()
    data = bytearray(w.read_bytes())
    data[-1] ^= 0xFF
    w.write_bytes(bytes(data))
    os.utime(w, ns=(st.st_atime_ns, st.st_mtime_ns))
    read.clear()
    assert I.engine_fingerprint(cfg, str(tiny_copy)) != first and read == ["model.safetensors"]


def test_a_llamacpp_jobs_checkpoint_is_its_gguf_file(tmp_path, monkeypatch):
    from tokenmill.schemas.models import bundled_gguf
    from tokenmill.transforms.engines.llamacpp_session import LlamaCppConfig

    monkeypatch.setenv("TOKENMILL_HOME", str(tmp_path / "home"))
    gguf = shutil.copy(bundled_gguf(), tmp_path / "model.gguf")
    cfg = LlamaCppConfig(kind="llamacpp", model=str(gguf))
    first = I.engine_fingerprint(cfg, "a tokenizer folder, not the weights")
    assert I.engine_fingerprint(cfg.model_copy(update={"model": "smollm2-135m"}), None) == first  # the same bytes
    with open(gguf, "r+b") as f:
        f.seek(-1, os.SEEK_END)
        last = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([last[0] ^ 0xFF]))
    assert I.engine_fingerprint(cfg, None) != first


# ---------------------------------------------------------------- serving


def test_a_row_is_served_only_when_every_sample_is_cached_and_its_answer_comes_back_whole():
    d = SamplingDefaults()
    both, one_missing, sampled = _prompt(n=2), _prompt(n=2), _prompt(temperature=0.9)
    one_missing.id, one_missing.input_row, one_missing.token_ids = "b", 1, array("i", [5, 7])
    sampled.id, sampled.input_row = "c", 2
    row = {"job_id": "cold", "id": "a", "sample": 0, "model": "m", "text": "hi", "finish_reason": "stop",
           "prompt_tokens": 2, "output_tokens": 1, "token_count_source": "engine", "embedding": b"\x00\x00\x80?",
           "logprobs": [{"token": "hi", "logprob": -0.1, "top_logprobs": []}], "valid": None,
           "invalid_reason": None, "parsed": None, "choice_probs": None, "ttft_s": 0.5}
    store = {}
    for p in (both, one_missing):
        for i, k in enumerate(C.prompt_keys("f", d, p)):
            if not (p is one_missing and i == 1):
                store[k] = {"job_id": "cold", "answer": C.cache_entry(row, k, "f", 1.0)["answer"]}
    json.dumps(list(store.values()))  # what the database stores is JSON
    asked: list[list[str]] = []
    rest, rows, used = C.serve([both, one_missing, sampled], lambda ks: asked.append(ks) or store, fingerprint="f",
                               defaults=d, job_id="warm", model="m", batch_id="r1-cache")
    assert len(asked) == 1  # one lookup for the chunk
    assert [p.id for p in rest] == ["b", "c"] and [r["sample"] for r in rows] == [0, 1] and len(used) == 2
    r = rows[0]
    assert (r["id"], r["cached_from"], r["text"], r["embedding"], r["prompt_tokens"]) == ("a", "cold", "hi",
                                                                                         b"\x00\x00\x80?", 2)
    assert r["ttft_s"] is None and r["e2e_s"] is None and r["worker"] == "cache" and r["logprobs"] == row["logprobs"]


def test_openai_with_the_cache_is_refused_in_one_line(tmp_path, sqlite_url):
    inp = write_parquet(tmp_path / "in.parquet", [{"id": "a", "prompt": "hi"}])
    spec = job_spec(inp, tmp_path / "out", cache="read-write",
                    engine={"kind": "openai", "model": "m", "base_url": "http://127.0.0.1:9/v1"})
    problems = preflight(spec, engine=False).problems
    assert problems == [C.refusal("openai")] and "cache: read-write" in problems[0] and "\n" not in problems[0]
    assert preflight(spec.model_copy(update={"cache": "off"}), engine=False).problems == []
    # `run` says it before asking the server (here none answers)
    res = cli("run", "--input", inp, "--output", tmp_path / "o", "--engine", "openai", "--model", "m",
              "--base-url", "http://127.0.0.1:9/v1", "--cache", "read", "--db", sqlite_url)
    assert_one_line_error(res, 1, "cache: read: engine kind openai", "set cache: off")


def test_dtype_auto_measured_by_workers_on_other_hosts_is_refused_a_given_dtype_is_not(tmp_path):
    spec = job_spec(tmp_path / "in.parquet", tmp_path / "out", cache="read", engine={"dtype": "auto"})
    line = C.cache_problem(spec, on_gpu=False, workers_elsewhere=True)
    assert line.startswith("cache: read with engine.dtype auto") and "set engine.dtype" in line
    assert C.cache_problem(spec, on_gpu=False, workers_elsewhere=False) is None  # measured here, before the run
    given = spec.model_copy(update={"engine": spec.engine.model_copy(update={"dtype": "bfloat16"})})
    assert C.cache_problem(given, on_gpu=False, workers_elsewhere=True) is None


def test_cli_cache_stats_and_prune(tmp_path, sqlite_url):
    inp = write_parquet(tmp_path / "in.parquet", [{"id": str(i), "prompt": f"question {i}"} for i in range(5)])
    for jid, mode in (("filler", "read-write"), ("reader", "read")):
        res = run_job(job_spec(inp, tmp_path / jid, job_id=jid, cache=mode, sampling={"max_tokens": 3}),
                      db_url=sqlite_url, session_factory=FakeSession)
        assert res.status == "succeeded"
    assert res.metrics["cache"]["rows"] == 5 and res.metrics["cache"]["source_jobs"] == {"filler": 5}
    out = cli("cache", "stats", "--db", sqlite_url, "--json")
    s = json.loads(out.output)
    assert (s["entries"], s["hits"], len(s["by_fingerprint"])) == (5, 5, 1)
    assert s["by_fingerprint"][0]["models"] == ["smollm2-135m"] and s["bytes"] > 0
    assert "5 entries" in cli("cache", "stats", "--db", sqlite_url).output
    assert json.loads(cli("cache", "prune", "--older-than", "1d", "--db", sqlite_url, "--json").output)[
        "deleted_entries"] == 0  # used a moment ago
    time.sleep(1.1)
    gone = cli("cache", "prune", "--older-than", "1s", "--fingerprint", "0" * 64, "--db", sqlite_url)
    assert gone.exit_code == 0 and "deleted 0 entries" in gone.output
    fp = s["by_fingerprint"][0]["fingerprint"]
    gone = json.loads(cli("cache", "prune", "--older-than", "1s", "--fingerprint", fp, "--db", sqlite_url,
                          "--json").output)
    assert (gone["deleted_entries"], gone["entries_left"]) == (5, 0)
    assert_one_line_error(cli("cache", "prune", "--older-than", "soon", "--db", sqlite_url), 2, "--older-than", "30d")


# ---------------------------------------------------------------- the real engine


def _outputs(eng, job_id):
    from sqlalchemy import select

    from tokenmill.schemas import tables as T

    with eng.connect() as c:
        return {(r["id"], r["sample"]): dict(r) for r in
                c.execute(select(T.outputs).where(T.outputs.c.job_id == job_id)).mappings()}


def _engine_rows(eng, job_id) -> int:
    """Requests the job's engines generated, counted on the engine side (workers' counters)."""
    return sum(int(w.get("generated_rows") or 0) for w in S.MetricsReader(eng).workers(job_id))


@pytest.mark.engine
def test_a_rerun_with_new_rows_generates_only_them_and_dtype_or_sampling_changes_miss(tmp_path, sqlite_url):
    from bench.tinymodel import tiny_model

    plain = {"temperature": None, "seed": None, "n": None}  # every row has the columns (Arrow reads the first)
    greedy = [{"id": f"g{i}", "prompt": f"Write a line about the number {i}.", **plain} for i in range(40)]
    seeded = [{"id": f"s{i}", "prompt": f"Tell a story about {i} cats.", "temperature": 0.9, "seed": 100 + i, "n": 2}
              for i in range(3)]
    free = [{"id": "t0", "prompt": "Say anything.", **plain, "temperature": 0.9}]  # no seed: never cached
    new = [{"id": f"new{i}", "prompt": f"Name the colour number {i}.", **plain} for i in range(4)]
    cold_in = write_parquet(tmp_path / "cold.parquet", greedy + seeded + free)
    warm_in = write_parquet(tmp_path / "warm.parquet", greedy + seeded + free + new)
    engine = {**TEST_ENGINE, "model": str(tiny_model())}

    def job(jid, inp, **kw):
        spec = job_spec(inp, tmp_path / jid, job_id=jid, engine=kw.pop("engine", engine), price_per_hour=1.0,
                        **{"cache": "read-write", "sampling": {"max_tokens": 12}, **kw})
        res = run_job(spec, db_url=sqlite_url)
        assert res.status == "succeeded" and res.total == res.succeeded, res.note
        return res

    eng = S.connect(sqlite_url)
    cold = job("cold", cold_in)
    assert _engine_rows(eng, "cold") == 40 + 3 * 2 + 1
    warm = job("warm", warm_in)
    # the engine side: only the new rows and the unseeded one were generated, in batches of theirs alone
    assert _engine_rows(eng, "warm") == 4 + 1
    assert sum(b["requests"] for b in S.MetricsReader(eng).batches("warm")) == 4 + 1
    a, b = _outputs(eng, "cold"), _outputs(eng, "warm")
    for k, row in a.items():
        if k[0] == "t0":
            assert b[k]["cached_from"] is None
            continue
        assert b[k]["cached_from"] == "cold" and b[k]["text"] == row["text"], k
        assert (b[k]["output_tokens"], b[k]["ttft_s"], b[k]["worker"]) == (row["output_tokens"], None, "cache")
    assert all(b[(r["id"], 0)]["cached_from"] is None for r in new)
    m = warm.metrics
    assert (m["cache"]["rows"], m["cache"]["samples"], m["cache"]["source_jobs"]) == (43, 46, {"cold": 46})
    assert m["cache"]["output_tokens"] == sum(r["output_tokens"] for k, r in a.items() if k[0] != "t0")
    assert m["requests"]["samples"] == 51 and m["latency_s"]["e2e"]["n"] == 5  # engine figures: engine rows
    assert m["tokens"]["output"] == sum(r["output_tokens"] for r in b.values() if r["cached_from"] is None)
    exported = pq.read_table(tmp_path / "warm" / "outputs.parquet").to_pylist()
    assert sum(r["cached_from"] == "cold" for r in exported) == 46 and len(exported) == 51
    status = json.loads(cli("status", "warm", "--db", sqlite_url, "--json").output)
    assert (status["cache_rows"], status["cache_mode"]) == (43, "read-write")
    assert "from the result cache (read-write)" in cli("report", "warm", "--db", sqlite_url, "--no-html").output
    # a rerun of the warm job resumes: nothing to do, every id once
    again = job("warm", warm_in)
    assert again.resumed and _engine_rows(eng, "warm") == 5 and len(_outputs(eng, "warm")) == 51

    # another dtype: another fingerprint, nothing served
    bf16 = job("bf16", cold_in, engine={**engine, "dtype": "bfloat16"})
    assert bf16.metrics["cache"]["rows"] == 0 and _engine_rows(eng, "bf16") == 47
    # another sampling key (max_tokens), and `read`: nothing served, nothing stored
    entries = S.CacheStore(eng).stats()["entries"]
    shorter = job("shorter", cold_in, cache="read", sampling={"max_tokens": 11})
    assert shorter.metrics["cache"]["rows"] == 0 and _engine_rows(eng, "shorter") == 47
    assert S.CacheStore(eng).stats()["entries"] == entries
    assert cold.metrics["cache"]["rows"] == 0


@pytest.mark.engine
def test_a_new_tune_of_the_same_model_spends_no_engine_time_on_eval_answers_already_computed(tmp_path, sqlite_url):
    from bench.tinymodel import tiny_model
    from tokenmill.jobs.modeltools import tune as T

    inp = write_parquet(tmp_path / "in.parquet", [{"id": f"q{i}", "prompt": f"Question {i}?"} for i in range(8)])
    evals = tmp_path / "eval.parquet"
    pq.write_table(pq.read_table(T.EVAL_SET).slice(0, 8), evals)
    spec = {"input": str(inp), "output": str(tmp_path / "o"), "engine": {**TEST_ENGINE, "model": str(tiny_model())},
            "sampling": {"max_tokens": 4}, "cache": "read-write"}
    eng = S.connect(sqlite_url)
    tunes = []
    for budget in (256, 512):  # two spaces: two tune ids, every job a new one; one engine config throughout
        space = tmp_path / f"space{budget}.yaml"
        space.write_text(f"candidates:\n  - {{batching.token_budget: {budget}}}\n")
        tunes.append(T.tune(spec, T.TuneOptions(sample=4, out=tmp_path / f"tune{budget}", db_url=sqlite_url,
                                                space=space, repeats=2, eval_set=evals)).tune_id)
    jobs = {j["id"]: j for j in S.JobStore(eng).recent(100)}
    first, again = f"tune-{tunes[0]}-ref-eval", f"tune-{tunes[1]}-ref-eval"
    assert _engine_rows(eng, first) == 8 and jobs[first]["metrics"]["cache"]["mode"] == "read-write"
    # the second tune's reference answers to the eval set: all from the first's, no engine time
    # (no worker row: no work item reached Generate, so no engine was started or asked)
    assert S.MetricsReader(eng).workers(again) == [] and S.MetricsReader(eng).batches(again) == []
    assert jobs[again]["metrics"]["cache"]["source_jobs"] == {first: 8} and jobs[again]["succeeded"] == 8
    # the runs that measure the engine never take an answer from the cache, whatever the spec says
    measured = [j for j in jobs if not j.endswith("-eval")]
    assert len(measured) == 8 and all(jobs[j]["metrics"]["cache"]["mode"] == "off" and _engine_rows(eng, j) == 4
                                      for j in measured)
