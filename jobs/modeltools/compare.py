"""Quality regression gate: compare a candidate job's outputs with a base job's.

Rows are matched by input `id`.  Agreement is measured without a model:
exact-match rate of the stripped texts and a word-level similarity
(`difflib.SequenceMatcher` ratio over whitespace-separated words, 1.0 = same
words in the same order).  Where the outputs carry a `reference` answer (the
job spec's `reference_column`), each job's accuracy is the share of rows whose
output contains the reference as a whole word/number (case-insensitive; `a|b`
lists accepted alternatives), and the gate compares the accuracy drop with the
allowed one.  Without references the gate uses the disagreement
`1 − mean similarity` instead.

The accuracy drop is a paired difference over the same questions: the rows the
candidate lost (base right, candidate wrong) minus those it gained, over the rows
with a reference.  Next to it stands its 95% interval (the Wald interval for a
paired difference of proportions, the one McNemar's test goes with), so a gate
verdict on a small evaluation set shows whether it could be noise: on 60
questions one answer is 1.7 points, and a drop whose interval spans zero is not
a measured loss.
"""

from __future__ import annotations

import difflib
import math
import re
from dataclasses import dataclass
from typing import Any

DEFAULT_MAX_DROP = 0.05


class CompareError(ValueError):
    """Jobs that cannot be compared (missing, unfinished, no common ids); one line."""


def _norm(s: str) -> str:
    return " ".join(s.lower().replace(",", "").split())


def is_correct(output: str | None, reference: str | None) -> bool:
    """True when `output` contains one of the `|`-separated alternatives of `reference`
    as a whole word or number (case-insensitive; thousands separators ignored)."""
    if not output or not reference:
        return False
    text = _norm(output)
    for alt in reference.split("|"):
        a = _norm(alt)
        if a and re.search(rf"(?<![\w.]){re.escape(a)}(?![\w]|\.\d)", text):
            return True
    return False


def word_similarity(a: str | None, b: str | None) -> float:
    """difflib ratio over words: 1.0 for the same words in the same order, 0.0 for nothing in common."""
    wa, wb = (a or "").split(), (b or "").split()
    if not wa and not wb:
        return 1.0
    return difflib.SequenceMatcher(None, wa, wb, autojunk=False).ratio()


@dataclass
class Comparison:
    """The result of comparing two jobs' outputs; `passed` is the gate's verdict."""

    base: str
    candidate: str
    matched: int
    only_base: int
    only_candidate: int
    exact_match_rate: float
    word_similarity: float
    with_reference: int
    base_accuracy: float | None
    candidate_accuracy: float | None
    accuracy_drop: float | None
    lost: int | None
    gained: int | None
    accuracy_drop_ci95: tuple[float, float] | None
    gate_metric: str
    gate_value: float
    max_drop: float
    passed: bool
    worst: list[dict[str, Any]]

    def as_dict(self) -> dict[str, Any]:
        r = lambda v: round(v, 4) if isinstance(v, float) else v  # noqa: E731
        return {k: (tuple(map(r, v)) if isinstance(v, tuple) else r(v)) for k, v in self.__dict__.items()}


def paired_drop_ci95(lost: int, gained: int, n: int) -> tuple[float, float]:
    """95% Wald interval of a paired accuracy drop (lost − gained) / n over n questions."""
    d = (lost - gained) / n
    half = 1.96 * math.sqrt(max((lost + gained) / n - d * d, 0.0) / n)
    return d - half, d + half


def compare_rows(base: dict[str, dict[str, Any]], cand: dict[str, dict[str, Any]], *, base_id: str = "base",
                 cand_id: str = "candidate", max_drop: float = DEFAULT_MAX_DROP, show: int = 5) -> Comparison:
    """Compare outputs keyed by id (each a dict with `text` and optionally `reference`).

    A base row with no candidate counts as a wrong, fully different candidate answer,
    so dropping rows cannot improve the score."""
    if max_drop < 0:
        raise CompareError(f"max drop must be >= 0, got {max_drop}")
    ids = sorted(set(base) & set(cand))
    if not ids:
        raise CompareError(f"jobs {base_id!r} and {cand_id!r} have no output ids in common")
    keys = sorted(base)
    exact = sims = 0.0
    n_ref = ok_b = ok_c = lost = gained = 0
    rows = []
    for i in keys:
        b = base[i]
        c = cand.get(i, {})
        bt, ct = b.get("text"), c.get("text")
        sim = word_similarity(bt, ct) if c else 0.0
        same = bool(c) and (bt or "").strip() == (ct or "").strip()
        exact += same
        sims += sim
        ref = b.get("reference") or c.get("reference")
        cb = cc = None
        if ref:
            n_ref += 1
            cb, cc = is_correct(bt, ref), is_correct(ct, ref)
            ok_b += cb
            ok_c += cc
            lost += cb and not cc
            gained += cc and not cb
        rows.append({"id": i, "similarity": round(sim, 3), "reference": ref, "base_correct": cb,
                     "candidate_correct": cc, "base": bt, "candidate": ct})
    n = len(keys)
    acc_b = ok_b / n_ref if n_ref else None
    acc_c = ok_c / n_ref if n_ref else None
    drop = acc_b - acc_c if n_ref else None
    if n_ref:
        metric, value = "accuracy_drop", drop
    else:
        metric, value = "disagreement", 1 - sims / n
    # worst first: answers the candidate lost, then the least similar
    rows.sort(key=lambda r: (not (r["base_correct"] and not r["candidate_correct"]), r["similarity"]))
    return Comparison(
        base=base_id, candidate=cand_id, matched=len(ids), only_base=len(set(base) - set(cand)),
        only_candidate=len(set(cand) - set(base)), exact_match_rate=exact / n, word_similarity=sims / n,
        with_reference=n_ref, base_accuracy=acc_b, candidate_accuracy=acc_c, accuracy_drop=drop,
        lost=lost if n_ref else None, gained=gained if n_ref else None,
        accuracy_drop_ci95=paired_drop_ci95(lost, gained, n_ref) if n_ref else None,
        gate_metric=metric, gate_value=value, max_drop=max_drop, passed=value <= max_drop + 1e-12,
        worst=rows[:show],
    )


def job_outputs(eng, job_id: str) -> dict[str, dict[str, Any]]:
    """A finished job's outputs keyed by id; raises CompareError for a missing or unfinished job."""
    from tokenmill.schemas import storage as S

    job = S.JobStore(eng).get(job_id)
    if job is None:
        raise CompareError(f"no job with id {job_id!r}")
    if job["status"] in ("pending", "running"):
        raise CompareError(f"job {job_id!r} is {job['status']}; compare finished jobs")
    return S.MetricsReader(eng).outputs(job_id)


def compare_jobs(eng, base_id: str, cand_id: str, *, max_drop: float = DEFAULT_MAX_DROP, show: int = 5) -> Comparison:
    """Compare two jobs stored in the same database (see module docstring for the measures)."""
    base = job_outputs(eng, base_id)
    cand = job_outputs(eng, cand_id)
    if not base:
        raise CompareError(f"base job {base_id!r} has no outputs")
    return compare_rows(base, cand, base_id=base_id, cand_id=cand_id, max_drop=max_drop, show=show)


def format_comparison(c: Comparison) -> str:
    pct = lambda v: "-" if v is None else f"{v:.1%}"  # noqa: E731
    lines = [
        f"compare {c.candidate} against {c.base}: {c.matched} rows matched by id"
        + (f" ({c.only_base} only in base, {c.only_candidate} only in candidate)" if c.only_base or c.only_candidate else ""),
        f"  exact match {pct(c.exact_match_rate)}, word similarity {c.word_similarity:.3f}",
    ]
    if c.with_reference:
        lines.append(
            f"  accuracy vs reference ({c.with_reference} rows): base {pct(c.base_accuracy)}, "
            f"candidate {pct(c.candidate_accuracy)}, drop {c.accuracy_drop:+.1%} "
            f"(lost {c.lost}, gained {c.gained}; 95% interval {c.accuracy_drop_ci95[0]:+.1%} to {c.accuracy_drop_ci95[1]:+.1%})"
        )
    verdict = "PASS" if c.passed else "FAIL"
    lines.append(f"  gate: {c.gate_metric} {c.gate_value:.1%} (allowed {c.max_drop:.1%}): {verdict}")
    for r in c.worst:
        if r["similarity"] >= 1.0:
            continue
        lines.append(f"    {r['id']}: {(r['base'] or '')[:60]!r} → {(r['candidate'] or '')[:60]!r}")
    return "\n".join(lines)
