"""The online side of a served model's engine process (jobs/serve/engines.py): the messages
the server and the engine process exchange about online requests, on a connection of their
own beside the batches' (`Submit`, `Cancel` in; `Text`, `Done`, `State` out), and `OnlineHost`,
which answers them in the engine process.

Each request is made the engine's record exactly as a batch's line is: the same parse
(schemas/wire/openai/request.py, done by the server), the same row validation
(`validate_row`), tokenizer and chat template (`tokenize_record`, `record_rules`) and sampling
(`request_sampling`), so a greedy answer equals `tokenmill run`'s.  It goes into the engine
the model's batches use (the registry's session, wrapped in `SharedSession` in this process:
`registry.share_sessions`), loaded now with the batches' own engine config when no batch
loaded it.  A thread steps the engine for online requests while no batch does (`pump`)."""

from __future__ import annotations

import logging
import math
import threading
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any, cast

from tokenmill.schemas.errors import first_line

if TYPE_CHECKING:
    from tokenmill.transforms.engines.protocol import EngineSession, Finished
    from tokenmill.transforms.engines.shared_session import SharedSession

log = logging.getLogger(__name__)

#: The online pump's wait when no online request is in the engine (a new one wakes it at once).
PUMP_IDLE_S = 0.5
#: The pump steps only when no batch stepped within this (Generate's loop steps while it runs).
PUMP_GAP_S = 0.02


@dataclass(frozen=True)
class OnlineSetup:
    """What an engine process needs to answer online requests: the job spec its model's
    batches run (`ServeConfig.job_spec`, as JSON) and how batches give way (`ServeConfig.online`)."""

    spec: dict[str, Any]
    batch_floor: float
    reserve_seqs: int
    idle_s: float


@dataclass(frozen=True)
class Submit:
    """Server → engine: answer this request (`fields`: `request_fields` of its body)."""

    id: str
    fields: dict[str, Any]


@dataclass(frozen=True)
class Cancel:
    """Server → engine: its client left; free its sequence."""

    id: str


@dataclass(frozen=True)
class Text:
    """Engine → server: new text of a request (each step's, streamed)."""

    id: str
    text: str


@dataclass(frozen=True)
class Done:
    """Engine → server: a request's end: its row (`RequestFigures`' fields) or an error with
    the HTTP status it is answered with."""

    id: str
    row: dict[str, Any] | None
    error: str | None = None
    status: int = 200


@dataclass(frozen=True)
class State:
    """Engine → server: what the engine holds now (`SharedSession.state`), after each change."""

    model: str
    state: dict[str, int]


class Busy(RuntimeError):
    """The engine runs another of the batch's passes (its embeddings): no online answer now."""


class OnlineHost:
    """Answers the online connection of one engine process (module doc)."""

    def __init__(self, model: str, conn: Connection, setup: OnlineSetup):
        from tokenmill.schemas.config import JobSpec

        self.model, self.conn, self.setup = model, conn, setup
        self.spec = JobSpec.model_validate(setup.spec)
        self.batch_running = False
        """Set by the engine process while a batch's job runs there."""
        self.last_active = -math.inf
        self._send_lock = threading.Lock()
        self._wake = threading.Event()
        self._current: SharedSession | None = None
        self._path: str | None = None
        self._encoder: Any = None

    def wrap(self, inner: EngineSession) -> EngineSession:
        """The registry's wrapper of every session this process makes (`registry.share_sessions`)."""
        from tokenmill.transforms.engines.shared_session import SharedSession

        s = SharedSession(inner, batch_floor=self.setup.batch_floor, reserve_seqs=self.setup.reserve_seqs,
                          idle_s=self.setup.idle_s)
        return cast("EngineSession", s)  # its `max_num_seqs` is a property: the batch's share

    def start(self) -> None:
        threading.Thread(target=self._read, daemon=True, name="tokenmill-online-read").start()
        threading.Thread(target=self._pump, daemon=True, name="tokenmill-online-pump").start()

    def active_within(self, seconds: float) -> bool:
        """Whether an online request ran within `seconds` (the engine is not idle then)."""
        s = self._current
        return bool(s is not None and s.state()["online"]) or time.monotonic() - self.last_active < seconds

    def send(self, msg: Any) -> None:
        with self._send_lock:
            try:
                self.conn.send(msg)
            except (OSError, ValueError):  # the server is gone: this process follows it
                pass

    # ------------------------------------------------------------------ the threads

    def _read(self) -> None:
        while True:
            try:
                msg = self.conn.recv()
            except (EOFError, OSError):
                return
            if msg is None:
                return
            if isinstance(msg, Submit):
                self._submit(msg)
            elif isinstance(msg, Cancel):
                s = self._current
                if s is not None and s.cancel(msg.id):
                    self._report(s)

    def _pump(self) -> None:
        while True:
            s = self._current
            try:
                stepped = s is not None and s.alive() and s.pump(PUMP_GAP_S)
            except Exception as err:  # the engine failed: its online requests ended with it
                log.warning("online step failed: %s", first_line(err))
                stepped = False
            if not stepped:
                self._wake.wait(PUMP_IDLE_S)
                self._wake.clear()

    # ------------------------------------------------------------------ one request

    def _submit(self, msg: Submit) -> None:
        from tokenmill.schemas.records import FailedRecord
        from tokenmill.schemas.sampling import request_sampling, sample_requests
        from tokenmill.transforms.batch_runner import add_keywords
        from tokenmill.transforms.engines.shared_session import OnlineRequest

        self.last_active = time.monotonic()
        try:
            s = self._session()
            p = self._prompt(msg)
        except Busy as err:
            self.send(Done(msg.id, None, str(err), 503))
            return
        except Exception as err:
            log.exception("online request %s", msg.id)
            self.send(Done(msg.id, None, f"the engine could not take the request: {first_line(err)}", 503))
            return
        if isinstance(p, FailedRecord):
            self.send(Done(msg.id, None, p.message, 400))
            return
        sampling = sample_requests(request_sampling(self.spec.sampling.model_dump(), p))[0]

        def on_text(text: str, tokens: int) -> None:
            self.send(Text(msg.id, text))

        def on_done(f: Finished | None, error: str | None) -> None:
            self.last_active = time.monotonic()
            if f is not None and f.error_reason is None:
                self.send(Done(msg.id, {k: v for k, v in f.figures().items() if k != "embedding"}))
            else:
                self.send(Done(msg.id, None, error or (f.error if f else None) or "the engine failed", 500))
            self._report(s)

        s.submit(OnlineRequest(msg.id, p.token_ids, sampling, on_text, on_done, add_keywords(p)))
        self._report(s)
        self._wake.set()

    def _session(self) -> SharedSession:
        """The engine the model's batches use, loaded now (their engine config) when no batch did."""
        from tokenmill.transforms.engines import registry
        from tokenmill.transforms.engines.shared_session import SharedSession
        from tokenmill.transforms.engines.worker import worker_session

        cfg = self.spec.engine
        path = self._model_path()
        held = registry.started_with(cfg, path, registry.factory_for(cfg))
        if held is None and self.batch_running and registry.sessions():
            raise Busy("the model's engine is running a batch's embeddings; try again in a moment")
        s = worker_session(cfg, path, group="online")
        if not isinstance(s, SharedSession):
            raise RuntimeError("the engine process does not share its engine (registry.share_sessions)")
        self._current = s
        return s

    def _model_path(self) -> str:
        """The model folder, as a batch's preflight finds it (the registry's key for its session)."""
        if self._path is None:
            from tokenmill.transforms.counting import TokenCounter
            from tokenmill.transforms.engines.device import has_nvidia_gpu
            from tokenmill.transforms.engines.kinds import engine_of

            cfg = self.spec.engine
            found = engine_of(cfg.kind).preflight(cfg, on_gpu=has_nvidia_gpu())
            if found.problems:
                raise RuntimeError("; ".join(found.problems))
            counter = found.counter or TokenCounter.local(str(found.model_path), model=cfg.model)
            self._encoder = counter.open(threads=1)
            self._path = str(found.model_path)
        return self._path

    def _prompt(self, msg: Submit) -> Any:
        """The request as the engine's record (`TokenizedPrompt`), or its `FailedRecord`."""
        from tokenmill.schemas.records import FailedRecord
        from tokenmill.transforms.images import image_rules
        from tokenmill.transforms.tokenize import record_rules, tokenize_record
        from tokenmill.transforms.validate import validate_row

        fields = msg.fields
        row: dict[str, Any] = {"_row": 0, "_file_index": 0, "id": msg.id,
                               **{k: v for k, v in fields.items() if k not in ("custom_id", "url", "model")}}
        if fields.get("model") in (self.spec.engine.lora_adapters or {}):
            row["adapter"] = fields["model"]
        rec = validate_row(row, None, self.spec.engine.lora_adapters or (), image_rules(self.spec))
        if isinstance(rec, FailedRecord):
            return rec
        return tokenize_record(self._encoder, rec, record_rules(self.spec))

    def _report(self, s: SharedSession) -> None:
        # the state read under the send lock, so the reports of two threads arrive in the order taken
        with self._send_lock:
            try:
                self.conn.send(State(self.model, s.state()))
            except (OSError, ValueError):
                pass
