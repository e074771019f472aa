"""The batch service: what the HTTP routes ask of it (upload a file, create, read and cancel a
batch) and the scheduler thread that moves batches along.

A batch's life, each step written to its row before the next (so a restarted server takes
every batch up where its row says):

1. `validating`: the scheduler checks the input file (validate.py); a bad line fails the batch
   whole, with the lines named, and nothing runs.
2. `in_progress`: queued as the job of the batch's id (its row in the jobs table: priority from
   `metadata.priority`, then age) for its model's engine process and run there (scheduler.py).
   A job whose process died, or whose server was killed, is run again: `run_job` resumes it
   from the database, so every line is answered once.  A cancel, or the end of the completion window, asks the job to stop after
   its batches in flight (`JobStore.request_cancel`).
3. `finalizing`: the job's own exports (outputs.jsonl, errors.jsonl) become the batch's
   output and error files, a line that never ran an error line (`batch_cancelled`,
   `batch_expired`), and the request counts and usage are stored.
4. `completed`, `cancelled`, `expired` or `failed`."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from tokenmill.jobs.lifecycle.openai_export import unanswered_line
from tokenmill.jobs.lifecycle.sinks import export_job
from tokenmill.jobs.serve.blobs import blob_store
from tokenmill.jobs.serve.config import ServeConfig, window_seconds
from tokenmill.jobs.serve.engines import EngineProcess
from tokenmill.jobs.serve.objects import ENDED, batch_status, usage_of
from tokenmill.jobs.serve.quotas import Quotas
from tokenmill.jobs.serve.scheduler import Scheduler
from tokenmill.jobs.serve.validate import check_file, line_error
from tokenmill.jobs.serve.webhooks import METADATA_KEY, WebhookSender
from tokenmill.schemas import storage as S
from tokenmill.schemas.errors import first_line

log = logging.getLogger(__name__)

TICK_S = 0.5
#: How long a running batch's live request counts are reused (they change batch by batch).
COUNTS_TTL_S = 1.0
#: Job statuses whose rows are all answered or dead-lettered (the batch completed).
JOB_DONE = ("succeeded", "partial")
ENDED_BY = {"cancelled": ("batch_cancelled", "This line was not executed because the batch was cancelled."),
            "expired": ("batch_expired", "This line was not executed because the batch's completion window ended "
                                         "before it ran."),
            "failed": ("batch_failed", "This line was not executed because the batch failed.")}


class ApiError(Exception):
    """A refusal the routes turn into OpenAI's error shape."""

    def __init__(self, status: int, message: str, *, code: str | None = None, param: str | None = None,
                 type: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.code, self.param, self.type = status, code, param, type


def new_id(prefix: str) -> str:
    return f"{prefix}{uuid.uuid4().hex[:24]}"


def derived_file_id(batch_id: str, which: str) -> str:
    """The output or error file's id of a batch: the same on every finalization (a server killed
    while finalizing writes the same file again, never a second one)."""
    return "file-" + hashlib.sha256(f"{batch_id}/{which}".encode()).hexdigest()[:24]


class BatchService(Scheduler):
    def __init__(self, cfg: ServeConfig):
        self.cfg = cfg
        self.db_url = cfg.db_url()
        self.eng = S.connect(self.db_url)
        self.blobs = blob_store(cfg.files_root())
        self.batches, self.files = S.BatchStore(self.eng), S.FileStore(self.eng)
        self.webhooks, self.quotas = WebhookSender(self.eng, cfg.webhooks), Quotas(self.eng, cfg.limits)
        self.engines: dict[str, EngineProcess] = {}
        self.counters: dict[tuple[str, ...], float] = {}  # (metric, model, label) → value
        self._counts: dict[str, tuple[float, dict[str, int]]] = {}  # batch id → (when, its live counts)
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        cfg.work_root().mkdir(parents=True, exist_ok=True)

    # ------------------------------------------------------------------ what the routes call

    def add_file(self, owner: str, filename: str, purpose: str, path: str, nbytes: int, lines: int) -> dict[str, Any]:
        row: dict[str, Any] = {"id": new_id("file-"), "owner": owner, "filename": filename[:512] or "upload.jsonl",
               "purpose": purpose, "bytes": nbytes, "lines": lines, "created_at": time.time(), "deleted_at": None}
        self.blobs.put_file(row["id"], path)
        self.files.add(row)
        return row

    def delete_file(self, owner: str | None, file_id: str) -> None:
        f = self.files.get(file_id, owner)
        if f is None:
            raise ApiError(404, f"No such File object: {file_id}", code="not_found", param="file_id")
        using = [b["id"] for b in self.batches.unfinished() if b["input_file_id"] == file_id]
        if using:
            raise ApiError(409, f"file {file_id} is the input of batch {using[0]}, which has not ended; cancel it "
                                "first", code="file_in_use")
        self.files.delete(file_id, owner)
        self.blobs.delete(file_id)

    def create_batch(self, owner: str, input_file_id: str, endpoint: str, completion_window: str,
                     metadata: dict[str, str] | None) -> dict[str, Any]:
        from tokenmill.transforms.openai_batch import ENDPOINTS

        limits = self.cfg.limits
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
                   "created_at": now, "expires_at": now + window}
            self.batches.add(row)
        self._wake.set()
        return self.batches.get(row["id"]) or row

    def cancel_batch(self, owner: str | None, batch_id: str) -> dict[str, Any]:
        b = self.batches.get(batch_id, owner)
        if b is None:
            raise ApiError(404, f"No such Batch object: {batch_id}", code="not_found", param="batch_id")
        status = batch_status(b)
        if status in ENDED or status == "finalizing":
            raise ApiError(409, f"Cannot cancel a batch with status '{status}'.", code="batch_not_cancellable")
        self.batches.set(batch_id, unless="cancelling_at", cancelling_at=time.time())
        self._wake.set()
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

    # ------------------------------------------------------------------ the scheduler (scheduler.py)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, daemon=True, name="tokenmill-serve-scheduler")
        self._thread.start()
        self.webhooks.start()

    def stop(self) -> None:
        self.webhooks.stop()
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(10)
        for e in self.engines.values():
            e.stop()

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.tick()
            except Exception:  # one bad batch or a database hiccup must not stop the service
                log.exception("scheduler tick failed")
            self._wake.wait(TICK_S)
            self._wake.clear()

    def _validate(self, b: dict[str, Any]) -> dict[str, Any] | None:
        """Check the batch's file: its row failed with the errors (None), or queued (the row)."""
        lim = self.cfg.limits
        path, temp = self.blobs.local_copy(b["input_file_id"])
        try:
            found = check_file(open(path, "rb"), self.cfg.served_names(), max_lines=lim.max_file_lines,
                               max_errors=lim.max_line_errors)
        except OSError as err:
            found = None
            problem = first_line(err)
        finally:
            if temp:
                os.unlink(path)
        now = time.time()
        if found is None or found.errors:
            errors = found.errors if found is not None else [line_error("file_unreadable", problem, None)]
            self._fail_validating(b, errors, lines=found.lines if found else 0, model=found.model if found else None)
            return None
        self.batches.set(b["id"], unless="in_progress_at", in_progress_at=now, lines=found.lines, model=found.model)
        return {**b, "in_progress_at": now, "lines": found.lines, "model": found.model}

    def _fail_validating(self, b: dict[str, Any], errors: list[dict[str, Any]], *, lines: int,
                         model: str | None) -> None:
        """End a batch `failed` in validation, with its errors; nothing of it ran."""
        if self.webhooks.end_batch(b, "failed", failed_at=time.time(), errors=errors, lines=lines, model=model,
                                   request_counts={"total": lines, "completed": 0, "failed": 0}):
            self._count("batches", model or "", "failed", 1)

    def _finalize(self, b: dict[str, Any]) -> None:
        now = time.time()
        self.batches.set(b["id"], unless="finalizing_at", finalizing_at=now)
        job_status, note = None, None  # the job's row says how its run ended (scheduler.ended)
        job = S.JobStore(self.eng).get(b["id"])
        job_status = job_status or (job["status"] if job else None)
        if job_status in JOB_DONE:
            ended = "completed"
        elif job_status == "failed":
            ended = "failed"
        else:
            ended = "cancelled" if b.get("cancelling_at") or now < b["expires_at"] else "expired"
        out_lines, err_lines, counts = self._result_files(b, ended)
        values: dict[str, Any] = {
            f"{ended}_at": time.time(), "request_counts": counts,
            "usage": usage_of(S.MetricsReader(self.eng).token_totals(b["id"])), "output_file_id": out_lines,
            "error_file_id": err_lines,
        }
        if ended == "failed":
            values["errors"] = [line_error("batch_failed", (note or (job or {}).get("error") or "the job failed")[:1000],
                                           None)]
        if self.webhooks.end_batch(b, ended, **values):  # the ending and its webhook event: one transaction
            model = b.get("model") or ""
            self._count("lines", model, "completed", counts["completed"])
            self._count("lines", model, "failed", counts["failed"])
            tokens = values["usage"]
            self._count("tokens", model, "input", tokens["input_tokens"])
            self._count("tokens", model, "output", tokens["output_tokens"])
            self._count("batches", model, ended, 1)
            # the result files hold what the job folder's exports held; the job's rows stay in the database
            shutil.rmtree(self.cfg.work_root() / b["id"], ignore_errors=True)

    def _result_files(self, b: dict[str, Any], ended: str) -> tuple[str | None, str | None, dict[str, int]]:
        """The batch's output and error files from its job's export (a line that never ran an
        error line of how the batch ended): (output file id, error file id, request counts)."""
        run = self.cfg.work_root() / b["id"]
        outputs, errors = run / "outputs.jsonl", run / "errors.jsonl"
        job = S.JobStore(self.eng).get(b["id"])
        if job is not None and (job["status"] not in (*JOB_DONE, "cancelled") or not outputs.exists()):
            export_job(self.eng, b["id"], str(run), "openai-jsonl")  # a run cut off: what it committed
        answered = _custom_ids(outputs) | _custom_ids(errors)
        code, message = ENDED_BY.get(ended, ENDED_BY["failed"])
        path, temp = self.blobs.local_copy(b["input_file_id"])
        try:
            missing = [cid for cid in _input_ids(path) if cid not in answered]
        finally:
            if temp:
                os.unlink(path)
        with tempfile.NamedTemporaryFile("w", suffix=".jsonl", delete=False, dir=run if run.exists() else None) as tmp:
            if errors.exists():
                tmp.write(errors.read_text())
            for cid in missing:
                tmp.write(unanswered_line(b["id"], cid, code, message) + "\n")
        try:
            n_out = _count_lines(outputs)
            n_err = _count_lines(Path(tmp.name))
            out_id = self._store_result(b, "output", str(outputs), n_out) if n_out else None
            err_id = self._store_result(b, "error", tmp.name, n_err) if n_err else None
        finally:
            os.unlink(tmp.name)
        return out_id, err_id, {"total": int(b.get("lines") or n_out + n_err), "completed": n_out, "failed": n_err}

    def _store_result(self, b: dict[str, Any], which: str, path: str, lines: int) -> str:
        file_id = derived_file_id(b["id"], which)
        self.blobs.put_file(file_id, path)
        if S.FileStore(self.eng).get(file_id, None) is None:
            self.files.add({"id": file_id, "owner": b["owner"], "filename": f"{b['id']}_{which}.jsonl",
                            "purpose": "batch_output", "bytes": os.path.getsize(path), "lines": lines,
                            "created_at": time.time(), "deleted_at": None})
        return file_id

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
        return int(raw)
    except ValueError:
        raise ApiError(400, f"metadata.priority must be a whole number, got {raw[:40]!r}",
                       param="metadata.priority", code="invalid_value") from None


def _custom_ids(path: Path) -> set[str]:
    if not path.exists():
        return set()
    with open(path, "rb") as fh:
        return {json.loads(line)["custom_id"] for line in fh if line.strip()}


def _input_ids(path: str) -> list[str]:
    """The input's custom_ids in order (lines without one have none to report)."""
    out = []
    with open(path, "rb") as fh:
        for line in fh:
            try:
                cid = json.loads(line).get("custom_id")
            except (ValueError, AttributeError):
                continue
            if isinstance(cid, str) and cid:
                out.append(cid)
    return out


def _count_lines(path: Path) -> int:
    if not path.exists():
        return 0
    with open(path, "rb") as fh:
        return sum(1 for line in fh if line.strip())

