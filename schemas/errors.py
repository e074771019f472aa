"""What every layer says about an error: one line, never a traceback."""

from __future__ import annotations

import re

LIMIT = 300
#: The line a Python traceback ends with: `SomeError: message` (not indented).
_RAISED = re.compile(r"^[A-Za-z_][\w.]*(?:Error|Exception|Unavailable|Exit|Interrupt|Warning)\b.*")


def first_line(err: BaseException | str, limit: int = LIMIT) -> str:
    """The first non-empty line of an exception's message (its type name when it has
    none), at most `limit` characters.  Beam's BeamIOError keeps the useful message
    in `exception_details`; that one is preferred.  A message that is a traceback (what
    a runner reports of an error in one of its worker processes) gives the error it
    ends with, `SomeError: message`, not its "Traceback (most recent call last):"."""
    text = str(err).strip()
    for inner in (getattr(err, "exception_details", None) or {}).values():
        text = str(inner).strip() or text
    lines = text.splitlines()
    if lines and lines[0].startswith("Traceback (most recent call last)"):
        raised = [line for line in lines if _RAISED.match(line)]
        if raised:  # the error's class without its module path
            return re.sub(r"^(?:\w+\.)+(?=\w+\b)", "", raised[-1])[:limit]
    return (lines[0] if lines else type(err).__name__)[:limit]
