"""The results file of a job whose input is Anthropic Message Batches requests: `results.jsonl`.

`AnthropicBatchExport` writes one result line per request (schemas/wire/anthropic/results.py):
each answered request `succeeded` under the model name its request gave (read back from the
input's line index, as the OpenAI export reads its endpoints: openai_export.RequestIndex), each
dead letter `errored`.  `result_lines` is the same writing with the requests that never ran
answered by how the batch ended (`canceled`, `expired`): what the service's finalization writes
(jobs/serve/messages.py).  A job's input is Anthropic's when its first request line is one
(`is_message_input`; an input holds one format: transforms/openai_batch.plan_jsonl)."""

from __future__ import annotations

from typing import Any, ClassVar, Iterable, Iterator, Mapping

from sqlalchemy.engine import Engine

from tokenmill.jobs.lifecycle.export import job_input, write_jsonl
from tokenmill.jobs.lifecycle.openai_export import RequestIndex
from tokenmill.schemas.records import DeadLetterRow, OutputRow
from tokenmill.schemas.storage import MetricsReader
from tokenmill.schemas.wire.anthropic.request import MESSAGES
from tokenmill.schemas.wire.anthropic.results import UNRUN, errored_line, succeeded_line, unrun_line
from tokenmill.schemas.wire.openai.response import by_request
from tokenmill.transforms.openai_batch import JSONL_PATTERNS, line_entries
from tokenmill.transforms.read import InputError, expand_input

FORMAT = "anthropic-jsonl"


def is_message_input(source: str | None) -> bool:
    """Whether a job's input (file, folder or glob) is Anthropic batch requests: its first request line is one."""
    if not source:
        return False
    try:
        files = expand_input(source, JSONL_PATTERNS)
    except InputError:
        return False
    for f in files:
        for _, url, _ in line_entries(f):
            if url is not None:
                return url == MESSAGES
    return False


def result_lines(eng: Engine, job_id: str, index: RequestIndex, counts: dict[str, int],
                 unrun: tuple[Iterable[str], str] | None = None) -> Iterator[list[str]]:
    """Chunks of result lines of a job: its outputs (`succeeded`), its dead letters (`errored`)
    and, with `unrun` (the batch's custom_ids, how it ended), a line for each id with neither.
    Adds to `counts` (`succeeded`, `errored`, and `canceled`/`expired` or `errored` for the unrun)."""
    rows = MetricsReader(eng)
    seen: set[str] = set()
    for requests in by_request(rows.stream_rows(OutputRow, job_id)):
        out = []
        for samples in requests:
            r = samples[0]
            out.append(succeeded_line(r, index.lookup(r["input_file"], r["input_row"])[1]))
            seen.add(r["id"])
        counts["succeeded"] = counts.get("succeeded", 0) + len(out)
        yield out
    for chunk in rows.stream_rows(DeadLetterRow, job_id):
        seen.update(r["id"] for r in chunk if r.get("id"))
        counts["errored"] = counts.get("errored", 0) + len(chunk)
        yield [errored_line(r) for r in chunk]
    if unrun is None:
        return
    ids, ended = unrun
    kind = UNRUN.get(ended, "errored")
    left = [unrun_line(cid, ended) for cid in ids if cid not in seen]
    counts[kind] = counts.get(kind, 0) + len(left)
    yield left


class AnthropicBatchExport:
    """results.jsonl in Anthropic's batch results format, written whole each time (a served
    batch's file is moved into the files store as one file)."""

    format: ClassVar[str] = FORMAT
    files: ClassVar[Mapping[str, str]] = {"results": "results.jsonl"}

    def write(self, eng: Engine, job_id: str, paths: Mapping[str, str],
              previous: Mapping[str, Any] | None = None) -> tuple[int, int, dict[str, Any]]:
        counts: dict[str, int] = {}
        index = RequestIndex.from_input(job_input(eng, job_id))  # the model name each request gave
        write_jsonl(paths["results"], result_lines(eng, job_id, index, counts))
        return counts.get("succeeded", 0), counts.get("errored", 0), {}
