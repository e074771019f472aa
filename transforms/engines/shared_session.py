"""One warm engine shared by a batch and online requests (`tokenmill serve`, docs/SERVING.md
"Online requests"): the one owner of the engine in its process.

`SharedSession` wraps the engine's own session.  Generate gets it from the registry like any
session (`registry.share_sessions`) and drives it as ever: `add`, `step`, `num_unfinished`,
`max_num_seqs`.  The online side hands it requests with `submit` (callbacks for each step's
new text and for the end) and takes them back with `cancel`.  One lock around the engine:
whoever steps (Generate's loop while a batch runs, the online pump otherwise: `pump`) hands
the online requests' new text to their callbacks and keeps the batch's finished requests for
Generate's next `step`.

Batches give way.  While online requests run, or ran within `idle_s`, the batch's share of
the engine's sequences (`max_num_seqs` as Generate sees it, and what this session lets into
the engine) is the engine's `max_num_seqs` less the online requests and `reserve_seqs` spare
seats, but never under `batch_floor` of it; the batch's requests past its share wait here,
not in the engine.  An online request that finds every seat taken takes the seat of the
batch request added last (the one with the least done: aborted and added again, first in
line, when a seat frees), so it starts within about one engine step.  An engine that
schedules by priority (vLLM's `scheduling_policy: priority`) is also told each online
request's (`ONLINE_PRIORITY`, ahead of the batch's 0).

An engine that streams (it keeps `progress`: request id → text so far, and takes `stream=`
and `priority=` in `add`: vLLM) gives the online callbacks each step's new text; any other
engine's online answer comes whole, as one piece, at its end."""

from __future__ import annotations

import dataclasses
import logging
import math
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from tokenmill.schemas.errors import first_line
from tokenmill.transforms.engines.protocol import EngineSession, Finished

log = logging.getLogger(__name__)

#: The priority an online request is added with on an engine that schedules by priority
#: (lower runs first in vLLM; a batch's requests are added with its default, 0).
ONLINE_PRIORITY = -1


@dataclass
class OnlineRequest:
    """An online request as the engine takes it, and whom to tell what it produced.

    `on_text(text, output_tokens)`: new text since the last call (a streaming engine's step by
    step; any other engine's whole answer once); `on_done(finished, error)`: the end, the
    engine's `Finished` (its text whole) or None with one line saying why it failed."""

    request_id: str
    token_ids: Sequence[int]
    sampling: dict[str, Any]
    on_text: Callable[[str, int], None]
    on_done: Callable[[Finished | None, str | None], None]
    extra: dict[str, Any] = field(default_factory=dict)
    """What `add` takes besides (`source`, `adapter`), as Generate would pass them."""
    sent: int = 0
    """Characters of its text handed to `on_text` so far."""


@dataclass
class _BatchRequest:
    request_id: str
    token_ids: Sequence[int]
    sampling: dict[str, Any]
    extra: dict[str, Any]
    preempted: bool = False
    """It gave its seat to an online request: added again under a new engine id."""


class SharedSession:
    """An `EngineSession` for Generate over `inner`, shared with online requests (module doc)."""

    def __init__(self, inner: EngineSession, *, batch_floor: float = 0.5, reserve_seqs: int = 1,
                 idle_s: float = 2.0, clock: Callable[[], float] = time.monotonic):
        self.inner = inner
        self.engine_seqs = int(inner.max_num_seqs)
        self.floor = max(1, min(self.engine_seqs, math.ceil(batch_floor * self.engine_seqs)))
        self.reserve_seqs, self.idle_s, self._clock = reserve_seqs, idle_s, clock
        self._lock = threading.RLock()
        self._held: deque[_BatchRequest] = deque()
        """The batch's requests past its share: not in the engine yet."""
        self._batch: dict[str, _BatchRequest] = {}
        """Engine request id → the batch request in the engine (added order: the last is the youngest)."""
        self._online: dict[str, OnlineRequest] = {}
        self._finished: list[Finished] = []
        self._calls: list[tuple[Callable[..., None], tuple]] = []
        """Online callbacks due, run outside the lock (`_flush`)."""
        """Batch requests finished in a step someone else ran: Generate's next `step` returns them."""
        self._last_online = -math.inf
        self._last_batch_step = -math.inf
        self._readds = 0
        self.streams = hasattr(inner, "progress")
        self.preempted = 0
        """Batch requests that gave their seat to an online request (added again later)."""
        self.online_done = 0

    # ------------------------------------------------------------------ Generate's side

    @property
    def max_num_seqs(self) -> int:
        """The batch's share of the engine's sequences now (module doc)."""
        with self._lock:
            return self._share()

    def _share(self) -> int:
        if not self._online and self._clock() - self._last_online > self.idle_s:
            return self.engine_seqs
        return max(self.floor, self.engine_seqs - len(self._online) - self.reserve_seqs)

    def add(self, request_id: str, token_ids: Sequence[int], sampling: dict[str, Any], **extra: Any) -> None:
        """A batch request: into the engine while the batch is within its share (a request the
        engine rejects raises here, as Generate expects), else held until a seat frees."""
        r = _BatchRequest(request_id, token_ids, sampling, extra)
        with self._lock:
            if len(self._batch) < self._share() and not self._held:
                self.inner.add(request_id, token_ids, sampling, **extra)
                self._batch[request_id] = r
            else:
                self._held.append(r)

    def step(self) -> list[Finished]:
        try:
            with self._lock:
                self._last_batch_step = self._clock()
                self._step()
                out, self._finished = self._finished, []
        finally:
            self._flush()
        return out

    def num_unfinished(self) -> int:
        """The batch's requests not finished: in the engine and held here."""
        with self._lock:
            return len(self._batch) + len(self._held) + len(self._finished)

    def abort(self, request_ids: list[str]) -> None:
        gone = set(request_ids)
        with self._lock:
            self._held = deque(r for r in self._held if r.request_id not in gone)
            self._finished = [f for f in self._finished if f.request_id not in gone]
            eids = [eid for eid, r in self._batch.items() if r.request_id in gone]
            for eid in eids:
                del self._batch[eid]
            if eids:
                self.inner.abort(eids)

    def alive(self) -> bool:
        return self.inner.alive()

    def kill(self) -> None:
        self.inner.kill()

    def info(self) -> dict[str, Any]:
        return self.inner.info()

    def shutdown(self) -> None:
        """Stop the engine; the online requests in it end with an error."""
        with self._lock:
            self._calls += [(o.on_done, (None, "the engine was stopped")) for o in self._online.values()]
            self._online.clear()
            self._held.clear()
            self._batch.clear()
        self._flush()
        self.inner.shutdown()

    def __getattr__(self, name: str) -> Any:  # what else the engine's session offers (metrics, cfg...)
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)

    # ------------------------------------------------------------------ the online side

    def submit(self, o: OnlineRequest) -> None:
        """Into the engine now, ahead of the batch: a seat taken from the batch's youngest
        request if none is free.  A request the engine rejects ends at once (`on_done` error)."""
        with self._lock:
            self._last_online = self._clock()
            while self._batch and len(self._batch) + len(self._online) >= self.engine_seqs:
                self._preempt()
            extra = dict(o.extra)
            if self.streams:
                extra.update(stream=True, priority=ONLINE_PRIORITY)
            try:
                self.inner.add(o.request_id, o.token_ids, o.sampling, **extra)
            except Exception as err:
                self._calls.append((o.on_done, (None, f"the engine rejected the request: {first_line(err)}")))
            else:
                self._online[o.request_id] = o
        self._flush()

    def cancel(self, request_id: str) -> bool:
        """Take an online request out of the engine (its client left); False when it is not there."""
        with self._lock:
            if self._online.pop(request_id, None) is None:
                return False
            self._last_online = self._clock()
            self.inner.abort([request_id])
            self._release()
            return True

    def pump(self, gap_s: float = 0.02) -> bool:
        """Step for the online requests when no batch stepped within `gap_s` (Generate's loop
        steps while it runs); False when no online request is in the engine."""
        waited = False
        try:
            with self._lock:
                if not self._online:
                    return False
                waited = self._clock() - self._last_batch_step < gap_s
                if not waited:
                    self._step()
        finally:
            self._flush()
        if waited:
            time.sleep(gap_s)
        return True

    def state(self) -> dict[str, int]:
        """What the engine holds now: online requests, the batch's in the engine and held, its
        share, the engine's own unfinished count, batch requests preempted so far."""
        with self._lock:
            return {"online": len(self._online), "batch_in_engine": len(self._batch), "batch_held": len(self._held),
                    "batch_share": self._share(), "engine_unfinished": self.inner.num_unfinished(),
                    "preempted": self.preempted, "online_done": self.online_done}

    # ------------------------------------------------------------------ under the lock

    def _preempt(self) -> None:
        eid = next(reversed(self._batch))
        r = self._batch.pop(eid)
        self.inner.abort([eid])
        r.preempted = True
        self._held.appendleft(r)
        self.preempted += 1

    def _release(self) -> None:
        """Held batch requests into the engine while the batch is under its share."""
        while self._held and len(self._batch) < self._share() \
                and len(self._batch) + len(self._online) < self.engine_seqs:
            r = self._held.popleft()
            eid = r.request_id
            if r.preempted:  # its old engine id may still be on its way out of the engine
                self._readds += 1
                eid = f"{r.request_id}#{self._readds}"
            try:
                self.inner.add(eid, r.token_ids, r.sampling, **r.extra)
            except Exception as err:  # the engine rejects it: that row's dead letter, as at once
                from tokenmill.schemas import records as R

                self._finished.append(Finished(request_id=r.request_id, text=None, finish_reason=None,
                                               error_reason=R.BAD_REQUEST,
                                               error=f"engine rejected the request: {first_line(err)}"))
                continue
            self._batch[eid] = r

    def _flush(self) -> None:
        """Run the online callbacks due, outside the lock; one that raises is logged and the rest still run."""
        with self._lock:
            calls, self._calls = self._calls, []
        for fn, args in calls:
            try:
                fn(*args)
            except Exception:
                log.exception("an online request's callback failed")

    def _step(self) -> None:
        calls = self._calls
        try:
            finished = self.inner.step()
        except Exception as err:
            if not self.inner.alive():  # the engine is gone: its online requests with it
                calls += [(o.on_done, (None, f"the engine failed: {first_line(err)}")) for o in self._online.values()]
                self._online.clear()
            raise
        for f in finished:
            o = self._online.pop(f.request_id, None)
            if o is not None:
                text = f.text or ""
                if len(text) > o.sent:
                    calls.append((o.on_text, (text[o.sent:], f.output_tokens or 0)))
                calls.append((o.on_done, (f, None)))
                self.online_done += 1
                self._last_online = self._clock()
                continue
            r = self._batch.pop(f.request_id, None)
            if r is not None:
                self._finished.append(f if f.request_id == r.request_id else dataclasses.replace(f, request_id=r.request_id))
        progress: dict[str, tuple[str, int]] = getattr(self.inner, "progress", None) or {}
        for rid, o in self._online.items():
            text, tokens = progress.get(rid, ("", 0))
            if len(text) > o.sent:
                calls.append((o.on_text, (text[o.sent:], tokens)))
                o.sent = len(text)
        self._release()
