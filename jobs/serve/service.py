"""The batch service: what the HTTP routes ask of it (upload a file, create, read and cancel a
batch) and the scheduler thread that moves batches along.

A batch's life, each step written to its row before the next (so a restarted server takes
every batch up where its row says):

1. `validating`: the scheduler checks the input file (validate.py) and stores its line index
   (finalize.py); a bad line fails the batch whole, with the lines named, and nothing runs.
2. `in_progress`: queued as the job of the batch's id (its row in the jobs table: priority from
   `metadata.priority`, then age) for its model's engine process and run there (scheduler.py).
   A job whose process died, or whose server was killed, is run again: `run_job` resumes it
   from the database, so every line is answered once.  A cancel, or the end of the completion
   window, asks the job to stop after its batches in flight (`JobStore.request_cancel`).
3. `finalizing`: the batch's output and error files are written into the files store
   (finalize.py), a line that never ran an error line (`batch_cancelled`, `batch_expired`),
   and the request counts and usage are stored.
4. `completed`, `cancelled`, `expired` or `failed`."""

from __future__ import annotations

import logging
import threading
import time
import uuid
from typing import TYPE_CHECKING, Any

from tokenmill.jobs.serve.blobs import blob_store
from tokenmill.jobs.serve.config import ServeConfig, window_seconds
from tokenmill.jobs.serve.errors import ApiError
from tokenmill.jobs.serve.finalize import BatchFiles
from tokenmill.jobs.serve.quotas import Quotas
from tokenmill.jobs.serve.requests import storable, stored_filename
from tokenmill.jobs.serve.scheduler import Scheduler
from tokenmill.jobs.serve.webhooks import METADATA_KEY, WebhookSender
from tokenmill.schemas import storage as S
from tokenmill.schemas import tables as T
from tokenmill.schemas.wire.openai.objects import ENDED, batch_status
from tokenmill.schemas.wire.openai.request import ENDPOINTS

if TYPE_CHECKING:
    from tokenmill.jobs.serve.replica import Replica

log = logging.getLogger(__name__)

#: How long a running batch's live request counts are reused (they change batch by batch).
COUNTS_TTL_S = 1.0
#: How often a drain looks whether the engines' runs have ended.
DRAIN_POLL_S = 0.2
#: The largest `metadata.priority` either way (the column is a 32-bit integer).
PRIORITY_MAX = 2**31 - 1


def new_id(prefix: str) -> str:
    return f"{prefix}{uuid.uuid4().hex[:24]}"


class BatchService:
    """The service the routes call; its scheduler (`scheduler`, scheduler.py) moves the
    batches along in its own thread, asking `results` (finalize.BatchFiles) for their files."""

    def __init__(self, cfg: ServeConfig, *, replica: Replica | None = None):
        self.cfg, self.replica = cfg, replica
        self._drain_by: float | None = None  # set by SIGTERM: when the drain ends (monotonic)
        self.eng = S.connect(cfg.db_url())
        self.blobs = blob_store(cfg.files_root())
        self.batches, self.files = S.BatchStore(self.eng), S.FileStore(self.eng)
        self.webhooks, self.quotas = WebhookSender(self.eng, cfg.webhooks), Quotas(self.eng, cfg.limits)
        self.results = BatchFiles(cfg, self.eng, self.blobs, self.webhooks, self._count)
        self.scheduler = Scheduler(cfg, self.eng, self.results, quotas=self.quotas, blobs=self.blobs)
        self.counters: dict[tuple[str, ...], float] = {}  # (metric, model, label) → value
        self._counts: dict[str, tuple[float, dict[str, int]]] = {}  # batch id → (when, its live counts)
        self._lock = threading.Lock()
        cfg.work_root().mkdir(parents=True, exist_ok=True, mode=0o700)  # the jobs' folders: the owner's alone

    # ------------------------------------------------------------------ what the routes call

    def add_file(self, owner: str, filename: str | None, purpose: str, path: str, nbytes: int,
                 lines: int, *, ttl_s: float | None = None) -> dict[str, Any]:
        """Store an upload; with `ttl_s`, it expires that long after it is made (then it is not
        found, and the scheduler's sweep removes it)."""
        now = time.time()
        row: dict[str, Any] = {"id": new_id("file-"), "owner": owner, "filename": stored_filename(filename),
               "purpose": purpose, "bytes": nbytes, "lines": lines, "created_at": now, "deleted_at": None,
               "expires_at": None if ttl_s is None else now + ttl_s}
        self.blobs.put_file(row["id"], path)
        self.files.add(row)
        return row

    def delete_file(self, owner: str | None, file_id: str) -> None:
        # the check and the deletion in one transaction: a batch created over the file meanwhile
        # is either named here or refused there, never both done
        deleted, using = self.files.delete_unused(file_id, owner)
        if using is not None:
            raise ApiError(409, f"file {file_id} is the input of batch {using}, which has not ended; cancel it "
                                "first", code="file_in_use")
        if not deleted:
            raise ApiError(404, f"No such File object: {file_id[:100]}", code="not_found", param="file_id")
        self.blobs.delete(file_id)

    def create_batch(self, owner: str, input_file_id: str, endpoint: str, completion_window: str,
                     metadata: dict[str, str] | None, *, output_expires_after: int | None = None) -> dict[str, Any]:
        limits = self.cfg.limits
        storable(completion_window, T.api_batches.c.completion_window, "completion_window")
        if endpoint not in ENDPOINTS:
            raise ApiError(400, f"endpoint must be one of {list(ENDPOINTS)}, got {endpoint[:80]!r}", param="endpoint",
                           code="invalid_value")
        window = window_seconds(completion_window)
        if window is None or not 0 < window <= limits.max_completion_window_s:
            raise ApiError(400, f"completion_window must be like '24h' (s, m, h or d) and at most "
                                f"{limits.max_completion_window_s} s, got {completion_window[:40]!r}",
                           param="completion_window", code="invalid_value")
        meta = _check_metadata(metadata, limits.max_metadata_keys)
        refused = self.webhooks.check_batch_url(meta[METADATA_KEY]) if meta and METADATA_KEY in meta else None
        if refused:
            raise ApiError(400, refused, param=f"metadata.{METADATA_KEY}", code="invalid_value")
        f = self.files.get(input_file_id, owner)
        if f is None:
            raise ApiError(404, f"No such File object: {input_file_id}", code="not_found", param="input_file_id")
        if f["purpose"] != "batch":
            raise ApiError(400, f"file {input_file_id} has purpose {f['purpose']!r}; a batch's input needs 'batch'",
                           param="input_file_id", code="invalid_value")
        with self._lock:  # the in-flight count and the insert together: two requests cannot both pass
            self.quotas.admit(owner)  # 429 naming the limit (or, configured to queue, held in validating)
            now = time.time()
            row: dict[str, Any] = {"id": new_id("batch_"), "owner": owner, "endpoint": endpoint, "input_file_id": input_file_id,
                   "completion_window": completion_window, "metadata": meta, "priority": priority_of(meta),
                   "created_at": now, "expires_at": now + window, "output_expires_after": output_expires_after}
            if not self.batches.add_over_file(row):  # deleted since: the file's row is held while the batch is added
                raise ApiError(404, f"No such File object: {input_file_id}", code="not_found", param="input_file_id")
        self.scheduler.wake()
        return self.batches.get(row["id"]) or row

    def cancel_batch(self, owner: str | None, batch_id: str) -> dict[str, Any]:
        b = self.batches.get(batch_id, owner)
        if b is None:
            raise ApiError(404, f"No such Batch object: {batch_id}", code="not_found", param="batch_id")
        status = batch_status(b)
        if status in ENDED or status == "finalizing":
            raise ApiError(409, f"Cannot cancel a batch with status '{status}'.", code="batch_not_cancellable")
        # only while nothing else has begun to end it: a batch finalized since is not marked cancelling
        if not self.batches.set(batch_id, unless=S.BatchStore.NOT_CANCELLABLE, cancelling_at=time.time()):
            status = batch_status(self.batches.get(batch_id) or b)
            if status != "cancelling":
                raise ApiError(409, f"Cannot cancel a batch with status '{status}'.", code="batch_not_cancellable")
        self.scheduler.wake()
        return self.batches.get(batch_id) or b

    def live_counts(self, b: dict[str, Any]) -> dict[str, int] | None:
        """A running batch's lines answered and failed so far (the job's rows)."""
        if b.get("request_counts") or b.get("in_progress_at") is None:
            return None
        now = time.monotonic()
        held = self._counts.get(b["id"])
        if held is not None and now - held[0] < COUNTS_TTL_S:  # many clients polling one batch: one count a second
            return held[1]
        c = S.MetricsReader(self.eng).counts(b["id"])
        counts = {"completed": c["succeeded"], "failed": c["failed"]}
        if len(self._counts) > 10_000:
            self._counts.clear()
        self._counts[b["id"]] = (now, counts)
        return counts

    # ------------------------------------------------------------------ the threads

    def start(self) -> None:
        self.scheduler.start()
        self.webhooks.start()

    def stop(self) -> None:
        """End the threads and the engine processes: at once, or, once `start_draining` was
        called, after the engines ended their runs (at most `drain_s` after the SIGTERM)."""
        if self._drain_by is not None:
            self._drain()
        self.webhooks.stop()
        self.scheduler.stop()

    def start_draining(self) -> None:
        """SIGTERM (called in the signal handler: no database here): dispatch no new run and
        tell each engine process to take no new unit (its own SIGTERM handler), so its current
        run ends by finishing or handing back what it holds; the registry learns it in a thread."""
        if self._drain_by is not None:
            return
        self._drain_by = time.monotonic() + self.cfg.drain_s
        self.scheduler.draining = True
        for e in list(self.scheduler.engines.values()):
            e.terminate()
        if self.replica is not None:
            threading.Thread(target=self.replica.draining, daemon=True, name="tokenmill-serve-drain").start()

    def _drain(self) -> None:
        """Wait (up to the drain's end) for the engines' runs to end, stop the engines, and hand
        back the unit leases their processes still hold, so other replicas take those units now
        instead of after the leases expire."""
        assert self._drain_by is not None
        engines = list(self.scheduler.engines.values())
        while time.monotonic() < self._drain_by and any(e.running and e.alive() for e in engines):
            time.sleep(DRAIN_POLL_S)
        leases = S.LeaseStore(self.eng)
        for e in engines:
            pid = e.proc.pid if e.proc is not None else None
            e.stop(timeout=max(1.0, self._drain_by - time.monotonic()))
            if pid is not None:
                n = leases.hand_back(S.owner_tag(pid))
                if n:
                    log.warning("drain: handed back %d unit(s) the %s engine (pid %d) still held", n, e.model, pid)

    def _count(self, metric: str, model: str, label: str, n: float) -> None:
        with self._lock:
            key = (metric, model, label)
            self.counters[key] = self.counters.get(key, 0) + n


def _check_metadata(meta: dict[str, Any] | None, max_keys: int) -> dict[str, str] | None:
    if meta is None:
        return None
    if not isinstance(meta, dict) or len(meta) > max_keys:
        raise ApiError(400, f"metadata must be an object of at most {max_keys} keys", param="metadata",
                       code="invalid_value")
    for k, v in meta.items():
        if not isinstance(k, str) or len(k) > 64 or not isinstance(v, str) or len(v) > 512:
            raise ApiError(400, "metadata keys must be strings of at most 64 characters and values strings of at "
                                f"most 512, got key {str(k)[:80]!r}", param="metadata", code="invalid_value")
    return meta


def priority_of(meta: dict[str, str] | None) -> int:
    """`metadata.priority`: an integer; higher runs first among one model's queued batches."""
    raw = (meta or {}).get("priority")
    if raw is None:
        return 0
    try:
        n = int(raw)
    except ValueError:
        n = None
    if n is None or not -PRIORITY_MAX <= n <= PRIORITY_MAX:  # the column is a 32-bit integer
        raise ApiError(400, f"metadata.priority must be a whole number from {-PRIORITY_MAX} to {PRIORITY_MAX}, got "
                            f"{raw[:40]!r}", param="metadata.priority", code="invalid_value")
    return n

