"""The small evaluation set with reference answers (`data/eval_set.parquet`).

Short arithmetic, capital cities and one-word facts: questions the default model
(SmolLM2-135M-Instruct) partly solves, so a quantized or otherwise "optimized"
run can be checked against the full-precision one with `tokenmill compare`.
References use `a|b` for accepted alternatives (see jobs/modeltools/compare.py).

Regenerate with `python -m bench.evalset [OUT]`; the rows are fixed
(seeded), so the file is reproducible.
"""

from __future__ import annotations

import random
import sys
from pathlib import Path
from typing import Any

CAPITALS = [
    ("France", "Paris"), ("Japan", "Tokyo"), ("Italy", "Rome"), ("Germany", "Berlin"), ("Spain", "Madrid"),
    ("the United Kingdom", "London"), ("Egypt", "Cairo"), ("Russia", "Moscow"), ("China", "Beijing"),
    ("Canada", "Ottawa"), ("Australia", "Canberra"), ("Greece", "Athens"), ("Portugal", "Lisbon"),
    ("Ireland", "Dublin"), ("Norway", "Oslo"), ("Sweden", "Stockholm"), ("Poland", "Warsaw"),
    ("Austria", "Vienna"), ("Kenya", "Nairobi"), ("Argentina", "Buenos Aires"),
]

FACTS = [
    ("How many days are there in a week?", "7|seven"),
    ("How many legs does a spider have?", "8|eight"),
    ("How many continents are there on Earth?", "7|seven"),
    ("What is the largest planet in our solar system?", "Jupiter"),
    ("Which planet is known as the Red Planet?", "Mars"),
    ("Who wrote Romeo and Juliet?", "Shakespeare"),
    ("What is the chemical symbol for gold?", "Au"),
    ("What gas do plants absorb from the air for photosynthesis?", "carbon dioxide|CO2"),
    ("What is the freezing point of water in degrees Celsius?", "0|zero"),
    ("What is the boiling point of water in degrees Celsius?", "100|one hundred"),
    ("How many hours are there in a day?", "24|twenty-four"),
    ("What color is the sky on a clear day?", "blue"),
    ("What is the largest ocean on Earth?", "Pacific"),
    ("How many sides does a triangle have?", "3|three"),
    ("What is the opposite of hot?", "cold"),
    ("Which animal is known as the king of the jungle?", "lion"),
    ("How many minutes are there in an hour?", "60|sixty"),
    ("What is the tallest mountain in the world?", "Everest"),
    ("What language is mainly spoken in Brazil?", "Portuguese"),
    ("What is frozen water called?", "ice"),
]

SYSTEM = "Answer the question in one short sentence."


def _arithmetic(rng: random.Random, n: int) -> list[tuple[str, str]]:
    out = []
    ops = [("+", lambda a, b: a + b), ("-", lambda a, b: a - b), ("*", lambda a, b: a * b)]
    while len(out) < n:
        sym, fn = ops[len(out) % 3]
        a, b = (rng.randint(2, 9), rng.randint(2, 9)) if sym == "*" else (rng.randint(2, 50), rng.randint(1, 40))
        if sym == "-" and b > a:
            a, b = b, a
        out.append((f"What is {a} {sym} {b}?", str(fn(a, b))))
    return out


def eval_rows(seed: int = 5) -> list[dict[str, Any]]:
    """The evaluation rows: id, category, messages (system + user) and reference."""
    rng = random.Random(seed)
    items: list[tuple[str, str, str]] = []
    items += [("arith", q, r) for q, r in _arithmetic(rng, 20)]
    items += [("capital", f"What is the capital of {c}?", a) for c, a in CAPITALS]
    items += [("fact", q, r) for q, r in FACTS]
    rows = []
    counts: dict[str, int] = {}
    for cat, q, ref in items:
        counts[cat] = counts.get(cat, 0) + 1
        rows.append({
            "id": f"{cat}-{counts[cat]:02d}",
            "category": cat,
            "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}],
            "reference": ref,
        })
    return rows


def write_eval_set(path: str | Path) -> Path:
    """Write the evaluation set as Parquet (columns id, category, messages, reference)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(eval_rows()), p)
    return p


if __name__ == "__main__":
    print(write_eval_set(sys.argv[1] if len(sys.argv) > 1 else "data/eval_set.parquet"))
