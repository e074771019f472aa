"""What every layer says about an error: one line, never a traceback."""

from __future__ import annotations

LIMIT = 300


def first_line(err: BaseException | str, limit: int = LIMIT) -> str:
    """The first non-empty line of an exception's message (its type name when it has
    none), at most `limit` characters.  Beam's BeamIOError keeps the useful message
    in `exception_details`; that one is preferred."""
    text = str(err).strip()
    for inner in (getattr(err, "exception_details", None) or {}).values():
        text = str(inner).strip() or text
    return (text.splitlines()[0] if text else type(err).__name__)[:limit]
