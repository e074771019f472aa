"""The quality gate of a tune: `METRIC<=LIMIT` or `METRIC>=LIMIT` over compare's measures."""

from __future__ import annotations

import re
from dataclasses import dataclass

from tokenmill.jobs.modeltools.tune.common import TuneError

#: Without --gate: the compare gate's own measure as a loss (accuracy drop where the input has
#: references, else disagreement = 1 - word similarity; for an embedding job 1 - the mean
#: cosine similarity to the reference vectors), at most 3 points.
DEFAULT_GATE = "auto<=3%"

#: gate metric → the comparison it reads and the direction of its limit
GATE_METRICS = {"auto": "<=", "accuracy_drop": "<=", "disagreement": "<=", "exact_match": ">=", "similarity": ">=",
                "cosine": ">=", "schema_valid_drop": "<="}
#: The measures of a text comparison, which an embedding job (no text) does not have.
TEXT_METRICS = ("disagreement", "exact_match", "similarity")


@dataclass(frozen=True)
class Gate:
    """`METRIC<=LIMIT` or `METRIC>=LIMIT` over `compare`'s measures (jobs/modeltools/compare.py)."""

    metric: str
    op: str
    limit: float
    text: str

    def judge(self, c) -> tuple[bool, float, str]:
        """(passed, quality loss as a fraction, the measure used) of one compare.Comparison.
        The loss is what the plots show: the accuracy drop, or 1 - agreement."""
        if self.metric == "auto":
            loss = 1.0 - c.gate_value if c.gate_metric == "mean_cosine" else c.gate_value  # a similarity, as a loss
            return loss <= self.limit + 1e-12, loss, c.gate_metric
        if self.metric == "cosine":
            if c.cosine_mean is None:
                raise TuneError("gate cosine needs embedding jobs (engine task: embed)")
            return c.cosine_mean >= self.limit - 1e-12, 1.0 - c.cosine_mean, "cosine"
        if self.metric == "schema_valid_drop":
            if c.valid_rate_drop is None:
                raise TuneError("gate schema_valid_drop needs structured rows (response_format, regex or choice)")
            return c.valid_rate_drop <= self.limit + 1e-12, c.valid_rate_drop, "schema_valid_drop"
        if c.word_similarity is None or c.exact_match_rate is None:
            raise TuneError(f"gate {self.metric} measures text; these jobs' rows are embeddings: use cosine or auto")
        if self.metric == "accuracy_drop":
            if c.accuracy_drop is None:
                raise TuneError("gate accuracy_drop needs reference answers: set reference_column in the job spec")
            return c.accuracy_drop <= self.limit + 1e-12, c.accuracy_drop, "accuracy_drop"
        if self.metric == "disagreement":
            v = 1.0 - c.word_similarity
            return v <= self.limit + 1e-12, v, "disagreement"
        v = c.exact_match_rate if self.metric == "exact_match" else c.word_similarity
        return v >= self.limit - 1e-12, 1.0 - v, self.metric


def parse_gate(text: str | None) -> Gate:
    """`auto<=3%`, `accuracy_drop<=0.03`, `disagreement<=5%`, `exact_match>=90%`, `similarity>=0.95`.
    A bare number is a fraction; `%` (or `points`) marks points."""
    text = (text or DEFAULT_GATE).strip()
    m = re.fullmatch(r"([a-z_]+)\s*(<=|>=)\s*(\d+(?:\.\d+)?)\s*(%|points?)?", text)
    if not m:
        raise TuneError(f"--gate must look like 'auto<=3%' or 'exact_match>=0.9' (metrics: {', '.join(GATE_METRICS)}), "
                        f"got {text!r}")
    metric, op, num, unit = m.groups()
    if metric not in GATE_METRICS:
        raise TuneError(f"--gate metric must be one of {', '.join(GATE_METRICS)}, got {metric!r}")
    if op != GATE_METRICS[metric]:
        raise TuneError(f"--gate {metric} is bounded with {GATE_METRICS[metric]}, got {text!r}")
    limit = float(num) / (100.0 if unit else 1.0)
    if not 0.0 <= limit <= 1.0:
        raise TuneError(f"--gate limit must be between 0 and 1 (or 0% and 100%), got {text!r}")
    return Gate(metric, op, limit, text)
