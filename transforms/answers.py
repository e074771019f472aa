"""What a structured or log-probability request answered, checked in the worker before it
is stored (the output row's `valid`, `invalid_reason`, `parsed`, `choice_probs`,
`logprobs`; docs/REQUESTS.md).

- A JSON row (`response_format` json_object or json_schema) is parsed; a json_schema row
  is validated against its schema (the `jsonschema` library, the schema's own draft).
- A regex row must match its regex as a whole (Python's `re.fullmatch`); a choice row
  must be one of its answers.  A grammar row is not checked (`valid` None).
- An output that fails is stored as it is, `valid` false and the reason in one line
  (truncated at max_tokens says so).
- A choice row's answers get probabilities from the engine's alternatives at the first
  output token (`requests.MAX_TOP_LOGPROBS` of them): an answer's probability is the
  summed probability of the alternatives that begin it and no other answer (under a
  constraint, such a token settles the answer, so this is the answer's probability).  The
  answer given, when its first token begins another answer too, adds its own path (the
  product of its tokens' probabilities) to that: a lower bound, since other ways to it
  through shared tokens are not measured.  Any other answer that shares its first token
  and has no token of its own is None (not measured), and so is one whose first token is
  not among the alternatives unless they hold all the probability (then 0).
  The probabilities are the engine's own: vLLM's under the constraint, llama-server's
  before it (docs/REQUESTS.md), so they sum to at most 1 either way.
"""

from __future__ import annotations

import json
import math
import re
from functools import lru_cache
from typing import Any

from tokenmill.schemas.errors import first_line
from tokenmill.schemas.sampling import structured_kind


@lru_cache(maxsize=256)
def _validator(schema_text: str):
    from jsonschema import validators

    schema = json.loads(schema_text)
    return validators.validator_for(schema)(schema)


def _truncated(finish_reason: str | None) -> str:
    return " (truncated at max_tokens)" if finish_reason == "length" else ""


def check(sampling: dict[str, Any], text: str, finish_reason: str | None) -> dict[str, Any]:
    """`valid`, `invalid_reason` and `parsed` of one output under its request's constraint."""
    kind = structured_kind(sampling)
    if kind is None or kind == "grammar":
        return {}
    if kind == "choice":
        ok = text in sampling["choice"]
        return {"valid": ok, "invalid_reason": None if ok else f"{text[:80]!r} is not one of the choices{_truncated(finish_reason)}"}
    if kind == "regex":
        ok = re.fullmatch(sampling["regex"], text) is not None
        return {"valid": ok, "invalid_reason": None if ok else f"does not match the regex{_truncated(finish_reason)}"}
    try:
        parsed = json.loads(text)
    except ValueError as err:
        return {"valid": False, "invalid_reason": f"not JSON: {first_line(err)}{_truncated(finish_reason)}"}
    if kind == "json_object":
        ok = isinstance(parsed, dict)
        return {"valid": ok, "parsed": parsed,
                "invalid_reason": None if ok else f"JSON {type(parsed).__name__}, not an object"}
    schema = sampling["response_format"]["json_schema"]["schema"]
    from jsonschema.exceptions import best_match

    error = best_match(_validator(json.dumps(schema, sort_keys=True)).iter_errors(parsed))
    if error is None:
        return {"valid": True, "parsed": parsed}
    where = "/".join(str(p) for p in error.absolute_path) or "(root)"
    return {"valid": False, "parsed": parsed, "invalid_reason": f"schema: at {where}: {first_line(error.message)}"}


def choice_probs(choices: list[str], text: str, logprobs: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Each answer with its probability (see the module docstring); None without log-probabilities."""
    if not logprobs:
        return None
    first = logprobs[0].get("top_logprobs") or []
    mass: dict[str, float] = {}
    shared: set[str] = set()
    for alt in first:
        token = alt["token"]
        starts = [c for c in choices if token and c.startswith(token)]
        if len(starts) == 1:
            mass[starts[0]] = mass.get(starts[0], 0.0) + math.exp(alt["logprob"])
        else:
            shared.update(starts)
    # an answer whose first token is not among the alternatives has at most the mass they leave
    # out: 0 when they hold all of it (vLLM's constrained distribution), else not measured
    left = 1.0 - sum(math.exp(a["logprob"]) for a in first)
    # the answer given, begun by a token it shares with another: its own path adds to it (a
    # disjoint way to it; other ways through shared tokens are not measured: a lower bound)
    taken = logprobs[0]["token"]
    path = math.exp(sum(-math.inf if t["logprob"] is None else t["logprob"] for t in logprobs))
    shared_taken = sum(c.startswith(taken) for c in choices if taken) > 1
    out = []
    for c in choices:
        if c == text and (shared_taken or c not in mass):  # its own path: the only measure, or one more way
            prob: float | None = mass.get(c, 0.0) + path
        elif c in mass:
            prob = mass[c]
        else:
            prob = 0.0 if c not in shared and left <= 1e-6 else None
        out.append({"choice": c, "prob": prob})
    return out


def answered(sampling: dict[str, Any], text: str, finish_reason: str | None,
             logprobs: list[dict[str, Any]] | None) -> dict[str, Any]:
    """The output row's answer columns for one finished request: the checks, a choice row's
    probabilities, and the log-probabilities the row asked for (cut to its top_logprobs)."""
    out = check(sampling, text, finish_reason)
    if sampling.get("choice"):
        out["choice_probs"] = choice_probs(sampling["choice"], text, logprobs)
    if not sampling.get("logprobs"):
        out["logprobs"] = None
    elif logprobs is not None:
        k = int(sampling.get("top_logprobs") or 0)
        out["logprobs"] = [{**t, "top_logprobs": t["top_logprobs"][:k]} for t in logprobs]
    return out
