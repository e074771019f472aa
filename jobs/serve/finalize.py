"""A batch's files: its input file checked and indexed once (`validating`), and its output and
error files written once, straight into the files store (`finalizing`).

Validation parses each line of the input once (validate.py) and stores the file's per-line
index beside it (schemas/wire/lines.py): the job's planning and export, and finalization here,
read the index instead of the file, so the pipeline's read is the only other parse.  At the
end, a job whose own export is complete and answers every line has its files moved into the
store (a rename where the store is local: not written again); any other ending (cancelled,
expired, failed, or an export cut off) is exported from the database straight into the store,
each line that never ran an error line of how the batch ended (`batch_cancelled`, ...)."""

from __future__ import annotations

import hashlib
import os
import shutil
import time
from typing import Any, Callable, Iterable

from sqlalchemy.engine import Engine

from tokenmill.jobs.lifecycle.anthropic_export import FORMAT as ANTHROPIC
from tokenmill.jobs.lifecycle.anthropic_export import result_lines
from tokenmill.jobs.lifecycle.export import finished_export
from tokenmill.jobs.lifecycle.openai_export import RequestIndex, dead_letter_lines, output_lines
from tokenmill.jobs.serve.blobs import Blobs
from tokenmill.jobs.serve.config import ServeConfig
from tokenmill.jobs.serve.validate import check_file
from tokenmill.jobs.serve.webhooks import WebhookSender
from tokenmill.schemas import storage as S
from tokenmill.schemas.records import DeadLetterRow, OutputRow
from tokenmill.schemas.wire.anthropic.objects import RESULT_KINDS
from tokenmill.schemas.wire.anthropic.request import MESSAGES
from tokenmill.schemas.wire.formats import index_lines
from tokenmill.schemas.wire.lines import LineIndex
from tokenmill.schemas.wire.openai.objects import line_error, usage_of
from tokenmill.schemas.wire.openai.response import unanswered_line

#: Job statuses whose rows are all answered or dead-lettered (the batch completed).
JOB_DONE = ("succeeded", "partial")
ENDED_BY = {"cancelled": ("batch_cancelled", "This line was not executed because the batch was cancelled."),
            "expired": ("batch_expired", "This line was not executed because the batch's completion window ended "
                                         "before it ran."),
            "failed": ("batch_failed", "This line was not executed because the batch failed.")}
#: A result file of a batch: output or error, the key of the job's export that holds it.
RESULTS = (("output", "outputs"), ("error", "errors"))


def derived_file_id(batch_id: str, which: str) -> str:
    """The output or error file's id of a batch: the same on every finalization (a server killed
    while finalizing writes the same file again, never a second one)."""
    return "file-" + hashlib.sha256(f"{batch_id}/{which}".encode()).hexdigest()[:24]


class BatchFiles:
    """What the service does with a batch's files when it starts and when it ends.  `count`
    adds to the service's metrics counters (metric, model, label, n)."""

    def __init__(self, cfg: ServeConfig, eng: Engine, blobs: Blobs, webhooks: WebhookSender,
                 count: Callable[[str, str, str, float], None]):
        self.cfg, self.eng, self.blobs, self.webhooks, self.count = cfg, eng, blobs, webhooks, count
        self.batches, self.files = S.BatchStore(eng), S.FileStore(eng)

    # ------------------------------------------------------------------ validating

    def validate(self, b: dict[str, Any]) -> dict[str, Any] | None:
        """Check the batch's file and store its line index: its row failed with the errors (None),
        or queued (the row)."""
        lim = self.cfg.limits
        path, temp = self.blobs.local_copy(b["input_file_id"])
        try:
            found = check_file(open(path, "rb"), self.cfg.served_names(), max_lines=lim.max_file_lines,
                               max_errors=lim.max_line_errors)
        except OSError as err:
            found = None
            # the error's own text names the server's path: a client is told the file and the reason only
            problem = f"the input file {b['input_file_id']} could not be read: {err.strerror or type(err).__name__}"
        finally:
            if temp:
                os.unlink(path)
        now = time.time()
        if found is None or found.errors:
            errors = found.errors if found is not None else [line_error("file_unreadable", problem, None)]
            self.fail_validating(b, errors, lines=found.lines if found else 0, model=found.model if found else None)
            return None
        self.blobs.put_index(b["input_file_id"], found.index.to_bytes())  # before the job can plan from it
        self.batches.set(b["id"], unless="in_progress_at", in_progress_at=now, lines=found.lines, model=found.model)
        return {**b, "in_progress_at": now, "lines": found.lines, "model": found.model}

    def fail_validating(self, b: dict[str, Any], errors: list[dict[str, Any]], *, lines: int,
                        model: str | None) -> None:
        """End a batch `failed` in validation, with its errors; nothing of it ran."""
        if self.webhooks.end_batch(b, "failed", failed_at=time.time(), errors=errors, lines=lines, model=model,
                                   request_counts={"total": lines, "completed": 0, "failed": 0}):
            self.count("batches", model or "", "failed", 1)

    # ------------------------------------------------------------------ finalizing

    def finalize(self, b: dict[str, Any]) -> None:
        """End the batch as its job's row says its job ended (status and error), with its result
        files, request counts and usage: once, however many replicas' schedulers call it at the
        same moment (the batch is held while it ends, `BatchStore.ending`: the others do nothing,
        and its files are written once)."""
        with self.batches.ending(b["id"]) as end:
            if end is None:  # ended, or another replica ends it now
                return
            b, conn = end.row, end.conn
            now = time.time()
            job = S.JobStore(self.eng).get(b["id"])
            job_status = job["status"] if job else None
            if job_status in JOB_DONE:
                ended = "completed"
            elif job_status == "failed":
                ended = "failed"
            else:
                ended = "cancelled" if b.get("cancelling_at") or now < b["expires_at"] else "expired"
            out_id, err_id, counts = self.result_files(b, ended, job)
            values: dict[str, Any] = {
                f"{ended}_at": time.time(), "request_counts": counts,
                "usage": usage_of(S.MetricsReader(self.eng).token_totals(b["id"])), "output_file_id": out_id,
                "error_file_id": err_id,
            }
            if ended == "failed":
                values["errors"] = [line_error("batch_failed", ((job or {}).get("error") or "the job failed")[:1000],
                                               None)]
            # the ending and its webhook event: one transaction (the hold's, on PostgreSQL)
            done = self.webhooks.end_batch(b, ended, conn=conn, **values)
        if done:  # committed: counted once, by the replica that ended it
            model = b.get("model") or ""
            self.count("lines", model, "completed", counts["completed"])
            self.count("lines", model, "failed", counts["failed"])
            tokens = values["usage"]
            self.count("tokens", model, "input", tokens["input_tokens"])
            self.count("tokens", model, "output", tokens["output_tokens"])
            self.count("batches", model, ended, 1)
            # the job folder's marker and what the job exported are spent; the job's rows stay in the database
            shutil.rmtree(self.cfg.work_root() / b["id"], ignore_errors=True)

    def result_files(self, b: dict[str, Any], ended: str,
                     job: dict[str, Any] | None) -> tuple[str | None, str | None, dict[str, int]]:
        """The batch's output and error files in the store (each None when it has no line):
        (output file id, error file id, request counts).  An Anthropic batch's one results file
        is its output file (`message_results`)."""
        if b.get("endpoint") == MESSAGES:
            return self.message_results(b, ended, job)
        run = str(self.cfg.work_root() / b["id"])
        done = finished_export(run, {"job_id": b["id"], "format": "openai-jsonl"}) \
            if job is not None and job["status"] in JOB_DONE else None
        if done is not None:  # every line answered, in the job's own export: its files become the batch's
            sizes = {which: self._move(b, which, done["files"][key]) for which, key in RESULTS}
            lines = {"output": int(done["outputs"]), "error": int(done["dead_letters"])}
        else:
            lines, sizes = self._export(b, ended)
        ids = {which: self._register(b, which, lines[which], sizes[which]) if lines[which] else None
               for which, _ in RESULTS}
        n_out, n_err = lines["output"], lines["error"]
        return ids["output"], ids["error"], {"total": int(b.get("lines") or n_out + n_err), "completed": n_out,
                                             "failed": n_err}

    def message_results(self, b: dict[str, Any], ended: str,
                        job: dict[str, Any] | None) -> tuple[str | None, None, dict[str, int]]:
        """An Anthropic batch's results file (jobs/lifecycle/anthropic_export.py): its job's own
        when the job answered every request, else written from the job's rows, each request that
        never ran answered by how the batch ended: (its id, None, request counts: Anthropic's
        kinds, and OpenAI's `completed` and `failed` for the service's counters)."""
        run = str(self.cfg.work_root() / b["id"])
        done = finished_export(run, {"job_id": b["id"], "format": ANTHROPIC}) \
            if job is not None and job["status"] in JOB_DONE else None
        counts: dict[str, int] = {}
        if done is not None:
            size = self._move(b, "results", done["files"]["results"])
            counts = {"succeeded": int(done["outputs"]), "errored": int(done["dead_letters"])}
        else:
            index = self.input_index(b["input_file_id"])
            _, size = self._write(derived_file_id(b["id"], "results"), result_lines(
                self.eng, b["id"], RequestIndex.of_lines(index), counts, (index.request_ids(), ended)))
        n = sum(counts.values())
        total = int(b.get("lines") or n)
        kinds = {k: counts.get(k, 0) for k in RESULT_KINDS}
        return (self._register(b, "results", n, size) if n else None, None,
                {"total": total, "completed": kinds["succeeded"], "failed": total - kinds["succeeded"], **kinds})

    def _move(self, b: dict[str, Any], which: str, path: str) -> int:
        size = os.path.getsize(path)
        if size:
            self.blobs.move_file(derived_file_id(b["id"], which), path)
        return size

    def _export(self, b: dict[str, Any], ended: str) -> tuple[dict[str, int], dict[str, int]]:
        """The batch's result files written from its job's rows straight into the store, each
        input line that has neither an output nor an error line an error line of how the batch
        ended: (lines, bytes) of each."""
        index = self.input_index(b["input_file_id"])
        rows = S.MetricsReader(self.eng)
        answered: set[str] = set()

        def tap(chunks: Iterable[list[dict[str, Any]]]) -> Iterable[list[dict[str, Any]]]:
            for chunk in chunks:
                answered.update(r["id"] for r in chunk if r.get("id"))
                yield chunk

        def errors() -> Iterable[list[str]]:
            yield from dead_letter_lines(tap(rows.stream_rows(DeadLetterRow, b["id"])))
            code, message = ENDED_BY.get(ended, ENDED_BY["failed"])
            yield [unanswered_line(b["id"], cid, code, message) for cid in index.request_ids() if cid not in answered]

        outputs = output_lines(tap(rows.stream_rows(OutputRow, b["id"])), index=RequestIndex.of_lines(index))
        lines, sizes = {}, {}
        for which, chunks in (("output", outputs), ("error", errors())):
            lines[which], sizes[which] = self._write(derived_file_id(b["id"], which), chunks)
        return lines, sizes

    def _write(self, file_id: str, chunks: Iterable[list[str]]) -> tuple[int, int]:
        n = size = 0
        with self.blobs.writer(file_id) as fh:
            for chunk in chunks:
                if chunk:
                    data = ("\n".join(chunk) + "\n").encode("utf-8")
                    fh.write(data)
                    n, size = n + len(chunk), size + len(data)
        if not n:
            self.blobs.delete(file_id)  # a batch has no empty result file
        return n, size

    def input_index(self, file_id: str) -> LineIndex:
        """The input file's line index as validation stored it (for a file validated before
        indexes were stored: read from the file)."""
        stored = self.blobs.read_index(file_id)
        idx = LineIndex.from_bytes(stored) if stored is not None else None
        if idx is not None:
            return idx
        path, temp = self.blobs.local_copy(file_id)
        try:
            with open(path, "rb") as fh:
                return index_lines(fh)
        finally:
            if temp:
                os.unlink(path)

    def _register(self, b: dict[str, Any], which: str, lines: int, size: int) -> str:
        file_id = derived_file_id(b["id"], which)
        if not self.files.known(file_id):  # a second finalization (its first cut off) registers it once
            now, ttl = time.time(), b.get("output_expires_after")  # the batch's `output_expires_after`
            self.files.add({"id": file_id, "owner": b["owner"], "filename": f"{b['id']}_{which}.jsonl",
                            "purpose": "batch_output", "bytes": size, "lines": lines,
                            "created_at": now, "deleted_at": None, "expires_at": now + ttl if ttl else None})
        return file_id
