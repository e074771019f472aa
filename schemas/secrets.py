"""Passwords kept out of what tokenmill prints or stores: logs, reports, the jobs table."""

from __future__ import annotations

import re
from typing import Any

# `//user:password@` anywhere in a string (a database URL, or one inside an error message);
# the password runs to the last `@` before whitespace, so one containing `@` is masked whole.
_PASSWORD_IN_URL = re.compile(r"(//[^:/@\s]+:)\S*@")


def mask_url(text: str) -> str:
    """The text with the password of every URL in it replaced by ***."""
    return _PASSWORD_IN_URL.sub(r"\1***@", text)


def scrub(obj: Any) -> Any:
    """A copy of a JSON-like value with `mask_url` applied to every string in it."""
    if isinstance(obj, str):
        return mask_url(obj)
    if isinstance(obj, dict):
        return {k: scrub(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [scrub(v) for v in obj]
    return obj
