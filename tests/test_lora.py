"""LoRA adapters per row (`engine.lora_adapters`, a row's `adapter`; docs/REQUESTS.md).

End to end on the bundled model with an adapter made here by peft (tests/lora_adapter.py, built
once per machine): in one job, the rows that name the adapter answer as the merged-weights model
does (greedy, the same tokens; the merged model run through tokenmill too), the rows that name
none as the base model does, a row naming an undeclared adapter is its dead letter, and the
figures per adapter add up to the job's.  On vLLM (float32, so the adapter applied at run time
and the merged weights agree) and on llama.cpp (the adapter converted to GGUF with llama.cpp's
own script).  Slow tests for a reason: each runs three real jobs (adapter, merged, base), with
4 prompts × 8 tokens each to keep them to a few engine steps.  And through `tokenmill serve`
(a server of its own, started only for that test): a batch whose lines name the adapter as
their `model` beside lines naming the base model.  The preflight's refusals and the pieces
(batch lines, ordering, cache keys, figures) are tested without an engine."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from tests.conftest import TEST_ENGINE, write_parquet
from tests.helpers import job_spec
from tests.lora_adapter import NAME, RANK, adapter_set
from tokenmill.schemas import storage as S
from tokenmill.schemas.records import TokenizedPrompt

QUESTIONS = ["Who counts the gulls?", "What colour is the sea?", "Name a bird.", "What is a lighthouse for?"]
SAMPLING = {"max_tokens": 8, "temperature": 0.0}


def _chat(q: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": q}]


def _mixed_rows() -> list[dict]:
    """Each question twice, with the adapter and without; and one row naming an undeclared adapter."""
    rows = []
    for i, q in enumerate(QUESTIONS):
        rows.append({"id": f"lora-{i}", "messages": json.dumps(_chat(q)), "adapter": NAME})
        rows.append({"id": f"base-{i}", "messages": json.dumps(_chat(q)), "adapter": None})
    rows.append({"id": "stray", "messages": json.dumps(_chat(QUESTIONS[0])), "adapter": "nope"})
    return rows


def _plain_rows() -> list[dict]:
    return [{"id": f"q-{i}", "messages": json.dumps(_chat(q))} for i, q in enumerate(QUESTIONS)]


def _run(tmp_path: Path, db: str, name: str, rows: list[dict], engine: dict):
    from tokenmill.jobs.lifecycle.runner import run_job

    inp = write_parquet(tmp_path / f"{name}.parquet", rows)
    spec = job_spec(inp, tmp_path / name, job_id=name, engine=engine, sampling=SAMPLING)
    res = run_job(spec, db_url=db)
    out = {r["id"]: r for r in pq.read_table(tmp_path / name / "outputs.parquet").to_pylist()}
    return res, out


def _check_mixed_job(tmp_path: Path, db: str, mixed: dict, merged: dict, base: dict, job: str) -> None:
    res, out = mixed
    assert (res.total, res.succeeded, res.failed) == (9, 8, 1), res
    dead = pq.read_table(tmp_path / job / "dead_letters.parquet").to_pylist()
    assert [(d["id"], d["reason"]) for d in dead] == [("stray", "unknown_adapter")]
    assert "'nope'" in dead[0]["message"] and NAME in dead[0]["message"]
    _, m_out = merged
    _, b_out = base
    for i in range(len(QUESTIONS)):
        lora, plain = out[f"lora-{i}"], out[f"base-{i}"]
        assert (lora["adapter"], plain["adapter"]) == (NAME, None)
        assert lora["text"] == m_out[f"q-{i}"]["text"], i  # the adapter at run time = the merged weights
        assert lora["output_tokens"] == m_out[f"q-{i}"]["output_tokens"]
        assert plain["text"] == b_out[f"q-{i}"]["text"], i  # rows without it: the base model, in the same job
    assert sum(out[f"lora-{i}"]["text"] != out[f"base-{i}"]["text"] for i in range(len(QUESTIONS))) >= 3
    m = S.JobStore(S.connect(db)).get(job)["metrics"]
    per = {a["adapter"]: a for a in m["adapters"]["by_adapter"]}
    assert set(per) == {None, NAME} and per[NAME]["rows"] == per[None]["rows"] == len(QUESTIONS)
    assert sum(a["rows"] for a in per.values()) == m["requests"]["succeeded"]
    assert sum(a["prompt_tokens"] for a in per.values()) == m["tokens"]["prompt"]
    assert sum(a["output_tokens"] for a in per.values()) == m["tokens"]["output"]
    assert per[NAME]["output_tokens"] == sum(out[f"lora-{i}"]["output_tokens"] for i in range(len(QUESTIONS)))
    assert sum(a["generation_s"] for a in per.values()) == pytest.approx(m["throughput"]["generation_wall_s"])
    from tokenmill.jobs.metrics.report import format_report, load_report

    text = format_report(load_report(S.connect(db), job))
    assert "LoRA adapters" in text and NAME in text and "(base model)" in text


@pytest.fixture(scope="module")
def adapters(model_path) -> Path:
    return adapter_set(model_path)


@pytest.mark.engine
def test_vllm_rows_with_an_adapter_answer_as_the_merged_model_and_the_rest_as_the_base(
        tmp_path, sqlite_url, model_path, adapters):
    lora = {**TEST_ENGINE, "lora_adapters": {NAME: str(adapters / "adapter")}, "max_lora_rank": RANK}
    mixed = _run(tmp_path, sqlite_url, "mixed", _mixed_rows(), lora)
    merged = _run(tmp_path, sqlite_url, "merged", _plain_rows(), {**TEST_ENGINE, "model": str(adapters / "merged")})
    base = _run(tmp_path, sqlite_url, "base", _plain_rows(), TEST_ENGINE)
    _check_mixed_job(tmp_path, sqlite_url, mixed, merged, base, "mixed")


@pytest.fixture(scope="module")
def lora_server(tmp_path_factory, adapters):
    """A real `tokenmill serve` of the bundled model with the adapter declared (tests/serve_server.py)."""
    from tests.serve_server import Server

    root = tmp_path_factory.mktemp("serve-lora")
    engine = {**TEST_ENGINE, "lora_adapters": {NAME: str(adapters / "adapter")}, "max_lora_rank": RANK}
    cfg = {"db": f"sqlite:///{root / 'serve.db'}", "files": str(root / "files"), "work": str(root / "runs"),
           "models": {"smollm2-135m": {"engine": engine, "sampling": SAMPLING}}}
    srv = Server(root, cfg).start()
    yield srv
    srv.stop()


@pytest.mark.engine
def test_a_served_batch_naming_the_adapter_as_model_answers_as_the_merged_model_beside_base_lines(
        tmp_path, sqlite_url, adapters, lora_server):
    from tests.serve_server import chat_line, jsonl, lines_of, wait_for

    lines = [chat_line(f"{kind}-{i}", q, model=model, max_tokens=SAMPLING["max_tokens"])
             for i, q in enumerate(QUESTIONS) for kind, model in (("lora", NAME), ("base", "smollm2-135m"))]
    client = lora_server.client(lora_server.make_key("lora")["key"])

    def batch(name: str, lines: list[dict]):
        with open(jsonl(tmp_path / name, lines), "rb") as fh:
            f = client.files.create(file=fh, purpose="batch")
        return wait_for(client, client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                                                      completion_window="24h").id)

    typo = batch("typo.jsonl", [chat_line("x", "hi", model=NAME + "-v2")])  # fails in validating, no engine
    assert (typo.status, typo.errors.data[0].code) == ("failed", "model_not_found"), typo
    assert f"(served: smollm2-135m (adapters: {NAME}))" in typo.errors.data[0].message
    b = batch("mixed.jsonl", lines)
    assert (b.status, b.model, b.request_counts.completed, b.error_file_id) == ("completed", "smollm2-135m",
                                                                               len(lines), None), b
    served = {x["custom_id"]: x["response"]["body"] for x in lines_of(client, b.output_file_id)}
    _, merged = _run(tmp_path, sqlite_url, "merged", _plain_rows(), {**TEST_ENGINE, "model": str(adapters / "merged")})
    text = {cid: body["choices"][0]["message"]["content"] for cid, body in served.items()}
    for i in range(len(QUESTIONS)):
        lora, base = served[f"lora-{i}"], served[f"base-{i}"]
        assert (lora["model"], base["model"]) == (NAME, "smollm2-135m")  # the name each line asked for
        assert text[f"lora-{i}"] == merged[f"q-{i}"]["text"], i  # the adapter at run time = the merged weights
        assert lora["usage"]["completion_tokens"] == merged[f"q-{i}"]["output_tokens"]
    assert sum(text[f"lora-{i}"] != text[f"base-{i}"] for i in range(len(QUESTIONS))) >= 3  # base lines: no adapter


@pytest.mark.llamacpp
def test_llamacpp_rows_with_a_gguf_adapter_answer_as_the_merged_model_and_the_rest_as_the_base(
        tmp_path, sqlite_url, model_path):
    from tests.lora_adapter import converter_dir

    if not (converter_dir() / "convert_lora_to_gguf.py").is_file():
        pytest.fail(f"llama.cpp's converters are not in {converter_dir()}: run `make llamacpp-convert`")
    got = adapter_set(model_path, gguf=True)
    engine = {"kind": "llamacpp", "max_in_flight": 4, "max_model_len": 1024, "tokenizer": model_path}
    mixed = _run(tmp_path, sqlite_url, "mixed", _mixed_rows(),
                 {**engine, "model": str(got / "base.gguf"), "lora_adapters": {NAME: str(got / "adapter.gguf")}})
    merged = _run(tmp_path, sqlite_url, "merged", _plain_rows(), {**engine, "model": str(got / "merged.gguf")})
    base = _run(tmp_path, sqlite_url, "base", _plain_rows(), {**engine, "model": str(got / "base.gguf")})
    _check_mixed_job(tmp_path, sqlite_url, mixed, merged, base, "mixed")


# ---------------------------------------------------------------- refused before the run


def _problems(tmp_path: Path, engine: dict) -> list[str]:
    from tokenmill.jobs.lifecycle.preflight import preflight

    inp = write_parquet(tmp_path / "in.parquet", _plain_rows())
    return preflight(job_spec(inp, tmp_path / "out", engine=engine)).problems


def test_an_adapter_over_max_lora_rank_or_missing_is_refused_in_one_line_each(tmp_path, model_path, adapters):
    problems = _problems(tmp_path, {**TEST_ENGINE, "max_lora_rank": 1, "lora_adapters": {
        NAME: str(adapters / "adapter"), "gone": str(tmp_path / "nowhere")}})
    assert f"lora adapter 'marisol' has rank {RANK}, over engine.max_lora_rank 1" in " | ".join(problems)
    assert any(p.startswith("lora adapter 'gone':") and "does not exist" in p for p in problems)
    assert all("\n" not in p for p in problems)
    assert not _problems(tmp_path, {**TEST_ENGINE, "max_lora_rank": RANK, "lora_adapters": {
        NAME: str(adapters / "adapter")}})


@pytest.mark.s3
def test_an_adapter_given_as_an_s3_url_is_synced_checked_there_and_handed_to_the_engine(
        tmp_path, model_path, adapters, s3, monkeypatch):
    """`engine.lora_adapters` naming an s3:// URL: the preflight syncs the adapter into this
    host's models cache and reads its rank from that copy; the engine is handed the copy
    (`adapter_paths`), file for file what was uploaded."""
    from tokenmill.schemas.config import JobSpec
    from tokenmill.schemas.model_sync import MANIFEST
    from tokenmill.transforms.engines.lora import adapter_paths

    monkeypatch.setenv("TOKENMILL_MODELS", str(tmp_path / "models"))
    src = adapters / "adapter"
    files = {f.relative_to(src): f.read_bytes() for f in src.rglob("*") if f.is_file()}
    for rel in files:
        s3.upload_file(str(src / rel), s3.buckets["in"], f"adapters/{NAME}/{rel}")
    engine = {**TEST_ENGINE, "model": model_path, "max_lora_rank": 1,  # the base by its folder: the cache is the test's
              "lora_adapters": {NAME: f"s3://{s3.buckets['in']}/adapters/{NAME}"}}
    problems = _problems(tmp_path, engine)
    assert any(f"lora adapter '{NAME}' has rank {RANK}, over engine.max_lora_rank 1" in p for p in problems), problems
    assert not _problems(tmp_path, {**engine, "max_lora_rank": RANK})
    spec = JobSpec.model_validate(job_spec(tmp_path / "in.parquet", tmp_path / "out", engine={**engine, "max_lora_rank": RANK}))
    copy = Path(adapter_paths(spec.engine)[NAME])
    assert copy.is_relative_to(tmp_path / "models")
    assert {f.relative_to(copy): f.read_bytes() for f in copy.rglob("*") if f.is_file() and f.name != MANIFEST} == files


def test_an_engine_without_lora_refuses_adapters_and_vllm_ranks_are_its_own(tmp_path):
    from tests import echo_engine
    from tokenmill.schemas.config import SpecError
    from tokenmill.transforms.engines import kinds

    kinds.register(echo_engine.ENGINE)
    try:
        problems = _problems(tmp_path, {"kind": "echo", "lora_adapters": {"a": str(tmp_path)}})
    finally:
        kinds.unregister("echo")
    assert any("engine kind echo does not run LoRA adapters" in p for p in problems)
    with pytest.raises(SpecError, match="max_lora_rank one of"):
        job_spec(tmp_path / "x.parquet", tmp_path / "o", engine={"max_lora_rank": 12})
    with pytest.raises(SpecError, match="adapter names"):
        job_spec(tmp_path / "x.parquet", tmp_path / "o", engine={"lora_adapters": {"bad name": "x"}})


# ---------------------------------------------------------------- the pieces


def test_a_row_naming_an_undeclared_adapter_is_a_dead_letter_and_a_declared_one_is_kept():
    from tokenmill.transforms.validate import validate_row

    row = {"_file_index": 0, "_row": 3, "id": "a", "prompt": "hi"}
    assert validate_row({**row, "adapter": "x"}, adapters={"x"}).adapter == "x"
    assert validate_row({**row, "adapter": None}, adapters={"x"}).adapter is None
    assert validate_row({**row, "adapter": ""}, adapters={"x"}).adapter is None
    dead = validate_row({**row, "adapter": "y"}, adapters={"x"})
    assert (dead.reason, dead.message) == ("unknown_adapter", "adapter 'y' is not declared in engine.lora_adapters "
                                                              "(declared: x)")


def test_an_openai_batch_line_naming_an_adapter_as_its_model_runs_with_it():
    from tokenmill.transforms.openai_batch import LineRules, line_row

    rules = LineRules(models=("smollm2-135m",), adapters=(NAME,))
    line = {"custom_id": "c", "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": NAME, "messages": _chat("hi"), "max_tokens": 4}}
    assert line_row(json.dumps(line).encode(), 0, 0, rules)["adapter"] == NAME
    base = line_row(json.dumps({**line, "body": {**line["body"], "model": "smollm2-135m"}}).encode(), 0, 1, rules)
    assert "adapter" not in base
    other = line_row(json.dumps({**line, "body": {**line["body"], "model": "other"}}).encode(), 0, 2, rules)
    assert other["_error"][0] == "bad_request"


def _prompt(i: int, prefix: str, adapter: str | None, tokens=(1, 2, 3)) -> TokenizedPrompt:
    return TokenizedPrompt(id=str(i), input_file=0, input_row=i, token_ids=list(tokens) + [i], prefix_key=prefix,
                           max_tokens=4, adapter=adapter)


def test_prefix_ordering_keeps_one_adapters_rows_together_inside_a_prefix_group():
    from tokenmill.transforms.batching import order_prompts

    ps = [_prompt(0, "p1", "b"), _prompt(1, "p1", None), _prompt(2, "p2", "a"), _prompt(3, "p1", "a"),
          _prompt(4, "p1", "b"), _prompt(5, "p1", None)]
    got = [(p.prefix_key, p.adapter) for p in order_prompts(ps, "prefix")]
    assert got == [("p1", None), ("p1", None), ("p1", "a"), ("p1", "b"), ("p1", "b"), ("p2", "a")]


def test_a_cache_key_names_the_adapters_content_and_a_base_rows_key_is_unchanged():
    from tokenmill.schemas.config import SamplingDefaults
    from tokenmill.transforms.cache import prompt_keys, request_key

    d = SamplingDefaults(max_tokens=4)
    base, one = _prompt(0, "p", None), _prompt(0, "p", "a")
    k_base = prompt_keys("fp", d, base, {"a": "sha-1"})
    assert k_base == [request_key("fp", base.token_ids, None, prompt_keys_sampling(d, base), 0)]
    k1, k2 = prompt_keys("fp", d, one, {"a": "sha-1"}), prompt_keys("fp", d, one, {"a": "sha-2"})
    assert k1 != k2 and k1 != k_base
    assert prompt_keys("fp", d, one, {}) is None  # an adapter of unknown content is never cached


def prompt_keys_sampling(d, p):
    from tokenmill.schemas.sampling import request_sampling, sample_requests

    return sample_requests(request_sampling(d, p))[0]


def test_figures_per_adapter_add_up_to_the_jobs_with_time_and_cost_by_token_share():
    from tokenmill.jobs.metrics.adapters import adapter_figures

    rows = [{"adapter": None, "rows": 3, "prompt_tokens": 30, "output_tokens": 10, "request_s": 2.0},
            {"adapter": "a", "rows": 1, "prompt_tokens": 50, "output_tokens": 10, "request_s": 1.0}]
    got = adapter_figures(rows, 10.0, {"total": 2.0, "held": {"total": 4.0}})["by_adapter"]
    assert [g["token_share"] for g in got] == [0.4, 0.6]
    assert [g["generation_s"] for g in got] == [4.0, 6.0]
    assert sum(g["cost"] for g in got) == pytest.approx(2.0) and sum(g["held_cost"] for g in got) == pytest.approx(4.0)


def test_the_openai_engine_sends_an_adapters_served_name_as_model_and_checks_the_server_lists_it():
    from tests.openai_server import FaultServer
    from tokenmill.transforms.engines.openai_config import OpenAIConfig
    from tokenmill.transforms.engines.openai_session import OpenAISession, check_server
    from tokenmill.transforms.engines.protocol import EngineStartError

    with FaultServer(also_serves=("gulls-v2",)) as s:
        cfg = OpenAIConfig(kind="openai", base_url=s.base_url, model=s.model, lora_adapters={"gulls": "gulls-v2"})
        session = OpenAISession(cfg)
        try:
            session.add("a", [1, 2], {"max_tokens": 2}, source="hi", adapter="gulls")
            session.add("b", [1, 2], {"max_tokens": 2}, source="hi")
            with pytest.raises(ValueError, match="not declared"):
                session.add("c", [1, 2], {"max_tokens": 2}, source="hi", adapter="nope")
            done = []
            while len(done) < 2:
                done += session.step()
        finally:
            session.shutdown()
        assert sorted(b["model"] for b in s.bodies) == sorted([s.model, "gulls-v2"])
        with pytest.raises(EngineStartError, match="does not serve the LoRA adapters"):
            check_server(cfg.model_copy(update={"lora_adapters": {"gulls": "gulls-v3"}}))


def test_llamacpp_loads_every_adapter_at_start_and_each_request_names_every_scale(tmp_path):
    from tokenmill.transforms.engines.llamacpp_session import LlamaCppConfig, lora_body, server_args

    cfg = LlamaCppConfig(kind="llamacpp", model="smollm2-135m",
                         lora_adapters={"b": str(tmp_path / "b.gguf"), "a": str(tmp_path / "a.gguf")})
    args = server_args(cfg, tmp_path / "m.gguf", 1234, 2)
    loads = [args[i + 1] for i, a in enumerate(args) if a == "--lora"]
    assert loads == [str(tmp_path / "a.gguf"), str(tmp_path / "b.gguf")] and "--lora-init-without-apply" in args
    body = lora_body(cfg)
    assert body["b"] == {"lora": [{"id": 0, "scale": 0.0}, {"id": 1, "scale": 1.0}]}
    assert body[None] == {"lora": [{"id": 0, "scale": 0.0}, {"id": 1, "scale": 0.0}]}
    assert lora_body(cfg.model_copy(update={"lora_adapters": {}})) == {}
