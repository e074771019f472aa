"""The estimate's arithmetic, pure: output lengths per prompt-length band scaled to the input,
the prefix cache from the input's own block hashes in the job's order, the generation wall
from the engine model (engine_model.py), held time and cost, each with its interval.

Output lengths.  A sampled request that stopped on its own (`finish_reason` not `length`)
says its answer's natural length L; one cut at its `max_tokens` says only that L is at least
that (right-censored).  Per prompt-length band, the Kaplan-Meier estimate of L's survival
over the band's sampled answers (all sampled answers where a band has none) gives a request
with `max_tokens` m the expected length E[min(L, m)]; the total is the sum over the input's
requests.  Cut answers past the longest uncut one are taken to run on to m (an upper bound).

Intervals are INTERVAL (90 %) bootstrap percentile intervals over the sample's requests
(resampled within each band; the engine model refitted on each resample), widened where
needed to contain the point value; the generation wall's also spans the engine model's
structural alternatives (engine_model.py) and the model as fitted, before it was scaled to
reproduce the sample's own wall (the time it did not explain may have been a one-off).  No interval covers a machine that is busier or
quieter during the job than during the sample.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from tokenmill.jobs.estimate import engine_model as M

INTERVAL = 0.90
#: Bootstrap resamples for token totals, and for the generation wall (each one a simulation).
TOKEN_RESAMPLES = 1000
WALL_RESAMPLES = 100
#: Output draws averaged for the wall's point value.
POINT_DRAWS = 5
#: Requests simulated at most; a larger job is simulated on a reproducible subset in its
#: order and the wall scaled by its size.
SIM_MAX_REQUESTS = 10_000
SEED = 0


def figure(value: float, lo: float, hi: float, how: str) -> dict[str, Any]:
    """One predicted figure: its value, an interval that contains it, and how it was made."""
    return {"value": float(value), "lo": float(min(lo, value)), "hi": float(max(hi, value)), "how": how}


def percentiles(values: np.ndarray) -> tuple[float, float]:
    tail = (1 - INTERVAL) / 2 * 100
    bounds = np.percentile(np.asarray(values, float), [tail, 100 - tail])
    lo, hi = (float(x) for x in bounds)  # type: ignore[attr-defined]  # an array for a list of q
    return lo, hi


# ---------------------------------------------------------------- output lengths


def survival(out: np.ndarray, capped: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The Kaplan-Meier estimate of an answer's natural length L from observed answers `out`
    of which `capped` were cut at their own max_tokens (right-censored: L ≥ out): the
    lengths where some answer stopped on its own, and S = P(L > u) before the first of them,
    after each (so one entry more).  Past the last, S stays where it was."""
    out, capped = np.asarray(out, float), np.asarray(capped, bool)
    times = np.unique(out[~capped])
    at_risk = (out[None, :] >= times[:, None]).sum(axis=1)
    ended = ((out[None, :] == times[:, None]) & ~capped[None, :]).sum(axis=1)
    return times, np.concatenate([[1.0], np.cumprod(1.0 - ended / at_risk)])


def expected_output(out: np.ndarray, capped: np.ndarray, caps: np.ndarray) -> np.ndarray:
    """E[min(L, m)] for each m of `caps` (see `survival`): S(u) summed over u < m; cut answers
    past the longest uncut one are taken to run on to m (an upper bound)."""
    caps = np.asarray(caps, float)
    if not len(out):
        return np.zeros(len(caps))
    times, surv = survival(out, capped)
    edges = np.concatenate([[0.0], times])  # S is surv[k] on [edges[k], edges[k+1]), surv[-1] after
    upto = np.minimum(caps[:, None], np.concatenate([edges[1:], [np.inf]])[None, :])
    frm = np.minimum(caps[:, None], edges[None, :])
    return ((upto - frm) * surv[None, :]).sum(axis=1)


@dataclass
class Outputs:
    """The sample's answered requests for the output-length model."""

    band: np.ndarray
    out: np.ndarray
    capped: np.ndarray

    def of_band(self, b: int, idx: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        idx = np.arange(len(self.out)) if idx is None else idx
        mine = idx[self.band[idx] == b]
        mine = mine if len(mine) else idx
        return self.out[mine], self.capped[mine]


def output_total(obs: Outputs, band: np.ndarray, caps: np.ndarray, weight: np.ndarray,
                 idx: np.ndarray | None = None) -> float:
    """Predicted output tokens of requests (`band`, `caps`, each counted `weight` times: a
    row's samples), from the observed requests `idx` (default: all)."""
    total = 0.0
    for b in np.unique(band):
        sel = band == b
        u, inv = np.unique(caps[sel], return_inverse=True)
        w = np.bincount(inv, weights=weight[sel])
        total += float((expected_output(*obs.of_band(int(b), idx), u) * w).sum())
    return total


def resample_within_bands(rng: np.random.Generator, band: np.ndarray) -> np.ndarray:
    """A bootstrap resample of indexes 0..n-1, drawn with replacement within each band."""
    parts = [rng.choice(np.flatnonzero(band == b), size=int((band == b).sum())) for b in np.unique(band)]
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)


def output_figure(obs: Outputs, band: np.ndarray, caps: np.ndarray, weight: np.ndarray, scale: float = 1.0,
                  seed: int = SEED) -> dict[str, Any]:
    """Output tokens of the input's requests, with its bootstrap interval."""
    point = output_total(obs, band, caps, weight) * scale
    rng = np.random.default_rng(seed)
    boots = [output_total(obs, band, caps, weight, resample_within_bands(rng, obs.band)) * scale
             for _ in range(TOKEN_RESAMPLES)]
    lo, hi = percentiles(np.asarray(boots))
    return figure(point, lo, hi, f"per prompt-length band, the length distribution of the sample's {len(obs.out)} "
                                 f"answers (Kaplan-Meier: an answer cut at max_tokens is a lower bound) capped at each "
                                 f"row's max_tokens, summed over the input's rows; {INTERVAL:.0%} bootstrap over the "
                                 f"sample's answers")


def draw_outputs(rng: np.random.Generator, obs: Outputs, band: np.ndarray, caps: np.ndarray,
                 idx: np.ndarray | None = None) -> np.ndarray:
    """One predicted output length per request: min(L, its max_tokens), L drawn from its
    band's length distribution (`survival`; past the last uncut length, L runs on to the cap)."""
    res: np.ndarray = np.empty(len(band), dtype=np.int64)
    for b in np.unique(band):
        sel = np.flatnonzero(band == b)
        times, surv = survival(*obs.of_band(int(b), idx))
        mass = np.concatenate([surv[:-1] - surv[1:], [surv[-1]]])  # P(L = each time), then P(L past them)
        pick = rng.choice(len(mass), size=len(sel), p=mass / mass.sum())
        length = np.concatenate([times, [np.inf]])[pick]
        res[sel] = np.minimum(length, caps[sel]).astype(np.int64)
    return np.maximum(res, 1)


# ---------------------------------------------------------------- the job's requests


def job_order(prefix_keys: list[str], prompt: np.ndarray, blocks: list[tuple[int, ...]], ordering: str) -> np.ndarray:
    """The rows' indexes in the order the job feeds them (transforms/batching.order_prompts:
    `prefix` by prefix key then tokens, here the block hashes; `length` longest first;
    `none` input order), over the whole input rather than per work unit."""
    n = len(prompt)
    if ordering == "prefix":
        return np.asarray(sorted(range(n), key=lambda i: (prefix_keys[i], blocks[i], prompt[i])), dtype=np.int64)
    if ordering == "length":
        return np.argsort(-np.asarray(prompt), kind="stable")
    return np.arange(n)


def prefill_tokens(order: np.ndarray, prompt: np.ndarray, samples: np.ndarray, blocks: list[tuple[int, ...]],
                   block_size: int, worker: np.ndarray | None = None, keep_prompts: int | None = None) -> np.ndarray:
    """Prompt tokens each request prefills, rows taken in `order`: a row's leading full blocks
    already cached on its worker's engine are not prefilled; a row's later samples find all
    its full blocks cached.  What the cache holds: every block seen (`keep_prompts` None: vLLM's
    block pool, nothing evicted), or the last `keep_prompts` prompts' blocks (llama-server: each
    of its slots keeps its last prompt).  One entry per request, in order."""
    from collections import Counter, deque

    seen: dict[int, Counter] = {}
    recent: dict[int, deque] = {}
    out: list[int] = []
    for pos, i in enumerate(order.tolist()):
        w = 0 if worker is None else int(worker[pos])
        cache = seen.setdefault(w, Counter())
        chain = blocks[i]
        hit = 0
        while hit < len(chain) and cache[chain[hit]] > 0:
            hit += 1
        cache.update(chain)
        if keep_prompts is not None:
            last = recent.setdefault(w, deque())
            last.append(chain)
            if len(last) > keep_prompts:
                cache.subtract(last.popleft())
        out.append(int(prompt[i]) - hit * block_size)
        out += [int(prompt[i]) - len(chain) * block_size] * (int(samples[i]) - 1)
    return np.asarray(out, dtype=np.int64)


@dataclass
class Requests:
    """The job's engine requests in the order it feeds them (a row's samples side by side)."""

    band: np.ndarray
    caps: np.ndarray
    prompt: np.ndarray
    prefill: np.ndarray
    batch: np.ndarray
    scale: float = 1.0
    """Requests of the job per request here (a subset simulated for a large job)."""

    def hit_rate(self) -> float | None:
        total = float(self.prompt.sum())
        return 1 - float(self.prefill.sum()) / total if total else None


# ---------------------------------------------------------------- the generation wall


@dataclass
class Measured:
    """What the sample job measured: each answered request's decode window, its output
    tokens, prompt tokens prefilled, batch and worker (in the order the engines were fed),
    and the run's generation wall."""

    windows: M.Windows
    steps: np.ndarray
    prefill: np.ndarray
    batch: np.ndarray
    worker: np.ndarray
    wall_s: float
    filler: np.ndarray | None = None
    """Which requests are filler rows (sample.py): resampled apart from the sampled rows'."""

    def resample(self, rng: np.random.Generator) -> np.ndarray:
        """A bootstrap resample of the requests, fillers and sampled rows each within their own."""
        n = len(self.steps)
        group: np.ndarray = np.zeros(n, dtype=np.int64) if self.filler is None else self.filler.astype(np.int64)
        return resample_within_bands(rng, group)


@dataclass(frozen=True)
class Engine:
    slots: int
    max_batches: int
    workers: int


def fitted(meas: Measured, eng: Engine, idx: np.ndarray | None = None, *, prefill: bool = True,
           calibrated: bool = True) -> M.StepModel:
    """The step model fitted on the sampled requests `idx` (default all), calibrated so the
    whole sample's replay takes its measured wall (`prefill` False: the alternative, p from
    what the replay leaves unexplained; `calibrated` False: as fitted)."""
    w = meas.windows
    if idx is not None:
        w = M.Windows(w.duration[idx], w.steps[idx], w.seq_steps[idx], w.prefill[idx])
    model = M.fit_steps(w, prefill=prefill)
    if not calibrated:
        return model
    replay = M.wall(meas.steps, meas.prefill, meas.batch, slots=eng.slots, max_batches=eng.max_batches,
                    workers=1, model=model, who=meas.worker)
    share = float(meas.prefill.sum()) / max(1, len(np.unique(meas.worker)))
    return M.calibrate(model, meas.wall_s, replay, share, rest_to_prefill=not prefill)


def wall_figure(meas: Measured, obs: Outputs, job: Requests, eng: Engine,
                seed: int = SEED) -> tuple[dict[str, Any], M.StepModel]:
    """The job's generation wall with its interval, and the step model of the point."""
    rng = np.random.default_rng(seed)

    def run(model: M.StepModel, idx: np.ndarray | None) -> float:
        steps = draw_outputs(rng, obs, job.band, job.caps, idx)
        return M.wall(steps, job.prefill, job.batch, slots=eng.slots, max_batches=eng.max_batches,
                      workers=eng.workers, model=model) * job.scale

    model = fitted(meas, eng)
    point = float(np.mean([run(model, None) for _ in range(POINT_DRAWS)]))
    other = float(np.mean([run(fitted(meas, eng, prefill=False), None) for _ in range(POINT_DRAWS)]))
    raw = float(np.mean([run(fitted(meas, eng, calibrated=False), None) for _ in range(POINT_DRAWS)]))
    alternatives = [other] + ([raw] if raw > 0 else [])
    boots = []
    for _ in range(WALL_RESAMPLES):
        boots.append(run(fitted(meas, eng, meas.resample(rng)), resample_within_bands(rng, obs.band)))
    lo, hi = percentiles(np.asarray(boots))
    how = (f"the engine model fitted on the sample ({model.how}), run on the input's "
           f"{len(job.band) * job.scale:,.0f} requests in the job's order and batches, {eng.slots} slots, "
           f"{eng.workers} worker(s); interval: {INTERVAL:.0%} bootstrap over the sample's answers (lengths and "
           f"refit), spanning also the model with prefill costed from the sample's unexplained time ({other:.2f} s) "
           f"and the model as fitted, before it was scaled to the sample's wall ({raw:.2f} s); not a machine "
           f"busier or quieter during the job than during the sample")
    return figure(point, min(lo, *alternatives), max(hi, *alternatives), how), model


# ---------------------------------------------------------------- held time and cost


def held_figure(gen: dict[str, Any], fixed_s: float, fixed_lo: float, fixed_hi: float, fixed_how: str
                ) -> dict[str, Any]:
    return figure(gen["value"] + fixed_s, gen["lo"] + fixed_lo, gen["hi"] + fixed_hi,
                  f"generation wall + {fixed_s:.1f} s measured by the sample job for what does not grow with "
                  f"rows (start-up, model load, export); interval: the generation wall's plus the fixed part's "
                  f"{fixed_lo:.1f}-{fixed_hi:.1f} s ({fixed_how})")


def cost_figure(seconds: dict[str, Any], usd_per_hour: float, what: str) -> dict[str, Any]:
    k = usd_per_hour / 3600.0
    return figure(seconds["value"] * k, seconds["lo"] * k, seconds["hi"] * k,
                  f"{what} × ${usd_per_hour:.4f}/hour (the workers' price as the job will run); interval: the "
                  f"time's")


def exact_or_scaled(values: np.ndarray, scale: float, how: str) -> dict[str, Any]:
    """A sum over the profiled rows: exact when every row was profiled, else scaled to the
    input with a normal {INTERVAL} interval (finite-population corrected)."""
    total = float(values.sum()) * scale
    if scale == 1.0 or len(values) < 2:
        return figure(total, total, total, f"exact: {how}")
    n, big_n = len(values), len(values) * scale
    se = float(values.std(ddof=1)) * big_n / np.sqrt(n) * np.sqrt(max(0.0, 1 - n / big_n))
    z = 1.6449 if INTERVAL == 0.90 else 1.96
    return figure(total, total - z * se, total + z * se,
                  f"{how}, on {n:,} rows drawn from {big_n:,.0f} and scaled; normal {INTERVAL:.0%} interval")
