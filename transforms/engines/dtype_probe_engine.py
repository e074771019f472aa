"""The process one candidate dtype of `dtype: auto`'s probe runs in
(`python -m tokenmill.transforms.engines.dtype_probe_engine DTYPE ARGS`): a real vLLM engine with
the job's model, answering one JSON request a line on stdin (`ready`, `speed`, `greedy`,
`teacher`) with one JSON line; everything vLLM and torch print goes to stderr (the job's log).

`speed` runs the engine for a slice of time and counts the output tokens it made: a stream of
requests kept in the engine from one slice to the next (`Stream`), `BATCH` sequences decoding at
once, each finished one replaced by the next prompt, so each slice times prefill and decode in
the mix the job has, and no slice waits for a fixed number of tokens (a dtype without fast
kernels takes as long per slice as a fast one, and is simply seen making fewer tokens).

The launcher side, and the rule that decides, are `dtype_probe`.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time
from typing import Any

from tokenmill.transforms.engines import kv

#: the speed workload: prompts sharing a 48-token system prefix, then 16-96 tokens of their own,
#: `OUTPUT_TOKENS` out each (about the demo job's 77 prompt and 51 output tokens a row), `BATCH`
#: of them decoding at once
BATCH = 32
OUTPUT_TOKENS = 32
PREFIX_TOKENS = 48
OWN_TOKENS = (16, 96)
#: new prompts admitted per engine step, by their prompt tokens (at least one): no step is one
#: long prefill of the whole batch, so a slice ends within about one short step of its time
#: even on a CPU without fast kernels for the dtype, and the batch still stays full
ADMIT_TOKENS = 256
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
QUALITY_OUTPUT_TOKENS = 16
_TEXT = ("Batch inference reads prompts from files, groups them by length and shared prefix, and "
         "runs them through an engine that keeps many sequences decoding at once. ")


def speed_prompts(tok) -> list[list[int]]:
    """The workload's prompts: a shared system prefix, then each prompt's own tokens."""
    ids = tok(_TEXT * 40, add_special_tokens=False)["input_ids"]
    system = ids[:PREFIX_TOKENS]
    lo, hi = OWN_TOKENS
    return [system + ids[PREFIX_TOKENS + i * 7: PREFIX_TOKENS + i * 7 + lo + (i * 41) % (hi - lo + 1)]
            for i in range(BATCH)]


def workload_kv_bytes(model_path: str, block_size: int) -> int:
    """A KV cache that holds the whole batch in float32 (the larger candidate), with headroom, so
    neither dtype's engine ever waits for blocks (a fixed size would leave float32 half of
    bfloat16's blocks)."""
    per_token = kv.bytes_per_token(kv.attention_shape(kv.text_config(model_path)), kv.elem_bytes("float32"))
    longest = PREFIX_TOKENS + OWN_TOKENS[1] + OUTPUT_TOKENS
    blocks = BATCH * -(-longest // block_size)
    return int(blocks * block_size * per_token * kv.HEADROOM)


def workload() -> dict[str, Any]:
    """The speed workload in words and numbers, for the measurement's record."""
    return {"batch": BATCH, "output_tokens": OUTPUT_TOKENS, "prefix_tokens": PREFIX_TOKENS,
            "own_prompt_tokens": list(OWN_TOKENS), "admit_prompt_tokens_per_step": ADMIT_TOKENS}


class Stream:
    """The speed workload, kept in the engine between slices: `BATCH` requests live, each
    finished one replaced by the next prompt (at most `ADMIT_TOKENS` new prompt tokens a step)."""

    def __init__(self, engine, prompts: list[list[int]], params, *, clock=time.perf_counter):
        self.engine, self.prompts, self.params, self.clock = engine, prompts, params, clock
        self.live: set[str] = set()
        self.added = 0

    def _admit(self) -> None:
        budget = ADMIT_TOKENS
        while len(self.live) < BATCH:
            p = self.prompts[self.added % len(self.prompts)]
            if budget < len(p) and budget < ADMIT_TOKENS:
                break
            rid = f"speed-{self.added}"
            self.engine.add_request(rid, {"prompt_token_ids": p}, self.params)  # a TokensPrompt
            self.live.add(rid)
            self.added += 1
            budget -= len(p)

    def run(self, seconds: float) -> dict[str, Any]:
        """Engine steps until `seconds` have passed (the step under way finishes): the output
        tokens made, the wall time, the steps and the longest one."""
        t = self.clock()
        tokens = steps = 0
        longest = 0.0
        while True:
            self._admit()
            s = self.clock()
            for out in self.engine.step():
                tokens += len(out.outputs[0].token_ids) if out.outputs else 0
                if out.finished:
                    self.live.discard(out.request_id)
            now = self.clock()
            longest, steps = max(longest, now - s), steps + 1
            if now - t >= seconds:
                break
        wall = now - t
        return {"output_tokens": tokens, "wall_s": wall, "output_tok_per_s": tokens / wall, "steps": steps,
                "max_step_s": longest}

    def stop(self) -> None:
        """Abort the live requests (the quality check runs the engine to completion)."""
        if self.live:
            self.engine.abort_request(sorted(self.live))
            self.live.clear()


def _chat_prompts(tok) -> list[list[int]]:
    out = []
    for q in QUALITY_PROMPTS:
        p = tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True)
        out.append(list(p["input_ids"] if isinstance(p, dict) or hasattr(p, "keys") else p))
    return out


def serve(dtype: str, engine_args: dict[str, Any]) -> None:
    """Start the engine in `dtype`, then answer the launcher's requests until stdin closes."""
    reply_to = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import RequestOutputKind

    kv_bytes = workload_kv_bytes(engine_args["model"], int(engine_args.get("block_size") or 128))
    llm = LLM(**{**engine_args, "kv_cache_memory_bytes": kv_bytes}, dtype=dtype)
    tok = llm.get_tokenizer()
    stream = Stream(llm.llm_engine, speed_prompts(tok),
                    SamplingParams(max_tokens=OUTPUT_TOKENS, min_tokens=OUTPUT_TOKENS, ignore_eos=True,
                                   temperature=0.0, output_kind=RequestOutputKind.DELTA))
    chat = _chat_prompts(tok)

    def greedy() -> dict[str, Any]:
        stream.stop()
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in chat],
                            SamplingParams(max_tokens=QUALITY_OUTPUT_TOKENS, temperature=0.0), use_tqdm=False)
        return {"tokens": [list(o.outputs[0].token_ids) for o in outs]}

    def teacher(reference: list[list[int]]) -> dict[str, Any]:
        stream.stop()
        hits = n = identical = 0
        prompts = [TokensPrompt(prompt_token_ids=p + r) for p, r in zip(chat, reference)]
        outs = llm.generate(prompts, SamplingParams(max_tokens=1, prompt_logprobs=1, temperature=0.0), use_tqdm=False)
        for p, r, o in zip(chat, reference, outs):
            lps = o.prompt_logprobs or []
            agree = 0
            for pos, token in enumerate(r, start=len(p)):
                entry = lps[pos] if pos < len(lps) else None
                agree += bool(entry and token in entry and entry[token].rank == 1)
            hits, n = hits + agree, n + len(r)
            identical += agree == len(r)  # every step's top-1 is the reference's: greedy decoding repeats it
        return {"agreement": hits / n if n else 0.0, "identical": identical}

    def ready() -> dict[str, Any]:
        use = resource.getrusage(resource.RUSAGE_SELF)
        return {"dtype": dtype, "kv_cache_memory_bytes": kv_bytes, "start_cpu_s": round(use.ru_utime + use.ru_stime, 1)}

    ops = {"ready": ready, "speed": stream.run,
           "greedy": greedy, "teacher": teacher}
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
    serve(sys.argv[1], json.loads(sys.argv[2]))
    os._exit(0)  # no interpreter teardown of torch and vLLM (seconds) once the launcher has its answers
