"""`dtype: auto` on a CPU, chosen by what the engine does: each candidate dtype runs the
job's model in a real vLLM engine, side by side, on a short fixed decode workload, and
its greedy answers to a fixed handful of prompts are checked against float32's.

Each candidate runs in a process of its own (`python -m tokenmill.transforms.engines.dtype_probe`,
the engine core in that process), all loaded at once, and the timed rounds alternate
A B B A, so a burst of load elsewhere on the machine falls on both candidates.  The
quality check is teacher-forced: float32's greedy tokens are fed to each candidate as
the prompt, and the share of positions where the candidate's own top-1 token is
float32's is its agreement (a dtype that breaks the model, as bf16 emulated on a CPU
without bf16 units can, falls far below a healthy one, whose greedy text may still
drift after a near-tie).

`measure` is called by `cpu.cpu_dtype_measurement` (cached per CPU, torch, vLLM and
model); this module imports vLLM only in the child processes.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Any

#: the dtypes `auto` chooses between on a CPU, float32 first: it is the quality reference
CANDIDATES = ("float32", "bfloat16")
#: teacher-forced top-1 agreement with float32 below which a dtype counts as degrading the model
MIN_AGREEMENT = 0.90
#: a faster dtype within this share of the other is a tie, and the tie goes to bfloat16 (half the
#: weight and KV memory); outside it the faster one wins
TIE = 0.03

#: the speed workload: prompts sharing a system prefix, then 24-280 tokens of their own, 16 tokens
#: out (prefill and a decode at a batch of 32); the warm-up runs its first 8 prompts
SPEED_PROMPTS = 32
SPEED_OUTPUT_TOKENS = 16
WARMUP_PROMPTS = 8
ROUNDS = ("A", "B", "B", "A")
#: the fixed handful of prompts whose greedy answers are compared
QUALITY_PROMPTS = (
    "What is the capital of France?",
    "Name three primary colors.",
    "Write one sentence about rain.",
    "What is 12 times 7?",
    "Explain photosynthesis in one sentence.",
    "Who wrote Hamlet?",
    "List two uses of copper.",
    "Translate 'good morning' into Spanish.",
)
QUALITY_OUTPUT_TOKENS = 32
_TEXT = ("Batch inference reads prompts from files, groups them by length and shared prefix, and "
         "runs them through an engine that keeps many sequences decoding at once. ")


class ProbeError(RuntimeError):
    """A candidate's engine could not start or answer; the message is one line, `dtype` the candidate's."""

    def __init__(self, message: str, dtype: str | None = None):
        super().__init__(message)
        self.dtype = dtype


# ---------------------------------------------------------------- launcher side


def probe_engine_args(engine_kwargs: dict[str, Any]) -> dict[str, Any]:
    """The job's engine arguments as the probe runs them: the job's model, batch and
    cache settings, but a small KV cache and context (the workload is short), stats off."""
    kw = {k: v for k, v in engine_kwargs.items() if k not in ("dtype", "kv_cache_memory_bytes", "disable_log_stats")}
    kw.update(max_model_len=min(int(kw.get("max_model_len") or 1024), 1024), kv_cache_memory_bytes=256 << 20,
              disable_log_stats=True, enforce_eager=True)
    return kw


class _Child:
    def __init__(self, dtype: str, engine_args: dict[str, Any], env: dict[str, str]):
        self.dtype = dtype
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tokenmill.transforms.engines.dtype_probe", dtype, json.dumps(engine_args)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=None, text=True, env=env)

    def ask(self, op: str, **kw) -> dict[str, Any]:
        assert self.proc.stdin and self.proc.stdout
        try:
            self.proc.stdin.write(json.dumps({"op": op, **kw}) + "\n")
            self.proc.stdin.flush()
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
            self.proc.wait(timeout=15)
        except Exception:
            self.proc.kill()
            self.proc.wait()


def measure(engine_kwargs: dict[str, Any], env: dict[str, str] | None = None,
            candidates: tuple[str, ...] = CANDIDATES, *, prompts: int = SPEED_PROMPTS,
            output_tokens: int = SPEED_OUTPUT_TOKENS, warmup_prompts: int = WARMUP_PROMPTS) -> dict[str, Any]:
    """Run each candidate dtype's engine side by side and choose: the faster one (both paired
    rounds' ratios beyond `TIE`), unless its greedy answers disagree with float32's
    (teacher-forced top-1 agreement below `MIN_AGREEMENT`), then the other.  `prompts` and
    `output_tokens`: the timed workload (at most SPEED_PROMPTS prompts)."""
    if len(candidates) != 2:
        raise ValueError(f"the probe compares two dtypes, got {candidates!r}")
    prompts = min(prompts, SPEED_PROMPTS)
    args = probe_engine_args(engine_kwargs)
    env = {**os.environ, **(env or {}), "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    t0 = time.perf_counter()
    children = [_Child(dt, args, env) for dt in candidates]
    try:
        failed: dict[str, str] = {}
        for c in children:
            try:
                c.ask("ready")
            except ProbeError as err:
                failed[c.dtype] = str(err)
        if len(failed) == len(children):
            raise ProbeError("; ".join(failed.values()))
        if failed:
            (bad, error), = failed.items()
            return _only(next(c.dtype for c in children if c.dtype != bad), bad, error, time.perf_counter() - t0)
        try:
            return _measure_both(children, prompts, output_tokens, warmup_prompts, args, t0)
        except ProbeError as err:  # W8A8 int8 checkpoints, say, refuse float32 activations on some CPUs
            if err.dtype is None:
                raise
            return _only(next(c.dtype for c in children if c.dtype != err.dtype), err.dtype, str(err),
                         time.perf_counter() - t0)
    finally:
        for c in children:
            c.close()


def _measure_both(children: list[_Child], prompts: int, output_tokens: int, warmup_prompts: int,
                  args: dict[str, Any], t0: float) -> dict[str, Any]:
    """Warm-up, the A B B A rounds, the greedy answers and the teacher-forced check, then `decide`."""
    for c in children:  # warm-up, untimed
        c.ask("speed", prompts=min(warmup_prompts, prompts), output_tokens=output_tokens)
    a, b = children[0], children[1]
    rates: dict[str, list[float]] = {c.dtype: [] for c in children}
    for r in ROUNDS:
        c = a if r == "A" else b
        rates[c.dtype].append(c.ask("speed", prompts=prompts, output_tokens=output_tokens)["output_tok_per_s"])
    greedy = {c.dtype: c.ask("greedy")["tokens"] for c in children}
    ref = greedy["float32"] if "float32" in greedy else greedy[a.dtype]
    agreement = {c.dtype: c.ask("teacher", reference=ref)["agreement"] for c in children}
    # A B B A: round 1 pairs with round 2, round 4 with round 3
    ra, rb = rates[a.dtype], rates[b.dtype]
    ratios = [rb[0] / ra[0], rb[1] / ra[1]]
    return decide(a.dtype, b.dtype, Measured(rates, ratios, agreement, greedy, ref),
                  workload={"prompts": prompts, "output_tokens": output_tokens,
                            "order": f"warm-up each on {min(warmup_prompts, prompts)} prompts, then " + " ".join(ROUNDS),
                            "max_num_seqs": args.get("max_num_seqs"),
                            "prefix_caching": args.get("enable_prefix_caching")},
                  wall_s=time.perf_counter() - t0)


def _only(choice: str, dtype: str, error: str, wall_s: float) -> dict[str, Any]:
    """The choice when one candidate's engine does not start: the other, unmeasured and unchecked."""
    return {"choice": choice, "reason": f"the only one that starts: {dtype}'s engine did not ({error})",
            "output_tok_per_s": {}, "rounds_output_tok_per_s": {}, "ratio": None,
            "quality": {"agreement_with_float32": {}, "what": "not checked: one candidate only"},
            "workload": None, "measure_wall_s": round(wall_s, 1)}


@dataclass(frozen=True)
class Measured:
    """What the probe measured of the two dtypes."""

    rates: dict[str, list[float]]
    """Each dtype's output tok/s, per round."""
    ratios: list[float]
    """b ÷ a per paired round."""
    agreement: dict[str, float]
    """Each dtype's teacher-forced agreement with float32's greedy tokens."""
    greedy: dict[str, list[list[int]]]
    """Each dtype's greedy answers."""
    ref: list[list[int]]
    """The reference greedy answers (float32's)."""


def decide(a: str, b: str, measured: Measured, *, workload: dict[str, Any], wall_s: float) -> dict[str, Any]:
    """The choice and its reason from the measured rates (`ratios`: b ÷ a per paired round)
    and each dtype's agreement with float32."""
    rates, ratios, agreement = measured.rates, measured.ratios, measured.agreement
    greedy, ref = measured.greedy, measured.ref
    ok = {dt: agreement[dt] >= MIN_AGREEMENT for dt in (a, b)}
    lo, hi = min(ratios), max(ratios)
    med = statistics.median(ratios)
    if hi < 1 - TIE:
        faster, speed = a, f"{a} faster: {b} ran at {lo:.2f}-{hi:.2f}× its output tok/s"
    elif lo > 1 + TIE:
        faster, speed = b, f"{b} faster: {lo:.2f}-{hi:.2f}× {a}'s output tok/s"
    else:
        faster = "bfloat16" if "bfloat16" in (a, b) else a
        speed = f"no clear speed difference ({b} at {lo:.2f}-{hi:.2f}× {a}'s output tok/s); {faster} for half the memory"
    choice, why = faster, speed
    if not ok[faster]:
        other = b if faster == a else a
        choice = other if ok[other] else "float32"
        why = (f"{speed}, but {faster}'s greedy answers agree with float32's at {agreement[faster]:.0%} "
               f"(below {MIN_AGREEMENT:.0%}): {choice}")
    exact = {dt: sum(g == r for g, r in zip(greedy[dt], ref)) for dt in greedy}
    return {
        "choice": choice,
        "reason": why,
        "output_tok_per_s": {dt: statistics.median(v) for dt, v in rates.items()},
        "rounds_output_tok_per_s": rates,
        "ratio": {"of": f"{b} / {a}", "median": med, "rounds": ratios},
        "quality": {"agreement_with_float32": agreement, "min_agreement": MIN_AGREEMENT,
                    "greedy_answers_identical_to_float32": exact, "prompts": len(ref),
                    "what": "teacher-forced: share of float32's greedy tokens that are the dtype's own top-1"},
        "workload": workload,
        "measure_wall_s": round(wall_s, 1),
    }


# ---------------------------------------------------------------- the probe engine's process


def _speed_prompts(tok) -> list[list[int]]:
    ids = tok(_TEXT * 40, add_special_tokens=False)["input_ids"]
    system = ids[:48]
    return [system + ids[48 + i * 7: 48 + i * 7 + 24 + (i * 41) % 257] for i in range(SPEED_PROMPTS)]


def _chat_prompts(tok) -> list[list[int]]:
    out = []
    for q in QUALITY_PROMPTS:
        p = tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True)
        out.append(list(p["input_ids"] if isinstance(p, dict) or hasattr(p, "keys") else p))
    return out


def _serve(dtype: str, engine_args: dict[str, Any]) -> None:
    """Answer one JSON request a line on stdin with one JSON line on the original stdout;
    everything vLLM and torch print goes to stderr (the job's log)."""
    reply_to = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(**engine_args, dtype=dtype)
    tok = llm.get_tokenizer()
    speed = [TokensPrompt(prompt_token_ids=p) for p in _speed_prompts(tok)]
    chat = _chat_prompts(tok)

    def speed_run(prompts: int, output_tokens: int) -> dict[str, Any]:
        sp = SamplingParams(max_tokens=output_tokens, min_tokens=output_tokens, ignore_eos=True, temperature=0.0)
        t = time.perf_counter()
        outs = llm.generate(speed[:prompts], sp, use_tqdm=False)
        dt = time.perf_counter() - t
        return {"output_tok_per_s": sum(len(o.outputs[0].token_ids) for o in outs) / dt, "wall_s": dt}

    def greedy() -> dict[str, Any]:
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in chat],
                            SamplingParams(max_tokens=QUALITY_OUTPUT_TOKENS, temperature=0.0), use_tqdm=False)
        return {"tokens": [list(o.outputs[0].token_ids) for o in outs]}

    def teacher(reference: list[list[int]]) -> dict[str, Any]:
        hits = n = 0
        prompts = [TokensPrompt(prompt_token_ids=p + r) for p, r in zip(chat, reference)]
        outs = llm.generate(prompts, SamplingParams(max_tokens=1, prompt_logprobs=1, temperature=0.0), use_tqdm=False)
        for p, r, o in zip(chat, reference, outs):
            lps = o.prompt_logprobs or []
            for pos, token in enumerate(r, start=len(p)):
                entry = lps[pos] if pos < len(lps) else None
                n += 1
                hits += bool(entry and token in entry and entry[token].rank == 1)
        return {"agreement": hits / n if n else 0.0}

    ops = {"ready": lambda: {"dtype": dtype}, "speed": speed_run, "greedy": greedy, "teacher": teacher}
    for line in sys.stdin:
        req = json.loads(line)
        op = req.pop("op")
        try:
            reply = ops[op](**req)  # type: ignore[operator]
        except Exception as err:  # the launcher turns it into one line
            reply = {"error": f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"}
        reply_to.write(json.dumps(reply) + "\n")
        reply_to.flush()


if __name__ == "__main__":
    _serve(sys.argv[1], json.loads(sys.argv[2]))
    os._exit(0)  # no interpreter teardown of torch and vLLM (seconds) once the launcher has its answers
