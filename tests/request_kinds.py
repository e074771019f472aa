"""One mixed job of the request kinds beyond free text (JSON schema, choice, logprobs), run
on each engine by its own test module, and the checks every engine's answers must pass."""

from __future__ import annotations

import json
import math

import jsonschema
import pyarrow.parquet as pq

PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}
PERSON_FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
LABELS = ["positive", "negative", "neutral"]
TOP = 3


def _chat(text: str) -> str:
    return json.dumps([{"role": "user", "content": text}])


def rows() -> list[dict]:
    """Three JSON-schema rows, one cut short by max_tokens, three choice rows, a logprobs
    row (raw prompt) and a free-text row; the keys as Parquet columns (JSON text for
    response_format)."""
    base = {"prompt": None, "messages": None, "response_format": None, "choice": None, "logprobs": None,
            "top_logprobs": None, "grammar": None, "n": None, "temperature": None, "seed": None, "max_tokens": 48}
    out = [{**base, "id": f"person-{i}", "messages": _chat(f"Give the person as JSON with name and age: {who}"),
            "response_format": json.dumps(PERSON_FORMAT)} for i, who in enumerate(["Alice, 31", "Bob, 45", "Carol, 27"])]
    out.append({**base, "id": "person-cut", "messages": _chat("Give the person as JSON with name and age: Dan, 50"),
                "response_format": json.dumps(PERSON_FORMAT), "max_tokens": 3})
    out += [{**base, "id": f"label-{i}", "messages": _chat(f"Is this review positive, negative or neutral? {t}"),
             "choice": LABELS, "max_tokens": 8}
            for i, t in enumerate(["I love it!", "Terrible, it broke at once.", "It is a chair."])]
    out.append({**base, "id": "logprobs", "prompt": "The capital of France is", "logprobs": True, "top_logprobs": TOP,
                "max_tokens": 6})
    out.append({**base, "id": "free", "prompt": "The three primary colors are", "max_tokens": 6})
    out.append({**base, "id": "grammar", "prompt": "Is the sky blue? Answer:", "grammar": 'root ::= "yes" | "no"',
                "max_tokens": 4})
    out.append({**base, "id": "grammar-bad", "prompt": "Anything:", "grammar": "root ::= (((", "max_tokens": 4})
    out.append({**base, "id": "samples", "prompt": "Name a fruit:", "n": SAMPLES, "temperature": 1.0, "seed": 5,
                "max_tokens": 8})
    return out


SAMPLES = 3


#: The rows the engine cannot serve: a grammar it cannot compile, a dead letter of its own.
REFUSED = {"grammar-bad"}


def outputs(folder) -> tuple[dict[str, dict], dict[str, dict]]:
    """A finished job's outputs (sample i > 0 of a row as "<id>#<i>") and dead letters, by id."""
    return ({r["id"] + (f"#{r['sample']}" if r["sample"] else ""): r
             for r in pq.read_table(folder / "outputs.parquet").to_pylist()},
            {r["id"]: r for r in pq.read_table(folder / "dead_letters.parquet").to_pylist()})


def check_answers(out: dict[str, dict], dead: dict[str, dict], metrics: dict) -> None:
    """What every engine's answers to `rows()` must satisfy."""
    extra = {f"samples#{i}" for i in range(1, SAMPLES)}
    assert set(out) == ({r["id"] for r in rows()} - REFUSED) | extra and set(dead) == REFUSED, (set(out), dead)
    drawn = [out["samples"], *(out[k] for k in sorted(extra))]
    assert [r["sample"] for r in drawn] == list(range(SAMPLES)) and all(r["output_tokens"] > 0 for r in drawn)
    assert len({r["text"] for r in drawn}) > 1, drawn  # seeds 5, 6, 7 at temperature 1: not one answer
    bad = dead["grammar-bad"]
    assert bad["reason"] == "bad_request" and "\n" not in bad["message"], bad
    assert out["grammar"]["text"] in ("yes", "no") and out["grammar"]["valid"] is None, out["grammar"]
    people = [r for k, r in out.items() if k.startswith("person-") and k != "person-cut"]
    for r in people:
        if r["valid"]:
            value = json.loads(r["text"])
            jsonschema.validate(value, PERSON)
            assert json.loads(r["parsed"]) == value and r["invalid_reason"] is None, r
        else:
            assert r["invalid_reason"], r
    assert sum(bool(r["valid"]) for r in people) >= 2, people  # the constraint holds where the budget does
    cut = out["person-cut"]
    assert cut["finish_reason"] == "length" and cut["valid"] is False, cut
    assert "truncated at max_tokens" in cut["invalid_reason"], cut
    for k in ("label-0", "label-1", "label-2"):
        r = out[k]
        assert r["text"] in LABELS and r["valid"] is True, r
        probs = {p["choice"]: p["prob"] for p in r["choice_probs"]}
        assert set(probs) == set(LABELS), r
        known = [p for p in probs.values() if p is not None]
        assert all(0.0 <= p <= 1.0 for p in known) and sum(known) <= 1.0 + 1e-6, probs
        assert probs[r["text"]] is not None and probs[r["text"]] > 0, probs
        assert r["logprobs"] is None  # not asked for: the alternatives behind the scores are not stored
    lp = out["logprobs"]
    assert lp["valid"] is None and len(lp["logprobs"]) == lp["output_tokens"] > 0, lp
    assert "".join(t["token"] for t in lp["logprobs"]) == lp["text"], lp
    for t in lp["logprobs"]:
        assert t["logprob"] <= 0.0 and len(t["top_logprobs"]) == TOP, t
        tops = [a["logprob"] for a in t["top_logprobs"]]
        assert tops == sorted(tops, reverse=True), t
        # greedy: the token taken is the most likely one
        assert t["top_logprobs"][0]["token"] == t["token"] and math.isclose(tops[0], t["logprob"], abs_tol=1e-4), t
    free = out["free"]
    assert free["valid"] is None and free["logprobs"] is None and free["choice_probs"] is None
    assert metrics["requests"]["samples"] == len(out) and metrics["requests"]["succeeded"] == len(out) - len(extra)
    answers = metrics["answers"]
    structured = people + [cut] + [out[f"label-{i}"] for i in range(3)]
    assert answers["checked"] == len(structured)
    assert answers["valid"] == sum(bool(r["valid"]) for r in structured)
    assert math.isclose(answers["valid_rate"], answers["valid"] / answers["checked"])
