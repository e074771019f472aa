"""Each PTransform on its own, in a TestPipeline with `assert_that` (the whole job: test_pipeline.py).

The DoFns' logic is unit-tested without Beam elsewhere (test_validate, test_batching,
test_generate, test_openai_batch); here each step is checked as Beam runs it:
its inputs, its main output and its tagged outputs.
"""

from __future__ import annotations

import json

import apache_beam as beam
from apache_beam.testing.test_pipeline import TestPipeline as BeamTestPipeline
from apache_beam.testing.util import assert_that, equal_to

from tests.conftest import write_parquet
from tests.fakes import FakeSession
from tokenmill.schemas import records as R
from tokenmill.schemas import storage as S
from tokenmill.schemas.config import BatchingConfig, SamplingDefaults
from tokenmill.schemas.records import Chunk, DeadLetterRow, FailedRecord, OutputRow, PromptRecord, TokenizedPrompt
from tokenmill.transforms.batching import TakePart
from tokenmill.transforms.chunks import DEAD
from tokenmill.transforms.counting import TokenCounter
from tokenmill.transforms.dedup import ClaimIds, DedupIds
from tokenmill.transforms.engines.vllm_config import VllmConfig
from tokenmill.transforms.generate import STATS, Generate, GenerateConfig
from tokenmill.transforms.openai_batch import plan_jsonl
from tokenmill.transforms.read import PlanUnits, ReadPrompts, plan_input, plan_units, plan_work
from tokenmill.transforms.resume import SkipDone
from tokenmill.transforms.tokenize import RecordRules, Tokenize
from tokenmill.transforms.validate import Validate
from tokenmill.transforms.write import WriteDeadLetters, commit_batch


def _pipeline():
    return BeamTestPipeline(options=beam.options.pipeline_options.PipelineOptions(["--runner=DirectRunner"]))


def _row(i: int, **kw) -> dict:
    """A row as the readers yield it: its columns plus where it came from."""
    return {"_file_index": 0, "_row": i, **kw}


def _chunk(items, unit="0.0") -> Chunk:
    return Chunk(unit, list(items))


def _items(chunks):
    """A PCollection of chunks → its records (one chunk per unit, never empty)."""
    return chunks | beam.FlatMap(lambda c: c.items if c.items else [AssertionError("empty chunk")])


def _prompt(i: int, ids: list[int], prefix_key: str = "0a", max_tokens: int = 3) -> TokenizedPrompt:
    return TokenizedPrompt(id=f"p{i}", input_file=0, input_row=i, token_ids=ids, prefix_key=prefix_key,
                           max_tokens=max_tokens)


def test_read_prompts_yields_every_row_of_every_row_group_with_its_position(tmp_path):
    rows = [{"id": f"r{i}", "prompt": f"question {i}"} for i in range(7)]
    plan = plan_input(str(write_parquet(tmp_path / "in.parquet", rows, row_group_size=3)))
    assert len(plan.shards) == 3
    with _pipeline() as p:
        got = (_items(p | PlanUnits(plan_work(plan_units(plan))) | ReadPrompts())
               | beam.Map(lambda r: (r["id"].decode(), r["_file_index"], r["_row"], r["prompt"].decode())))
        assert_that(got, equal_to([(f"r{i}", 0, i, f"question {i}") for i in range(7)]))


def test_read_openai_batch_turns_lines_into_rows_and_keeps_bad_lines_for_validate(tmp_path):
    lines = [
        {"custom_id": "a", "method": "POST", "url": "/v1/chat/completions",
         "body": {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}},
        "not json",
        {"custom_id": "c", "method": "POST", "url": "/v1/completions", "body": {"model": "m", "prompt": "x"}},
    ]
    f = tmp_path / "batch.jsonl"
    f.write_text("\n".join(json.dumps(x) if isinstance(x, dict) else x for x in lines) + "\n")
    with _pipeline() as p:
        got = _items(p | PlanUnits(plan_work(plan_units(plan_jsonl(str(f))))) | ReadPrompts()) | beam.Map(
            lambda r: (r["_row"], r.get("id"), r.get("max_tokens"), "_error" in r))
        assert_that(got, equal_to([(0, "a", 5, False), (1, None, None, True), (2, "c", None, False)]))


def test_validate_splits_good_rows_from_dead_letters_with_reasons():
    rows = [_row(0, id="a", prompt="fine"), _row(1, id="b", prompt="   "), _row(2, id="c", prompt="x", top_p=1.5),
            _row(3, id="d", messages=json.dumps([{"role": "user", "content": "hello"}]))]
    with _pipeline() as p:
        out = p | beam.Create([_chunk(rows)]) | Validate()
        assert_that(_items(out.ok) | "ok ids" >> beam.Map(lambda r: (r.id, r.input_ref)),
                    equal_to([("a", "0:0"), ("d", "0:3")]), label="ok")
        assert_that(out[DEAD] | "dead" >> beam.Map(lambda d: (d.id, d.reason)),
                    equal_to([("b", R.EMPTY_PROMPT), ("c", R.BAD_SAMPLING)]), label="dead")


def test_claim_ids_records_the_first_row_of_each_id_whatever_order_units_run_in(tmp_path, sqlite_url):
    rows = [{"id": i, "prompt": "q"} for i in ["a", "b", "a", "c", "b", "a", "d"]]
    plan = plan_input(str(write_parquet(tmp_path / "in.parquet", rows, row_group_size=2)))
    work = plan_work(plan_units(plan)[::-1], workers=3)  # the last unit claims first; the upsert keeps the earliest
    assert {w.parts for w in work} == {2}  # every unit in two parts: both claim, the same rows
    with _pipeline() as p:
        chunks = p | PlanUnits(work) | ReadPrompts() | ClaimIds(sqlite_url, "j")
        assert_that(chunks | beam.Map(lambda c: len(c.items)) | beam.CombineGlobally(sum), equal_to([14]))
    assert S.ResultWriter(S.connect(sqlite_url)).id_claims("j", "abcdz") == {"a": (0, 0), "b": (0, 1), "c": (0, 3), "d": (0, 6)}


def test_dedup_ids_keeps_the_claiming_row_of_an_id_and_dead_letters_the_rest(sqlite_url):
    S.ResultWriter(S.connect(sqlite_url)).claim_ids("j", [("a", 0, 5), ("a", 0, 2), ("b", 1, 0)])
    recs = [PromptRecord(id="a", input_file=0, input_row=5, prompt="late"),
            PromptRecord(id="a", input_file=0, input_row=2, prompt="early"),
            PromptRecord(id="b", input_file=1, input_row=0, prompt="only")]
    with _pipeline() as p:
        out = p | beam.Create([_chunk(recs)]) | DedupIds(sqlite_url, "j")
        assert_that(_items(out.ok) | "ok" >> beam.Map(lambda r: (r.id, r.prompt)),
                    equal_to([("a", "early"), ("b", "only")]), label="ok")
        assert_that(out[DEAD] | "dead" >> beam.Map(lambda d: (d.id, d.input_ref, d.reason, d.message)),
                    equal_to([("a", "0:5", R.DUPLICATE_ID, "duplicate id 'a': the row at 0:2 came first")]),
                    label="dead")


def test_skip_done_drops_done_rows_and_dead_letters_a_row_whose_id_another_row_answered(sqlite_url):
    eng = S.connect(sqlite_url)
    S.ResultWriter(eng).insert_rows(OutputRow, [OutputRow(job_id="j", id="a", input_file=0, input_row=0).as_dict()])
    S.ResultWriter(eng).insert_rows(DeadLetterRow, [DeadLetterRow(job_id="j", input_file=0, input_row=1, id="b",
                                                                       reason=R.EMPTY_PROMPT, message="empty").as_dict()])
    recs = [PromptRecord(id=i, input_file=0, input_row=n, prompt="q") for n, i in enumerate("abc")]
    recs.append(PromptRecord(id="a", input_file=0, input_row=3, prompt="a later row of an answered id"))
    with _pipeline() as p:
        got = _items(p | beam.Create([_chunk(recs)]) | SkipDone(sqlite_url, "j")) | beam.Map(lambda r: r.input_ref)
        assert_that(got, equal_to(["0:2"]))
    assert S.MetricsReader(eng).failure_reasons("j") == {R.EMPTY_PROMPT: 1, R.DUPLICATE_ID: 1}  # row 3 is not lost


def test_tokenize_counts_tokens_keys_prefixes_and_dead_letters_prompts_too_long(model_path):
    system = {"role": "system", "content": "You answer in one word. " * 20}
    recs = [PromptRecord(id="a", input_file=0, input_row=0, messages=[system, {"role": "user", "content": "Sky colour?"}]),
            PromptRecord(id="b", input_file=0, input_row=1, messages=[system, {"role": "user", "content": "Grass colour?"}]),
            PromptRecord(id="c", input_file=0, input_row=2, prompt="word " * 400)]
    with _pipeline() as p:
        out = p | beam.Create([_chunk(recs)]) | Tokenize(TokenCounter.local(model_path), RecordRules(
            max_model_len=256, default_max_tokens=8, block_size=16, prefix_blocks=4))
        # a and b share their system prompt: one prefix key, both prompts long, the job's max_tokens
        shape = (_items(out.ok) | beam.Map(lambda t: (t.id, t.prefix_key, len(t.token_ids) > 100, t.max_tokens))
                 | beam.combiners.ToList() | beam.Map(lambda ts: (len({k for _, k, _, _ in ts}), sorted(
                     (i, long, mt) for i, _, long, mt in ts))))
        assert_that(shape, equal_to([(1, [("a", True, 8), ("b", True, 8)])]), label="shared prefix")
        assert_that(out[DEAD] | beam.Map(lambda d: (d.id, d.reason)), equal_to([("c", R.PROMPT_TOO_LONG)]),
                    label="too long")


def test_take_part_gives_each_part_a_contiguous_segment_of_the_unit_order():
    prompts = [_prompt(i, [i % 3] * 8 + [i], prefix_key=f"0{i % 3}") for i in range(12)]
    with _pipeline() as p:
        parts = [p | f"part{k}" >> beam.Create([Chunk("u", prompts[::-1], k, 3)]) | f"take{k}" >> TakePart("prefix")
                 | f"ids{k}" >> beam.Map(lambda c: (c.part, [x.id for x in c.items])) for k in range(3)]
        got = parts | beam.Flatten()
        # prefix order groups i % 3 == 0, 1, 2: each part gets exactly one whole group
        assert_that(got, equal_to([(k, [f"p{i}" for i in range(k, 12, 3)]) for k in range(3)]))


def _generate_config(**batching) -> GenerateConfig:
    return GenerateConfig(job_id="j", run_id="r", model_name="fake", model_path="", engine=VllmConfig(max_num_seqs=4),
                          sampling=SamplingDefaults(max_tokens=3), batching=BatchingConfig(**batching))


class _RejectingSession(FakeSession):
    def __init__(self, cfg=None, model_path=""):
        super().__init__(cfg, model_path, reject_token=666)


def test_generate_answers_each_prompt_once_dead_letters_rejected_ones_and_reports_batches():
    prompts = [_prompt(i, [100 + i] + [1] * 20) for i in range(9)] + [_prompt(9, [666, 1])]
    with _pipeline() as p:
        out = (p | beam.Create([_chunk(prompts)]) | Generate(_generate_config(token_budget=72), _RejectingSession))
        answered = out.ok | "rows" >> beam.FlatMap(lambda rows: [(r["id"], r["text"], r["output_tokens"]) for r in rows])
        assert_that(answered, equal_to([(f"p{i}", f"echo:{100 + i}", 3) for i in range(9)]), label="answered")
        assert_that(out[DEAD] | "dead" >> beam.Map(lambda d: (d.id, d.reason)), equal_to([("p9", R.BAD_REQUEST)]),
                    label="dead")
        stats = out[STATS] | "stats" >> beam.Map(lambda s: s["requests"]) | beam.CombineGlobally(sum)
        assert_that(stats, equal_to([10]), label="batch requests")


def test_generate_updates_the_worker_row_at_most_every_few_seconds_and_with_final_counts_at_bundle_end(monkeypatch):
    import dataclasses

    from apache_beam.utils.windowed_value import WindowedValue

    from tokenmill.transforms import generate as G
    from tokenmill.transforms import write as W

    reports = []
    monkeypatch.setattr(W, "record_worker", lambda *a, **k: None)
    monkeypatch.setattr(W, "update_worker_peak", lambda url, job, worker, **counts: reports.append(counts))
    admits = []  # the admitted count written ahead of each batch
    monkeypatch.setattr(W, "update_worker_admitted", lambda url, job, worker, n: admits.append(n))
    monkeypatch.setattr(G, "_DONE", {})
    fn = G.GenerateFn(dataclasses.replace(_generate_config(token_budget=64), db_url="sqlite://"), FakeSession)
    fn.setup()
    fn.start_bundle()
    emitted = []
    for k in range(3):  # three units of three batches, in one bundle
        emitted += fn.process(_chunk([_prompt(10 * k + i, [100 + 10 * k + i] + [1] * 20) for i in range(6)], unit=f"{k}.0"))
    finished = list(fn.finish_bundle())
    fn.teardown()
    # the last unit's tail comes out of finish_bundle, as windowed values (Beam's rule there)
    windowed = [o.value if isinstance(o, beam.pvalue.TaggedOutput) else o for o in finished]
    assert windowed and all(isinstance(w, WindowedValue) for w in windowed)
    rows = [r for o in emitted + [w.value for w in windowed] if isinstance(o, list) for r in o]
    assert sorted(r["id"] for r in rows) == sorted(f"p{10 * k + i}" for k in range(3) for i in range(6))
    # 9 batches, yet the row was written on the first one and at the bundle's end only
    # (the fake run is far shorter than REPORT_EVERY_S), the last with every count
    assert len(reports) == 2
    assert reports[-1] == {"admitted_rows": 18, "generated_rows": 18, "generated_tokens": 54}
    # ... while the admitted count went out before each of the 9 batches, its rows included
    assert len(admits) == 9 and admits == sorted(admits) and admits[0] > 0 and admits[-1] == 18


def test_a_batch_and_dead_letters_are_committed_idempotently(sqlite_url):
    """Generate's per-batch commit (outputs, its dead letters, its figures: one transaction)
    and a step's dead-letter writer: written twice (a retried bundle, a rerun), stored once."""
    out = [OutputRow(job_id="j", id=f"o{i}", input_file=0, input_row=i, text="t").as_dict() for i in range(3)]
    engine_dead = [FailedRecord(input_file=0, input_row=5, id="e", reason=R.ENGINE_ERROR, message="boom")]
    dead = [FailedRecord(input_file=0, input_row=7, id="x", reason=R.BAD_REQUEST, message="no")]
    stats = R.BatchStats(job_id="j", batch_id="b0", requests=4).as_dict()
    for _ in range(2):  # a retried bundle or a rerun writes the same keys again
        commit_batch(sqlite_url, "j", out, engine_dead, stats)
        with _pipeline() as p:
            _ = p | "dead" >> beam.Create(dead) | "w" >> WriteDeadLetters(sqlite_url, "j")
    eng = S.connect(sqlite_url)
    assert S.MetricsReader(eng).counts("j") == {"succeeded": 3, "failed": 2}
    assert [b["batch_id"] for b in S.MetricsReader(eng).batches("j")] == ["b0"]
