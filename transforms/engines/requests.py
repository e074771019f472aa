"""Request kinds beyond free text, for each engine: the one place that turns a request's
structured-output and log-probability keys (schemas/sampling.py `ANSWER_KEYS`) into what
an engine takes, and its log-probabilities back into one shape.

- vLLM in process: `StructuredOutputsParams` (json, json_object, regex, choice, grammar)
  and `SamplingParams.logprobs` (the top-k alternatives; the sampled token always comes).
- An OpenAI-compatible server (`openai`; vLLM's own server is the reference): the
  standard `response_format`, `logprobs` and `top_logprobs`, and vLLM's
  `structured_outputs` body key for regex, choice and grammar.
- llama-server (`llamacpp`): `response_format` on chat, `json_schema` on completions, a
  GBNF `grammar` for a grammar or a choice (written here), no regex (a dead letter
  that says so).

A `choice` row always asks for `MAX_TOP_LOGPROBS` alternatives: its answers'
probabilities are read from them (transforms/answers.py).  Log-probabilities come back
as `[{"token", "logprob", "top_logprobs": [{"token", "logprob"}, ...]}, ...]`, one entry
per output token, alternatives most likely first (schemas/records.LOGPROBS_TYPE).
"""

from __future__ import annotations

import json
import math
from typing import Any, Literal

from tokenmill.schemas.config import SamplingDefaults
from tokenmill.schemas.sampling import ANSWER_KEYS, MAX_TOP_LOGPROBS, request_keys, structured_kind

Dialect = Literal["openai", "llama.cpp"]


class UnsupportedRequest(ValueError):
    """The engine cannot serve this kind of request (the row's dead letter says so)."""


def logprobs_wanted(sampling: dict[str, Any]) -> int | None:
    """How many alternatives per token to ask the engine for; None: no log-probabilities."""
    if sampling.get("choice"):
        return MAX_TOP_LOGPROBS
    if sampling.get("logprobs"):
        return int(sampling.get("top_logprobs") or 0)
    return None


def constraint(sampling: dict[str, Any]) -> dict[str, Any] | None:
    """The request's structured-output constraint in vLLM's `StructuredOutputsParams` names."""
    kind = structured_kind(sampling)
    if kind is None:
        return None
    if kind == "json_schema":
        return {"json": sampling["response_format"]["json_schema"]["schema"]}
    if kind == "json_object":
        return {"json_object": True}
    return {kind: sampling[kind]}


def plain(sampling: dict[str, Any]) -> dict[str, Any]:
    """The sampling keys an engine takes as they are (the answer keys are translated here)."""
    return {k: v for k, v in sampling.items() if k not in ANSWER_KEYS}


# ---------------------------------------------------------------- vLLM in process


def vllm_sampling(sampling: dict[str, Any]) -> dict[str, Any]:
    """`SamplingParams` keywords for a request (vLLM imported)."""
    from vllm.sampling_params import StructuredOutputsParams

    kw = {k: v for k, v in plain(sampling).items() if v is not None}
    c = constraint(sampling)
    if c is not None:
        kw["structured_outputs"] = StructuredOutputsParams(**c)
    k = logprobs_wanted(sampling)
    if k is not None:
        kw["logprobs"] = k
    return kw


def vllm_logprobs(token_ids: list[int], logprobs: Any, k: int | None) -> list[dict[str, Any]] | None:
    """A vLLM completion's `logprobs` (per position, token id → Logprob) in the one shape,
    with at most `k` alternatives."""
    if logprobs is None or k is None:
        return None
    out = []
    for tid, pos in zip(token_ids, logprobs):
        chosen = pos.get(tid)
        top = [{"token": lp.decoded_token, "logprob": lp.logprob} for lp in pos.values()
               if lp.rank is not None and lp.rank <= k]  # the sampled token comes too, ranked or not
        out.append({
            "token": (chosen.decoded_token if chosen else None) or "",
            "logprob": _finite(chosen.logprob) if chosen else None,
            "top_logprobs": _alternatives(top, k),
        })
    return out


def _finite(v: Any) -> float | None:
    """A log-probability as stored: None for a token the engine ruled out (-inf under a
    constraint) or did not score, which JSON cannot hold."""
    v = None if v is None else float(v)
    return v if v is not None and math.isfinite(v) else None


# ---------------------------------------------------------------- over HTTP


def gbnf_choice(choices: list[str]) -> str:
    """A GBNF grammar whose only sentences are `choices`."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def http_body(sampling: dict[str, Any], *, chat: bool, dialect: Dialect) -> dict[str, Any]:
    """The body keys that ask an OpenAI-compatible server for this request's kind."""
    out: dict[str, Any] = {}
    k = logprobs_wanted(sampling)
    if k is not None:
        out.update({"logprobs": True, "top_logprobs": k} if chat else {"logprobs": k})
    kind = structured_kind(sampling)
    if kind is None:
        return out
    fmt: dict[str, Any] = sampling.get("response_format") or {}
    if dialect == "llama.cpp":
        if kind == "regex":
            raise UnsupportedRequest("llama-server has no regex constraint (use grammar, a GBNF grammar)")
        if kind in ("json_schema", "json_object"):
            if chat:
                out["response_format"] = fmt
            else:
                out["json_schema"] = fmt["json_schema"]["schema"] if kind == "json_schema" else {"type": "object"}
        else:
            out["grammar"] = gbnf_choice(sampling["choice"]) if kind == "choice" else sampling["grammar"]
        return out
    if kind in ("json_schema", "json_object"):
        out["response_format"] = fmt
    else:
        out["structured_outputs"] = {kind: sampling[kind]}
    return out


def request_body(model: str, source: str | list[dict[str, str]], sampling: dict[str, Any],
                 dialect: Dialect = "openai") -> dict[str, Any]:
    """The OpenAI request for one row: `messages` (chat) or `prompt` (raw text), every
    sampling key that is set (schemas/sampling.request_keys: a key at its "off" value is
    left out, so a server that does not know vLLM's extras, `min_tokens`, `top_k`,
    `ignore_eos`, is sent them only when a job sets them), and the keys of its request
    kind in the server's `dialect` (http_body: structured outputs, logprobs)."""
    chat = isinstance(source, list)
    body: dict[str, Any] = {"model": model, "stream": True, "stream_options": {"include_usage": True}}
    body["messages" if chat else "prompt"] = source
    body.update(request_keys(plain(sampling), SamplingDefaults))
    body.update(http_body(sampling, chat=chat, dialect=dialect))
    return body


def embedding_body(model: str, source: Any) -> dict[str, Any]:
    """An /embeddings request for one row's text; a conversation is refused (an embedding
    input is text)."""
    if not isinstance(source, str):
        raise UnsupportedRequest("an embedding row takes text (`prompt`), not chat messages")
    return {"model": model, "input": source, "encoding_format": "float"}


def _alternatives(top: Any, k: int) -> list[dict[str, Any]]:
    if isinstance(top, dict):  # completions: {token: logprob}
        pairs = [{"token": t, "logprob": _finite(v)} for t, v in top.items()]
    else:  # chat: [{"token", "logprob", ...}]
        pairs = [{"token": a.get("token") or "", "logprob": _finite(a.get("logprob"))} for a in top or ()]
    kept = [a for a in pairs if a["logprob"] is not None]  # a ruled-out alternative says nothing
    return sorted(kept, key=lambda a: -a["logprob"])[:k]


def http_logprobs(choice: dict[str, Any], *, chat: bool, k: int) -> list[dict[str, Any]]:
    """One streamed chunk's log-probabilities (a chunk's `choices[i]`) in the one shape."""
    lp: dict[str, Any] = choice.get("logprobs") or {}
    if not lp:
        return []
    if chat or "content" in lp:  # the chat shape (llama-server streams completions in it too)
        return [{"token": t.get("token") or "", "logprob": _finite(t.get("logprob")),
                 "top_logprobs": _alternatives(t.get("top_logprobs"), k)} for t in lp.get("content") or ()]
    tokens, values = lp.get("tokens") or [], lp.get("token_logprobs") or []
    tops = lp.get("top_logprobs") or [None] * len(tokens)
    return [{"token": t, "logprob": _finite(v), "top_logprobs": _alternatives(a, k)}
            for t, v, a in zip(tokens, values, tops)]

