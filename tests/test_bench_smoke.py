"""The throughput benchmark's pure parts: seeded workloads, A B B A order, the
shared-token share, CLI flags for the subprocess arms, the docs section."""

import pyarrow.parquet as pq

from bench import arms as A
from bench import throughput as T
from bench import workloads as W


def test_workloads_are_reproducible_and_shaped_as_described(tmp_path):
    a1 = W.chat(tmp_path / "a1.parquet", 50, seed=7)
    a2 = W.chat(tmp_path / "a2.parquet", 50, seed=7)
    assert pq.read_table(a1.path).equals(pq.read_table(a2.path))
    b = W.shared_prefix(tmp_path / "b.parquet", docs=5, questions=3)
    ids = pq.read_table(b.path).column("id").to_pylist()
    assert b.rows == 15 and sorted(ids) != ids  # shuffled in the file
    c = W.long_output(tmp_path / "c.parquet", 20, min_out=10, max_out=30)
    mts = pq.read_table(c.path).column("max_tokens").to_pylist()
    assert all(10 <= m <= 30 for m in mts) and len(set(mts)) > 1


def test_abba_order_repeats_arms_mirrored_and_rotates_the_first_arm_per_repetition():
    assert T.abba(["raw", "tm"], 2) == ["raw", "tm", "tm", "raw"]
    assert T.abba(["raw", "tm"], 4) == ["raw", "tm", "tm", "raw", "tm", "raw", "raw", "tm"]
    assert T.abba(["a", "b", "c"], 1) == ["a", "b", "c"]
    assert T.abba(["a", "b", "c"], 4) == ["a", "b", "c", "c", "b", "a", "b", "c", "a", "a", "c", "b"]
    # the full and GPU scales measure each in-process arm first as often as the other
    for scale in ("full", "gpu"):
        order = T.abba(["raw", "tm"], T.SCALES[scale]["ac_reps"])
        firsts = [order[i] for i in range(0, len(order), 4)]
        assert sorted(firsts) == ["raw", "tm"] and order.count("raw") == order.count("tm")


def test_the_docs_section_says_the_warm_up_and_the_order_and_counts_measured_runs_only():
    run = {"output_tok_per_s": 100.0, "total_tok_per_s": 300.0, "requests_per_s": 2.0, "gen_s": 10.0,
           "requests": 20, "prompt_tokens": 2000, "output_tokens": 1000}
    res = {"hardware": {"cpu_model": "X"}, "versions": {}, "engine_args": {}, "command": "c", "started_at": "s",
           "finished_at": "f", "model": "m", "load_format": "auto", "workloads": {},
           "runs": {"chat/raw": [run] * 4, "chat/tokenmill": [run] * 4},
           "warmups": {"chat/raw": [{**run, "output_tok_per_s": 50.0}]},
           "order": {"a": T.abba(["raw", "tokenmill"], 4)}}
    res["medians"] = {k: T.median_of(v) for k, v in res["runs"].items()}
    res["ratios"] = T.ratios(res["medians"])
    md = T.markdown(res, "x.json")
    assert "after one unmeasured warm-up run each, in the order (a) A B B A B A A B (A raw, B tokenmill)." in md
    assert "| chat/raw | 4 | 100.0 |" in md  # the warm-up's 50 tok/s is not in the median
    del res["order"]  # results files written before the warm-up still read
    assert "Medians of A B B A repetitions." in T.markdown(res, "x.json")


def test_shared_token_share_counts_whole_blocks_after_the_first_prompt():
    doc = list(range(300))  # two whole 128-blocks shared
    rows = [{"id": "b0-0", "token_ids": doc + [1]}, {"id": "b0-1", "token_ids": doc + [2]},
            {"id": "b1-0", "token_ids": [9] * 100}]
    assert T.shared_token_share(rows, 128) == 256 / (301 + 301 + 100)


def test_server_args_turn_engine_kwargs_into_vllm_flags():
    flags = A.server_args({"model": "m", "dtype": "float32", "enforce_eager": True, "enable_prefix_caching": False,
                           "quantization": None, "max_num_seqs": 8, "disable_log_stats": False})
    assert flags == ["--dtype", "float32", "--enforce-eager", "--no-enable-prefix-caching", "--max-num-seqs", "8"]


def test_docs_section_replaces_only_the_throughput_heading(tmp_path):
    doc = tmp_path / "B.md"
    doc.write_text("# Benchmarks\n\n## Demo\nkeep\n\n## Throughput\nold\n\n## Load\nkeep too\n")
    T.write_docs("## Throughput\nnew\n", doc)
    text = doc.read_text()
    assert "new" in text and "old" not in text and "keep\n" in text and "## Load\nkeep too" in text


def test_request_kinds_bench_workload_check_rounds_and_report(tmp_path):
    from bench import request_kinds as K

    rows = K.write_input(tmp_path / "in.parquet", 6, seed=7)
    table = pq.read_table(tmp_path / "in.parquet")
    assert table.column_names == ["id", "messages"] and rows == K.people(6, seed=7)  # the seed alone decides
    p = rows[0]["person"]
    assert p["name"] in rows[0]["prompt"] and str(p["age"]) in rows[0]["prompt"] and p["city"] in rows[0]["prompt"]
    good = '{"name": "Ana Silva", "age": 30, "city": "Porto"}'
    assert K.schema_check(good) == {"strict": True, "lenient": True}
    assert K.schema_check(f"```json\n{good}\n```") == {"strict": False, "lenient": True}
    assert not any(K.schema_check('{"name": "Ana", "age": "30", "city": "Porto"}').values())  # age not an integer
    assert not any(K.schema_check(good[:-1] + ', "job": "x"}').values())  # additionalProperties false
    assert K.order(2) == ["A", "B", "B", "A"] and K.order(1) == ["A", "B"]

    def run(arm, tok_s, valid):
        return {"arm": arm, "kind": K.ARMS[arm], "output_tok_per_s": tok_s, "rows_per_s": tok_s / 10,
                "generation_wall_s": 1.0, "rows": 6, "output_tokens": 60, "cut_at_max_tokens": 0, "valid_rate": valid,
                "lenient_valid_rate": valid, "status_valid_rate": valid if arm == "B" else None, "model_load_s": 1.0,
                "process_wall_s": 5.0, "dtype": None}

    runs = [run("A", 100.0, 0.0), run("B", 80.0, 1.0), run("B", 90.0, 1.0), run("A", 100.0, 0.0)]
    assert K.paired(runs) == [0.8, 0.9]
    assert K.verdict([0.8, 0.9]).startswith("structured slower") and K.verdict([1.1, 1.2]).startswith("structured faster")
    assert K.verdict([0.9, 1.1]).startswith("not resolved") and K.verdict([0.8]).startswith("not resolved: one round")
    res = {"hardware": {"cpu_model": "X"}, "cpu_features": "2-core X", "command": "c", "started_at": "2026-12-03T00:00",
           "finished_at": "f", "n": 6, "seed": 7, "max_tokens": 96, "dtype": "auto", "example_prompt": rows[0]["prompt"],
           "order": ["warm-up B", *K.order(2)],
           "engines": {"llamacpp": {"versions": {}, "warmup": run("B", 50.0, 1.0), "runs": runs, "ratios": [0.8, 0.9],
                                    "rows_per_s_ratios": [0.8, 0.9], "verdict": K.verdict([0.8, 0.9]),
                                    "free_valid_rate": 0.0, "structured_valid_rate": 1.0}}}
    md = K.markdown(res, "kinds-x.json")
    assert md.startswith(K.TITLE) and "2-core X, 2026-12-03" in md and md.count("| B structured |") == 3
    assert "per round: 0.80, 0.90" in md and "free 0%, structured 100%" in md
    doc = tmp_path / "B.md"
    doc.write_text("# Benchmarks\n\n## Dtype\nkeep\n")
    K.write_docs(md, doc)
    K.write_docs(md.replace("2026-12-03", "2026-12-04"), doc)
    text = doc.read_text()
    assert text.count(K.TITLE) == 1 and "## Dtype\nkeep" in text and text.index("2026-12-04") < text.index("2026-12-03")


def test_estimate_bench_inputs_have_their_length_mixes_and_every_run_is_tabled(tmp_path):
    from bench import estimate as E

    sample, mt = E.make_input("sample", 30, tmp_path)
    assert pq.read_table(sample).num_rows == 30 and mt == 64
    longout, mt = E.make_input("long_output", 20, tmp_path)
    assert mt == 256 and min(pq.read_table(longout).column("max_tokens").to_pylist()) >= 32
    longprompt, mt = E.make_input("long_prompt", 20, tmp_path)
    assert mt == 16 and pq.read_table(longprompt).num_rows == 20
    f = {"value": 10.0, "lo": 9.0, "hi": 12.0, "actual": 13.0, "error_pct": -23.1, "inside": False}
    good = {"value": 10.0, "lo": 9.0, "hi": 12.0, "actual": 10.5, "error_pct": -4.8, "inside": True}
    runs = [{"input": "sample", "engine": "vllm", "rows": 30, "sample_rows": 8, "estimate_process_s": 40.0,
             "figures": {"generation_wall_s": f, "held_wall_s": good, "cost_usd": good}},
            {"input": "long_output", "engine": "llamacpp", "error": "exit 1: no llama-server"}]
    text = E.table(runs)
    assert "10.0 [9.0-12.0] vs 13.0 (-23.1%, OUT)" in text and "failed: exit 1" in text
    v = E.verdict(runs)
    assert v["generation_wall_s"] == {"runs": 1, "within_target": 0, "inside_interval": 0}
    assert v["cost_usd"] == {"runs": 1, "within_target": 1, "inside_interval": 1}


def test_serve_polling_rounds_cancel_a_linear_drift_and_decide_only_when_every_round_agrees(monkeypatch):
    from bench import serve as S

    monkeypatch.setattr(S, "log", lambda msg: None)
    clock = iter(range(100))
    # every batch is 1 s slower than the one before (a linear drift); the polled arms add 5% and 10%
    extra = {"A": 1.0, "B": 1.05, "C": 1.10}
    arms = {k: (lambda k=k: {"recorded_created_to_completed_s": (40 + next(clock)) * extra[k]}) for k in extra}
    rounds = S.interleave(arms, 3)
    assert [a for a, _ in rounds][:12] == ["A", "B", "C", "C", "B", "A", "B", "C", "A", "A", "C", "B"]
    assert len(rounds) == 18
    b, c = (S.round_slowdowns(rounds, arm, 6) for arm in ("B", "C"))
    assert all(abs(x - 0.05) < 0.002 for x in b), b  # the drift cancels within each round
    assert all(abs(x - 0.10) < 0.004 for x in c), c
    assert S.verdict([0.01, 0.049], 0.05) == "PASS"
    assert S.verdict([0.051, 0.2], 0.05) == "MISS"
    assert S.verdict([0.01, 0.06], 0.05) == "not resolved"
