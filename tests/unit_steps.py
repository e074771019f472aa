"""The steps a worker takes with one work unit, through the pipeline's own functions and in
the pipeline's order, each one callable on its own so a test can interleave the steps of
several units (or run units in separate processes) and check where every row ends:

1. claim: ClaimIds (each row's id claimed in `id_claims`);
2. dedup: DedupIds (a row that is not its id's claim is a dead letter, written as
   WriteDeadLetters writes it);
3. skip: SkipDone (what a rerun or a late duplicate leaves to run);
4. commit: Generate's commit of the rows left, one batch (`ResultWriter.commit_batch`).

No pipeline runs: the DoFns' `process` and the storage calls are called directly."""

from __future__ import annotations

from typing import Callable

from apache_beam.pvalue import TaggedOutput
from sqlalchemy import text

from tokenmill.schemas import storage as S
from tokenmill.schemas.records import Chunk, DeadLetterRow, OutputRow, PromptRecord
from tokenmill.transforms.dedup import ClaimIdsFn, DedupIdsFn
from tokenmill.transforms.resume import undone
from tokenmill.transforms.write import dead_row

STEPS = ("claim", "dedup", "skip", "commit")


class UnitRun:
    """One unit's rows `(id, input_file, input_row)` taken through the four steps."""

    def __init__(self, db_url: str, job_id: str, rows: list[tuple[str, int, int]], unit: str = "u"):
        self.url, self.job_id, self.rows = db_url, job_id, rows
        self.chunk: Chunk | None = Chunk(unit, [PromptRecord(id=i, input_file=f, input_row=r, prompt=f"q{r}")
                                                for i, f, r in rows])
        self._unit = unit

    def step(self, name: str) -> None:
        getattr(self, name)()

    def claim(self) -> None:
        raw = Chunk(self._unit, [{"_file_index": f, "_row": r, "id": i, "prompt": f"q{r}"} for i, f, r in self.rows])
        list(ClaimIdsFn(self.url, self.job_id).process(raw))

    def dedup(self) -> None:
        assert self.chunk is not None
        out = list(DedupIdsFn(self.url, self.job_id).process(self.chunk))
        dead = [o.value for o in out if isinstance(o, TaggedOutput)]
        kept = [o for o in out if isinstance(o, Chunk)]
        S.ResultWriter(S.connect(self.url)).insert_rows(DeadLetterRow, [dead_row(self.job_id, d) for d in dead])
        self.chunk = kept[0] if kept else None

    def skip(self) -> None:
        if self.chunk is not None:
            self.chunk = undone(S.connect(self.url), self.job_id, self.chunk)

    def commit(self) -> None:
        if self.chunk is None:
            return
        outs = [OutputRow(job_id=self.job_id, id=p.id, input_file=p.input_file, input_row=p.input_row,
                          text=f"answer {p.input_row}", finish_reason="stop", model="m").as_dict()
                for p in self.chunk.items]
        S.ResultWriter(S.connect(self.url)).commit_batch(outs, [], [])


def run_interleaved(runs: list[UnitRun], order: list[int], pause: Callable[[], None] | None = None) -> None:
    """Run the units' steps in `order`: each entry names a unit, which takes its next step
    (`pause` called before each step)."""
    at = [0] * len(runs)
    for k in order:
        if pause is not None:
            pause()
        runs[k].step(STEPS[at[k]])
        at[k] += 1


def placement_problems(db_url: str, job_id: str, rows: list[tuple[str, int, int]]) -> list[str]:
    """What breaks "every input row ends in exactly one place, each id answered once by its first
    row": one line per problem, [] when none."""
    with S.connect(db_url).connect() as conn:
        outs = [tuple(r) for r in conn.execute(text(
            "SELECT id, input_file, input_row FROM outputs WHERE job_id = :j AND sample = 0"), {"j": job_id})]
        dead = [tuple(r) for r in conn.execute(text(
            "SELECT input_file, input_row FROM dead_letters WHERE job_id = :j"), {"j": job_id})]
    places: dict[tuple[int, int], int] = {}
    for _, f, r in outs:
        places[(f, r)] = places.get((f, r), 0) + 1
    for f, r in dead:
        places[(f, r)] = places.get((f, r), 0) + 1
    problems = [f"row {f}:{r} ({i}) is in {places.get((f, r), 0)} places" for i, f, r in rows
                if places.get((f, r), 0) != 1]
    first: dict[str, tuple[int, int]] = {}
    for i, f, r in rows:
        first[i] = min(first.get(i, (f, r)), (f, r))
    answered = sorted((i, (f, r)) for i, f, r in outs)
    if answered != sorted(first.items()):
        problems.append(f"answers {answered} are not each id's first row {sorted(first.items())}")
    return problems


def random_units(rng, ids: int, *, files: int = 1, rows_per_id: int = 4, unit_rows: int = 6,
                 positions: int = 10**6) -> tuple[list[tuple[str, int, int]], list[list[tuple[str, int, int]]]]:
    """Rows `(id, input_file, input_row)` of `ids` ids (1 to `rows_per_id` rows each, at random
    places, no two at one place), shuffled and cut into units of 1 to `unit_rows` rows."""
    rows = [(f"i{k}", rng.randrange(files), rng.randrange(positions)) for k in range(ids)
            for _ in range(rng.randint(1, rows_per_id))]
    rows = list({(f, r): (i, f, r) for i, f, r in rows}.values())
    rng.shuffle(rows)
    units, at = [], 0
    while at < len(rows):
        n = rng.randint(1, unit_rows)
        units.append(rows[at:at + n])
        at += n
    return rows, units


def interleavings(lengths: list[int]) -> list[list[int]]:
    """Every order of the units' steps that keeps each unit's own steps in order."""
    if not any(lengths):
        return [[]]
    out = []
    for k, n in enumerate(lengths):
        if n:
            rest = list(lengths)
            rest[k] -= 1
            out += [[k] + tail for tail in interleavings(rest)]
    return out


def run_units_in_process(db_url: str, job_id: str, units: list[list[tuple[str, int, int]]], seed: int,
                         max_delay_s: float = 0.004) -> int:
    """A worker process's share of a stress run: its units' steps, interleaved at random, with a
    random delay before each.  Returns the steps taken."""
    import random
    import time

    rng = random.Random(seed)
    runs = [UnitRun(db_url, job_id, u, unit=f"{seed}.{k}") for k, u in enumerate(units)]
    order = [k for k in range(len(runs)) for _ in STEPS]
    rng.shuffle(order)  # each entry is "this unit's next step", so a unit's own steps stay in order
    run_interleaved(runs, order, pause=lambda: time.sleep(rng.uniform(0, max_delay_s)))
    return len(order)
