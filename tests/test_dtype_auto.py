"""`dtype: auto` on a CPU: chosen by timing the candidates in the engine side by side, kept per
CPU, torch, vLLM and model, falling back where a dtype degrades the greedy answers."""

from __future__ import annotations

import itertools
import json
import math
import os

import pytest

from tests.conftest import TEST_ENGINE
from tokenmill.transforms.engines import cpu
from tokenmill.transforms.engines import dtype_probe as P
from tokenmill.transforms.engines.vllm_config import VllmConfig

GREEDY = {"float32": [[1, 2, 3]], "bfloat16": [[1, 2, 4]]}
IDENTICAL = {"bfloat16": 0}


def _decide(ratios, agreement):
    rates = {"float32": [100.0, 100.0], "bfloat16": [100.0 * ratios[0], 100.0 * ratios[1]]}
    return P.decide("float32", "bfloat16", P.Measured(rates, ratios, agreement, IDENTICAL, GREEDY["float32"]),
                    workload={}, wall_s=1.0)


def test_the_faster_dtype_wins_when_both_rounds_agree_beyond_the_tie():
    healthy = {"float32": 1.0, "bfloat16": 0.97}
    assert _decide([1.8, 1.6], healthy)["choice"] == "bfloat16"
    slow = _decide([0.05, 0.06], healthy)
    assert slow["choice"] == "float32" and "float32 faster" in slow["reason"]
    # AVX-512 without bf16 units, say: rounds either side of 1 are no speed difference, and the tie
    # goes to bfloat16 (half the memory), saying so
    tie = _decide([0.98, 1.02], healthy)
    assert tie["choice"] == "bfloat16" and "no clear speed difference" in tie["reason"]
    split = _decide([0.7, 1.2], healthy)
    assert split["choice"] == "bfloat16" and "0.70-1.20" in split["reason"]


def test_a_faster_dtype_that_degrades_the_answers_falls_back_to_float32():
    res = _decide([2.0, 2.2], {"float32": 1.0, "bfloat16": 0.41})
    assert res["choice"] == "float32"
    assert "bfloat16 faster" in res["reason"] and "41%" in res["reason"] and "below 90%" in res["reason"]
    assert res["quality"]["greedy_answers_identical_to_float32"] == {"bfloat16": 0}


def test_when_one_dtype_s_engine_does_not_start_the_other_is_chosen_and_both_failing_is_one_error(monkeypatch):
    class Child:
        refuse: set = set()

        def __init__(self, dtype, args, env):
            self.dtype = dtype

        def ask(self, op, **kw):
            if op == "ready" and self.dtype in Child.refuse:
                raise P.ProbeError(f"the {self.dtype} probe engine exited (status 1) during 'ready'")
            if op == "ready":
                return {"dtype": self.dtype}
            raise AssertionError(f"no {op!r} after a failed start")

        def send(self, op, **kw):
            self.sent = (op, kw)

        def receive(self, op, *, timeout=None):
            return self.ask(self.sent[0], **self.sent[1])

        def close(self):
            pass

    monkeypatch.setattr(P, "_Child", Child)
    Child.refuse = {"float32"}  # a W8A8 int8 checkpoint on a CPU whose int8 kernels want bf16 activations
    res = P.measure({"model": "/m"})
    assert res["choice"] == "bfloat16" and "float32's engine did not" in res["reason"]
    # float32 starts but its int8 kernel refuses float32 activations at the first request
    class LateChild(Child):
        def ask(self, op, **kw):
            if op == "speed" and self.dtype == "float32":
                raise P.ProbeError("the float32 probe engine failed during 'speed': RuntimeError: "
                                   "int8_scaled_mm_with_quant: expect A to be bfloat16 or half.", "float32")
            return {"dtype": self.dtype} if op == "ready" else {"output_tok_per_s": 1.0}

    monkeypatch.setattr(P, "_Child", LateChild)
    Child.refuse = set()
    res = P.measure({"model": "/m"})
    assert res["choice"] == "bfloat16" and "expect A to be bfloat16" in res["reason"]
    monkeypatch.setattr(P, "_Child", Child)
    Child.refuse = {"float32", "bfloat16"}
    with pytest.raises(P.ProbeError, match="float32 probe engine exited.*bfloat16 probe engine exited"):
        P.measure({"model": "/m"})


class FakeClock:
    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def fake_engines(clock, *, start_s, rates, step_s, agreement=None, asked=None):
    """Candidates' engines on a fake clock: each dtype's engine is ready `start_s[dtype]` s after
    the probe starts (both start at once), makes `rates[dtype]` output tok/s (a number, or one per
    slice, warm-up first) in engine steps of `step_s[dtype]` s, so a slice ends on the first step
    boundary past its time; a request that would outlast its `timeout` is a ProbeError, as the
    real process's is."""
    per_slice = {dt: itertools.cycle(r if isinstance(r, list) else [r]) for dt, r in rates.items()}

    class Engine:
        def __init__(self, dtype, args, env):
            self.dtype = dtype

        def _spend(self, op, seconds, timeout):
            if timeout is not None and seconds > timeout:
                clock.t += max(timeout, 0.0)
                raise P.ProbeError(f"the {self.dtype} probe engine did not answer {op!r} within {timeout:.0f} s",
                                   self.dtype, timed_out=True)
            clock.t += seconds

        def ask(self, op, *, timeout=None, **kw):
            (asked if asked is not None else []).append((self.dtype, op))
            if op == "ready":
                self._spend(op, max(start_s[self.dtype] - clock.t, 0.0), timeout)
                return {"dtype": self.dtype}
            if op == "speed":
                step = step_s[self.dtype]
                wall = max(math.ceil(kw["seconds"] / step), 1) * step
                self._spend(op, wall, timeout)
                rate = next(per_slice[self.dtype])
                return {"output_tokens": round(rate * wall), "wall_s": wall, "output_tok_per_s": rate,
                        "steps": round(wall / step), "max_step_s": step}
            if op == "greedy":
                self._spend(op, 32 * step_s[self.dtype], timeout)
                return {"tokens": [[1, 2, 3]]}
            self._spend(op, 2 * step_s[self.dtype], timeout)
            return {"agreement": (agreement or {}).get(self.dtype, 1.0), "identical": 0}

        def send(self, op, **kw):
            self.pending = (op, kw, clock.t)

        def receive(self, op, *, timeout=None):
            # sent ops run at once: each from the time it was sent, the clock at the latest end
            sent, kw, at = self.pending
            assert sent == op
            now, clock.t = clock.t, at
            try:
                return self.ask(op, timeout=None if timeout is None else timeout + now - at, **kw)
            finally:
                clock.t = max(now, clock.t)

        def close(self):
            pass

    return Engine


def _probe(monkeypatch, **engines):
    clock, asked = FakeClock(), []
    monkeypatch.setattr(P, "_Child", fake_engines(clock, asked=asked, **engines))
    res = P.measure({"model": "/m"}, clock=clock)
    return res, asked, clock.t


def _timed(res):
    return [s for s in res["slices"] if s["slice"] != "warm-up"]


def test_bf16_with_fast_kernels_wins_after_one_block_and_its_answers_are_checked(monkeypatch):
    # the 2-core Xeon with AMX: bf16 at 2.7x float32 in whole demo jobs
    res, asked, took = _probe(monkeypatch, start_s={"float32": 20.0, "bfloat16": 20.0},
                              rates={"float32": 320.0, "bfloat16": 880.0}, step_s={"float32": 0.1, "bfloat16": 0.05},
                              agreement={"float32": 1.0, "bfloat16": 0.97})
    assert res["choice"] == "bfloat16" and "bfloat16 faster: 2.75-2.75" in res["reason"]
    assert [s["dtype"] for s in _timed(res)] == ["float32", "bfloat16", "bfloat16", "float32"]  # one block decided
    assert ("bfloat16", "teacher") in asked and res["quality"]["agreement_with_float32"]["bfloat16"] == 0.97
    assert took <= P.BUDGET_S and res["measure_wall_s"] == pytest.approx(took, abs=0.05)
    assert res["rounds_output_tok_per_s"] == {"float32": [320.0, 320.0], "bfloat16": [880.0, 880.0]}


def test_bf16_without_fast_kernels_is_ruled_out_by_one_block_within_the_budget_and_nothing_is_checked(monkeypatch):
    # the AVX2-only EPYC: bf16 at 0.18-0.41x float32, engine steps of seconds, engines slow to start
    res, asked, took = _probe(monkeypatch, start_s={"float32": 33.0, "bfloat16": 35.0},
                              rates={"float32": 174.0, "bfloat16": [30.0, 40.0, 70.0]},
                              step_s={"float32": 0.2, "bfloat16": 2.5})
    assert res["choice"] == "float32" and res["reason"].startswith("float32 faster: bfloat16 ran at")
    assert len(_timed(res)) == 4 and took <= P.BUDGET_S
    assert not any(op in ("greedy", "teacher") for _, op in asked)
    assert res["quality"]["what"].startswith("not checked: float32, the reference")


def test_a_tie_runs_blocks_until_the_budget_is_spent_and_goes_to_bfloat16(monkeypatch):
    res, _, took = _probe(monkeypatch, start_s={"float32": 15.0, "bfloat16": 15.0},
                          rates={"float32": [300.0, 300.0, 310.0, 290.0], "bfloat16": [300.0, 305.0, 295.0]},
                          step_s={"float32": 0.1, "bfloat16": 0.1})
    assert res["choice"] == "bfloat16" and "no clear speed difference" in res["reason"]
    timed = _timed(res)
    assert len(timed) >= 8 and len(timed) % 4 == 0 and took <= P.BUDGET_S
    # every slice as long as the budget allowed, none shorter than the floor
    assert all(P.MIN_SLICE_S <= s["seconds"] <= P.SLICE_S for s in timed)


def test_a_stray_slice_is_outvoted_by_the_median_after_two_blocks(monkeypatch):
    # block 1: a burst of load elsewhere during bfloat16's second slice makes that pair look even
    res, _, took = _probe(monkeypatch, start_s={"float32": 15.0, "bfloat16": 15.0},
                          rates={"float32": 300.0, "bfloat16": [150.0, 600.0, 300.0, 600.0, 600.0]},
                          step_s={"float32": 0.1, "bfloat16": 0.1})
    assert res["choice"] == "bfloat16" and res["ratio"]["rounds"] == [2.0, 1.0, 2.0, 2.0]
    assert len(_timed(res)) == 8 and took <= P.BUDGET_S


def test_engines_slow_to_start_shorten_the_slices_and_one_that_misses_the_start_gives_a_provisional_choice(
        monkeypatch):
    res, _, took = _probe(monkeypatch, start_s={"float32": P.START_BY_S - 2, "bfloat16": P.START_BY_S - 2},
                          rates={"float32": 300.0, "bfloat16": 600.0}, step_s={"float32": 0.1, "bfloat16": 0.1})
    assert res["choice"] == "bfloat16" and took <= P.BUDGET_S
    assert all(s["seconds"] < P.SLICE_S for s in _timed(res))
    # one engine up in time, the other not: a start slowed by other work says nothing about the dtype
    res, asked, took = _probe(monkeypatch, start_s={"float32": 30.0, "bfloat16": 70.0},
                              rates={"float32": 300.0, "bfloat16": 600.0}, step_s={"float32": 0.1, "bfloat16": 0.1})
    assert res["choice"] == "float32" and res["provisional"] and f"bfloat16 engine not started within {P.START_BY_S:.0f} s" in res["reason"]
    assert took <= P.START_BY_S


def test_engines_that_do_not_start_within_the_budget_leave_float32_for_now_and_are_measured_again_later(
        monkeypatch, tmp_path):
    # a machine so busy that neither engine is up by START_BY_S
    res, _, took = _probe(monkeypatch, start_s={"float32": 50.0, "bfloat16": 55.0},
                          rates={"float32": 300.0, "bfloat16": 600.0}, step_s={"float32": 0.1, "bfloat16": 0.1})
    assert res["choice"] == "float32" and res["provisional"]
    assert f"float32 and bfloat16 engines not started within {P.START_BY_S:.0f} s" in res["reason"]
    assert took <= P.START_BY_S
    # the quality check cut off by the budget (engines slowed down by other work on the machine): the same
    res2, _, took = _probe(monkeypatch, start_s={"float32": 40.0, "bfloat16": 40.0},
                           rates={"float32": 300.0, "bfloat16": 600.0}, step_s={"float32": 0.4, "bfloat16": 0.2})
    assert res2["choice"] == "float32" and res2["provisional"] and "did not answer 'greedy'" in res2["reason"]
    assert took <= P.BUDGET_S
    monkeypatch.setenv("TOKENMILL_HOME", str(tmp_path / "home"))
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text("{}")
    calls: list = []
    monkeypatch.setattr(P, "measure", lambda kw, env=None, **_: calls.append(1) or {**res, "provisional": True})
    assert cpu.cpu_dtype(str(model), {}) == "float32" and cpu.cpu_dtype(str(model), {}) == "float32"
    assert len(calls) == 1  # the job's workers, and reruns for a while, use it
    monkeypatch.setattr(cpu, "PROVISIONAL_S", 0.0)
    cpu.cpu_dtype(str(model), {})
    assert len(calls) == 2


def _fake_measure(calls):
    def measure(kwargs, env=None, **kw):
        calls.append(kwargs)
        return _decide([1.5, 1.7], {"float32": 1.0, "bfloat16": 0.95})
    return measure


def test_the_choice_is_kept_per_cpu_and_model_and_measured_again_when_the_key_changes(tmp_path, monkeypatch):
    monkeypatch.setenv("TOKENMILL_HOME", str(tmp_path / "home"))
    calls: list = []
    monkeypatch.setattr(P, "measure", _fake_measure(calls))
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    kw = {"model": str(model), "dtype": "auto", "max_num_seqs": 8}
    told = []
    first = cpu.cpu_dtype_measurement(str(model), kw, on_measure=lambda: told.append(1))
    assert first["choice"] == "bfloat16" and not first["cached"] and len(calls) == 1 and told == [1]
    assert first["key"]["model"].startswith("m:") and first["key"]["vllm"] and first["key"]["torch"]
    again = cpu.cpu_dtype_measurement(str(model), kw, on_measure=lambda: told.append(2))
    assert again["cached"] and len(calls) == 1 and told == [1]
    # another model config: measured again, the first kept beside it
    (model / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "hidden_size": 64}))
    cpu.cpu_dtype_measurement(str(model), kw)
    assert len(calls) == 2
    # another CPU (a home directory carried to another machine): measured again
    monkeypatch.setattr(cpu, "cpu_identity", lambda: {"cpu": "AMD EPYC 9B14", "flags_sha256": "0" * 16})
    cpu.cpu_dtype_measurement(str(model), kw)
    assert len(calls) == 3
    stored = json.loads((tmp_path / "home" / "cpu_dtype.json").read_text())
    assert len(stored["measurements"]) == 3


def test_an_old_lone_matmul_measurement_is_not_used(tmp_path, monkeypatch):
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("TOKENMILL_HOME", str(home))
    (home / "cpu_dtype.json").write_text(json.dumps({"choice": "float32", "matmuls_per_s": {"float32": 1710.0,
                                                                                          "bfloat16": 1105.0}}))
    calls: list = []
    monkeypatch.setattr(P, "measure", _fake_measure(calls))
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text("{}")
    assert cpu.cpu_dtype(str(model), {"dtype": "auto"}) == "bfloat16" and len(calls) == 1


def test_the_cpu_identity_names_the_model_and_hashes_the_flags():
    ident = cpu.cpu_identity()
    assert ident["cpu"] and len(ident["flags_sha256"]) == 16


@pytest.mark.engine
@pytest.mark.cpu_only
def test_the_probe_times_both_dtypes_in_the_real_engine_and_float32_agrees_with_itself(model_path):
    from tokenmill.transforms.engines.vllm_session import engine_kwargs

    cfg = VllmConfig(**{**TEST_ENGINE, "dtype": "auto"})
    kw = engine_kwargs(cfg, model_path, on_gpu=False, resolve_auto=False)
    cpu.apply_cpu_env()
    # a budget for a shared test machine (the 60 s bound is the fake-clock tests'): on an idle one it
    # stops as soon as the slices decide, as the real probe does; at load 4-15 on 2 cores, 240 s
    # passed once (136 s) and ran out once
    res = P.measure(kw, env=cpu.single_process_omp_env() or {}, budget_s=480.0)
    assert res["choice"] in P.CANDIDATES and not res.get("provisional"), res["reason"]
    rounds = res["rounds_output_tok_per_s"]
    assert sorted(rounds) == ["bfloat16", "float32"]
    assert all(len(v) >= 2 and len(v) % 2 == 0 and min(v) > 0 for v in rounds.values())
    q = res["quality"]
    if q["agreement_with_float32"]:  # checked where bfloat16 is the faster (AVX-512 bf16 hosts)
        assert sorted(q["agreement_with_float32"]) == ["bfloat16"]  # float32 is not teacher-forced on itself
        assert 0 <= q["greedy_answers_identical_to_float32"]["bfloat16"] <= q["prompts"] == 8
        assert 0.0 <= q["agreement_with_float32"]["bfloat16"] <= 1.0
        # the check's own check, outside the probe's budget: teacher-forced on its own greedy tokens,
        # float32 picks every one of them
        ref = P._Child("float32", P.probe_engine_args(kw), {**os.environ, **(cpu.single_process_omp_env() or {}),
                                                            "VLLM_ENABLE_V1_MULTIPROCESSING": "0"})
        try:
            got = ref.ask("teacher", reference=ref.ask("greedy")["tokens"])
            assert got["agreement"] == 1.0 and got["identical"] == 8
        finally:
            ref.close()
    else:  # float32, the reference, the faster: nothing to check
        assert res["choice"] == "float32" and res["reason"].startswith("float32 faster")
    # the choice follows from the figures by the documented rule
    again = P.decide("float32", "bfloat16", P.Measured(rounds, res["ratio"]["rounds"], q["agreement_with_float32"],
                                                       {}, []), workload={}, wall_s=0.0)
    assert again["choice"] == res["choice"]
