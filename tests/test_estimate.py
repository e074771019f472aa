"""`tokenmill estimate`: the sample draw, the output-length and engine models and the cost
arithmetic on known figures (no engine); the estimate beside a job's actual figures; and
one real-engine estimate, stored, then the job itself, with `status --json` showing the
estimate beside what happened."""

from __future__ import annotations

import json

import numpy as np
import pyarrow.parquet as pq
import pytest

from tests.conftest import TEST_ENGINE, write_parquet
from tests.helpers import cli
from tokenmill.jobs.estimate import beside as B
from tokenmill.jobs.estimate import engine_model as M
from tokenmill.jobs.estimate import predict as P
from tokenmill.jobs.estimate import sample as SM
from tokenmill.jobs.estimate.profile import Profiler, block_chain, profile_rows

# ---------------------------------------------------------------- the sample


def test_default_sample_is_a_tenth_of_the_rows_between_the_floor_and_the_cap():
    assert SM.default_sample_rows(240) == 24
    assert SM.default_sample_rows(100_000) == SM.MAX_SAMPLE_ROWS
    assert SM.default_sample_rows(30) == SM.MIN_SAMPLE_ROWS  # a tiny input still measures something
    assert SM.default_sample_rows(5) == 5  # never more rows than there are


def test_the_draw_is_reproducible_stratified_by_prompt_length_and_at_most_the_asked_size():
    rng = np.random.default_rng(3)
    lengths = np.concatenate([rng.integers(10, 50, 700), rng.integers(400, 900, 300)])  # a short and a long mode
    a, band, edges = SM.draw(lengths, 40, seed=1)
    b, _, _ = SM.draw(lengths, 40, seed=1)
    assert np.array_equal(a, b) and len(a) == 40 and len(set(a.tolist())) == 40
    assert np.all(np.diff(a) > 0)  # input order
    assert len(edges) == SM.MAX_BANDS - 1
    counts = np.bincount(band)
    drawn = np.bincount(band[a], minlength=len(counts))
    assert np.all(np.abs(drawn - counts * 40 / counts.sum()) <= 1)  # proportional to each band's rows
    assert not np.array_equal(a, SM.draw(lengths, 40, seed=2)[0])
    assert len(SM.draw(lengths[:6], 40)[0]) == 6


def test_allocation_gives_every_band_a_row_when_the_sample_allows():
    assert SM.allocate(np.array([1000, 3, 2]), 6).tolist() == [4, 1, 1]
    assert SM.allocate(np.array([5, 0, 5]), 4).tolist() == [2, 0, 2]
    assert SM.allocate(np.array([2, 2]), 10).tolist() == [2, 2]


def test_the_sample_file_holds_the_drawn_rows_in_order_then_fillers_with_their_own_ids(tmp_path):
    from tokenmill.transforms.read import plan_input

    rows = [{"id": f"r{i}", "prompt": f"p{i}", "max_tokens": 50 + i} for i in range(10)]
    plan = plan_input(str(write_parquet(tmp_path / "in.parquet", rows, row_group_size=4)))
    path = SM.write_sample(plan, np.zeros(3, dtype=np.int64), np.array([1, 5, 9]), tmp_path / "s", fill=4)
    got = pq.read_table(path).to_pylist()
    assert [r["prompt"] for r in got] == ["p1", "p5", "p9", "p1", "p5", "p9", "p1"]
    assert [r["max_tokens"] for r in got[:3]] == [51, 55, 59]
    assert [r["max_tokens"] for r in got[3:]] == [SM.FILL_TOKENS] * 4
    assert len({r["id"] for r in got}) == 7


# ---------------------------------------------------------------- the profile


class Chars:
    """One token per character: known counts without a tokenizer."""

    def encode(self, rec):
        return [ord(c) for c in (rec.prompt or "")]


def test_the_profile_counts_what_the_job_would_dead_letter_and_keeps_the_rest():
    rows = [{"id": "a", "prompt": "x" * 40}, {"id": "b", "prompt": "y" * 300}, {"id": "a", "prompt": "z"},
            {"id": "c", "prompt": None}, {"id": "d", "prompt": "w" * 20, "max_tokens": 7}]
    rows = [{**r, "_row": i, "_file_index": 0} for i, r in enumerate(rows)]
    prof = profile_rows(rows, Profiler(Chars(), max_model_len=200, default_max_tokens=16, block_size=16,
                                       prefix_blocks=4, default_samples=1), total_rows=5)
    assert prof.prompt_tokens.tolist() == [40, 20] and prof.max_tokens.tolist() == [16, 7]
    assert prof.dead == {"prompt_too_long": 1, "duplicate_id": 1, "empty_prompt": 1}
    assert prof.row.tolist() == [0, 4] and not prof.sampled and prof.scale == 1.0
    assert len(prof.blocks[0]) == 2  # 40 tokens: two full 16-token blocks


def test_block_chains_agree_as_far_as_two_prompts_share_whole_blocks():
    a = block_chain(list(range(40)), 16)
    b = block_chain(list(range(16)) + [99] * 24, 16)
    assert len(a) == 2 and a[0] == b[0] and a[1] != b[1]


def test_prefill_skips_the_blocks_an_earlier_prompt_on_the_same_engine_cached():
    blocks = [(1, 2), (1, 3), (1, 2), (7,)]
    prompt = np.array([40, 40, 40, 20])
    got = P.prefill_tokens(np.arange(4), prompt, np.array([1, 1, 2, 1]), blocks, 16)
    # row 1 shares block 1 with row 0; row 2 shares both, and its second sample finds them cached too
    assert got.tolist() == [40, 24, 8, 8, 20]
    apart = P.prefill_tokens(np.arange(4), prompt, np.ones(4, dtype=int), blocks, 16, worker=np.array([0, 1, 0, 1]))
    assert apart.tolist() == [40, 40, 8, 20]  # another worker's engine has its own cache


# ---------------------------------------------------------------- output lengths


def test_output_lengths_are_scaled_per_band_and_capped_at_each_rows_max_tokens():
    # band 0 answered 10 and 20 tokens on its own; band 1 was cut at max_tokens both times
    obs = P.Outputs(band=np.array([0, 0, 1, 1]), out=np.array([10, 20, 64, 64]),
                    capped=np.array([False, False, True, True]))
    assert P.expected_output(obs.out[:2], obs.capped[:2], np.array([15, 100])).tolist() == [12.5, 15.0]
    band, caps = np.array([0, 0, 0, 1, 1]), np.array([100, 100, 15, 32, 200])
    total = P.output_total(obs, band, caps, np.ones(5))
    assert total == 15 + 15 + 12.5 + 32 + 200  # a cut answer predicts the row's own max_tokens
    assert P.output_total(obs, band, caps, np.array([1, 1, 1, 1, 2.0])) == total + 200  # n = 2 samples


def test_bootstrap_intervals_contain_the_point_and_close_on_a_sample_without_spread():
    rng = np.random.default_rng(0)
    obs = P.Outputs(band=np.repeat([0, 1], 20), out=rng.integers(5, 60, 40), capped=np.zeros(40, dtype=bool))
    band, caps = np.repeat([0, 1], 500), np.full(1000, 64)
    f = P.output_figure(obs, band, caps, np.ones(1000))
    assert f["lo"] <= f["value"] <= f["hi"] and f["hi"] - f["lo"] > 0
    same = P.Outputs(band=np.zeros(8, dtype=int), out=np.full(8, 30), capped=np.zeros(8, dtype=bool))
    g = P.output_figure(same, np.zeros(100, dtype=int), np.full(100, 64), np.ones(100))
    assert g["value"] == g["lo"] == g["hi"] == 3000


# ---------------------------------------------------------------- the engine model


def test_the_simulation_follows_slots_and_step_costs():
    one = M.StepModel(a=1.0, b=0.0)
    steps = np.array([3, 5, 2])
    kw = dict(prefill=np.zeros(3), batch=np.zeros(3, dtype=int), max_batches=2, model=one)
    assert M.simulate(steps, slots=1, **kw) == 10.0  # one at a time: every step its own
    assert M.simulate(steps, slots=8, **kw) == 5.0  # all at once: the longest decides
    per_seq = M.StepModel(a=0.0, b=1.0, p=0.5)
    assert M.simulate(steps, np.array([2, 2, 2]), np.zeros(3, dtype=int), slots=8, max_batches=2,
                      model=per_seq) == 3 * 0.5 * 2 + (3 * 2 + 2 * 1 + 1 * 2)
    # two batches, one in flight at a time: the second waits for the whole first
    assert M.simulate(np.array([4, 1, 1]), np.zeros(3), np.array([0, 0, 1]), slots=8, max_batches=1,
                      model=one) == 5.0


def test_the_fit_recovers_the_costs_the_windows_were_made_with():
    rng = np.random.default_rng(5)
    steps, conc, pre = rng.integers(5, 90, 60).astype(float), rng.uniform(1, 200, 60), rng.uniform(0, 5000, 60)
    w = M.Windows(duration=0.03 * steps + 0.0008 * steps * conc + 0.0004 * pre, steps=steps,
                  seq_steps=steps * conc, prefill=pre)
    m = M.fit_steps(w)
    assert (m.a, m.b, m.p) == pytest.approx((0.03, 0.0008, 0.0004))
    scaled = M.calibrate(m, measured_wall_s=12.0, replay_wall_s=10.0, prefilled_tokens=1000)
    assert (scaled.a, scaled.b, scaled.p) == pytest.approx((0.036, 0.00096, 0.00048))
    rest = M.calibrate(M.StepModel(0.03, 0.0008), 12.0, 10.0, prefilled_tokens=1000, rest_to_prefill=True)
    assert (rest.a, rest.b, rest.p) == pytest.approx((0.03, 0.0008, 0.002))  # 2 s unexplained over 1000 tokens
    embed = M.calibrate(M.StepModel(0.0, 0.0), 3.0, 0.0, prefilled_tokens=6000)  # nothing decoded
    assert embed.p == pytest.approx(0.0005)


def test_batches_are_cut_by_the_token_budget_as_the_job_cuts_them():
    assert M.batches_by_budget(np.array([5, 5, 5, 20, 1]), 10).tolist() == [0, 0, 1, 2, 3]


# ---------------------------------------------------------------- held time and cost


def test_cost_is_held_time_at_the_hourly_price_and_held_time_adds_the_fixed_part():
    gen = P.figure(100.0, 90.0, 120.0, "x")
    held = P.held_figure(gen, 20.0, 15.0, 30.0, "spread")
    assert (held["value"], held["lo"], held["hi"]) == (120.0, 105.0, 150.0)  # both intervals' bounds added
    cost = P.cost_figure(held, 0.36, "held wall")
    assert (cost["value"], cost["lo"], cost["hi"]) == pytest.approx((0.012, 0.0105, 0.015))


def test_the_fixed_parts_interval_comes_from_this_machines_earlier_jobs_else_an_allowance():
    from tokenmill.jobs.estimate.measure import FIXED_ALLOWANCE, fixed_history, fixed_interval

    hw = {"cpu_model": "x", "cpu_cores": 2}

    def job(held, gen, **over):
        return {"status": "succeeded", "model": "m", "engine_config": {"kind": "vllm"}, "hardware": hw,
                "metrics": {"runs": [{"held_s": held}], "throughput": {"generation_wall_s": gen}}, **over}

    jobs = [job(30, 10), job(25, 10), job(40, 10), job(99, 10, model="other"), job(99, 10, status="failed"),
            job(99, 10, hardware={"cpu_model": "y"}), job(99, 10, engine_config={"kind": "llamacpp"})]
    history = fixed_history(jobs, "vllm", "m", hw)
    assert sorted(history) == [15.0, 20.0, 30.0]  # only the same engine, model and machine, finished
    assert fixed_interval(18.0, history)[:2] == (15.0, 30.0)
    lo, hi, how = fixed_interval(18.0, history[:2])
    assert (lo, hi) == pytest.approx((18.0 * FIXED_ALLOWANCE[0], 18.0 * FIXED_ALLOWANCE[1])) and "fewer than" in how
    exact = P.exact_or_scaled(np.array([3, 4, 5]), 1.0, "counted")
    assert exact["value"] == exact["lo"] == exact["hi"] == 12
    scaled = P.exact_or_scaled(np.array([3, 4, 5, 8]), 10.0, "counted")
    assert scaled["value"] == 200 and scaled["lo"] < 200 < scaled["hi"]


def test_the_estimate_beside_the_actual_says_the_error_and_whether_the_interval_held_it():
    est = {"generation_wall_s": P.figure(10.0, 8.0, 12.0, "m"), "cost_usd": P.figure(0.02, 0.015, 0.025, "m"),
           "tokens": {"output": P.figure(1000, 900, 1100, "m")}}
    metrics = {"throughput": {"generation_wall_s": 12.5}, "cost": {"held": {"total": 0.02}},
               "tokens": {"output": 1000}}
    rows = {r["figure"]: r for r in B.compare(est, metrics)}
    assert rows["generation_wall_s"]["error_pct"] == pytest.approx(-20.0)
    assert rows["generation_wall_s"]["inside"] is False
    assert rows["cost_usd"]["error_pct"] == 0 and rows["cost_usd"]["inside"] is True
    assert rows["tokens.output"]["inside"] is True and "tokens.prompt" not in rows
    assert B.compare(est, None)[0]["actual"] is None and B.compare(est, None)[0]["inside"] is None


# ---------------------------------------------------------------- the real engine


@pytest.mark.engine
def test_estimate_with_the_real_engine_is_stored_and_shown_beside_the_job_that_follows(
        tmp_path, sqlite_url, model_path, monkeypatch):
    from bench.datasets import sample_chat_rows
    from tokenmill.jobs.lifecycle.runner import run_job
    from tokenmill.schemas import storage as S
    from tokenmill.schemas.config import load_spec

    monkeypatch.setenv("TOKENMILL_LOG_DIR", str(tmp_path / "logs"))
    rows = [{**r, "max_tokens": 8} for r in sample_chat_rows(40)]
    inp = write_parquet(tmp_path / "in.parquet", rows)
    flags = ["--input", inp, "--output", tmp_path / "out", "--db", sqlite_url, "--temperature", "0",
             *[x for k, v in TEST_ENGINE.items() for x in (f"--{k.replace('_', '-')}", v)]]
    res = cli("estimate", *flags, "--sample", 6, "--json")
    assert res.exit_code == 0, res.output
    est = json.loads(res.output)
    assert {"job_id", "rows", "sample_rows", "tokens", "generation_wall_s", "held_wall_s", "cost_usd",
            "cost_generation_usd", "fixed", "per_row", "price_per_hour", "cost_covers", "method", "engine",
            "made_at"} <= set(est)
    for f in (*est["tokens"].values(), est["generation_wall_s"], est["held_wall_s"], est["cost_usd"]):
        assert set(f) == {"value", "lo", "hi", "how"} and f["lo"] <= f["value"] <= f["hi"] and f["how"]
    assert (est["rows"], est["sample_rows"], est["engine"]) == (40, 6, "vllm")
    assert est["tokens"]["prompt"]["lo"] == est["tokens"]["prompt"]["value"] == est["tokens"]["prompt"]["hi"]
    assert 0 < est["tokens"]["output"]["value"] <= 40 * 8
    assert est["fixed"]["held_s"] > 0 and est["per_row"]["held_s"] > 0 and est["price_per_hour"] > 0
    assert est["cost_usd"]["value"] == pytest.approx(
        est["fixed"]["cost_usd"] + 40 * est["per_row"]["cost_usd"], rel=1e-6)
    eng = S.connect(sqlite_url)
    stored = S.EstimateStore(eng).latest(est["job_id"])
    assert stored["estimate"] == est and (stored["sample_rows"], stored["total_rows"]) == (6, 40)
    assert S.JobStore(eng).get(est["sample_job_id"])["status"] == "succeeded"

    spec = load_spec({"input": str(inp), "output": str(tmp_path / "out"), "engine": TEST_ENGINE,
                      "sampling": {"temperature": 0.0}})
    assert spec.derived_job_id() == est["job_id"]  # the same spec, the same job
    assert run_job(spec, db_url=sqlite_url).status == "succeeded"
    res = cli("status", est["job_id"], "--db", sqlite_url, "--json")
    beside = {f["figure"]: f for f in json.loads(res.output)["estimate"]["figures"]}
    assert beside["tokens.prompt"]["actual"] == beside["tokens.prompt"]["value"]  # exact: the same tokenizer
    for key in ("generation_wall_s", "held_wall_s", "cost_usd", "tokens.output"):
        assert beside[key]["actual"] > 0 and isinstance(beside[key]["inside"], bool)
        assert beside[key]["error_pct"] == pytest.approx(
            (beside[key]["value"] - beside[key]["actual"]) / beside[key]["actual"] * 100)
    text = cli("report", est["job_id"], "--db", sqlite_url, "--no-html").output
    assert "Estimate beside what happened" in text and "generation wall" in text
