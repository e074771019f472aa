"""What the benchmark programs share: where results and scratch files go, the
machine description, timestamped progress lines."""

from __future__ import annotations

import datetime as dt
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
#: results files (committed): `bench/results/<benchmark>-<stamp>.json`
RESULTS = ROOT / "bench" / "results"
#: scratch (ignored by git, removed by `make clean`): inputs, databases, outputs
WORK = ROOT / "bench" / "work"


def machine() -> dict[str, Any]:
    from tokenmill.jobs.lifecycle.runner import hardware, versions

    return {"hardware": hardware(), "versions": versions()}


def utc_stamp() -> str:
    return dt.datetime.now(dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")


def utc_now() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")


def log(msg: str) -> None:
    print(f"[{dt.datetime.now(dt.timezone.utc):%H:%M:%S}] {msg}", flush=True)


def save_results(name: str, res: dict[str, Any], markdown, write_docs, *, docs: bool = True) -> None:
    """Write a benchmark's results to bench/results/`name`, print its markdown, and put it in
    docs/BENCHMARKS.md with the benchmark's own `write_docs` unless `docs` is False."""
    import json

    (ROOT / "bench" / "results").mkdir(parents=True, exist_ok=True)
    (ROOT / "bench" / "results" / name).write_text(json.dumps(res, indent=1, default=str))
    md = markdown(res, name)
    print(md)
    if docs:
        write_docs(md, ROOT / "docs" / "BENCHMARKS.md")


def code_label(given: str | None) -> str:
    """What code a bench ran: `--code` where PYTHONPATH points at another tree, else HEAD."""
    import subprocess

    return given or subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                   cwd=ROOT).stdout.strip()


def write_report(rep: dict[str, Any], json_arg: str | None, default_name: str) -> Path:
    """Write a bench's report to `--json` or bench/results/`default_name`, and say where."""
    import json

    out = Path(json_arg) if json_arg else RESULTS / default_name
    out.write_text(json.dumps(rep, indent=1) + "\n")
    print(f"wrote {out}")
    return out
