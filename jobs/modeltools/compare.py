"""Quality regression gate: compare a candidate job's outputs with a base job's.

Rows are matched by input `id`, sample 0 of each (a row that asked for n samples is
compared by its first).  Agreement is measured without a model: exact-match rate of the
stripped texts and a word-level similarity (`difflib.SequenceMatcher` ratio over
whitespace-separated words, 1.0 = same words in the same order).  Where the outputs
carry a `reference` answer (the job spec's `reference_column`), each job's accuracy is
the share of rows whose output contains the reference as a whole word/number
(case-insensitive; `a|b` lists accepted alternatives), and the gate compares the
accuracy drop with the allowed one.  Without references the gate uses the
disagreement `1 − mean similarity` instead.

The accuracy drop is a paired difference over the same questions: the rows the
candidate lost (base right, candidate wrong) minus those it gained, over the rows
with a reference.  Next to it stands its 95% interval (the Wald interval for a
paired difference of proportions, the one McNemar's test goes with), so a gate
verdict on a small evaluation set shows whether it could be noise: on 60
questions one answer is 1.7 points, and a drop whose interval spans zero is not
a measured loss.

Structured rows (`valid` not null: a JSON schema, JSON object, regex or choice) add
each job's schema-valid rate: valid rows over the rows structured in either job (a
candidate row missing or not valid counts as invalid).  Its drop is the same paired
difference, with the same interval, and fails the gate when over the allowed drop,
whatever the text gate says.  Over the rows where both `parsed` values are JSON objects,
a top-level field's agreement is the share of the rows having it in either object where
both have it with equal values (JSON equality: `true` is not `1`, `1` is `1.0`); beside
them stand their mean over fields and the share of rows whose objects are equal.

Embedding rows (`embedding`: float32 little-endian bytes; no text, so no text measures)
are compared by the cosine similarity of each row's two vectors, in float64 with numpy:
mean, 5th percentile (linear interpolation), minimum and the rows compared (those with
a vector in either job; a vector in one job only scores 0, two zero vectors 1).  The gate
fails when the mean is below `min_cosine`.  Vectors of different dimensions: CompareError.

`compare_jobs` has the database join the jobs by id and measures the pairs in chunks of
CHUNK_ROWS, holding a chunk, the `show` worst rows and one float per embedding row.
"""

from __future__ import annotations

import difflib
import heapq
import math
import re
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator

import numpy as np
from sqlalchemy import and_, func, select

from tokenmill.schemas import tables as T
from tokenmill.schemas.records import embedding_array

DEFAULT_MAX_DROP = 0.05
DEFAULT_MIN_COSINE = 0.99
#: Row pairs per chunk read from the database and measured at once.
CHUNK_ROWS = 1000
#: The columns compared of each job's row, besides its id (those the table has).
COLUMNS = ("text", "reference", "valid", "parsed", "embedding")

Pair = tuple[str, dict[str, Any], dict[str, Any] | None]


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


def json_equal(a: Any, b: Any) -> bool:
    """Equality of two JSON values: `true` is not `1`, `1` is `1.0`, objects ignore key order."""
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return a == b
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(json_equal(v, b[k]) for k, v in a.items())
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(json_equal(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


def cosines(base: np.ndarray, cand: np.ndarray) -> np.ndarray:
    """Row-wise cosine similarity of two (rows × dim) arrays, in float64; a zero vector
    scores 1.0 against a zero vector and 0.0 against any other."""
    b, c = np.asarray(base, dtype=np.float64), np.asarray(cand, dtype=np.float64)
    nb, nc = np.linalg.norm(b, axis=1), np.linalg.norm(c, axis=1)
    den = nb * nc
    out = np.divide(np.einsum("ij,ij->i", b, c), den, out=np.zeros(len(b)), where=den > 0)
    out[(nb == 0) & (nc == 0)] = 1.0
    return np.clip(out, -1.0, 1.0)


def _round(v: Any) -> Any:
    if isinstance(v, float):
        return round(v, 4)
    if isinstance(v, (tuple, list)):
        return type(v)(map(_round, v))
    return {k: _round(x) for k, x in v.items()} if isinstance(v, dict) else v


@dataclass
class Comparison:
    """The result of comparing two jobs' outputs; `passed` is the gate's verdict (every one
    of `gates`); `gate_metric` and `gate_value` are the first gate's (text, or mean cosine)."""

    base: str
    candidate: str
    matched: int
    only_base: int
    only_candidate: int
    exact_match_rate: float | None
    word_similarity: float | None
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
    min_cosine: float = DEFAULT_MIN_COSINE
    gates: list[dict[str, Any]] = field(default_factory=list)
    structured_rows: int = 0
    base_valid_rate: float | None = None
    candidate_valid_rate: float | None = None
    valid_rate_drop: float | None = None
    valid_lost: int | None = None
    valid_gained: int | None = None
    valid_rate_drop_ci95: tuple[float, float] | None = None
    object_rows: int = 0
    object_match_rate: float | None = None
    mean_field_agreement: float | None = None
    field_agreement: dict[str, float] | None = None
    embedding_rows: int = 0
    embedding_missing: int = 0
    embedding_dim: int | None = None
    cosine_mean: float | None = None
    cosine_p5: float | None = None
    cosine_min: float | None = None

    def as_dict(self) -> dict[str, Any]:
        return {k: _round(v) for k, v in self.__dict__.items()}


def paired_drop_ci95(lost: int, gained: int, n: int) -> tuple[float, float]:
    """95% Wald interval of a paired accuracy drop (lost − gained) / n over n questions."""
    d = (lost - gained) / n
    half = 1.96 * math.sqrt(max((lost + gained) / n - d * d, 0.0) / n)
    return d - half, d + half


def _vector(row: dict[str, Any], job: str, i: str) -> np.ndarray | None:
    blob = row.get("embedding")
    if blob is None:
        return None
    try:
        return embedding_array(blob)
    except ValueError:
        raise CompareError(f"job {job!r} row {i!r}: embedding of {len(blob)} bytes is not float32 values") from None


class _Tally:
    """The sums of a comparison, taken chunk by chunk over (id, base row, candidate row or None)."""

    def __init__(self, base_id: str, cand_id: str, show: int):
        self.base_id, self.cand_id, self.show = base_id, cand_id, show
        self.n = self.exact = self.n_ref = self.ok_b = self.ok_c = self.lost = self.gained = 0
        self.sims = 0.0
        self.worst: list[dict[str, Any]] = []
        # structured rows, valid in base, in candidate, lost, gained
        self.valid: np.ndarray = np.zeros(5, dtype=np.int64)
        self.objects = self.objects_equal = 0
        self.fields: dict[str, list[int]] = {}  # field → [rows having it in either, rows equal in both]
        self.cos: list[np.ndarray] = []
        self.missing = 0
        self.dims: set[int] = set()
        self.emb_worst: list[tuple[float, str]] = []

    def add(self, pairs: list[Pair]) -> None:
        ids = [p[0] for p in pairs]
        bs = [p[1] for p in pairs]
        cs = [p[2] or {} for p in pairs]
        self.n += len(pairs)
        self._text(ids, bs, cs, [p[2] is not None for p in pairs])
        self._structured(bs, cs)
        self._embeddings(ids, bs, cs)

    def _text(self, ids, bs, cs, present) -> None:
        bt, ct = [b.get("text") for b in bs], [c.get("text") for c in cs]
        sim = np.array([word_similarity(x, y) if p else 0.0 for x, y, p in zip(bt, ct, present)])
        same = np.array([p and (x or "").strip() == (y or "").strip() for x, y, p in zip(bt, ct, present)], dtype=bool)
        refs = [b.get("reference") or c.get("reference") for b, c in zip(bs, cs)]
        has = np.array([bool(r) for r in refs], dtype=bool)
        cb = np.array([is_correct(x, r) for x, r in zip(bt, refs)], dtype=bool)
        cc = np.array([is_correct(y, r) for y, r in zip(ct, refs)], dtype=bool)
        self.exact += int(same.sum())
        self.sims += float(sim.sum())
        self.n_ref += int(has.sum())
        self.ok_b, self.ok_c = self.ok_b + int(cb.sum()), self.ok_c + int(cc.sum())
        self.lost, self.gained = self.lost + int((cb & ~cc).sum()), self.gained + int((cc & ~cb).sum())
        # worst first: answers the candidate lost, then the least similar
        key = lambda k: (not (cb[k] and not cc[k]), round(float(sim[k]), 3), ids[k])  # noqa: E731
        rows = [{"id": ids[k], "similarity": round(float(sim[k]), 3), "reference": refs[k],
                 "base_correct": bool(cb[k]) if has[k] else None, "candidate_correct": bool(cc[k]) if has[k] else None,
                 "base": bt[k], "candidate": ct[k]} for k in heapq.nsmallest(self.show, range(len(ids)), key=key)]
        self.worst = heapq.nsmallest(self.show, self.worst + rows, key=lambda r: (
            not (r["base_correct"] and not r["candidate_correct"]), r["similarity"], r["id"]))

    def _structured(self, bs, cs) -> None:
        code = lambda v: -1 if v is None else int(bool(v))  # noqa: E731
        v = np.array([(code(b.get("valid")), code(c.get("valid"))) for b, c in zip(bs, cs)], dtype=np.int8).reshape(-1, 2)
        ok = v == 1
        self.valid += [int((v >= 0).any(axis=1).sum()), int(ok[:, 0].sum()), int(ok[:, 1].sum()),
                       int((ok[:, 0] & ~ok[:, 1]).sum()), int((ok[:, 1] & ~ok[:, 0]).sum())]
        for b, c in zip(bs, cs):
            pb, pc = b.get("parsed"), c.get("parsed")
            if not (isinstance(pb, dict) and isinstance(pc, dict)):
                continue
            self.objects += 1
            self.objects_equal += json_equal(pb, pc)
            for k in pb.keys() | pc.keys():
                f = self.fields.setdefault(k, [0, 0])
                f[0] += 1
                f[1] += k in pb and k in pc and json_equal(pb[k], pc[k])

    def _embeddings(self, ids, bs, cs) -> None:
        by_dim: dict[int, list[tuple[str, np.ndarray, np.ndarray]]] = {}
        missing = []
        for i, b, c in zip(ids, bs, cs):
            vb, vc = _vector(b, self.base_id, i), _vector(c, self.cand_id, i)
            if vb is None and vc is None:
                continue
            if vb is None or vc is None:
                missing.append(i)
            elif vb.size != vc.size:
                raise CompareError(f"embedding dimensions differ: base {self.base_id!r} has {vb.size}, "
                                   f"candidate {self.cand_id!r} has {vc.size} (row {i!r})")
            else:
                by_dim.setdefault(vb.size, []).append((i, vb, vc))
        scored = [(0.0, i) for i in missing]
        self.missing += len(missing)
        self.cos.append(np.zeros(len(missing)))
        for dim, group in by_dim.items():
            cos = cosines(np.stack([g[1] for g in group]), np.stack([g[2] for g in group]))
            self.dims.add(dim)
            self.cos.append(cos)
            scored += [(float(s), g[0]) for s, g in zip(cos, group)]
        self.emb_worst = heapq.nsmallest(self.show, self.emb_worst + scored)

    def result(self, matched: int, only_base: int, only_cand: int, max_drop: float, min_cosine: float) -> Comparison:
        n, refs = self.n, self.n_ref
        m: dict[str, Any] = {}  # the measures that are Comparison's own fields
        cos = np.concatenate(self.cos) if self.cos else np.zeros(0)
        if len(cos):  # an embedding job: no text measures
            refs, metric, value = 0, "mean_cosine", float(cos.mean())
            gates = [{"metric": metric, "value": value, "limit": min_cosine, "passed": value >= min_cosine - 1e-12}]
            m = {"exact_match_rate": None, "word_similarity": None, "embedding_missing": self.missing,
                 "worst": [{"id": i, "cosine": round(c, 4)} for c, i in self.emb_worst], "cosine_mean": value,
                 "cosine_p5": float(np.percentile(cos, 5)), "cosine_min": float(cos.min()),
                 "embedding_dim": next(iter(self.dims)) if len(self.dims) == 1 else None}
        else:
            metric, value = ("accuracy_drop", (self.ok_b - self.ok_c) / refs) if refs else ("disagreement", 1 - self.sims / n)
            gates = [{"metric": metric, "value": value, "limit": max_drop, "passed": value <= max_drop + 1e-12}]
            m = {"exact_match_rate": self.exact / n, "word_similarity": self.sims / n, "worst": self.worst}
        s, ok_b, ok_c, v_lost, v_gained = (int(x) for x in self.valid)
        if s:
            d, ci = (v_lost - v_gained) / s, paired_drop_ci95(v_lost, v_gained, s)
            m |= {"base_valid_rate": ok_b / s, "candidate_valid_rate": ok_c / s, "valid_rate_drop": d,
                  "valid_lost": v_lost, "valid_gained": v_gained, "valid_rate_drop_ci95": ci}
            gates.append({"metric": "valid_rate_drop", "value": d, "limit": max_drop, "ci95": ci,
                          "passed": d <= max_drop + 1e-12})
        if self.objects:
            fa = {k: f[1] / f[0] for k, f in sorted(self.fields.items())}
            m |= {"object_match_rate": self.objects_equal / self.objects, "field_agreement": fa,
                  "mean_field_agreement": float(np.mean(list(fa.values()))) if fa else None}
        return Comparison(
            base=self.base_id, candidate=self.cand_id, matched=matched, only_base=only_base, only_candidate=only_cand,
            with_reference=refs, base_accuracy=self.ok_b / refs if refs else None,
            candidate_accuracy=self.ok_c / refs if refs else None,
            accuracy_drop=(self.ok_b - self.ok_c) / refs if refs else None,
            lost=self.lost if refs else None, gained=self.gained if refs else None,
            accuracy_drop_ci95=paired_drop_ci95(self.lost, self.gained, refs) if refs else None,
            gate_metric=metric, gate_value=value, max_drop=max_drop, passed=all(g["passed"] for g in gates),
            min_cosine=min_cosine, gates=gates, structured_rows=s, object_rows=self.objects, embedding_rows=len(cos), **m)


def _check_limits(max_drop: float, min_cosine: float) -> None:
    if max_drop < 0:
        raise CompareError(f"max drop must be >= 0, got {max_drop}")
    if not -1.0 <= min_cosine <= 1.0:
        raise CompareError(f"min cosine must be between -1 and 1, got {min_cosine}")


def compare_pairs(chunks: Iterable[list[Pair]], *, matched: int, only_base: int = 0, only_candidate: int = 0,
                  ids: tuple[str, str] = ("base", "candidate"), max_drop: float = DEFAULT_MAX_DROP,
                  min_cosine: float = DEFAULT_MIN_COSINE, show: int = 5) -> Comparison:
    """Compare chunks of (id, base row, candidate row or None: missing), each row a dict of COLUMNS
    (any may be absent); `matched`, the `only_*` counts and `ids` (base, candidate) are the caller's."""
    _check_limits(max_drop, min_cosine)
    base_id, cand_id = ids
    if not matched:
        raise CompareError(f"jobs {base_id!r} and {cand_id!r} have no output ids in common")
    t = _Tally(base_id, cand_id, show)
    for pairs in chunks:
        t.add(pairs)
    return t.result(matched, only_base, only_candidate, max_drop, min_cosine)


def compare_rows(base: dict[str, dict[str, Any]], cand: dict[str, dict[str, Any]], *, base_id: str = "base",
                 cand_id: str = "candidate", max_drop: float = DEFAULT_MAX_DROP,
                 min_cosine: float = DEFAULT_MIN_COSINE, show: int = 5) -> Comparison:
    """Compare outputs keyed by id (each a dict with `text` and optionally `reference`,
    `valid`, `parsed`, `embedding`).

    A base row with no candidate counts as a wrong, fully different, invalid candidate
    answer, so dropping rows cannot improve the score."""
    keys = sorted(base)
    matched = len(set(base) & set(cand))
    chunks = ([(i, base[i], cand.get(i)) for i in keys[k:k + CHUNK_ROWS]] for k in range(0, len(keys), CHUNK_ROWS))
    return compare_pairs(chunks, matched=matched, only_base=len(base) - matched, only_candidate=len(cand) - matched,
                         ids=(base_id, cand_id), max_drop=max_drop, min_cosine=min_cosine, show=show)


def finished_job(eng, job_id: str) -> dict[str, Any]:
    """A finished job's row; raises CompareError for a missing or unfinished job."""
    from tokenmill.schemas import storage as S

    job = S.JobStore(eng).get(job_id)
    if job is None:
        raise CompareError(f"no job with id {job_id!r}")
    if job["status"] in ("pending", "running"):
        raise CompareError(f"job {job_id!r} is {job['status']}; compare finished jobs")
    return job


def output_counts(eng, base_id: str, cand_id: str) -> tuple[int, int, int]:
    """(base rows, candidate rows, ids in both), sample 0 only."""
    o, b, c = T.outputs, T.outputs.alias("b"), T.outputs.alias("c")
    count = lambda job: select(func.count()).select_from(o).where(o.c.job_id == job, o.c.sample == 0)  # noqa: E731
    both = (select(func.count()).select_from(b.join(c, and_(c.c.job_id == cand_id, c.c.id == b.c.id, c.c.sample == 0)))
            .where(b.c.job_id == base_id, b.c.sample == 0))
    with eng.connect() as conn:
        nb, nc, n = conn.execute(select(count(base_id).scalar_subquery(), count(cand_id).scalar_subquery(),
                                        both.scalar_subquery())).one()
    return int(nb), int(nc), int(n)


def job_pairs(eng, base_id: str, cand_id: str) -> Iterator[list[Pair]]:
    """Sample 0 of each base row, by id, beside the candidate's row of that id (None: it has
    none), in chunks of CHUNK_ROWS; each row a dict of the COLUMNS the table has."""
    b, c = T.outputs.alias("b"), T.outputs.alias("c")
    cols = [k for k in COLUMNS if k in T.outputs.c]
    q = (select(b.c.id, *(b.c[k].label(f"b_{k}") for k in cols), c.c.id.label("c_id"),
                *(c.c[k].label(f"c_{k}") for k in cols))
         .select_from(b.outerjoin(c, and_(c.c.job_id == cand_id, c.c.id == b.c.id, c.c.sample == 0)))
         .where(b.c.job_id == base_id, b.c.sample == 0).order_by(b.c.id))
    with eng.connect() as conn:
        res = conn.execution_options(stream_results=True, yield_per=CHUNK_ROWS).execute(q).mappings()
        for part in res.partitions(CHUNK_ROWS):
            yield [(r["id"], {k: r[f"b_{k}"] for k in cols},
                    None if r["c_id"] is None else {k: r[f"c_{k}"] for k in cols}) for r in part]


def compare_jobs(eng, base_id: str, cand_id: str, *, max_drop: float = DEFAULT_MAX_DROP,
                 min_cosine: float = DEFAULT_MIN_COSINE, show: int = 5) -> Comparison:
    """Compare two jobs stored in the same database (see module docstring for the measures)."""
    finished_job(eng, base_id)
    finished_job(eng, cand_id)
    nb, nc, matched = output_counts(eng, base_id, cand_id)
    if not nb:
        raise CompareError(f"base job {base_id!r} has no outputs")
    return compare_pairs(job_pairs(eng, base_id, cand_id), matched=matched, only_base=nb - matched,
                         only_candidate=nc - matched, ids=(base_id, cand_id), max_drop=max_drop,
                         min_cosine=min_cosine, show=show)


def format_comparison(c: Comparison) -> str:
    pct = lambda v: "-" if v is None else f"{v:.1%}"  # noqa: E731
    lines = [
        f"compare {c.candidate} against {c.base}: {c.matched} rows matched by id"
        + (f" ({c.only_base} only in base, {c.only_candidate} only in candidate)" if c.only_base or c.only_candidate else ""),
    ]
    if c.word_similarity is not None:
        lines.append(f"  exact match {pct(c.exact_match_rate)}, word similarity {c.word_similarity:.3f}")
    if c.with_reference and c.accuracy_drop_ci95 is not None:  # the interval is set whenever there are references
        lines.append(
            f"  accuracy vs reference ({c.with_reference} rows): base {pct(c.base_accuracy)}, "
            f"candidate {pct(c.candidate_accuracy)}, drop {c.accuracy_drop:+.1%} "
            f"(lost {c.lost}, gained {c.gained}; 95% interval {c.accuracy_drop_ci95[0]:+.1%} to {c.accuracy_drop_ci95[1]:+.1%})"
        )
    if c.structured_rows and c.valid_rate_drop_ci95:
        lo, hi = c.valid_rate_drop_ci95
        lines.append(
            f"  schema-valid ({c.structured_rows} structured rows): base {pct(c.base_valid_rate)}, "
            f"candidate {pct(c.candidate_valid_rate)}, drop {c.valid_rate_drop:+.1%} "
            f"(lost {c.valid_lost}, gained {c.valid_gained}; 95% interval {lo:+.1%} to {hi:+.1%})"
        )
    if c.object_rows and c.field_agreement:
        low = sorted(c.field_agreement.items(), key=lambda kv: (kv[1], kv[0]))[:8]
        lines.append(f"  JSON fields ({c.object_rows} rows with two objects): equal objects {pct(c.object_match_rate)}, "
                     f"mean field agreement {pct(c.mean_field_agreement)} (lowest: "
                     + ", ".join(f"{k} {pct(v)}" for k, v in low) + ")")
    if c.embedding_rows:
        dim = f", dimension {c.embedding_dim}" if c.embedding_dim is not None else ""
        lines.append(f"  cosine similarity ({c.embedding_rows} rows{dim}): mean {c.cosine_mean:.4f}, "
                     f"p5 {c.cosine_p5:.4f}, min {c.cosine_min:.4f}"
                     + (f"; {c.embedding_missing} rows with a vector in one job only, scored 0" if c.embedding_missing else ""))
    for g in c.gates:
        verdict = "PASS" if g["passed"] else "FAIL"
        if g["metric"] == "mean_cosine":
            lines.append(f"  gate: mean_cosine {g['value']:.4f} (at least {g['limit']:.4f}): {verdict}")
        else:
            lines.append(f"  gate: {g['metric']} {g['value']:.1%} (allowed {g['limit']:.1%}): {verdict}")
    for r in c.worst:
        if "cosine" in r:
            if r["cosine"] < 1.0:
                lines.append(f"    {r['id']}: cosine {r['cosine']:.4f}")
        elif r["similarity"] < 1.0:
            lines.append(f"    {r['id']}: {(r['base'] or '')[:60]!r} → {(r['candidate'] or '')[:60]!r}")
    return "\n".join(lines)
