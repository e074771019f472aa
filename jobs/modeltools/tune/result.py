"""What a tune found: the table of candidates, the one-line recommendation, and the result
that holds them with the search's log."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tokenmill.jobs.metrics.catalog import VIEWS
from tokenmill.jobs.modeltools.tune.common import REFERENCE, mean
from tokenmill.jobs.modeltools.tune.gate import Gate
from tokenmill.jobs.modeltools.tune.halving import SearchLog, beats
from tokenmill.jobs.modeltools.tune.space import Candidate


@dataclass
class TuneResult:
    """What `tune` found and wrote (`files`: table, report, winning spec, JSON)."""

    tune_id: str
    gate: Gate
    reference: Candidate
    candidates: list[Candidate]
    log: SearchLog
    sample_rows: int
    repeats: int
    table: list[dict[str, Any]]
    recommendation: str
    winner_spec: dict[str, Any]
    files: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {
            "tune_id": self.tune_id, "gate": self.gate.text, "sample_rows": self.sample_rows,
            "repeats": self.repeats, "sizes": self.log.sizes, "stopped": self.log.stopped,
            "winner": self.log.verdict.winner if self.log.verdict else REFERENCE,
            "recommendation": self.recommendation, "table": self.table, "files": self.files, "notes": self.notes,
            "runs": {k: {str(s): e.runs for s, e in by.items()} for k, by in self.log.entries.items()},
            "comparisons": {k: {str(s): e.comparison for s, e in by.items() if e.comparison}
                            for k, by in self.log.entries.items()},
        }


def build_table(ref: Candidate, cands: list[Candidate], log: SearchLog) -> list[dict[str, Any]]:
    """One row per candidate (the reference first): its figures (means of its runs) at the
    largest sample it ran on, the spread of its cost, the gate, and where it stopped."""
    rows = []
    for c in [ref, *cands]:
        row: dict[str, Any] = {"candidate": c.key, "label": c.label, "changes": c.changes}
        size = log.last_size(c.key)
        if c.rejected or size is None:
            row.update(outcome=f"rejected: {c.rejected}" if c.rejected else log.outcome.get(c.key, "not run"),
                       rows=None, dropped_at=log.dropped_at.get(c.key))
            rows.append(row)
            continue
        e = log.entry(c.key, size)
        costs = e.values("cost")
        ref_costs = log.entry(REFERENCE, size).values("cost")
        cost_mean, ref_cost_mean = mean(costs), mean(ref_costs)  # None without costs
        row.update(
            outcome=log.outcome.get(c.key, "not finished"), rows=size, dropped_at=log.dropped_at.get(c.key),
            runs=len(e.runs), job_ids=[r["job_id"] for r in e.runs],
            **{key: mean(e.values(key)) for key, _ in VIEWS["tune"]},
            cost_runs=costs, cost_spread=(max(costs) - min(costs)) if costs else None,
            cheaper_than_reference=(ref_cost_mean / cost_mean) if ref_cost_mean is not None and cost_mean else None,
            beats_reference=beats(costs, ref_costs) if c.key != REFERENCE else None,
            gate=None if e.passed is None else ("pass" if e.passed else "fail"),
            quality_loss=e.loss, gate_metric=e.gate_metric,
            # word similarity of its answers to the reference's on the sampled rows (what the
            # eval-set gate does not look at)
            sample_similarity=((e.comparison or {}).get("sample") or e.comparison or {}).get("word_similarity"),
        )
        rows.append(row)
    return rows


def recommendation(res: TuneResult) -> str:
    """One line: what the winner gains over the spec as given and at what quality cost."""
    v = res.log.decided()
    rows = {r["candidate"]: r for r in res.table}
    if v.size is None:
        return "No recommendation: the budget ran out before the first sample size finished."
    where = f"{v.size} sampled rows × {res.repeats} runs"
    if v.winner != REFERENCE:
        w, ref = rows[v.winner], rows[REFERENCE]
        tput = (w["output_tok_per_s"] / ref["output_tok_per_s"]) if w.get("output_tok_per_s") and ref.get("output_tok_per_s") else None
        return (f"Use {w['label']}: ${w['cost']:.4g} per 1M output tokens against ${ref['cost']:.4g} for the spec as "
                f"given ({w['cheaper_than_reference']:.2f}× cheaper" + (f", {tput:.2f}× the output tok/s" if tput else "")
                + f"), quality loss {w['quality_loss']:+.1%} ({w['gate_metric']}, gate {res.gate.text}), on {where}.")
    if v.best is None:
        return f"Keep the spec as given: no candidate passed the gate ({res.gate.text}) on {where}."
    b = rows[v.best]
    x = b["cheaper_than_reference"]
    if x > 1:
        return (f"Keep the spec as given: the cheapest candidate that passes the gate, {b['label']} "
                f"({x:.2f}× cheaper by mean), is inside the measured noise of the reference on {where}.")
    return (f"Keep the spec as given: no candidate that passes the gate is cheaper; the cheapest, {b['label']}, "
            f"costs {1 / x:.2f}× the reference's on {where}.")
