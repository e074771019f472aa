"""The engine loop of one worker, pure of Beam: token-budgeted batches kept fed through
one engine session, with admission, deadlines and bisection of a failing batch.

The next batch is admitted as soon as the engine has free sequence slots, i.e.
while the current batch's tail is still decoding, so the engine never idles at a
batch boundary.  A batch's results are yielded as soon as all of its requests
are done.

A row the engine rejects is a dead letter (`bad_request`), and so is a row an
engine finishes with a reason code (`Finished.error_reason`: the `openai` engine
after its retries).  If a step fails,
the batches in flight are retried by bisection on a fresh engine until the
poison row is alone; it becomes a dead letter (`engine_error`) and the rest is
answered.  A batch older than `batch_timeout_s` counts as hung: between steps
the runner sees it; a step that never returns (an engine core that froze) is
ended by a watchdog thread that kills the engine's processes, so the same
restart-and-bisect path runs and the row that hangs becomes `engine_timeout`.
The Beam step around it is transforms/generate.py.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter, deque
from dataclasses import dataclass
from typing import Any, Callable

from tokenmill.schemas import records as R
from tokenmill.schemas.config import BatchingConfig, EngineConfig, SamplingDefaults
from tokenmill.schemas.errors import first_line
from tokenmill.schemas.records import Batch, BatchStats, FailedRecord, OutputRow, TokenizedPrompt
from tokenmill.schemas.sampling import request_sampling, sample_requests
from tokenmill.transforms import answers
from tokenmill.transforms.engines.protocol import EngineSession, Finished

log = logging.getLogger(__name__)


@dataclass
class GenerateConfig:
    job_id: str
    run_id: str
    model_name: str
    model_path: str
    engine: EngineConfig
    sampling: SamplingDefaults
    batching: BatchingConfig
    db_url: str | None = None
    num_workers: int = 1
    """Engine processes sharing this host (DirectRunner multi_processing): on CPU each
    binds its own cores and gets its share of the KV cache memory."""
    cache: str = "off"
    """The job's `cache` mode: with `read-write` each deterministic answer is stored (transforms/cache.py)."""
    fingerprint: str | None = None
    """The engine's identity in the result cache's keys (the launcher's `LaunchSide.fingerprint`)."""
    adapter_hashes: dict[str, str] | None = None
    """The LoRA adapters' content hashes in those keys (`engines/identity.adapter_hashes`)."""
    lease_s: float | None = None
    """A shared job's lease length (`runner.lease_s`): each batch's commit is fenced by its
    unit's lease and renews it."""


def add_keywords(p: TokenizedPrompt) -> dict[str, Any]:
    """What an engine's `add` takes of a prompt besides its token ids and sampling: its text
    (`source`, kept only for an engine that takes text), its LoRA adapter, its images; each
    only when the prompt has it."""
    out: dict[str, Any] = {} if p.source is None else {"source": p.source}
    if p.adapter is not None:  # an engine's session is told only when a row names one
        out["adapter"] = p.adapter
    if p.images:  # only an engine that `takes_images` gets a row with images
        out["images"] = p.images
    return out


class BatchTimeout(RuntimeError):
    """A batch stayed in the engine longer than `batching.batch_timeout_s` (a hung request)."""


class StepWatchdog:
    """Kills the engine (its `kill()`) when one `step()` outlives its deadline.

    The runner's own deadline check runs between steps; a step that blocks (an
    engine core that hangs or froze) never gets there.  One daemon thread per
    runner, armed around each step; `fired` tells the runner it was a timeout."""

    GRACE_S = 1.0

    def __init__(self, poll_s: float = 0.2):
        self.poll_s = poll_s
        self._deadline: float | None = None
        self._kill: Callable[[], None] | None = None
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self.fired = False
        self._thread: threading.Thread | None = None

    def arm(self, seconds_left: float, kill: Callable[[], None]) -> None:
        with self._lock:
            self.fired = False
            self._deadline = time.monotonic() + max(0.0, seconds_left) + self.GRACE_S
            self._kill = kill
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="tokenmill-step-watchdog", daemon=True)
            self._thread.start()

    def disarm(self) -> None:
        with self._lock:
            self._deadline = self._kill = None

    def close(self) -> None:
        self._stop.set()

    def _loop(self) -> None:
        while not self._stop.wait(self.poll_s):
            with self._lock:
                due = self._deadline is not None and time.monotonic() > self._deadline
                kill = self._kill if due else None
                if due:
                    self.fired, self._deadline, self._kill = True, None, None
            if kill is not None:
                log.warning("engine step blocked past batch_timeout_s; killing the engine to recover")
                try:
                    kill()
                except Exception as err:  # the step may still return; the runner sees `fired`
                    log.warning("killing the engine failed: %s", first_line(err))


class BatchRunner:
    """Drives one engine session over a list of batches. Pure of Beam: tested with a fake session."""

    def __init__(
        self,
        cfg: GenerateConfig,
        session_fn: Callable[[], EngineSession],
        restart_fn: Callable[[], EngineSession],
        cancelled: Callable[[], bool] = lambda: False,
        clock: Callable[[], float] = time.time,
        worker: str = "",
        before_admit: Callable[[int], None] | None = None,
    ):
        self.cfg = cfg
        self._defaults = cfg.sampling.model_dump()
        """The job's sampling defaults, dumped once: every request's sampling starts from them."""
        self._before_admit = before_admit
        """Told how many requests are about to be handed to the engine, before they are
        (a write-ahead count: a worker that dies mid-batch has already said what it took on)."""
        self._session_fn = session_fn
        self._restart_fn = restart_fn
        self._cancelled = cancelled
        self._clock = clock
        self.worker = worker
        self.cancelled = False
        self._watchdog = StepWatchdog()
        self._pending: deque[Batch] = deque()
        self._active: dict[str, dict[str, Any]] = {}
        """batch id → its state, for the batches in the engine"""
        self._owner: dict[str, tuple[str, TokenizedPrompt, int]] = {}
        """request id → (batch id, prompt, sample), for the requests in the engine"""
        self._samples: dict[tuple[str, int, int], list[Any]] = {}
        """(batch id, input position) → the finished samples of a row asking for n > 1, until all are in"""
        self.admitted_rows = 0
        """Requests handed to the engine, retries included: engine-side work, for rework figures."""
        self.generated_rows = 0
        """Requests the engine finished (committed or not)."""
        self.generated_tokens = 0

    # -- helpers
    def _output_row(self, p: TokenizedPrompt, f: Finished, batch_id: str, sample: int = 0) -> dict[str, Any]:
        self.generated_rows += 1
        self.generated_tokens += f.output_tokens or 0
        figures = f.figures()
        if f.embedding is None:  # an embedding has no text to check
            sampling = request_sampling(self._defaults, p)
            figures.update(answers.answered(sampling, f.text or "", f.finish_reason, f.logprobs))
        return OutputRow(
            job_id=self.cfg.job_id, id=p.id, sample=sample, input_file=p.input_file, input_row=p.input_row,
            model=self.cfg.model_name, adapter=p.adapter, reference=p.reference, batch_id=batch_id, worker=self.worker,
            **figures,
        ).as_dict()

    def _finished(self, p: TokenizedPrompt, f: Finished, bid: str, sample: int):
        """One finished engine request: the row's output rows and dead letter once all its
        samples are in (([], None) until then; a row whose sample the engine gave up on is
        that dead letter alone, none of its samples stored)."""
        result = self._gave_up(p, f) if f.error_reason is not None else self._output_row(p, f, bid, sample)
        if p.samples == 1:
            return ([], result) if isinstance(result, FailedRecord) else ([result], None)
        got = self._samples.setdefault((bid, p.input_file, p.input_row), [])
        got.append(result)
        if len(got) < p.samples:
            return [], None
        del self._samples[(bid, p.input_file, p.input_row)]
        dead = next((r for r in got if isinstance(r, FailedRecord)), None)
        return ([], dead) if dead is not None else (sorted(got, key=lambda r: r["sample"]), None)

    @staticmethod
    def _gave_up(p: TokenizedPrompt, f: Finished) -> FailedRecord:
        """The dead letter of a row the engine finished with `error_reason` (never None here)."""
        reason = f.error_reason or R.ENGINE_ERROR
        return FailedRecord(p.input_file, p.input_row, p.id, reason, f.error or reason)

    def _add(self, s: EngineSession, p: TokenizedPrompt, rid: str) -> list[str] | FailedRecord:
        """Hand the engine a row's requests (one per sample, `rid` and `rid~i`): their request
        ids, or the row's dead letter when the engine rejects one (the others are aborted)."""
        added: list[str] = []
        try:
            source = add_keywords(p)
            for i, sampling in enumerate(sample_requests(request_sampling(self._defaults, p))):
                one = rid if i == 0 else f"{rid}~{i}"
                s.add(one, p.token_ids, sampling, **source)
                added.append(one)
        except Exception as err:
            if added:
                s.abort(added)
            return FailedRecord(p.input_file, p.input_row, p.id, R.BAD_REQUEST, f"engine rejected the request: {first_line(err)}")
        self.admitted_rows += len(added)
        return added

    def run(self, batches: list[Batch]):
        """Yield (rows, dead, stats) per finished batch, until every batch is answered."""
        try:
            self.feed(batches)
            yield from self.drain()
        finally:
            self.close()

    def feed(self, batches: list[Batch]) -> None:
        """Queue batches behind the ones already fed (a worker's next work unit)."""
        self._pending.extend(batches)

    def advance(self):
        """Yield finished batches until every fed batch is in the engine, then return
        with the last ones still in flight: the engine keeps decoding them while the
        worker reads and tokenizes its next unit (no drain at a unit's end)."""
        yield from self._drive(drain=False)

    def drain(self):
        """Yield finished batches until nothing is in flight."""
        yield from self._drive(drain=True)

    @property
    def in_flight(self) -> int:
        """Batches fed and not yet yielded."""
        return len(self._pending) + len(self._active)

    def discard(self) -> None:
        """Forget what is in flight (a failed bundle: its work is retried): abort its
        requests so they do not hold engine slots, and stop the watchdog."""
        if self._owner:
            try:
                self._session_fn().abort(list(self._owner))
            except Exception as err:  # an engine that is gone has nothing to abort
                log.debug("abort of a discarded runner's requests failed: %s", first_line(err))
        self._pending.clear()
        self._active.clear()
        self._owner.clear()
        self._samples.clear()
        self.close()

    def close(self) -> None:
        """Stop the watchdog thread (a later step arms a new one)."""
        self._watchdog.close()
        self._watchdog = StepWatchdog()

    def _step(self, s: EngineSession, started: float) -> list[Finished]:
        """One engine step, with the batch deadline enforced before it and, by killing
        the engine, during it."""
        self._check_deadline(started)
        limit = self.cfg.batching.batch_timeout_s
        self._watchdog.arm(limit - (self._clock() - started), s.kill)
        failure: Exception | None = None
        try:
            out = s.step()
        except Exception as err:
            if not self._watchdog.fired:
                raise
            failure = err
        finally:
            self._watchdog.disarm()
        if self._watchdog.fired:  # also when killed just as the step returned: the engine is gone anyway
            raise BatchTimeout(f"engine step blocked past {limit:g} s (batch_timeout_s); engine killed") from failure
        return out

    def _drive(self, drain: bool):
        s = self._session_fn()
        pending, active, owner = self._pending, self._active, self._owner
        max_ahead = self.cfg.batching.max_inflight_batches
        while pending or (drain and active):
            # Admit while the engine has free sequence slots (the tail of the
            # current batch), keeping at most max_ahead batches in flight.
            while pending and len(active) < max_ahead and (not active or s.num_unfinished() < s.max_num_seqs):
                if self._cancelled():
                    self.cancelled = True
                    pending.clear()
                    break
                b = pending.popleft()
                if self._before_admit is not None:
                    self._before_admit(len(b.prompts))
                st: dict[str, Any] = {"batch": b, "rows": [], "dead": [], "left": 0, "started": self._clock(),
                                      "done_times": [], "idle": 0.0}
                active[b.batch_id] = st
                for i, p in enumerate(b.prompts):
                    added = self._add(s, p, f"{b.batch_id}.{i}")
                    if isinstance(added, FailedRecord):
                        st["dead"].append(added)
                        continue
                    for j, rid in enumerate(added):
                        owner[rid] = (b.batch_id, p, j)
                    st["left"] += len(added)
            if not pending and not drain:
                return  # every fed batch is in the engine: the caller's next unit comes next
            if not active:
                continue
            # Underfed: the engine has free sequence slots while a batch waits
            # (held back by max_inflight_batches).  Charged to the oldest batch.
            underfed = bool(pending) and s.num_unfinished() < s.max_num_seqs
            t_step = self._clock()
            try:
                finished = self._step(s, min(st["started"] for st in active.values()))
            except Exception as err:
                log.warning("engine step failed (%s); isolating the batches in flight", first_line(err))
                yield from self._recover(s, active, owner)
                s = self._live_session()
                active.clear()
                owner.clear()
                continue
            if underfed and active:
                next(iter(active.values()))["idle"] += self._clock() - t_step
            for f in finished:
                entry = owner.pop(f.request_id, None)
                if entry is None:
                    continue
                bid, p, sample = entry
                st = active[bid]
                if f.retries is not None:  # an HTTP engine's retries of this row, by reason
                    st.setdefault("retries", Counter()).update(f.retries)
                rows, dead = self._finished(p, f, bid, sample)  # the engine gave up on it: a dead letter
                if dead is not None:
                    st["dead"].append(dead)
                st["rows"].extend(rows)
                st["done_times"].extend(r["finished_at"] for r in rows)
                st["left"] -= 1
            for bid in [b for b, st in active.items() if st["left"] <= 0]:
                st = active.pop(bid)
                yield self._emit(st)

    def _live_session(self) -> EngineSession:
        s = self._session_fn()
        return s if s.alive() else self._restart_fn()

    def _check_deadline(self, started: float) -> None:
        # Checked between engine steps: a request that never finishes trips it.
        limit = self.cfg.batching.batch_timeout_s
        if self._clock() - started > limit:
            raise BatchTimeout(f"batch still unfinished after {limit:g} s (batch_timeout_s)")

    def _emit(self, st: dict[str, Any]):
        b: Batch = st["batch"]
        now = self._clock()
        times = sorted(st["done_times"])
        # Tail: from when 90% of the batch was done to its last request.
        tail = (times[-1] - times[int(0.9 * (len(times) - 1))]) if times else 0.0
        rows = st["rows"]
        stats = BatchStats(
            job_id=self.cfg.job_id, batch_id=b.batch_id, worker=self.worker, requests=len(b.prompts),
            prompt_tokens=sum(r["prompt_tokens"] for r in rows),
            output_tokens=sum(r["output_tokens"] for r in rows),
            # None when the engine cannot count prefix-cache hits (the `openai` engine, mostly)
            cached_tokens=None if rows and all(r["cached_tokens"] is None for r in rows)
            else sum(r["cached_tokens"] or 0 for r in rows),
            started_at=st["started"], finished_at=now, tail_s=tail, engine_idle_s=st.get("idle", 0.0),
            retries=dict(st["retries"]) if "retries" in st else None,
        )
        return rows, st["dead"], stats.as_dict()

    def _recover(self, s, active, owner):
        """A step failed: abort what is in flight, restart the engine if it died,
        and answer the in-flight batches one by one with bisection."""
        s.abort(list(owner))
        self._samples.clear()  # the rows whose samples were not all in are answered again, whole
        for bid, st in list(active.items()):
            done_ids = {r["id"] for r in st["rows"]}
            todo = [p for p in st["batch"].prompts if p.id not in done_ids and all(d.id != p.id for d in st["dead"])]
            rows, dead = list(st["rows"]), list(st["dead"])
            r2, d2 = self._isolate(todo, bid)
            rows += r2
            dead += d2
            st["rows"], st["dead"], st["done_times"] = rows, dead, [r["finished_at"] for r in rows]
            yield self._emit(st)

    def _run_sync(self, prompts: list[TokenizedPrompt], bid: str):
        s = self._live_session()
        owner: dict[str, tuple[TokenizedPrompt, int]] = {}
        rows: list[dict[str, Any]] = []
        dead: list[FailedRecord] = []
        for i, p in enumerate(prompts):
            added = self._add(s, p, f"{bid}.r{time.monotonic_ns()}.{i}")
            if isinstance(added, FailedRecord):
                dead.append(added)
                continue
            for j, rid in enumerate(added):
                owner[rid] = (p, j)
        started = self._clock()
        try:
            while owner:
                for f in self._step(s, started):
                    entry = owner.pop(f.request_id, None)
                    if entry is None:
                        continue
                    got, bad = self._finished(entry[0], f, bid, entry[1])
                    rows.extend(got)
                    if bad is not None:
                        dead.append(bad)
        except Exception:
            s.abort(list(owner))
            self._samples.clear()
            raise
        return rows, dead

    def _isolate(self, prompts: list[TokenizedPrompt], bid: str):
        if not prompts:
            return [], []
        try:
            return self._run_sync(prompts, bid)
        except Exception as err:
            self._live_session()  # restart a dead engine now, before the halves run
            if len(prompts) == 1:
                p = prompts[0]
                if isinstance(err, BatchTimeout):
                    return [], [FailedRecord(p.input_file, p.input_row, p.id, R.ENGINE_TIMEOUT, f"engine hung on this row: {first_line(err)}")]
                return [], [FailedRecord(p.input_file, p.input_row, p.id, R.ENGINE_ERROR, f"engine failed on this row: {first_line(err)}")]
            mid = len(prompts) // 2
            r1, d1 = self._isolate(prompts[:mid], bid)
            r2, d2 = self._isolate(prompts[mid:], bid)
            return r1 + r2, d1 + d2
