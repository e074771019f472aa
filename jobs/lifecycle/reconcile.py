"""The reconcile's words when a job's rows do not add up: which input rows ended in neither
the outputs nor the dead letters, and which in more than one place, named by their
`file:row` references beside the counts."""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import groupby
from typing import Iterable, Iterator

from tokenmill.schemas import storage as S
from tokenmill.schemas.records import format_ref

#: Rows named in each list; the rest are counted.
NAMED = 10


@dataclass
class Tally:
    """The first NAMED lines of a kind, and how many there were."""

    named: list[str] = field(default_factory=list)
    count: int = 0

    def add(self, line: str) -> None:
        self.count += 1
        if len(self.named) < NAMED:
            self.named.append(line)

    def __str__(self) -> str:
        more = f" and {self.count - len(self.named)} more" if self.count > len(self.named) else ""
        return ", ".join(self.named) + more


def misplaced(expected: Iterable[tuple[int, range]], placed: Iterator[tuple[int, int, str]]) -> tuple[Tally, Tally]:
    """Merge the input's rows (`expected`: (file, rows) runs) with where rows ended (`placed`,
    in input order, as `MetricsReader.placed_rows` streams them).  Returns (rows in no place,
    rows in more than one place or not in the input); memory is bounded by NAMED."""
    want = ((f, r) for f, rows in sorted(expected, key=lambda e: (e[0], e[1].start)) for r in rows)
    missing, extra = Tally(), Tally()
    nxt = next(want, None)
    for at, group in groupby(placed, key=lambda p: (p[0], p[1])):
        where = [p[2] for p in group]
        while nxt is not None and nxt < at:
            missing.add(format_ref(*nxt))
            nxt = next(want, None)
        if nxt == at:
            nxt = next(want, None)
            if len(where) > 1:
                extra.add(f"{format_ref(*at)} is in {len(where)} places ({', '.join(where)})")
        else:
            extra.add(f"{format_ref(*at)} ({', '.join(where)}) is not an input row")
    while nxt is not None:
        missing.add(format_ref(*nxt))
        nxt = next(want, None)
    return missing, extra


def mismatch_note(eng, job_id: str, plan, counts: dict[str, int]) -> str:
    """The failed reconcile's one line: the counts, then the rows in no place and the rows in
    more than one, named (the first NAMED of each)."""
    c = counts
    note = (f"row count mismatch: {plan.total_rows} input rows but {c['succeeded']} outputs + "
            f"{c['failed']} dead letters = {c['succeeded'] + c['failed']}")
    missing, extra = misplaced(((s.file_index, s.rows) for s in plan.shards), S.MetricsReader(eng).placed_rows(job_id))
    if missing.count:
        note += f"; in neither file: {missing}"
    if extra.count:
        note += f"; {extra}"
    return note
