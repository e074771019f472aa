"""A job's runs from its batch and worker rows: which run a batch or worker belongs to, what
each run's engines did, and each run's generation window, model load and held time."""

from __future__ import annotations

from typing import Any, Sequence

from tokenmill.schemas.config import TASKS


def run_of(batch_id: str | None) -> str:
    """The run a batch belongs to: generate.py names batches `<run_id>-<unit>...`."""
    return (batch_id or "").split("-", 1)[0]


def span(batches: Sequence[dict[str, Any]]) -> tuple[float | None, float | None]:
    starts = [b["started_at"] for b in batches if b.get("started_at") is not None]
    ends = [b["finished_at"] for b in batches if b.get("finished_at") is not None]
    return (min(starts) if starts else None), (max(ends) if ends else None)


def worker_run(w: dict[str, Any], batches: Sequence[dict[str, Any]]) -> str | None:
    if w.get("run_id"):
        return w["run_id"]
    mine = [b for b in batches if w.get("worker") is not None and b.get("worker") == w.get("worker")]
    return run_of(mine[0].get("batch_id")) if mine else None


def worker_task(w: dict[str, Any]) -> str | None:
    """The engine task a worker row's engine ran (record_worker writes it in `engine_info`)."""
    return (w.get("engine_info") or {}).get("task")


def job_task(workers: Sequence[dict[str, Any]], engine_config: dict[str, Any]) -> str:
    """What the job's engines did: `generate`, `embed`, or `generate+embed` for a batch file
    whose lines named both (a pass each); the config's task when no worker row says."""
    done = {worker_task(w) for w in workers}
    return "+".join(t for t in TASKS if t in done) or engine_config.get("task") or "generate"


def run_end(run: dict[str, Any], now: float | None = None) -> float | None:
    """When a run (a `runs` row) stopped holding its devices: its finish; for a run without
    one (killed, or still running), `now` where given (the running one), else its last heartbeat."""
    ended = run.get("finished_at")
    if ended is None:
        ended = now if now is not None else run.get("seen_at")
    return ended


def run_figures(batches: Sequence[dict[str, Any]], workers: Sequence[dict[str, Any]],
                runs: Sequence[dict[str, Any]] = (), now: float | None = None) -> list[dict[str, Any]]:
    """Per run of the job (the first and each resume), oldest first: its active generation
    window (first batch admitted → last batch finished; a run of two passes, a batch file's
    generate and embed lines, the two passes' windows summed), tokens and requests of its batches,
    its model load (slowest of its workers) and how long its launcher held the devices
    (start → after export; a run without a finish, killed or still running, up to its
    last heartbeat, or `now`)."""
    by_run: dict[str, list[dict[str, Any]]] = {}
    for b in batches:
        by_run.setdefault(run_of(b.get("batch_id")), []).append(b)
    loads: dict[str, dict[str, list[float]]] = {}  # run → task → its workers' loads
    for w in workers:
        r = worker_run(w, batches)
        if r is not None and w.get("load_s") is not None:
            loads.setdefault(r, {}).setdefault(worker_task(w) or "generate", []).append(float(w["load_s"]))
    rows = {r["run_id"]: r for r in runs}
    ids = list(dict.fromkeys([r["run_id"] for r in runs] + list(by_run) + list(loads)))
    task_of = {w.get("worker"): worker_task(w) or "generate" for w in workers}
    out = []
    for rid in ids:
        bs = by_run.get(rid, [])
        t0, t1 = span(bs)
        # a run of a batch file naming both tasks is a pass per task, one engine after the other:
        # its generation wall is the passes' windows summed, not the span from the first to the last
        passes: dict[str, list[dict[str, Any]]] = {}
        for b in bs:
            passes.setdefault(task_of.get(b.get("worker"), "generate"), []).append(b)
        gen = sum((e - s) for s, e in map(span, passes.values()) if s is not None and e is not None)
        row = rows.get(rid)
        held = ended = None
        if row is not None:
            ended = run_end(row, now if row is runs[-1] else None)
            held = (ended - row["started_at"]) if ended is not None else None
        out_tok = sum(b.get("output_tokens") or 0 for b in bs)
        out.append({
            "run_id": rid,
            "started_at": row["started_at"] if row else t0,
            "ended_at": ended,
            "finished": bool(row and row.get("finished_at")),
            "held_s": held,
            "model_load_s": sum(map(max, loads[rid].values())) if rid in loads else None,
            "generation_started_at": t0,
            "generation_finished_at": t1,
            "generation_wall_s": gen,
            "batches": len(bs),
            "requests": sum(b.get("requests") or 0 for b in bs),
            "prompt_tokens": sum(b.get("prompt_tokens") or 0 for b in bs),
            "output_tokens": out_tok,
            "output_tok_per_s": (out_tok / gen) if gen > 0 else None,
        })
    out.sort(key=lambda r: (r["started_at"] is None, r["started_at"] or 0.0))
    return out
