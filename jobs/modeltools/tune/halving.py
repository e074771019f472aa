"""Successive halving with the tie rule, over figures the caller measures (no engine, no
database): every candidate runs on a small sample, the cheaper half of those that pass the
gate runs on one twice as large, and a difference is a win only beyond the runs' noise."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable

from tokenmill.jobs.modeltools.tune.common import REFERENCE, CandidateFailed, TuneError, mean


def beats(a: list[float], b: list[float]) -> bool:
    """Whether figures `a` are lower than figures `b` beyond their noise: every repetition
    of `a` below every repetition of `b` (the two ranges do not overlap)."""
    return bool(a) and bool(b) and max(a) < min(b)


def tied(a: list[float], b: list[float]) -> bool:
    return not beats(a, b) and not beats(b, a)


@dataclass
class Entry:
    """One candidate at one sample size: its repetitions' figures and the gate's verdict."""

    runs: list[dict[str, Any]] = field(default_factory=list)
    passed: bool | None = None
    loss: float | None = None
    gate_metric: str | None = None
    comparison: dict[str, Any] | None = None

    def values(self, name: str = "cost") -> list[float]:
        return [r[name] for r in self.runs if r.get(name) is not None]


def _mean_cost(e: Entry) -> float:
    """The mean of an entry's costs, which rank the candidates: every run measured has one
    (the tuner fails a run without)."""
    cost = mean(e.values())
    if cost is None:
        raise TuneError("a candidate that passed the gate has no cost to rank it by")
    return cost


def halve(entries: dict[str, Entry]) -> tuple[list[str], dict[str, str]]:
    """(kept, dropped → why) after one rung: the cheaper half (rounded up) of the candidates
    that pass the gate, by mean cost, plus every passing candidate tied with the last one
    kept (a difference inside the noise is no reason to drop it)."""
    passing = sorted((k for k, e in entries.items() if e.passed), key=lambda k: _mean_cost(entries[k]))
    dropped = {k: "failed the gate" for k, e in entries.items() if not e.passed}
    keep = passing[: math.ceil(len(passing) / 2)]
    if keep:
        last = entries[keep[-1]].values()
        keep += [k for k in passing[len(keep):] if tied(entries[k].values(), last)]
    for k in passing:
        if k not in keep:
            dropped[k] = "costlier half"
    return keep, dropped


@dataclass
class Verdict:
    """The search's outcome at the last sample size every remaining candidate finished."""

    size: int | None
    winner: str
    """A candidate key, or `ref` when none passing the gate is cheaper beyond the noise."""
    best: str | None
    """The cheapest passing candidate by mean cost (may be tied with the reference)."""
    tied_with_best: list[str]
    """Other passing candidates whose cost is tied with the best's."""
    beats_reference: bool


def pick(ref: Entry, entries: dict[str, Entry], size: int | None) -> Verdict:
    """The cheapest passing candidate wins only if it beats the reference beyond the noise;
    otherwise the spec as given stays (`winner` = `ref`)."""
    passing = sorted((k for k, e in entries.items() if e.passed and e.values()),
                     key=lambda k: _mean_cost(entries[k]))
    if not passing:
        return Verdict(size, REFERENCE, None, [], False)
    best = passing[0]
    ties = [k for k in passing[1:] if tied(entries[k].values(), entries[best].values())]
    wins = beats(entries[best].values(), ref.values())
    return Verdict(size, best if wins else REFERENCE, best, ties, wins)


@dataclass
class SearchLog:
    """Everything the search measured: `entries[key][size]`, and why each candidate stopped."""

    sizes: list[int]
    entries: dict[str, dict[int, Entry]] = field(default_factory=dict)
    outcome: dict[str, str] = field(default_factory=dict)
    dropped_at: dict[str, int] = field(default_factory=dict)
    stopped: str | None = None
    """Why the search stopped before its last rung (the budget), or None."""
    verdict: Verdict | None = None

    def entry(self, key: str, size: int) -> Entry:
        return self.entries.setdefault(key, {}).setdefault(size, Entry())

    def decided(self) -> Verdict:
        """The verdict, which `search` sets before it returns."""
        if self.verdict is None:
            raise TuneError("the search has no verdict yet")
        return self.verdict

    def last_size(self, key: str) -> int | None:
        done = [s for s, e in self.entries.get(key, {}).items() if e.runs]
        return max(done) if done else None


def search(keys: list[str], sizes: list[int], *, repeats: int,
           measure: Callable[[str, int, int], dict[str, Any]],
           gate: Callable[[str, int], tuple[bool, float, str, dict[str, Any] | None]],
           rung_fits: Callable[[int, int], bool] = lambda size, jobs: True,
           job_fits: Callable[[], bool] = lambda: True) -> SearchLog:
    """Successive halving over `keys` (the reference, `ref`, runs at every rung).

    `measure(key, size, rep)`: one run's figures (`figures_of`), or CandidateFailed;
    `gate(key, size)`: (passed, loss, measure used, comparison) against the reference's run;
    `rung_fits(size, jobs)`: whether the budget left holds a rung of `jobs` runs of `size`
    rows; `job_fits()`: whether it holds one more run.  Runs are interleaved: every
    candidate's first repetition, then every candidate's second, and so on."""
    if repeats < 2:
        raise TuneError(f"every figure is measured at least twice (repeats >= 2), got {repeats}")
    log = SearchLog(sizes=sizes)
    alive = [k for k in keys if k != REFERENCE]
    complete: int | None = None
    for i, size in enumerate(sizes):
        if i > 0 and not rung_fits(size, repeats * (len(alive) + 1)):
            log.stopped = f"the budget left does not hold the {size}-row rung"
            break
        failed: dict[str, str] = {}
        for rep in range(repeats):
            for key in [REFERENCE, *alive]:
                if key in failed:
                    continue
                if not job_fits():
                    log.stopped = f"the budget ran out during the {size}-row rung"
                    break
                try:
                    log.entry(key, size).runs.append({**measure(key, size, rep), "rep": rep})
                except CandidateFailed as err:
                    if key == REFERENCE:
                        raise TuneError(f"the spec as given failed on the {size}-row sample: {err}") from None
                    failed[key] = str(err)
            if log.stopped:
                break
        if log.stopped:  # an unfinished rung decides nothing (its jobs stay in the database for a rerun)
            for by_size in log.entries.values():
                by_size.pop(size, None)
            break
        complete = size
        for key, why in failed.items():
            log.outcome[key], log.dropped_at[key] = f"failed: {why}", size
        alive = [k for k in alive if k not in failed]
        for key in alive:
            e = log.entry(key, size)
            e.passed, e.loss, e.gate_metric, e.comparison = gate(key, size)
        if i == len(sizes) - 1:
            break
        keep, dropped = halve({k: log.entry(k, size) for k in alive})
        for key, why in dropped.items():
            log.outcome[key], log.dropped_at[key] = why, size
        alive = keep
        if not alive:
            break
    if complete is None:
        log.verdict = Verdict(None, REFERENCE, None, [], False)
    else:
        at = {k: log.entry(k, complete) for k in alive}
        log.verdict = pick(log.entry(REFERENCE, complete), at, complete)
    ref_costs = log.entry(REFERENCE, complete).values() if complete else []
    for key in alive:
        if key == log.verdict.winner:
            log.outcome[key] = "winner"
        elif key == log.verdict.best and complete is not None:  # a best only when a rung completed
            costs = log.entry(key, complete).values()
            log.outcome[key] = ("passed; costlier than the reference" if beats(ref_costs, costs)
                                else "passed; tied with the reference")
        elif key in log.verdict.tied_with_best:
            log.outcome[key] = "passed; tied with the best"
        else:
            last = log.entry(key, complete) if complete else None
            log.outcome[key] = ("failed the gate" if last is not None and last.passed is False
                                else "passed; costlier" if last is not None and last.passed else "not finished")
        if log.stopped and complete is not None and key not in log.dropped_at:
            log.outcome[key] += f" (stopped at {complete} rows: {log.stopped})"
    log.outcome[REFERENCE] = "winner" if log.verdict.winner == REFERENCE else "reference"
    return log
