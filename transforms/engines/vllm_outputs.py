"""vLLM's requests and outputs in tokenmill's terms: a request's `SamplingParams`, and a
finished `RequestOutput` as the `Finished` record (its text, token counts and times from the
engine's own metrics).  vllm is imported inside the calls."""

from __future__ import annotations

from typing import Any

from tokenmill.transforms.engines import requests
from tokenmill.transforms.engines.protocol import Finished


def sampling_params(sampling: dict[str, Any], *, stream: bool = False):
    """`stream`: every step's output carries the text so far (an online request streamed to
    its client), else only the finished one is read."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    kw = requests.vllm_sampling(sampling)
    # Only finished requests are read (as `LLM.generate` does): the default, CUMULATIVE,
    # builds an output with the whole token list so far for every running request at
    # every step, which cost ~5% of generation time on the long-output workload here.
    kw.setdefault("output_kind", RequestOutputKind.CUMULATIVE if stream else RequestOutputKind.FINAL_ONLY)
    return SamplingParams(**kw)


def finished_of(o: Any, now: float, logprobs: int | None) -> Finished:
    """A finished generation (`RequestOutput`) as `Finished`; `logprobs`: the alternatives per
    token it asked for (None: no log-probabilities)."""
    c = o.outputs[0]
    n_out = len(c.token_ids)
    m = o.metrics
    ttft = tpot = e2e = queue = None
    if m is not None:
        ttft = m.first_token_latency or None
        if m.arrival_time:
            e2e = max(0.0, now - m.arrival_time)
        if m.scheduled_ts and m.queued_ts:
            queue = max(0.0, m.scheduled_ts - m.queued_ts)
        if n_out > 1 and m.last_token_ts and m.first_token_ts:
            tpot = (m.last_token_ts - m.first_token_ts) / (n_out - 1)
    return Finished(
        request_id=o.request_id,
        text=c.text,
        finish_reason=c.finish_reason,
        stop_sequence=c.stop_reason if isinstance(c.stop_reason, str) else None,
        prompt_tokens=len(o.prompt_token_ids or []),
        output_tokens=n_out,
        cached_tokens=int(o.num_cached_tokens or 0),
        ttft_s=ttft,
        tpot_s=tpot,
        e2e_s=e2e,
        queue_s=queue,
        finished_at=now,
        output_token_ids=list(c.token_ids),
        logprobs=requests.vllm_logprobs(list(c.token_ids), c.logprobs, logprobs),
    )
