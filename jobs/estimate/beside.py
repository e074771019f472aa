"""The newest estimate of a job beside what the job did (`tokenmill report`, `status --json`):
for each predicted figure its value, interval, the job's actual figure, the error and whether
the actual fell inside the interval, so the estimator's accuracy shows job after job."""

from __future__ import annotations

from typing import Any, Callable

from tokenmill.jobs.metrics.catalog import fmt, get_path


def _held(m: dict[str, Any]) -> float | None:
    runs = [r.get("held_s") for r in m.get("runs") or []]
    return sum(runs) if runs and all(h is not None for h in runs) else None


#: (the estimate's key path, label, unit for `catalog.fmt`, the actual figure from the job's metrics)
FIGURES: tuple[tuple[str, str, str, Callable[[dict[str, Any]], Any]], ...] = (
    ("tokens.prompt", "prompt tokens", "tokens", lambda m: (m.get("tokens") or {}).get("prompt")),
    ("tokens.output", "output tokens", "tokens", lambda m: (m.get("tokens") or {}).get("output")),
    ("tokens.total", "total tokens", "tokens", lambda m: (m.get("tokens") or {}).get("total")),
    ("generation_wall_s", "generation wall", "s", lambda m: (m.get("throughput") or {}).get("generation_wall_s")),
    ("held_wall_s", "held wall (all runs)", "s", _held),
    ("cost_usd", "cost, all held time", "usd", lambda m: ((m.get("cost") or {}).get("held") or {}).get("total")),
    ("cost_generation_usd", "cost, generation only", "usd", lambda m: (m.get("cost") or {}).get("total")),
)


def show(v: Any, unit: str) -> str:
    """A figure in its unit: token counts as whole numbers, the rest as `catalog.fmt` writes them."""
    if unit == "tokens" and isinstance(v, (int, float)):
        return fmt(int(round(v)))
    return fmt(v, unit)


def when(t: float | None) -> str:
    import datetime as dt

    return "-" if t is None else dt.datetime.fromtimestamp(t, dt.timezone.utc).isoformat(timespec="seconds")


def compare(estimate: dict[str, Any], metrics: dict[str, Any] | None) -> list[dict[str, Any]]:
    """Each predicted figure beside the actual one: error_pct = (value - actual) / actual × 100,
    inside = lo ≤ actual ≤ hi (None where the job has no such figure yet)."""
    out = []
    for path, label, unit, actual_of in FIGURES:
        f = get_path(estimate, path)
        if not isinstance(f, dict):
            continue
        actual = actual_of(metrics or {})
        ok = isinstance(actual, (int, float))
        out.append({"figure": path, "label": label, "unit": unit, "value": f.get("value"), "lo": f.get("lo"),
                    "hi": f.get("hi"), "actual": actual,
                    "error_pct": (f["value"] - actual) / actual * 100 if ok and actual else None,
                    "inside": (f["lo"] <= actual <= f["hi"]) if ok else None, "how": f.get("how")})
    return out


def job_estimate(eng, job_id: str, metrics: dict[str, Any] | None) -> dict[str, Any] | None:
    """The newest estimate stored for `job_id` beside its metrics (None: none was made)."""
    from tokenmill.schemas.storage import EstimateStore

    row = EstimateStore(eng).latest(job_id)
    if row is None:
        return None
    est = row["estimate"] or {}
    return {"made_at": row["created_at"], "sample_rows": row.get("sample_rows"), "rows": row.get("total_rows"),
            "engine": est.get("engine"), "sample_job_id": est.get("sample_job_id"),
            "figures": compare(est, metrics)}


def lines(beside: dict[str, Any]) -> list[tuple[str, str]]:
    """(label, text) lines for a report section: value [lo - hi], actual, error, inside."""
    out = [("made", f"{when(beside.get('made_at'))} from {fmt(beside.get('sample_rows'))} sample rows of "
                    f"{fmt(beside.get('rows'))} (job {beside.get('sample_job_id') or '-'})")]
    for f in beside["figures"]:
        u = f["unit"]
        where = {True: "inside", False: "outside", None: "-"}[f["inside"]]
        err = "-" if f["error_pct"] is None else f"{f['error_pct']:+.1f} %"
        out.append((f["label"], f"{show(f['value'], u)} [{show(f['lo'], u)} - {show(f['hi'], u)}]; actual "
                                f"{show(f['actual'], u)}; error {err}; {where} the interval"))
    return out


def one_line(beside: dict[str, Any]) -> str:
    """The estimate in one line for `status`: generation wall and cost against the actual."""
    parts = []
    for f in beside["figures"]:
        if f["figure"] in ("generation_wall_s", "cost_usd") and f["actual"] is not None:
            err = "" if f["error_pct"] is None else f" ({f['error_pct']:+.1f} %, {'in' if f['inside'] else 'out'})"
            parts.append(f"{f['label']} {show(f['value'], f['unit'])} vs {show(f['actual'], f['unit'])}{err}")
    return "; ".join(parts) or f"made from {beside.get('sample_rows')} sample rows; the job has no figures yet"
