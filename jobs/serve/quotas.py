"""Per-key quotas of `tokenmill serve`: tokens per UTC day and batches in flight, each the
key's own (`tokenmill keys quota`) or the server's `limits`.  A batch created over either is
refused with 429 in OpenAI's error shape, the message naming the limit, what was used and what
is left; with `limits.over_quota: queue` it is accepted and held in `validating` until the key
is under both again.  The tokens are the jobs' own (schemas/storage/usage.py)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable

from tokenmill.jobs.serve.config import Limits
from tokenmill.jobs.serve.errors import ApiError
from tokenmill.schemas import storage as S
from tokenmill.schemas.storage.usage import DAY_S


@dataclass(frozen=True)
class Over:
    """A limit a key is at: which, the limit, what is used and left, and the message."""

    limit: str
    allowed: int
    used: int
    message: str

    @property
    def left(self) -> int:
        return max(0, self.allowed - self.used)


def day_start(now: float) -> float:
    return now - now % DAY_S


class Quotas:
    def __init__(self, eng, limits: Limits, *, clock: Callable[[], float] = time.time):
        self.limits, self.clock = limits, clock
        self.keys, self.batches, self.usage = S.KeyStore(eng), S.BatchStore(eng), S.UsageStore(eng)

    def of(self, key: dict[str, Any] | None) -> tuple[int | None, int]:
        """A key's (tokens per day or None, batches in flight): its own, else the server's."""
        k = key or {}
        return (k.get("tokens_per_day") or self.limits.tokens_per_day,
                k.get("max_batches_in_flight") or self.limits.max_batches_in_flight)

    def over(self, owner: str, *, in_flight: int) -> Over | None:
        """The first limit the key is at with `in_flight` batches counted, or None."""
        tokens_per_day, max_in_flight = self.of(self.keys.get(owner))
        if in_flight >= max_in_flight:
            return Over("max_batches_in_flight", max_in_flight, in_flight,
                        f"max_batches_in_flight: this key has {in_flight} batches not ended, the most it may have is "
                        f"{max_in_flight}; {max(0, max_in_flight - in_flight)} left; wait for one to end")
        if tokens_per_day is not None:
            now = self.clock()
            used = self.usage.tokens_since(owner, day_start(now))
            if used >= tokens_per_day:
                reset = day_start(now) + DAY_S - now
                return Over("tokens_per_day", tokens_per_day, used,
                            f"tokens_per_day: this key's batches used {used:,} of its {tokens_per_day:,} tokens today "
                            f"(UTC); {max(0, tokens_per_day - used):,} left; the day ends in "
                            f"{int(reset // 3600)} h {int(reset % 3600 // 60)} min")
        return None

    def admit(self, owner: str) -> None:
        """At a batch's creation (under the service's lock): refuse it with 429 when the key is
        at a limit and the server refuses; with `queue`, let it in (the scheduler holds it)."""
        if self.limits.over_quota == "queue":
            return
        over = self.over(owner, in_flight=self.batches.in_flight(owner))
        if over is not None:
            raise ApiError(429, over.message, type="rate_limit_error", code="rate_limit_exceeded", param=over.limit)

    def holds(self, b: dict[str, Any]) -> bool:
        """With `queue`: whether a validating batch waits (its key at a limit, counting the
        key's batches that run)."""
        if self.limits.over_quota != "queue":
            return False
        return self.over(b["owner"], in_flight=self.usage.running(b["owner"])) is not None
