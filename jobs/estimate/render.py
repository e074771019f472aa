"""An estimate as a table for a person (`tokenmill estimate` without --json)."""

from __future__ import annotations

from typing import Any

from tabulate import tabulate

from tokenmill.jobs.estimate.beside import FIGURES, show
from tokenmill.jobs.metrics.catalog import get_path


def format_estimate(est: dict[str, Any]) -> str:
    rows = []
    for path, label, unit, _ in FIGURES:
        f = get_path(est, path)
        if isinstance(f, dict):
            rows.append((label, show(f["value"], unit), f"{show(f['lo'], unit)} - {show(f['hi'], unit)}"))
    inp, pc, em = est.get("input") or {}, est.get("prefix_cache") or {}, est.get("engine_model") or {}
    dead = sum((inp.get("dead_before_engine") or {}).values())
    lines = [
        f"estimate of job {est['job_id']} ({est['engine']}): {est['rows']:,} input rows"
        + (f", {dead:,} of them dead letters before the engine" if dead else "")
        + f"; {est['sample_rows']} rows run as job {est.get('sample_job_id')}",
        "",
        *tabulate(rows, headers=("", "estimate", "interval (90 %)"), tablefmt="plain",
                  colalign=("left", "right", "right"), disable_numparse=True).splitlines(),
        "",
        f"fixed (start-up, model load, export): {show(est['fixed']['held_s'], 's')}, "
        f"{show(est['fixed']['cost_usd'], 'usd')}; per row: {show(est['per_row']['held_s'], 's')}, "
        f"{show(est['per_row']['cost_usd'], 'usd')}; price {show(est['price_per_hour'], 'usd')}/hour",
        f"engine model: {em.get('how')}; {em.get('slots')} slots",
        "prefix cache hit rate: " + (f"{pc['hit_rate']:.1%} predicted" if pc.get("hit_rate") is not None else
                                     "not predicted")
        + (f", {pc['sample_hit_rate']:.1%} in the sample" if pc.get("sample_hit_rate") is not None else ""),
        "how:",
    ]
    lines += [f"  {k}: {v}" for k, v in (est.get("method") or {}).items()]
    return "\n".join(lines) + "\n"
