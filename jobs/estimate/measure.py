"""What the sample job measured, read back from the database and turned into the model's
inputs: each answered request's band, length and timing, the run's fixed part (start-up,
model load, export) and the hourly price the full job's workers will have."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from tokenmill.jobs.estimate.engine_model import decode_windows
from tokenmill.jobs.estimate.predict import Measured, Outputs

#: The output-row columns the estimate reads of the sample job's requests.
COLUMNS = ("input_row", "sample", "batch_id", "worker", "finish_reason", "prompt_tokens", "output_tokens",
           "cached_tokens", "ttft_s", "tpot_s", "e2e_s", "finished_at")


def _col(rows: list[dict[str, Any]], key: str) -> np.ndarray:
    return np.asarray([np.nan if r.get(key) is None else float(r[key]) for r in rows], dtype=float)


def requests_of(rows: list[dict[str, Any]], batches: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The sample's answered requests in the order its engines were fed them (batches by
    start, then input order)."""
    rank = {b["batch_id"]: i for i, b in enumerate(sorted(batches, key=lambda b: b.get("started_at") or 0.0))}
    return sorted(rows, key=lambda r: (rank.get(r.get("batch_id"), len(rank)), r["input_row"], r.get("sample") or 0))


def observe(rows: list[dict[str, Any]], batches: list[dict[str, Any]], *, picks: np.ndarray, band: np.ndarray,
            max_tokens: np.ndarray, wall_s: float, cache_measured: bool) -> tuple[Outputs, Measured]:
    """The output-length observations and the engine measurements of the sample's requests
    (`rows`, output rows with COLUMNS).  The sample file's row k < len(picks) is the
    profile's row `picks[k]`; the rows after them are fillers (sample.py), measured for the
    engine only.  `cache_measured`: the engine reports cached prompt tokens (else every
    prompt token counts as prefilled)."""
    rows = requests_of(rows, batches)
    pos = np.asarray([int(r["input_row"]) for r in rows], dtype=np.int64)
    real = pos < len(picks)
    at = picks[pos[real]]
    out = np.asarray([int(r.get("output_tokens") or 0) for r in rows], dtype=np.int64)
    capped = np.asarray([r.get("finish_reason") == "length" for r in rows])[real] | (out[real] >= max_tokens[at])
    prompt, cached = _col(rows, "prompt_tokens"), _col(rows, "cached_tokens")
    prefill = prompt - (np.nan_to_num(cached) if cache_measured else 0.0)
    e2e, ttft, end = _col(rows, "e2e_s"), _col(rows, "ttft_s"), _col(rows, "finished_at")
    arrival = end - e2e
    names = {w: i for i, w in enumerate(dict.fromkeys(r.get("worker") for r in rows))}
    worker = np.asarray([names[r.get("worker")] for r in rows], dtype=np.int64)
    windows = decode_windows(arrival, arrival + np.nan_to_num(ttft), end, out, prefill, worker)
    order = {b: i for i, b in enumerate(dict.fromkeys(r.get("batch_id") for r in rows))}
    meas = Measured(windows=windows, steps=np.maximum(out, 1), prefill=np.nan_to_num(prefill),
                    batch=np.asarray([order[r.get("batch_id")] for r in rows]), worker=worker, wall_s=wall_s,
                    filler=~real)
    return Outputs(band=band[at], out=out[real], capped=capped), meas


@dataclass
class Fixed:
    """The sample run's parts that do not grow with rows."""

    held_s: float
    generation_s: float
    model_load_s: float | None
    first_unit_tokenize_s: float

    @property
    def fixed_s(self) -> float:
        return max(0.0, self.held_s - self.generation_s) + self.first_unit_tokenize_s

    def describe(self) -> dict[str, Any]:
        return {"sample_held_s": self.held_s, "sample_generation_wall_s": self.generation_s,
                "sample_model_load_s": self.model_load_s, "first_unit_tokenize_s": self.first_unit_tokenize_s,
                "fixed_s": self.fixed_s}


#: The fixed part's interval, as factors of the sample's own, where the database holds fewer than
#: HISTORY_MIN earlier jobs to take its spread from: one start-up and model load measured once
#: says little of the next (model loads of 10-22 s were seen on one 2-core Xeon, 2026-12-04).
FIXED_ALLOWANCE = (0.7, 1.6)
HISTORY_MIN = 3


def fixed_history(jobs: list[dict[str, Any]], kind: str, model: str, hardware: dict[str, Any]) -> list[float]:
    """The fixed part (held − generation wall) of earlier finished single-run jobs of the same
    engine kind and model on a machine described as this one is."""
    out = []
    for j in jobs:
        m = j.get("metrics") or {}
        runs = m.get("runs") or []
        if j.get("status") not in ("succeeded", "partial") or len(runs) != 1 or j.get("model") != model:
            continue
        if (j.get("engine_config") or {}).get("kind") != kind or j.get("hardware") != hardware:
            continue
        gen, held = (m.get("throughput") or {}).get("generation_wall_s"), runs[0].get("held_s")
        if gen is not None and held is not None:
            out.append(max(0.0, float(held) - float(gen)))
    return out


def fixed_interval(fixed_s: float, history: list[float]) -> tuple[float, float, str]:
    """(lo, hi, how) of the fixed part: the range of this machine's earlier jobs' and the
    sample's, given HISTORY_MIN earlier jobs; else the sample's × FIXED_ALLOWANCE."""
    if len(history) >= HISTORY_MIN:
        vals = [*history, fixed_s]
        return min(vals), max(vals), (f"the range of {len(history)} earlier jobs' of this engine and model on this "
                                      f"machine and the sample's")
    lo, hi = FIXED_ALLOWANCE
    return fixed_s * lo, fixed_s * hi, (f"the sample's × {lo:g}-{hi:g} (fewer than {HISTORY_MIN} earlier jobs of "
                                        f"this engine and model on this machine in the database to take it from)")


def fixed_part(metrics: dict[str, Any], first_unit_tokenize_s: float) -> Fixed:
    """The sample run's held time (launcher start to after export) and generation wall; what
    the job's first unit adds before its engine starts (tokenizing more rows than the sample)."""
    runs = metrics.get("runs") or []
    held = sum(float(r.get("held_s") or 0.0) for r in runs)
    thr = metrics.get("throughput") or {}
    return Fixed(held_s=held, generation_s=float(thr.get("generation_wall_s") or 0.0),
                 model_load_s=thr.get("model_load_s"), first_unit_tokenize_s=first_unit_tokenize_s)


def job_kv_bytes(info: dict[str, Any], job_tokens, engine_cfg, block_size: int) -> int | None:
    """The KV cache the full job's engine will start with on a CPU, where the sample's was
    sized to its work (engines/cpu.cpu_kv_cache: `kv.size_for_job` under the same ceiling);
    None where the size does not follow the work (a GPU, a configured size, the default)."""
    from tokenmill.transforms.engines.kv import size_for_job

    sizing = (info or {}).get("kv_sizing") or {}
    if "job_tokens" not in sizing or not sizing.get("kv_bytes_per_token"):
        return None
    return size_for_job(job_tokens, per_token=int(sizing["kv_bytes_per_token"]), block_size=block_size,
                        max_num_seqs=engine_cfg.max_num_seqs, max_model_len=engine_cfg.max_model_len,
                        ceiling_bytes=sizing.get("ceiling_bytes")).bytes


def job_price(workers: list[dict[str, Any]], spec, job_tokens, block_size: int,
              hardware: dict[str, Any]) -> tuple[float, str]:
    """(USD an hour for all the full job's workers, how): each sample worker priced as the
    accounting prices it (pricing.worker_rate), its peak memory moved by the difference
    between the KV cache the job's engine will have and the sample's."""
    from tokenmill.jobs.metrics.pricing import launcher_worker, price_table, worker_rate

    table, total, moved = price_table(spec.prices), 0.0, 0
    for w in workers:
        desc = w if w.get("device_type") else {**w, **launcher_worker(hardware)}
        info = w.get("engine_info") or {}
        new_kv = job_kv_bytes(info, job_tokens, spec.engine, block_size)
        if new_kv is not None and desc.get("device_type") == "cpu":
            measure = dict(desc.get("measure") or {})
            rss = measure.get("peak_tree_rss_bytes") or desc.get("peak_rss_bytes") or 0
            delta = new_kv - int(info.get("kv_cache_bytes") or 0)
            measure["peak_tree_rss_bytes"] = max(0, rss + delta)
            desc, moved = {**desc, "measure": measure}, moved + delta
        total += worker_rate(desc, table, spec.price_per_hour)["usd_per_hour"]
    how = f"the sample job's {len(workers)} worker(s) priced as the job's accounting prices them"
    if moved:
        how += f", peak memory {moved / 2**30:+.2f} GiB for the job's own KV cache"
    return total, how
