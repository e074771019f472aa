"""What the GPU check (bench/gpu_check.py) and its lease part (bench/lease_check.py) share: a
check's result row, the table and exit status made of them, and why there is no GPU here.

Imported first by both: from a clone where tokenmill is not installed it makes the clone's
folders importable as tokenmill's subpackages."""

from __future__ import annotations

import os
import sys
import types
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
try:
    import tokenmill  # noqa: F401  (installed: pip install -e .)
except ModuleNotFoundError:  # a bare clone on a GPU host: its folders are tokenmill's subpackages
    _pkg = types.ModuleType("tokenmill")
    _pkg.__path__ = [str(ROOT)]
    sys.modules["tokenmill"] = _pkg

from tokenmill.transforms.engines.meter import nvidia_driver_present  # noqa: E402

EXIT_PASS, EXIT_FAIL, EXIT_USAGE, EXIT_NO_GPU, EXIT_CANNOT_RUN = 0, 1, 2, 3, 4


def check(name: str, tokenmill: Any, reference: Any, ok: bool | None, limit: str, note: str = "") -> dict[str, Any]:
    """A row of the result: `status` "pass", "fail" or "n/a" (`ok` None: nothing to judge)."""
    return {"check": name, "tokenmill": tokenmill, "reference": reference, "limit": limit,
            "status": "n/a" if ok is None else "pass" if ok else "fail", "note": note}


def exit_status(checks: list[dict[str, Any]]) -> int:
    return EXIT_FAIL if any(c["status"] == "fail" for c in checks) else EXIT_PASS


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:,.4g}" if abs(v) < 1e4 else f"{v:,.0f}"
    if isinstance(v, int) and not isinstance(v, bool):
        return f"{v:,}"
    return "-" if v is None else str(v)


def table(checks: list[dict[str, Any]]) -> str:
    """The checks as an aligned text table."""
    head = ("check", "tokenmill", "reference", "limit", "status", "note")
    rows = [head] + [(c["check"], _fmt(c["tokenmill"]), _fmt(c["reference"]), c["limit"], c["status"].upper(),
                      c["note"]) for c in checks]
    widths = [max(len(r[i]) for r in rows) for i in range(len(head) - 1)]
    lines = ["  ".join(r[i].ljust(widths[i]) for i in range(len(head) - 1)) + "  " + r[-1] for r in rows]
    lines.insert(1, "-" * len(lines[0]))
    return "\n".join(lines)


def no_gpu_reason() -> str | None:
    """Why there is no NVIDIA GPU to check here (None: there is one), found without NVML or torch."""
    if nvidia_driver_present():
        return None
    cvd = os.environ.get("CUDA_VISIBLE_DEVICES")
    if cvd is not None and cvd.strip() in ("", "-1"):
        return f"CUDA_VISIBLE_DEVICES={cvd!r} hides every device"
    if os.environ.get("TOKENMILL_FORCE_CPU"):
        return "TOKENMILL_FORCE_CPU is set"
    return "no NVIDIA driver with a GPU (/proc/driver/nvidia/gpus is absent or empty)"
