"""`dtype: auto` on a CPU, chosen by what the engine does, in at most `BUDGET_S` seconds in
all: each candidate dtype runs the job's model in a real vLLM engine, side by side, timed in
slices of time on a stream of prefill + decode work, and, where bfloat16 would be chosen, its
greedy answers to a fixed handful of prompts are checked against float32's.

Each candidate runs in a process of its own (`dtype_probe_engine`, the engine core in that
process), both started at once.  After an untimed warm-up slice each (both at once), the timed slices
alternate A B B A, so a burst of load elsewhere on the machine falls on both candidates; a slice
lasts `SLICE_S` seconds (less when the budget is short), whatever the dtype's speed, and its
output tokens are counted.  Slices 1 and 2, and 4 and 3, of a block are paired, and blocks run
until the paired ratios decide (`verdict`) or the time is spent: a dtype without fast kernels on
this CPU is ruled out by the first block's few seconds, never by a flag list.  The quality check
is teacher-forced: float32's greedy tokens are fed to each candidate as the prompt, and the share
of positions where the candidate's own top-1 token is float32's is its agreement (a dtype that
breaks the model, as bf16 emulated on a CPU without bf16 units can, falls far below a healthy
one, whose greedy text may still drift after a near-tie).  When float32, the reference, is the
faster, there is nothing to check.

`measure` is called by `cpu.cpu_dtype_measurement` (cached per CPU, torch, vLLM and model);
this module imports no vLLM, and takes its clock and candidates' processes as given (tests).
"""

from __future__ import annotations

import json
import os
import select
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from tokenmill.transforms.engines import dtype_probe_engine as engine_side

#: the dtypes `auto` chooses between on a CPU, float32 first: it is the quality reference
CANDIDATES = ("float32", "bfloat16")
REFERENCE = "float32"
#: teacher-forced top-1 agreement with float32 below which a dtype counts as degrading the model
MIN_AGREEMENT = 0.90
#: a faster dtype within this share of the other is a tie, and the tie goes to bfloat16 (half the
#: weight and KV memory); outside it, in every paired slice, the faster one wins
TIE = 0.03
#: after two blocks (four paired slices), a median ratio beyond this decides despite a stray slice
CLEAR = 1.5

#: the whole probe, from starting the engines to their exit
BUDGET_S = 60.0
#: an untimed slice each first (the stream's first prefills, the kernels' first calls)
WARMUP_S = 2.0
#: a timed slice, shortened when the budget left is short, but never below MIN_SLICE_S
SLICE_S = 2.0
MIN_SLICE_S = 1.0
ORDER = ("A", "B", "B", "A")
#: kept at the end for the quality check (float32's greedy answers, then bfloat16's teacher-forced
#: pass, one engine at a time: 0.8 s and 3.6 s on the 2-core AMD EPYC with AVX-512, 2026-12-07, the
#: second mostly the engine's first prompt-logprobs call) and the engines' exit
QUALITY_S = 6.0
#: the engines must have started by then, or leave too little for one block: what a warm-up and
#: one block of the shortest slices and the quality check need
START_BY_S = BUDGET_S - (WARMUP_S + len(ORDER) * MIN_SLICE_S + QUALITY_S)


class ProbeError(RuntimeError):
    """A candidate's engine could not start or answer; the message is one line, `dtype` the
    candidate's; `timed_out`: it did not answer within the budget (rather than fail)."""

    def __init__(self, message: str, dtype: str | None = None, *, timed_out: bool = False):
        super().__init__(message)
        self.dtype = dtype
        self.timed_out = timed_out


# ---------------------------------------------------------------- launcher side


def probe_engine_args(engine_kwargs: dict[str, Any]) -> dict[str, Any]:
    """The job's engine arguments as the probe runs them: the job's model, batch and cache
    settings, but a context of at most 1,024 tokens (the workload is short), eager mode, stats
    off; the KV cache is sized to the workload where it runs (`dtype_probe_engine`)."""
    kw = {k: v for k, v in engine_kwargs.items() if k not in ("dtype", "kv_cache_memory_bytes", "disable_log_stats")}
    kw.update(max_model_len=min(int(kw.get("max_model_len") or 1024), 1024), disable_log_stats=True,
              enforce_eager=True)
    return kw


class _Child:
    """One candidate's engine process, asked one JSON line at a time."""

    def __init__(self, dtype: str, engine_args: dict[str, Any], env: dict[str, str]):
        self.dtype = dtype
        self.proc = subprocess.Popen(
            [sys.executable, "-m", engine_side.__name__, dtype, json.dumps(engine_args)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=None, text=True, env=env)

    def ask(self, op: str, *, timeout: float | None = None, **kw) -> dict[str, Any]:
        """The answer to `op`; a ProbeError naming the dtype when the process exits, fails or
        does not answer within `timeout` seconds (then it is killed)."""
        self.send(op, **kw)
        return self.receive(op, timeout=timeout)

    def send(self, op: str, **kw) -> None:
        """Ask `op` without waiting (`receive` reads the answer): both engines work at once."""
        assert self.proc.stdin
        try:
            self.proc.stdin.write(json.dumps({"op": op, **kw}) + "\n")
            self.proc.stdin.flush()
        except BrokenPipeError:
            pass  # receive finds the process gone and says so

    def receive(self, op: str, *, timeout: float | None = None) -> dict[str, Any]:
        """The answer to the `op` sent last (as `ask`)."""
        assert self.proc.stdout
        try:
            if timeout is not None and not select.select([self.proc.stdout], [], [], max(timeout, 0.0))[0]:
                self.proc.kill()
                self.proc.wait()
                raise ProbeError(f"the {self.dtype} probe engine did not answer {op!r} within {timeout:.0f} s "
                                 f"(the probe's budget is {BUDGET_S:.0f} s)", self.dtype, timed_out=True)
            line = self.proc.stdout.readline()
        except BrokenPipeError:
            line = ""
        if not line:
            code = self.proc.wait(timeout=30)
            raise ProbeError(f"the {self.dtype} probe engine exited (status {code}) during {op!r}; its log is in the job log",
                             self.dtype)
        reply = json.loads(line)
        if "error" in reply:
            raise ProbeError(f"the {self.dtype} probe engine failed during {op!r}: {reply['error']}", self.dtype)
        return reply

    def close(self) -> None:
        try:
            if self.proc.stdin:
                self.proc.stdin.close()
            self.proc.wait(timeout=5)
        except Exception:
            self.proc.kill()
            self.proc.wait()


@dataclass
class _Run:
    """One probe under way: its clock, its deadline and what it has measured so far."""

    clock: Callable[[], float]
    t0: float
    deadline: float
    slices: list[dict[str, Any]] = field(default_factory=list)
    """every slice as the engine reported it, warm-ups included, in the order run"""
    timeline: dict[str, float] = field(default_factory=dict)
    """seconds from the start at which each phase ended, and the CPU seconds each engine's
    process took to start (`<dtype>_start_cpu_s`: what its start costs on an idle machine)"""

    def left(self) -> float:
        return self.deadline - self.clock()

    def mark(self, phase: str) -> None:
        self.timeline[phase] = round(self.clock() - self.t0, 1)


def measure(engine_kwargs: dict[str, Any], env: dict[str, str] | None = None,
            candidates: tuple[str, ...] = CANDIDATES, *, budget_s: float = BUDGET_S,
            clock: Callable[[], float] = time.perf_counter) -> dict[str, Any]:
    """Run each candidate dtype's engine side by side and choose, all within `budget_s`
    seconds: the faster one (`verdict` on the paired slices), unless its greedy answers
    disagree with float32's (teacher-forced top-1 agreement below `MIN_AGREEMENT`), then the
    other.  A candidate whose engine does not start (by `START_BY_S`), fails or does not
    answer in time leaves the other."""
    if len(candidates) != 2:
        raise ValueError(f"the probe compares two dtypes, got {candidates!r}")
    args = probe_engine_args(engine_kwargs)
    env = {**os.environ, **(env or {}), "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    t0 = clock()
    run = _Run(clock, t0, t0 + budget_s)
    start_by = t0 + budget_s - (BUDGET_S - START_BY_S)
    children = [_Child(dt, args, env) for dt in candidates]
    try:
        failed: dict[str, str] = {}
        late = 0
        for c in children:
            try:
                run.timeline[f"{c.dtype}_start_cpu_s"] = c.ask("ready", timeout=start_by - clock()).get("start_cpu_s", 0.0)
            except ProbeError as err:
                failed[c.dtype] = str(err)
                late += err.timed_out
        run.mark("started")
        if late:  # a start slowed by other work on the machine says nothing about the dtype
            res = _provisional(f"{' and '.join(failed)} engine{'s' if late > 1 else ''} not started within "
                               f"{start_by - t0:.0f} s")
        elif len(failed) == len(children):
            raise ProbeError("; ".join(failed.values()))
        elif failed:
            (bad, error), = failed.items()
            res = _only(next(c.dtype for c in children if c.dtype != bad), bad, error)
        else:
            try:
                res = _measure_both(children, run, args)
            except ProbeError as err:  # W8A8 int8 checkpoints, say, refuse float32 activations on some CPUs
                if err.timed_out:
                    res = _provisional(f"the measurement did not fit in {budget_s:.0f} s ({err})")
                elif err.dtype is None:
                    raise
                else:
                    res = _only(next(c.dtype for c in children if c.dtype != err.dtype), err.dtype, str(err))
    finally:
        for c in children:
            c.close()
    run.mark("closed")
    return {**res, "slices": run.slices, "timeline_s": run.timeline, "budget_s": budget_s,
            "measure_wall_s": run.timeline["closed"]}


def _slice(c: _Child, seconds: float, label: str | int, run: _Run) -> dict[str, Any]:
    """One slice of `seconds` on `c`'s stream, kept in the run's record."""
    reply = c.ask("speed", seconds=seconds, timeout=run.left())
    run.slices.append({"dtype": c.dtype, "slice": label, "seconds": round(seconds, 2), **reply})
    return reply


def time_slices(a: _Child, b: _Child, run: _Run) -> tuple[dict[str, list[float]], list[float]]:
    """The warm-up, then A B B A blocks until `verdict` decides or no block of at least
    MIN_SLICE_S slices fits before the quality check's reserve: each dtype's output tok/s per
    slice, and the b ÷ a ratio per pair (slices 1 and 2, and 4 and 3, of each block)."""
    # the warm-ups are untimed, so both run at once: the budget pays for one
    for c in (a, b):
        c.send("speed", seconds=WARMUP_S)
    longest = {}
    for c in (a, b):
        reply = c.receive("speed", timeout=run.left())
        run.slices.append({"dtype": c.dtype, "slice": "warm-up", "seconds": WARMUP_S, **reply})
        longest[c.dtype] = reply.get("max_step_s", 0.0)
    rates: dict[str, list[float]] = {a.dtype: [], b.dtype: []}
    ratios: list[float] = []
    block = 0
    while verdict(a.dtype, b.dtype, ratios)[0] is None:
        # each slice may end up to one engine step past its time
        room = run.left() - QUALITY_S - 2 * (longest[a.dtype] + longest[b.dtype])
        seconds = min(SLICE_S, room / len(ORDER))
        if seconds < MIN_SLICE_S:
            break
        block += 1
        for r in ORDER:
            c = a if r == "A" else b
            reply = _slice(c, seconds, block, run)
            longest[c.dtype] = max(longest[c.dtype], reply.get("max_step_s", 0.0))
            rates[c.dtype].append(reply["output_tok_per_s"])
        ra, rb = rates[a.dtype], rates[b.dtype]
        ratios += [rb[-2] / ra[-2], rb[-1] / ra[-1]]
    return rates, ratios


def _measure_both(children: list[_Child], run: _Run, args: dict[str, Any]) -> dict[str, Any]:
    """The timed slices, then, unless float32 (the reference) is the faster, the greedy answers
    and the teacher-forced check; then `decide`."""
    a, b = children
    rates, ratios = time_slices(a, b, run)
    run.mark("timed")
    workload = {**engine_side.workload(), "order": f"a warm-up slice of {WARMUP_S:g} s each, both at once, then "
                + " ".join(ORDER) + f" blocks of slices of up to {SLICE_S:g} s",
                "max_num_seqs": args.get("max_num_seqs"), "prefix_caching": args.get("enable_prefix_caching")}
    if not ratios:
        return {**_unchecked(REFERENCE, f"the engines took {run.timeline['started']:.0f} s to start, leaving no "
                             f"time to time them within {run.deadline - run.t0:.0f} s: {REFERENCE}, the reference",
                             rates), "workload": workload}
    faster = verdict(a.dtype, b.dtype, ratios)[0] or tie_choice(a.dtype, b.dtype)
    identical: dict[str, int] = {}
    agreement: dict[str, float] = {}
    ref: list[list[int]] = []
    if faster != REFERENCE:
        # the reference's greedy answers, then each other dtype teacher-forced on them, one engine
        # at a time (two engines' threads on the same cores at once slow both several times over)
        ref_child = next((c for c in children if c.dtype == REFERENCE), a)
        ref = ref_child.ask("greedy", timeout=run.left())["tokens"]
        for c in children:
            if c is not ref_child:
                got = c.ask("teacher", reference=ref, timeout=run.left())
                agreement[c.dtype], identical[c.dtype] = got["agreement"], got["identical"]
        run.mark("checked")
    return decide(a.dtype, b.dtype, Measured(rates, ratios, agreement, identical, ref), workload=workload,
                  wall_s=run.clock() - run.t0)


def _unchecked(choice: str, reason: str, rates: dict[str, list[float]] | None = None) -> dict[str, Any]:
    return {"choice": choice, "reason": reason,
            "output_tok_per_s": {dt: statistics.median(v) for dt, v in (rates or {}).items() if v},
            "rounds_output_tok_per_s": rates or {}, "ratio": None,
            "quality": {"agreement_with_float32": {}, "what": "not checked"}, "workload": None}


def _provisional(why: str) -> dict[str, Any]:
    """float32 for now when the probe ran out of time (a busy or slow machine), not a measured
    choice: `cpu_dtype_measurement` keeps it a while only, then measures again."""
    return {**_unchecked(REFERENCE, f"{why} (a busy or slow machine?): {REFERENCE}, the reference, until it is "
                         "measured again"), "provisional": True}


def _only(choice: str, dtype: str, error: str) -> dict[str, Any]:
    """The choice when one candidate's engine does not start or answer: the other, unchecked."""
    res = _unchecked(choice, f"the only one that starts: {dtype}'s engine did not ({error})")
    res["quality"]["what"] = "not checked: one candidate only"
    return res


@dataclass(frozen=True)
class Measured:
    """What the probe measured of the two dtypes."""

    rates: dict[str, list[float]]
    """Each dtype's output tok/s, per timed slice."""
    ratios: list[float]
    """b ÷ a per paired slice."""
    agreement: dict[str, float]
    """Each dtype's teacher-forced agreement with float32's greedy tokens (empty: not checked,
    float32 being the faster)."""
    identical: dict[str, int]
    """Per checked dtype, the prompts whose every teacher-forced top-1 token is float32's: those
    whose greedy answer is float32's, token for token."""
    ref: list[list[int]]
    """The reference greedy answers (float32's)."""


def verdict(a: str, b: str, ratios: list[float]) -> tuple[str | None, str]:
    """Which dtype the paired ratios (b ÷ a) put ahead, and in words; None while they do not
    decide: with at least two pairs, every ratio beyond `TIE` on one side of 1, or, with at
    least four, the median beyond `CLEAR`."""
    if len(ratios) < 2:
        return None, f"not timed ({len(ratios)} paired slices)"
    lo, hi, med = min(ratios), max(ratios), statistics.median(ratios)
    if hi < 1 - TIE or (len(ratios) >= 4 and med <= 1 / CLEAR):
        return a, f"{a} faster: {b} ran at {lo:.2f}-{hi:.2f}× its output tok/s (median {med:.2f})"
    if lo > 1 + TIE or (len(ratios) >= 4 and med >= CLEAR):
        return b, f"{b} faster: {lo:.2f}-{hi:.2f}× {a}'s output tok/s (median {med:.2f})"
    return None, f"no clear speed difference ({b} at {lo:.2f}-{hi:.2f}× {a}'s output tok/s)"


def tie_choice(a: str, b: str) -> str:
    """The tie goes to bfloat16: half the weight and KV memory."""
    return "bfloat16" if "bfloat16" in (a, b) else a


def decide(a: str, b: str, measured: Measured, *, workload: dict[str, Any], wall_s: float) -> dict[str, Any]:
    """The choice and its reason from the measured rates (`ratios`: b ÷ a per paired slice)
    and, where checked, each dtype's agreement with float32."""
    rates, ratios, agreement = measured.rates, measured.ratios, measured.agreement
    ref = measured.ref
    faster, speed = verdict(a, b, ratios)
    if faster is None:
        faster = tie_choice(a, b)
        speed = f"{speed}; {faster} for half the memory"
    choice, why = faster, speed
    ok = {dt: dt == REFERENCE or agreement.get(dt, 0.0) >= MIN_AGREEMENT for dt in (a, b)}
    if not ok[faster]:
        other = b if faster == a else a
        choice = other if ok[other] else REFERENCE
        why = (f"{speed}, but {faster}'s greedy answers agree with float32's at {agreement.get(faster, 0.0):.0%} "
               f"(below {MIN_AGREEMENT:.0%}): {choice}")
    exact = measured.identical
    quality: dict[str, Any] = {"agreement_with_float32": agreement, "what": f"not checked: {REFERENCE}, the reference, was faster"}
    if agreement:
        quality = {"agreement_with_float32": agreement, "min_agreement": MIN_AGREEMENT,
                   "greedy_answers_identical_to_float32": exact, "prompts": len(ref),
                   "what": "teacher-forced: share of float32's greedy tokens that are the dtype's own top-1"}
    return {
        "choice": choice,
        "reason": why,
        "output_tok_per_s": {dt: statistics.median(v) for dt, v in rates.items() if v},
        "rounds_output_tok_per_s": rates,
        "ratio": {"of": f"{b} / {a}", "median": statistics.median(ratios), "rounds": ratios},
        "quality": quality,
        "workload": workload,
        "measure_wall_s": round(wall_s, 1),
    }
