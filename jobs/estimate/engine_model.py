"""How long the engine takes for a set of requests: a batch-level model fitted on the sample
job's own measurements, then run on the whole input (pure: no engine, no database).

The model.  An engine decodes its running sequences together, one token each per step; a
step with B sequences running takes `a + b·B` seconds, and every prompt token it prefills
(not served from its prefix cache) adds `p` seconds.  The engine runs at most `slots`
sequences (`max_num_seqs`; llama.cpp's and an HTTP engine's `max_in_flight`), and
tokenmill's batch runner admits a token-budgeted batch while the engine has a free slot, at
most `max_inflight_batches` batches at once (transforms/batch_runner.py).

Why a model and not the sample's tok/s: a sample of a few dozen rows runs the engine at a
few dozen sequences, the whole job at up to `slots`, and a step of 200 sequences does not
take 200 steps of one (nor one).  So the sample job runs at the job's concurrency (filler
rows, sample.py) and the three costs are fitted on its requests: each request's decode
window (first token → finish, from its E2E and TTFT) lasted

    D = a·S + b·Σ B + p·P

where S is its decode steps (output tokens − 1), Σ B the sequences decoding beside it summed
over those steps (S × the mean number of decode windows open during its window, its own
included, on the same worker) and P the prompt tokens prefilled during its window (those of
the requests whose first token came then: a prompt is prefilled in the step that gives its
first token).  Least squares over the requests, every cost ≥ 0 (`fit_steps`).  The fitted
model then replays the sample itself through the simulation below, and all three costs are
scaled by measured ÷ replayed generation wall (`calibrate`), so the model reproduces the
sample's own wall.  The interval also spans two alternatives: a and b fitted without p, and p
set from the time the sample's replay leaves unexplained (how prefill is told apart from
decoding is the least certain part), and the model as fitted, before the scaling (the time it
did not explain may have been a one-off of the sample's).

The simulation (`simulate`) replays requests through the slots event by event (a request's
admission, a request's finish), so it is linear in the requests whatever their lengths; a
request's prefill is added when it is admitted.  Assumed and not modelled: the KV cache
holds `slots` sequences (tokenmill sizes it so on CPU), no preemption, the machine as busy
during the job as during the sample.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from dataclasses import dataclass, replace

import numpy as np


@dataclass(frozen=True)
class StepModel:
    a: float
    """Seconds per engine step, whatever runs in it."""
    b: float
    """Seconds per step per running sequence."""
    p: float = 0.0
    """Seconds per prompt token the engine prefills (not served from its prefix cache)."""
    how: str = ""

    def describe(self) -> dict[str, float | str]:
        return {"step_s": self.a, "per_sequence_step_s": self.b, "prefill_s_per_token": self.p, "how": self.how}


@dataclass
class Windows:
    """Each request's decode window and what the engine did in it (the fit's columns)."""

    duration: np.ndarray
    steps: np.ndarray
    seq_steps: np.ndarray
    prefill: np.ndarray


def decode_windows(arrival: np.ndarray, first: np.ndarray, finish: np.ndarray, output: np.ndarray,
                   prefilled: np.ndarray, group: np.ndarray) -> Windows:
    """The fit's columns from each request's arrival, first-token and finish times, output
    tokens, prompt tokens prefilled and worker (`group`): see the module docstring."""
    first, finish = np.asarray(first, float), np.asarray(finish, float)
    same = np.asarray(group)[:, None] == np.asarray(group)[None, :]
    length = finish - first
    lo = np.maximum(first[:, None], first[None, :])
    hi = np.minimum(finish[:, None], finish[None, :])
    open_time = (np.clip(hi - lo, 0.0, None) * same).sum(axis=1)
    steps = np.maximum(np.asarray(output, float) - 1, 0)
    conc = np.where(length > 0, open_time / np.where(length > 0, length, 1.0), 1.0)
    during = same & (first[None, :] > first[:, None]) & (first[None, :] <= finish[:, None])
    return Windows(duration=length, steps=steps, seq_steps=steps * conc,
                   prefill=during.astype(float) @ np.nan_to_num(np.asarray(prefilled, float)))


def nonneg_lstsq(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares with every coefficient ≥ 0 (the best of the subsets of columns whose
    unconstrained fit is non-negative: three columns, seven subsets)."""
    best, err = np.zeros(x.shape[1]), float((y ** 2).sum())
    for m in range(1, x.shape[1] + 1):
        for cols in itertools.combinations(range(x.shape[1]), m):
            w = np.linalg.lstsq(x[:, cols], y, rcond=None)[0]
            r = float(((x[:, cols] @ w - y) ** 2).sum())
            if (w >= 0).all() and r < err:
                best, err = np.zeros(x.shape[1]), r
                best[list(cols)] = w
    return best


def fit_steps(w: Windows, *, prefill: bool = True) -> StepModel:
    """a, b and p fitted to the requests' decode windows (least squares, each ≥ 0); without
    `prefill`, a and b only (p = 0, for `calibrate` to set from what they leave unexplained)."""
    ok = np.isfinite(w.duration) & (w.steps > 0) & np.isfinite(w.seq_steps)
    if not ok.any():
        return StepModel(0.0, 0.0, how="no decode window measured (no request of the sample had two output tokens)")
    cols = [w.steps[ok], w.seq_steps[ok]] + ([w.prefill[ok]] if prefill else [])
    a, b, *rest = nonneg_lstsq(np.stack(cols, axis=1), w.duration[ok])
    p = float(rest[0]) if rest else 0.0
    conc = w.seq_steps[ok] / w.steps[ok]
    return StepModel(float(a), float(b), p,
                     how=f"step = {a * 1e3:.2f} ms + {b * 1e3:.3f} ms × running sequences"
                         + (f", {p * 1e6:.1f} µs a prefilled token" if prefill else "")
                         + f" (fitted on {int(ok.sum())} requests' decode windows at concurrency "
                           f"{conc.min():.0f}-{conc.max():.0f})")


def batches_by_budget(budget: np.ndarray, token_budget: int) -> np.ndarray:
    """Each request's batch number when the ordered requests are cut into batches of at most
    `token_budget` tokens (a request larger than the budget alone still gets one), as
    transforms/batching.pack cuts them."""
    out: np.ndarray = np.empty(len(budget), dtype=np.int64)
    b, used = 0, 0
    for i, t in enumerate(budget.tolist()):
        if used and used + t > token_budget:
            b, used = b + 1, 0
        out[i] = b
        used += t
    return out


def simulate(steps: np.ndarray, prefill: np.ndarray, batch: np.ndarray, *, slots: int, max_batches: int,
             model: StepModel) -> float:
    """Seconds one engine takes for requests (in the order they are fed) of `steps` decode
    steps each (their output tokens), `prefill` uncached prompt tokens each, fed in batches
    (`batch`: each request's batch number, non-decreasing) under the batch runner's rule."""
    step_counts: list[float] = np.asarray(steps).tolist()
    uncached: list[float] = np.asarray(prefill).tolist()
    batch_of: list[int] = np.asarray(batch).tolist()
    n = len(step_counts)
    starts = [0] + [i for i in range(1, n) if batch_of[i] != batch_of[i - 1]] + [n]
    t, step, nb, next_b = 0.0, 0, len(starts) - 1, 0
    running: list[tuple[int, int]] = []  # (finish step, batch)
    waiting: deque[int] = deque()
    left: dict[int, int] = {}  # batch → requests not finished
    in_engine = 0
    while True:
        while next_b < nb and len(left) < max_batches and (not left or in_engine < slots):
            lo, hi = starts[next_b], starts[next_b + 1]
            waiting.extend(range(lo, hi))
            left[next_b] = hi - lo
            in_engine += hi - lo
            next_b += 1
        while waiting and len(running) < slots:
            i = waiting.popleft()
            heapq.heappush(running, (step + max(1, int(step_counts[i])), batch_of[i]))
            t += model.p * uncached[i]
        if not running:
            return t
        nxt = running[0][0]
        t += (nxt - step) * (model.a + model.b * len(running))
        step = nxt
        while running and running[0][0] == step:
            _, b = heapq.heappop(running)
            in_engine -= 1
            left[b] -= 1
            if not left[b]:
                del left[b]


def deal(batch: np.ndarray, workers: int) -> np.ndarray:
    """The worker of each request when batches are dealt round-robin over `workers`."""
    return np.asarray(batch) % max(1, workers)


def wall(steps, prefill, batch, *, slots: int, max_batches: int, workers: int, model: StepModel,
         who: np.ndarray | None = None) -> float:
    """The job's generation wall: the slowest of its workers' engines (`who`: each request's
    worker; default: batches dealt round-robin over `workers`)."""
    steps, prefill, batch = np.asarray(steps), np.asarray(prefill), np.asarray(batch)
    who = deal(batch, workers) if who is None else np.asarray(who)
    return max((simulate(steps[who == w], prefill[who == w], batch[who == w], slots=slots, max_batches=max_batches,
                         model=model) for w in np.unique(who)), default=0.0)


def calibrate(model: StepModel, measured_wall_s: float, replay_wall_s: float, prefilled_tokens: float = 0.0, *,
              rest_to_prefill: bool = False) -> StepModel:
    """The model made to reproduce the sample: its replay (`replay_wall_s`) takes the measured
    generation wall.  With `rest_to_prefill` (a model fitted without p), or a replay of no
    time at all (no decoding: an embedding job), the time the replay leaves unexplained sets p
    (the rest ÷ the `prefilled_tokens`); otherwise a, b and p are scaled by measured ÷ replayed."""
    rest = measured_wall_s - replay_wall_s
    if (rest_to_prefill or replay_wall_s <= 0) and rest >= 0 and prefilled_tokens > 0:
        return replace(model, p=model.p + rest / prefilled_tokens,
                       how=f"{model.how}; {rest / prefilled_tokens * 1e6:.1f} µs a prefilled token from the "
                           f"{rest:.2f} s of the sample's {measured_wall_s:.2f} s the decode steps leave")
    if replay_wall_s <= 0 or measured_wall_s <= 0:
        return model
    k = measured_wall_s / replay_wall_s
    return replace(model, a=model.a * k, b=model.b * k, p=model.p * k,
                   how=f"{model.how}; × {k:.3f} so the sample's replay takes its measured {measured_wall_s:.2f} s")
