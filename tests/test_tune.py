"""`tokenmill tune`: the halving and the tie rule on known figures, the sample, the gate,
the space; a whole tune over fake engines (jobs in the database, resume, outputs); and a
real-engine tune over two dtypes × two max_num_seqs on a tiny sample."""

from __future__ import annotations

import dataclasses
import math
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from tests.conftest import TEST_ENGINE, write_parquet
from tests.fakes import FakeSession
from tests.helpers import cli, one_error_line
from tokenmill.jobs.modeltools import tune as T
from tokenmill.jobs.modeltools.tune import halving
from tokenmill.schemas import storage as S

# ---------------------------------------------------------------- the search on known figures


def known(costs: dict[tuple[str, int], list[float]], fails_gate=(), calls=None, broken=()):
    """measure/gate functions over known figures: costs[(key, size)][rep]."""

    def measure(key, size, rep):
        if calls is not None:
            calls.append((key, size, rep))
        if key in broken:
            raise T.CandidateFailed("engine would not start")
        return {"cost": costs[(key, size)][rep], "job_id": f"{key}-{size}-{rep}"}

    def gate(key, size):
        return key not in fails_gate, 0.5 if key in fails_gate else 0.0, "disagreement", None

    return measure, gate


def test_halving_keeps_the_cheaper_half_that_passes_and_interleaves_the_runs():
    costs = {("ref", 4): [10, 10.2], ("a", 4): [5, 5.1], ("b", 4): [6, 6.1], ("c", 4): [8, 8.1], ("d", 4): [4, 4.1],
             ("ref", 8): [10, 10.1], ("a", 8): [5.2, 5.3], ("b", 8): [6.2, 6.3]}
    calls: list = []
    measure, gate = known(costs, fails_gate={"d"}, calls=calls)
    log = T.search(["ref", "a", "b", "c", "d"], [4, 8], repeats=2, measure=measure, gate=gate)
    # every candidate's first run, then every candidate's second (interleaved), rung by rung
    assert calls == [("ref", 4, 0), ("a", 4, 0), ("b", 4, 0), ("c", 4, 0), ("d", 4, 0),
                     ("ref", 4, 1), ("a", 4, 1), ("b", 4, 1), ("c", 4, 1), ("d", 4, 1),
                     ("ref", 8, 0), ("a", 8, 0), ("b", 8, 0), ("ref", 8, 1), ("a", 8, 1), ("b", 8, 1)]
    assert log.outcome["d"] == "failed the gate" and log.dropped_at["d"] == 4  # cheapest, but fails
    assert log.outcome["c"] == "costlier half" and log.dropped_at["c"] == 4
    assert log.verdict.winner == "a" and log.verdict.beats_reference and log.verdict.size == 8
    assert log.outcome["a"] == "winner" and log.outcome["b"] == "passed; costlier"
    assert log.outcome["ref"] == "reference"


def _result(keys, sizes, costs, fails_gate=()):
    """A TuneResult of a search over known figures, as `tune` builds it."""
    measure, gate = known(costs, fails_gate=fails_gate)
    ref = T.Candidate(T.REFERENCE, {}, "spec as given", {"engine": {"max_num_seqs": 1}})
    cands = [T.Candidate(k, {"engine.max_num_seqs": i + 2}, f"max_num_seqs={i + 2}",
                         {"engine": {"max_num_seqs": i + 2}}) for i, k in enumerate(keys)]
    log = T.search([T.REFERENCE, *keys], sizes, repeats=2, measure=measure, gate=gate)
    by_key = {c.key: c for c in [ref, *cands]}
    res = T.TuneResult(tune_id="t", gate=T.parse_gate(None), reference=ref, candidates=cands, log=log, sample_rows=8,
                       repeats=2, table=T.build_table(ref, cands, log), recommendation="",
                       winner_spec=by_key[log.verdict.winner].spec_data)
    res.recommendation = T.recommendation(res)
    return res


def test_the_promise_check_fails_a_tuner_that_picks_wrong(monkeypatch):
    """`assert_the_tuner_kept_its_promise` (what the real-engine tune is held to) passes the
    tuner's own picks and fails each wrong one: a costlier winner, a gate-failing winner, the
    costlier half kept, a win inside the reference's noise, a recommendation naming another."""
    # d is the cheapest everywhere but fails the gate; c is dropped at 4 rows as the costlier half
    costs = {("ref", 4): [10, 10.2], ("a", 4): [5, 5.1], ("b", 4): [6, 6.1], ("c", 4): [8, 8.1], ("d", 4): [4, 4.1],
             ("ref", 8): [10, 10.1], ("a", 8): [5.2, 5.3], ("b", 8): [6.2, 6.3], ("c", 8): [3, 3.1], ("d", 8): [2, 2.1]}
    args = (["a", "b", "c", "d"], [4, 8], costs, {"d"})
    honest = _result(*args)
    assert honest.log.verdict.winner == "a"
    assert_the_tuner_kept_its_promise(honest)

    real_pick, real_halve = T.pick, T.halve
    costlier = lambda ref, entries, size: real_pick(  # noqa: E731 - the costliest passing candidate
        ref, {k: T.Entry(runs=[{"cost": -c} for c in e.values()], passed=e.passed) for k, e in entries.items()}, size)
    ungated = lambda ref, entries, size: real_pick(  # noqa: E731 - the gate ignored
        ref, {k: dataclasses.replace(e, passed=True) for k, e in entries.items()}, size)
    ungated_halve = lambda entries: real_halve(  # noqa: E731
        {k: dataclasses.replace(e, passed=True) for k, e in entries.items()})
    costlier_half = lambda entries: real_halve(  # noqa: E731
        {k: T.Entry(runs=[{"cost": -c} for c in e.values()], passed=e.passed) for k, e in entries.items()})
    # one rung, d the cheapest but failing the gate: only a pick that ignores the gate takes it
    one = (["a", "d"], [8], {k: v for k, v in costs.items() if k[1] == 8 and k[0] in ("ref", "a", "d")}, {"d"})
    assert_the_tuner_kept_its_promise(_result(*one))
    for name, fn, on in [("pick", costlier, args), ("pick", ungated, one), ("halve", ungated_halve, args),
                         ("halve", costlier_half, args)]:
        with monkeypatch.context() as mp:
            mp.setattr(halving, name, fn)  # where the search looks them up
            wrong = _result(*on)
        assert wrong.table != _result(*on).table  # the wrong rule changed what the tune did
        with pytest.raises(AssertionError):
            assert_the_tuner_kept_its_promise(wrong)

    # inside the reference's noise the spec as given stays; a tuner that took the cheaper mean fails
    tie = {("ref", 8): [10.0, 10.2], ("a", 8): [9.5, 10.1], ("b", 8): [9.9, 10.4]}
    kept = _result(["a", "b"], [8], tie)
    assert kept.log.verdict.winner == "ref"
    assert_the_tuner_kept_its_promise(kept)
    with monkeypatch.context() as mp:
        mp.setattr(halving, "beats", lambda a, b: T.mean(a) < T.mean(b))
        noisy = _result(["a", "b"], [8], tie)
    assert noisy.log.verdict.winner == "a"
    with pytest.raises(AssertionError):
        assert_the_tuner_kept_its_promise(noisy)

    # the recommendation and the winning spec must name the winner
    with pytest.raises(AssertionError):
        assert_the_tuner_kept_its_promise(dataclasses.replace(honest, recommendation=kept.recommendation))
    with pytest.raises(AssertionError):
        assert_the_tuner_kept_its_promise(dataclasses.replace(honest, winner_spec={"engine": {"max_num_seqs": 3}}))


def test_a_candidate_tied_with_the_last_one_kept_is_kept_too():
    # c's runs overlap b's (6.05..6.3 against 6.0..6.1): inside the noise, so c is not dropped
    costs = {("ref", 4): [10, 10], ("a", 4): [5, 5.1], ("b", 4): [6.0, 6.1], ("c", 4): [6.3, 6.05], ("d", 4): [9, 9.1]}
    measure, gate = known(costs)
    keep, dropped = T.halve({k: T.Entry(runs=[{"cost": v} for v in costs[(k, 4)]], passed=True) for k in "abcd"})
    assert keep == ["a", "b", "c"] and dropped == {"d": "costlier half"}
    log = T.search(["ref", "a", "b", "c", "d"], [4, 8], repeats=2, measure=measure, gate=gate,
                   rung_fits=lambda size, jobs: False)
    assert log.stopped and log.verdict.size == 4


def test_a_candidate_inside_the_reference_noise_ties_and_the_reference_stays():
    costs = {("ref", 8): [10.0, 10.2], ("a", 8): [9.5, 10.1], ("b", 8): [9.9, 10.4]}
    measure, gate = known(costs)
    log = T.search(["ref", "a", "b"], [8], repeats=2, measure=measure, gate=gate)
    assert log.verdict.winner == "ref" and log.verdict.best == "a" and not log.verdict.beats_reference
    assert log.verdict.tied_with_best == ["b"]
    assert log.outcome["a"] == "passed; tied with the reference" and log.outcome["ref"] == "winner"
    # the same means, measured tighter, are a win
    costs = {("ref", 8): [10.0, 10.01], ("a", 8): [9.8, 9.81], ("b", 8): [9.9, 10.4]}
    measure, gate = known(costs)
    assert T.search(["ref", "a", "b"], [8], repeats=2, measure=measure, gate=gate).verdict.winner == "a"
    # and a best candidate costlier beyond the noise is said to be so
    costs = {("ref", 8): [10.0, 10.01], ("a", 8): [11.0, 11.1]}
    measure, gate = known(costs)
    log = T.search(["ref", "a"], [8], repeats=2, measure=measure, gate=gate)
    assert log.verdict.winner == "ref" and log.outcome["a"] == "passed; costlier than the reference"


def test_tie_rule_is_range_overlap():
    assert T.beats([1.0, 1.1], [1.2, 1.3]) and not T.beats([1.2, 1.3], [1.0, 1.1])
    assert T.tied([1.0, 1.25], [1.2, 1.3]) and T.tied([1.0, 1.0], [1.0, 1.0])


def test_a_candidate_that_fails_to_run_is_dropped_and_a_failing_reference_stops_the_tune():
    costs = {("ref", 4): [10, 10], ("a", 4): [5, 5]}
    measure, gate = known(costs, broken={"b"})
    log = T.search(["ref", "a", "b"], [4], repeats=2, measure=measure, gate=gate)
    assert log.outcome["b"] == "failed: engine would not start" and log.verdict.winner == "a"
    measure, gate = known(costs, broken={"ref"})
    with pytest.raises(T.TuneError, match="spec as given failed on the 4-row sample: engine would not start"):
        T.search(["ref", "a"], [4], repeats=2, measure=measure, gate=gate)


def test_a_rung_the_budget_cuts_short_decides_nothing():
    costs = {("ref", 4): [10, 10], ("a", 4): [5, 5], ("ref", 8): [10, 10], ("a", 8): [5, 5], ("b", 4): [6, 6]}
    measure, gate = known(costs)
    left = iter([True] * 6 + [True, False])  # rung 4: 6 runs; rung 8: one run, then out
    log = T.search(["ref", "a", "b"], [4, 8], repeats=2, measure=measure, gate=gate, job_fits=lambda: next(left))
    assert log.stopped == "the budget ran out during the 8-row rung"
    assert log.verdict.size == 4 and log.verdict.winner == "a" and 8 not in log.entries["ref"]
    with pytest.raises(T.TuneError, match="at least twice"):
        T.search(["ref"], [4], repeats=1, measure=measure, gate=gate)


def test_rung_sizes_double_up_to_the_sample():
    assert T.rung_sizes(1, 64) == [64]
    assert T.rung_sizes(4, 64) == [32, 64]
    assert T.rung_sizes(8, 64) == [16, 32, 64]
    assert T.rung_sizes(30, 16) == [4, 8, 16]  # never below MIN_RUNG_ROWS
    assert T.rung_sizes(8, 2) == [2]


def test_budget_estimates_a_rung_from_the_runs_so_far():
    b = T.Budget(100.0)
    assert b.rung_fits(1000, 50)  # nothing measured yet
    b.add(10, wall_s=12.0, gen_s=2.0)
    b.add(10, wall_s=14.0, gen_s=4.0)
    assert b.estimate(20) == pytest.approx(10.0 + 0.3 * 20)
    assert b.rung_fits(20, 4) and not b.rung_fits(20, 5) and b.job_fits()


# ---------------------------------------------------------------- what the tuner promises, checked


def _spread(xs):
    return min(xs), max(xs)


def assert_the_tuner_kept_its_promise(res) -> None:
    """The tuner's promise (docs/TUNE.md, jobs/modeltools/tune/), recomputed here from
    what it measured rather than taken from its verdict: at every rung but the last, the
    cheaper half (by mean cost, rounded up) of the candidates that passed the gate goes
    on, with any passing candidate whose cost runs overlap the last one kept; at the last
    rung the cheapest candidate that passed the gate wins when every one of its cost runs
    is below every one of the reference's, else the spec as given stays (a tie keeps the
    spec); the recommendation and the winning spec name the winner."""
    table = {r["candidate"]: r for r in res.table}
    log, ref = res.log, table[T.REFERENCE]

    def costs(key, size):
        return [r["cost"] for r in log.entries[key][size].runs]

    def failed_at(key, size):
        return table[key]["outcome"].startswith("failed: ") and table[key]["dropped_at"] == size

    def ran_at(size):
        return {k for k, by in log.entries.items() if k != T.REFERENCE and by.get(size) is not None and
                (by[size].runs or failed_at(k, size))}

    rungs = [s for s in log.sizes if log.entries[T.REFERENCE].get(s) is not None]  # the rungs that finished
    assert rungs and ref["rows"] == rungs[-1]
    for size, nxt in zip(rungs, rungs[1:]):  # successive halving keeps the cheaper half
        here = {k for k in ran_at(size) if not failed_at(k, size)}
        passed = sorted((k for k in here if log.entries[k][size].passed), key=lambda k: T.mean(costs(k, size)))
        n = math.ceil(len(passed) / 2)
        kept = passed[:n]
        if kept:
            lo, hi = _spread(costs(kept[-1], size))
            kept += [k for k in passed[n:] if not (max(costs(k, size)) < lo or hi < min(costs(k, size)))]
        assert ran_at(nxt) == set(kept), (size, passed, ran_at(nxt))
        for k in here - set(kept):
            assert table[k]["dropped_at"] == size, k
            assert table[k]["outcome"] == ("costlier half" if k in passed else "failed the gate"), table[k]
    # the winner, from the table: each candidate's figures at the largest sample it ran on
    final = [r for k, r in table.items() if k != T.REFERENCE and r.get("rows") == rungs[-1]
             and not failed_at(k, rungs[-1])]
    passing = [r for r in final if r["gate"] == "pass"]
    want = T.REFERENCE
    if passing:
        best = min(passing, key=lambda r: T.mean(r["cost_runs"]))
        if max(best["cost_runs"]) < min(ref["cost_runs"]):  # cheaper beyond the noise
            want = best["candidate"]
    assert log.verdict.winner == want, (log.verdict, {k: (r.get("gate"), r.get("cost_runs")) for k, r in table.items()})
    assert [k for k, r in table.items() if r["outcome"].split(" (")[0] == "winner"] == [want]
    w = table[want]
    if want == T.REFERENCE:
        assert res.recommendation.startswith("Keep the spec as given"), res.recommendation
    else:
        assert w["gate"] == "pass" and w["cost"] < ref["cost"]
        assert res.recommendation.startswith(f"Use {w['label']}: "), res.recommendation
    for path, value in w["changes"].items():  # the winning spec is the winner's
        node = res.winner_spec
        for part in path.split("."):
            node = node[part]
        assert node == value, (path, node, value)


# ---------------------------------------------------------------- gate, space, sample


@pytest.mark.parametrize("text,expect", [
    ("auto<=3%", ("auto", "<=", 0.03)), ("accuracy_drop<=0.05", ("accuracy_drop", "<=", 0.05)),
    ("exact_match >= 90%", ("exact_match", ">=", 0.9)), ("disagreement<=2 points", ("disagreement", "<=", 0.02)),
    (None, ("auto", "<=", 0.03)),
])
def test_gate_parses(text, expect):
    g = T.parse_gate(text)
    assert (g.metric, g.op) == expect[:2]
    assert g.limit == pytest.approx(expect[2])


@pytest.mark.parametrize("text,match", [
    ("accuracy<=3%", "must be one of"), ("exact_match<=0.9", "bounded with >="), ("auto<=300%", "between 0 and 1"),
    ("3%", "must look like"),
])
def test_bad_gate_is_one_line(text, match):
    with pytest.raises(T.TuneError, match=match):
        T.parse_gate(text)


def test_gate_judges_a_comparison():
    from tokenmill.jobs.modeltools.compare import compare_rows

    base = {"1": {"text": "paris is the capital", "reference": "paris"}, "2": {"text": "4", "reference": "4"}}
    cand = {"1": {"text": "paris is a capital", "reference": "paris"}, "2": {"text": "5", "reference": "4"}}
    c = compare_rows(base, cand)
    assert T.parse_gate("auto<=3%").judge(c) == (False, pytest.approx(0.5), "accuracy_drop")
    assert T.parse_gate("accuracy_drop<=60%").judge(c)[0]
    passed, loss, metric = T.parse_gate("exact_match>=0.5").judge(c)
    assert (passed, loss, metric) == (False, 1.0, "exact_match")


def test_gate_judges_embedding_and_structured_comparisons():
    import numpy as np

    from tokenmill.jobs.modeltools.compare import compare_rows
    from tokenmill.schemas.records import embedding_bytes

    a, b = np.array([1.0, 0.0]), np.array([np.cos(0.3), np.sin(0.3)])  # cosine cos(0.3) = 0.955
    base = {"1": {"text": None, "embedding": embedding_bytes(a)}}
    cand = {"1": {"text": None, "embedding": embedding_bytes(b)}}
    c = compare_rows(base, cand)
    passed, loss, metric = T.parse_gate("auto<=3%").judge(c)
    assert (passed, metric) == (False, "mean_cosine") and loss == pytest.approx(1 - np.cos(0.3), abs=1e-6)
    assert T.parse_gate("cosine>=0.95").judge(c)[0] and not T.parse_gate("cosine>=0.96").judge(c)[0]
    with pytest.raises(T.TuneError, match="measures text"):
        T.parse_gate("similarity>=0.9").judge(c)
    structured = {str(i): {"text": "{}", "valid": True, "parsed": {}} for i in range(4)}
    worse = {**structured, "3": {"text": "{", "valid": False, "parsed": None}}
    s = compare_rows(structured, worse)
    assert T.parse_gate("schema_valid_drop<=30%").judge(s)[:2] == (True, pytest.approx(0.25))
    assert not T.parse_gate("schema_valid_drop<=20%").judge(s)[0]
    with pytest.raises(T.TuneError, match="needs embedding jobs"):
        T.parse_gate("cosine>=0.9").judge(s)


def test_candidates_from_the_space(tmp_path):
    space = tmp_path / "space.yaml"
    space.write_text("grid:\n  engine.dtype: [float32, bfloat16]\n  engine.max_num_seqs: [8, 32]\n"
                     "candidates:\n  - {engine.no_such_key: 1}\n  - {batching.ordering: length}\n")
    sp = T.load_space(space)
    ref, cands = T.make_candidates({"input": "x.parquet", "output": "o", "engine": {"dtype": "float32",
                                                                                   "max_num_seqs": 8}},
                                   T.space_changes(sp))
    labels = [c.label for c in cands]
    # float32 × 8 is the spec as given: not a candidate of its own
    assert T.describe_changes({"engine.speculative_config": {"method": "ngram", "num_speculative_tokens": 3}}) == \
        "speculative_config=ngram"
    assert labels == ["dtype=float32 max_num_seqs=32", "dtype=bfloat16 max_num_seqs=8",
                      "dtype=bfloat16 max_num_seqs=32", "no_such_key=1", "ordering=length"]
    assert "engine.no_such_key: unknown key" in cands[3].rejected
    assert len({c.key for c in cands}) == 5 and all(len(c.key) == 6 for c in cands)
    assert cands[0].spec_data["engine"] == {"dtype": "float32", "max_num_seqs": 32}
    default = T.load_space(None)
    assert default["grid"] and default["quantized"] is True
    bad = tmp_path / "bad.yaml"
    bad.write_text("grids: {}\n")
    with pytest.raises(T.TuneError, match="unknown key"):
        T.load_space(bad)


def test_sample_is_reproducible_and_nested(tmp_path):
    from tokenmill.schemas.config import load_spec

    rows = [{"id": f"r{i}", "prompt": f"p{i}"} for i in range(50)]
    inp = write_parquet(tmp_path / "in.parquet", rows, row_group_size=7)
    spec = load_spec({"input": str(inp), "output": str(tmp_path / "o")})
    p1, n = T.draw_sample(spec, 12, 3, tmp_path / "s1")
    p2, _ = T.draw_sample(spec, 12, 3, tmp_path / "s2")
    a, b = pq.read_table(p1).to_pylist(), pq.read_table(p2).to_pylist()
    assert n == 12 and a == b and len({r["id"] for r in a}) == 12
    assert all(r["prompt"] == "p" + r["id"][1:] for r in a)  # whole rows, not mixed up
    assert pq.read_table(T.rung_file(p1, 4)).to_pylist() == a[:4]
    assert [r["id"] for r in pq.read_table(T.draw_sample(spec, 12, 4, tmp_path / "s3")[0]).to_pylist()] != \
        [r["id"] for r in a]
    assert T.draw_sample(spec, 500, 3, tmp_path / "s4")[1] == 50
    # the same rows drawn: the same tune; the input's rows changed: another tune
    g = T.parse_gate(None)
    ids = {T.make_tune_id(spec, sample=12, seed=3, gate=g, repeats=2, candidates=[], rows=T.sample_digest(p))
           for p in (p1, p2)}
    write_parquet(inp, [{**r, "prompt": r["prompt"] + "!"} for r in rows], row_group_size=7)
    p5, _ = T.draw_sample(spec, 12, 3, tmp_path / "s5")
    ids.add(T.make_tune_id(spec, sample=12, seed=3, gate=g, repeats=2, candidates=[], rows=T.sample_digest(p5)))
    assert len(ids) == 2


# ---------------------------------------------------------------- a whole tune over fake engines


class PacedFake(FakeSession):
    """A fake engine whose every step takes STEP_S (fewer sequences in flight: more steps,
    higher cost) and whose answers are garbled under bfloat16 (a quality loss: "echo:…"
    becomes "ohce:… and more", so an eval reference "echo" is missed)."""

    STEP_S = 0.02

    def step(self):
        time.sleep(self.STEP_S)
        out = super().step()
        if getattr(self.cfg, "dtype", None) == "bfloat16":
            out = [dataclasses.replace(f, text=f.text.replace("echo", "ohce") + " and more") for f in out]
        return out


def test_fake_tune_drops_the_gate_failures_picks_the_cheapest_and_resumes(tmp_path, sqlite_url):
    inp = write_parquet(tmp_path / "in.parquet",
                        [{"id": f"q{i}", "prompt": f"question {i} about the weather"} for i in range(40)])
    space = tmp_path / "space.yaml"
    space.write_text("grid:\n  engine.dtype: [float32, bfloat16]\n  engine.max_num_seqs: [2, 16]\n"
                     "candidates:\n  - {engine.model: no-such-model}\n  - {engine.max_num_seqs: 0}\n")
    spec = {"input": str(inp), "output": str(tmp_path / "never-written"),
            "engine": {"dtype": "float32", "max_num_seqs": 2}, "sampling": {"max_tokens": 4}}
    out = tmp_path / "tune"
    # the default gate: no references in the job's rows, so accuracy on an eval set (here one the
    # fake answers right, "echo", unless garbled)
    evals = write_parquet(tmp_path / "eval.parquet",
                          [{"id": f"e{i}", "prompt": f"eval question {i}", "reference": "echo"} for i in range(6)])
    kw = dict(sample=16, out=out, db_url=sqlite_url, space=space, session_factory=PacedFake, eval_set=evals)

    # a budget spent by the first run: the tune stops inside its first rung, deciding nothing
    first = T.tune(spec, T.TuneOptions(budget_minutes=1e-6, **kw))
    assert first.log.stopped and first.recommendation.startswith("No recommendation")
    eng = S.connect(sqlite_url)
    ran = [j["id"] for j in S.JobStore(eng).recent(100)]
    assert ran == [f"tune-{first.tune_id}-ref-n8-r0"]

    # Ctrl-C while the fourth run starts: what ran is kept
    from tokenmill.jobs.lifecycle import runner

    real, calls = runner.run_job, []

    def interrupted(spec, **kw):
        calls.append(spec.job_id)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(spec, **kw)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(runner, "run_job", interrupted)
        with pytest.raises(KeyboardInterrupt):
            T.tune(spec, T.TuneOptions(**kw))
    assert len(S.JobStore(eng).recent(100)) == 3

    res = T.tune(spec, T.TuneOptions(**kw))
    assert res.tune_id == first.tune_id and res.log.sizes == [8, 16] and res.log.stopped is None
    rows = {r["label"]: r for r in res.table}
    assert rows["model=no-such-model"]["outcome"].startswith("rejected: unknown model 'no-such-model'")
    assert "engine.max_num_seqs" in rows["max_num_seqs=0"]["outcome"]
    for label in ("dtype=bfloat16 max_num_seqs=2", "dtype=bfloat16 max_num_seqs=16"):
        assert rows[label]["outcome"] == "failed the gate" and rows[label]["rows"] == 8
        assert rows[label]["gate"] == "fail" and rows[label]["quality_loss"] == 1.0  # every eval answer lost
        assert rows[label]["gate_metric"] == "eval_accuracy_drop" and rows[label]["sample_similarity"] == 0.0
    win = rows["dtype=float32 max_num_seqs=16"]
    assert win["outcome"] == "winner" and win["rows"] == 16 and win["gate"] == "pass" and win["quality_loss"] == 0
    assert win["beats_reference"] and win["cheaper_than_reference"] > 1.5
    assert rows["spec as given"]["rows"] == 16 and rows["spec as given"]["outcome"] == "reference"
    assert res.recommendation.startswith("Use dtype=float32 max_num_seqs=16: $")
    # every run is an ordinary job of the tune; the one run before was read back, not rerun;
    # one eval-set job for the reference and each candidate judged
    jobs = {j["id"]: j for j in S.JobStore(eng).recent(100)}
    assert len(jobs) == 2 * 4 + 2 * 2 + 4 and all(j.startswith(f"tune-{res.tune_id}-") for j in jobs)
    assert sum(j.endswith("-eval") for j in jobs) == 4
    assert all(j["status"] == "succeeded" for j in jobs.values())
    assert all(len(S.JobStore(eng).runs(j)) == 1 for j in jobs)
    # the outputs
    from tokenmill.schemas.config import load_spec_file

    won = load_spec_file(res.files["spec"])
    assert (won.engine.dtype, won.engine.max_num_seqs, won.input) == ("float32", 16, str(inp))
    html = (out / "tune-report.html").read_text()
    assert "Cost against quality loss" in html and "P95 TPOT" in html
    cost, perf = T.plot_figures(res)
    points = {t.name: list(zip(t.x, t.y)) for t in cost.data}
    assert [len(points[g]) for g in ("reference", "passes the gate", "fails the gate")] == [1, 1, 2]
    assert points["passes the gate"][0] == (0.0, pytest.approx(win["cost"]))
    assert all(x > 3 for x, _ in points["fails the gate"])  # quality loss in points, beyond the gate
    assert sum(len(t.x) for t in perf.data) == 4 and all(y > 0 for t in perf.data for y in t.y)
    text = (out / "tune-table.txt").read_text()
    assert "failed the gate" in text and f"{win['cheaper_than_reference']:.2f}×" in text
    tie = {**win, "beats_reference": False}
    assert T.vs_reference(tie).endswith("× (tie)") and not T.vs_reference(win).endswith("(tie)")
    assert pq.read_metadata(out / "samples" / "sample.parquet").num_rows == 16

    assert_the_tuner_kept_its_promise(res)

    # the same arguments again: everything is read back
    again = T.tune(spec, T.TuneOptions(**kw))
    assert again.log.verdict.winner == res.log.verdict.winner
    assert all(len(S.JobStore(eng).runs(j)) == 1 for j in jobs) and len(S.JobStore(eng).recent(100)) == len(jobs)


def test_cli_tune_refuses_a_bad_gate_and_a_spec_that_cannot_run(tmp_path, sqlite_url):
    inp = write_parquet(tmp_path / "in.parquet", [{"id": "a", "prompt": "hi"}])
    spec = tmp_path / "job.yaml"
    spec.write_text(f"input: {inp}\noutput: {tmp_path / 'o'}\n")
    res = cli("tune", spec, "--sample", 4, "--out", tmp_path / "t", "--gate", "accuracy<=3%", "--db", sqlite_url)
    assert res.exit_code == 2 and "--gate metric must be one of" in one_error_line(res)
    spec.write_text(f"input: {inp}\noutput: {tmp_path / 'o'}\nengine: {{model: no-such-model}}\n")
    res = cli("tune", spec, "--sample", 4, "--out", tmp_path / "t", "--db", sqlite_url)
    assert res.exit_code == 2 and "the spec as given does not pass preflight: unknown model" in one_error_line(res)


# ---------------------------------------------------------------- the real engine


@pytest.mark.engine
def test_cpu_screen_resolves_auto_and_drops_duplicates_and_slow_dtypes(tmp_path):
    space = tmp_path / "space.yaml"
    space.write_text("grid:\n  engine.dtype: [float32, bfloat16]\n  engine.max_num_seqs: [64, 256]\n")
    spec = {"input": "x.parquet", "output": "o", "engine": {"max_num_seqs": 256}}  # dtype auto
    avx2 = {"choice": "float32", "output_tok_per_s": {"float32": 51.0, "bfloat16": 2.6}}
    ref, cands = T.make_candidates(spec, T.space_changes(T.load_space(space)))
    T.screen_cpu_dtypes(spec, cands, avx2)
    why = {c.label: c.rejected for c in cands}
    assert why["dtype=float32 max_num_seqs=64"] is None
    assert "the same as the spec as given on this machine" in why["dtype=float32 max_num_seqs=256"]
    assert "20× slower" in why["dtype=bfloat16 max_num_seqs=64"] and "keep_slow_dtypes" in why["dtype=bfloat16 max_num_seqs=256"]
    # a CPU where bf16 is the faster (AMX): auto is bf16, and fp32 at 3× slower is still run
    amx = {"choice": "bfloat16", "output_tok_per_s": {"float32": 900.0, "bfloat16": 2700.0}}
    ref, cands = T.make_candidates(spec, T.space_changes(T.load_space(space)))
    T.screen_cpu_dtypes(spec, cands, amx)
    why = {c.label: c.rejected for c in cands}
    assert why["dtype=float32 max_num_seqs=256"] is None and "spec as given" in why["dtype=bfloat16 max_num_seqs=256"]
    ref, cands = T.make_candidates(spec, T.space_changes(T.load_space(space)))
    T.screen_cpu_dtypes(spec, cands, avx2, keep_slow=True)
    assert {c.label: c.rejected for c in cands}["dtype=bfloat16 max_num_seqs=64"] is None


def test_space_quantize_makes_a_checkpoint_once_and_refuses_a_bad_entry(tmp_path, monkeypatch, model_path):
    monkeypatch.setenv("TOKENMILL_HOME", str(tmp_path / "home"))
    from tokenmill.schemas.models import models_dir

    space = tmp_path / "space.yaml"
    space.write_text("quantize:\n  - {scheme: w8a8-int8}\n  - {scheme: nf4}\n")
    sp = T.load_space(space)
    sample = write_parquet(tmp_path / "s.parquet", [{"id": "a", "prompt": "hello there"}])
    made, notes = T.make_checkpoints(sp["quantize"], model_path, sample, str(sample), echo=lambda line: None)
    assert [Path(m).parent for m in made] == [models_dir()] and (Path(made[0]) / "TOKENMILL_QUANTIZED.json").is_file()
    assert "unknown scheme 'nf4'" in notes[1] and notes[0].startswith("made ")
    # the same entry again: the checkpoint is reused, not made twice
    again, notes2 = T.make_checkpoints(sp["quantize"][:1], model_path, sample, str(sample), echo=lambda line: None)
    assert again == made and notes2 == []
    assert T.quantized_checkpoints(model_path) == made  # also what `quantized: true` finds
    space.write_text("quantize:\n  - {method: gptq}\n")
    with pytest.raises(T.TuneError, match="quantize must be a list of mappings with scheme"):
        T.load_space(space)


def test_real_tune_over_two_dtypes(tmp_path, sqlite_url, model_path):
    rows = [{"id": f"q{i}", "messages": [{"role": "user", "content": q}]} for i, q in enumerate(
        ["What is the capital of France?", "Name a primary color.", "What is 2 + 2?", "Say hello.",
         "Name a fruit.", "What day comes after Monday?", "Name an ocean.", "What is ice made of?"])]
    inp = write_parquet(tmp_path / "in.parquet", rows)
    space = tmp_path / "space.yaml"
    # keep_slow_dtypes: both dtypes run even on a CPU where bf16 is measured much slower (AVX2)
    # one max_num_seqs: the grid's expansion over several keys is covered with the fake engine above; this test
    # is the real engine under both dtypes (two candidates, one rung: 71 s alone on a 2-core AMD EPYC, against 170 s with four candidates and two rungs)
    space.write_text("grid:\n  engine.dtype: [float32, bfloat16]\n  engine.max_num_seqs: [32]\n"
                     "keep_slow_dtypes: true\n")
    spec = {"input": str(inp), "output": str(tmp_path / "o"), "engine": dict(TEST_ENGINE),
            "sampling": {"max_tokens": 8, "temperature": 0.0}}
    # the default gate on the first 8 questions of the bundled eval set (accuracy with references)
    evals = tmp_path / "eval.parquet"
    pq.write_table(pq.read_table(T.EVAL_SET).slice(0, 8), evals)
    res = T.tune(spec, T.TuneOptions(sample=8, out=tmp_path / "tune", db_url=sqlite_url, space=space,
                                     budget_minutes=30, eval_set=evals))
    table = {r["label"]: r for r in res.table}
    # float32 × 32 is the spec as given (TEST_ENGINE): one candidate beside it, so one rung of all 8 rows
    assert set(table) == {"spec as given", "dtype=bfloat16 max_num_seqs=32"}
    assert res.log.sizes == [8] and res.log.stopped is None
    for r in table.values():
        assert r["rows"] == 8 and r["runs"] == 2 and r["cost"] > 0 and r["output_tok_per_s"] > 0
        assert r["candidate"] == "ref" or (r["gate"] in ("pass", "fail") and r["gate_metric"] == "eval_accuracy_drop")
    assert table["spec as given"]["rows"] == 8
    # the winner is the one the tuner's rules give on the figures it measured (not just any)
    assert_the_tuner_kept_its_promise(res)
    from tokenmill.schemas.config import load_spec_file

    assert load_spec_file(res.files["spec"]).input == str(inp)
    html = (tmp_path / "tune" / "tune-report.html").read_text()
    assert "Cost against quality loss" in html and "P95 TPOT" in html
    assert "spec as given" in (tmp_path / "tune" / "tune-table.txt").read_text()
