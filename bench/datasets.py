"""Reproducible prompt datasets: the bundled demo sample and the benchmark workloads.

Seeded generators only (no downloads).  The texts are varied, realistic
requests with shared system prompts, mixed lengths and a long tail.
"""

from __future__ import annotations

import random
from typing import Any, Iterator

SYSTEM_PROMPTS = {
    "support": (
        "You are a patient customer support agent for Northwind Outdoor Gear. Answer briefly and politely. "
        "If an order number is mentioned, repeat it back. Never invent policies: returns are accepted within "
        "30 days with a receipt, shipping is free above 50 dollars, and warranty claims need a photo of the damage. "
        "Store credit is offered for returns without a receipt. Orders ship within two business days from our "
        "warehouse in Denver; express shipping costs 15 dollars and arrives in one to two days. Customers in Alaska "
        "and Hawaii pay a flat 20 dollar shipping fee. Gift cards cannot be refunded. If a customer is upset, "
        "apologize once, then focus on the next concrete step they can take."
    ),
    "code": (
        "You are a senior Python engineer reviewing code for a small team. Explain problems plainly, suggest the "
        "smallest fix, and show corrected code when it helps. Prefer the standard library. Point out bugs before "
        "style issues. Mention edge cases such as empty inputs, None values, very large inputs and concurrency. "
        "Do not rewrite working code only to match your taste. When a function has side effects, say so. When you "
        "suggest a test, write it with pytest. Keep answers under two hundred words unless the code is long. "
        "If the code is already correct, say so in one sentence and stop. Assume Python 3.11 and type hints."
    ),
    "summarize": (
        "You summarize documents for busy readers. Give the main point first, then at most three supporting "
        "points. Keep names, numbers and dates exact. Do not add opinions or facts that are not in the document. "
        "If the document is a meeting record, list decisions separately from discussion. If the document is a "
        "financial report, lead with revenue, costs and the outlook. Write in plain English for a reader who has "
        "two minutes, and never exceed one hundred and twenty words. If something in the document is "
        "unclear or contradictory, say so in one short sentence at the end instead of guessing what was meant. Use short, direct sentences throughout."
    ),
    "tutor": "You are a friendly tutor for high-school students. Explain step by step and check understanding.",
}

TOPICS = [
    "photosynthesis", "the French Revolution", "compound interest", "how vaccines work", "plate tectonics",
    "the water cycle", "binary search", "supply and demand", "the Pythagorean theorem", "black holes",
    "the printing press", "machine learning", "climate change", "the immune system", "electric cars",
    "the Roman Empire", "recursion", "inflation", "volcanoes", "DNA replication",
]
PRODUCTS = ["tent", "sleeping bag", "hiking boots", "rain jacket", "camping stove", "backpack", "headlamp"]
ISSUES = [
    "arrived with a broken zipper", "is the wrong size", "never arrived", "leaks in the rain",
    "stopped working after two trips", "was charged twice", "is missing a part",
]
CODE_SNIPPETS = [
    "def mean(xs):\n    return sum(xs) / len(xs)\n",
    "for i in range(len(items)):\n    if items[i] == target:\n        del items[i]\n",
    "def read(path):\n    f = open(path)\n    return f.read()\n",
    "cache = {}\ndef fib(n):\n    if n < 2: return n\n    return fib(n-1) + fib(n-2)\n",
    "import json\ndef load(s):\n    try:\n        return json.loads(s)\n    except:\n        return None\n",
]
SENTENCES = [
    "The committee met on Tuesday to review the quarterly budget.",
    "Revenue grew by 12 percent compared with the same period last year.",
    "Several members raised concerns about rising maintenance costs.",
    "The new warehouse in Leeds is expected to open in March.",
    "Customer complaints fell after the support team was expanded.",
    "A pilot program for electric delivery vans will start in two cities.",
    "The board approved a hiring freeze for non-essential roles.",
    "Analysts expect demand to slow during the winter months.",
    "The company signed a five-year lease for new office space.",
    "Training sessions on the new inventory system begin next week.",
    "Energy prices remain the largest source of uncertainty.",
    "The audit found no material weaknesses in financial controls.",
]


def _document(rng: random.Random, n_sentences: int) -> str:
    return " ".join(rng.choice(SENTENCES) for _ in range(n_sentences))


def sample_chat_rows(n: int = 240, seed: int = 7) -> list[dict[str, Any]]:
    """Mixed chat prompts: four shared system prompts, short to long user turns (long tail)."""
    return list(iter_chat_rows(n, seed=seed))


def iter_chat_rows(n: int = 240, seed: int = 7) -> Iterator[dict[str, Any]]:
    """sample_chat_rows's rows, the same ones in the same order, one at a time (bounded
    memory at any `n`; row i depends only on the rows before it, so a prefix of a longer
    run is the shorter run)."""
    rng = random.Random(seed)
    for i in range(n):
        kind = rng.choices(["support", "code", "summarize", "tutor", "plain"], weights=[3, 2, 2, 3, 2])[0]
        if kind == "support":
            user = (
                f"Hi, my {rng.choice(PRODUCTS)} {rng.choice(ISSUES)}. Order number {rng.randint(10000, 99999)}. "
                "What can I do?"
            )
        elif kind == "code":
            user = f"Can you review this?\n\n{rng.choice(CODE_SNIPPETS)}"
        elif kind == "summarize":
            # long tail: most documents are a few sentences, some are long
            k = int(min(60, rng.paretovariate(1.3) * 3))
            user = "Summarize this report:\n\n" + _document(rng, max(2, k))
        elif kind == "tutor":
            user = f"Can you explain {rng.choice(TOPICS)} to me in simple terms?"
        else:
            user = rng.choice(
                [
                    f"Write a haiku about {rng.choice(TOPICS)}.",
                    f"Give me three facts about {rng.choice(TOPICS)}.",
                    f"What is {rng.randint(2, 20)} times {rng.randint(2, 20)}?",
                    "What is the capital of France?",
                ]
            )
        messages = ([{"role": "system", "content": SYSTEM_PROMPTS[kind]}] if kind != "plain" else []) + [
            {"role": "user", "content": user}
        ]
        yield {"id": f"sample-{i:04d}", "messages": messages, "max_tokens": rng.choice([32, 48, 64, 96])}


def write_rows(rows: list[dict[str, Any]], path: str, row_group_size: int | None = None) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=row_group_size)
