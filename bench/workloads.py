"""Seeded benchmark workloads, written as Parquet in tokenmill's input schema
(`id`, `messages` as JSON, optional per-row `max_tokens`).

(a) `chat`: mixed-length chat prompts with a long tail (log-normal user turns
    behind one of a few system prompts);
(b) `shared_prefix`: documents of a few hundred tokens, several questions per
    document, rows shuffled;
(c) `long_output`: short prompts with long, varied output lengths.

Text is drawn from a fixed word list with a seeded RNG, so the same seed gives
the same file on any machine.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

WORDS = (
    "the of and to in is was that for on as with by he at from his an were are which this be "
    "or has had not but first one their its new after who they have her she two been other when "
    "there all during into school time may years more most only over city some world would where "
    "later up such used many can state about national out known university united then made "
    "river water system energy market policy report study method model data network process "
    "light field power value signal engine budget token prefix cache batch worker memory queue "
    "garden morning winter harbor village mountain forest letter history music science theory "
    "number family company region travel health season library window kitchen station bridge "
    "quickly slowly carefully rarely often always never together almost perhaps however therefore "
    "explain describe compare summarize translate list evaluate suggest improve analyze"
).split()


@dataclass(frozen=True)
class Workload:
    name: str
    path: Path
    rows: int
    max_tokens: int
    """Job-wide max_tokens (rows may override it with their own `max_tokens`)."""
    description: str


def _text(rng: random.Random, n_words: int) -> str:
    words = [rng.choice(WORDS) for _ in range(max(1, n_words))]
    out, sent = [], []
    for w in words:
        sent.append(w)
        if len(sent) >= rng.randint(8, 16):
            out.append(" ".join(sent).capitalize() + ".")
            sent = []
    if sent:
        out.append(" ".join(sent).capitalize() + ".")
    return " ".join(out)


def _write(rows: list[dict], path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path)


def chat(path: Path, n: int, *, seed: int = 1, max_tokens: int = 32) -> Workload:
    """Mixed-length chat: user turns log-normal (median ~40 words, tail to ~700)."""
    rng = random.Random(seed)
    systems = [_text(rng, rng.randint(20, 60)) for _ in range(4)]
    rows = []
    for i in range(n):
        words = min(700, max(3, int(rng.lognormvariate(3.7, 0.9))))
        msgs = [{"role": "system", "content": rng.choice(systems)}, {"role": "user", "content": _text(rng, words)}]
        rows.append({"id": f"a{i}", "messages": json.dumps(msgs)})
    _write(rows, path)
    return Workload("chat", path, n, max_tokens, "mixed-length chat, log-normal user turns (median ~40 words, max 700)")


def shared_prefix(path: Path, docs: int, questions: int, *, seed: int = 2, doc_words: int = 300,
                  max_tokens: int = 8) -> Workload:
    """`docs` documents × `questions` questions each; the document leads the user turn
    so prompts about one document share its KV blocks; rows shuffled."""
    rng = random.Random(seed)
    system = "You answer questions about the document the user gives you, briefly."
    rows = []
    for d in range(docs):
        doc = _text(rng, doc_words + rng.randint(-20, 20))
        for q in range(questions):
            msgs = [
                {"role": "system", "content": system},
                {"role": "user", "content": f"Document:\n{doc}\n\nQuestion: {_text(rng, rng.randint(6, 14))}"},
            ]
            rows.append({"id": f"b{d}-{q}", "messages": json.dumps(msgs)})
    rng.shuffle(rows)
    _write(rows, path)
    return Workload("shared_prefix", path, len(rows), max_tokens,
                    f"{docs} documents of ~{doc_words} words × {questions} questions, shuffled")


def long_output(path: Path, n: int, *, seed: int = 3, min_out: int = 32, max_out: int = 384) -> Workload:
    """Short prompts, per-row max_tokens uniform in [min_out, max_out]."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        msgs = [{"role": "user", "content": "Write a long story about " + _text(rng, rng.randint(5, 30))}]
        rows.append({"id": f"c{i}", "messages": json.dumps(msgs), "max_tokens": rng.randint(min_out, max_out)})
    _write(rows, path)
    return Workload("long_output", path, n, max_out, f"short prompts, per-row max_tokens uniform in [{min_out}, {max_out}]")
