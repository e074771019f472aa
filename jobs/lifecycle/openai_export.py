"""The OpenAI Batch API output files of a job: `outputs.jsonl` and `errors.jsonl`.

`OpenAIBatchExport`, the exporter of `output_format: openai-jsonl`, runs in the
launcher at export (jobs/lifecycle/sinks.py): one line per input line, matched by
`custom_id`, in OpenAI's batch output format (the lines themselves are
schemas/wire/openai/response.py's).  The endpoint and the model name of each request
are read back from the input's per-line index (`RequestIndex`: the one validation
stored beside the file, or the file's lines when it has none), so the database needs
no column for them.  The input side is transforms/openai_batch.py.
"""

from __future__ import annotations

from array import array
from typing import Any, ClassVar, Iterable, Iterator, Mapping

from sqlalchemy.engine import Engine

from tokenmill.jobs.lifecycle.export import job_input, write_jsonl
from tokenmill.schemas.records import DeadLetterRow, OutputRow
from tokenmill.schemas.storage import MetricsReader
from tokenmill.schemas.wire.lines import LineIndex
from tokenmill.schemas.wire.openai.request import CHAT, ENDPOINTS
from tokenmill.schemas.wire.openai.response import by_request, error_line, output_line
from tokenmill.transforms.openai_batch import JSONL_PATTERNS, line_entries
from tokenmill.transforms.read import InputError, expand_input

#: The endpoints an input line may name, by their code in `RequestIndex` (0: unknown, read as chat).
KINDS = ("", *ENDPOINTS)


class RequestIndex:
    """Endpoint and model of every input line, by (file index, line), in a few bytes per line.

    Rows whose input cannot be read again fall back to a chat completion under the row's own
    model name."""

    def __init__(self) -> None:
        self._kind: dict[int, array] = {}  # file index → per line: an index into KINDS (0: unknown)
        self._model: dict[int, array] = {}  # file index → per line: index into _models
        self._models: list[str | None] = [None]
        self._names: dict[str | None, int] = {None: 0}

    def _add_file(self, fi: int, entries: Iterable[tuple[str | None, str | None]]) -> None:
        kinds, models = array("B"), array("I")
        for url, model in entries:
            kinds.append(KINDS.index(url) if url in KINDS else 0)
            if model not in self._names:
                self._names[model] = len(self._models)
                self._models.append(model)
            models.append(self._names[model])
        self._kind[fi], self._model[fi] = kinds, models

    @classmethod
    def from_input(cls, source: str | None) -> "RequestIndex":
        """The index of a job's input (file, folder or glob), each file's from its stored line
        index when it has one (`openai_batch.line_entries`)."""
        idx = cls()
        if not source:
            return idx
        try:
            files = expand_input(source, JSONL_PATTERNS)
        except InputError:
            return idx
        for fi, f in enumerate(files):
            idx._add_file(fi, ((url, model) for _, url, model in line_entries(f)))
        return idx

    @classmethod
    def of_lines(cls, lines: LineIndex) -> "RequestIndex":
        """The index of a one-file input from its line index."""
        idx = cls()
        idx._add_file(0, zip(lines.endpoints, lines.models))
        return idx

    def lookup(self, f: int, line: int) -> tuple[str, str | None]:
        try:
            kind = self._kind[f][line]
            return (KINDS[kind] or CHAT), self._models[self._model[f][line]]
        except (KeyError, IndexError):
            return CHAT, None


def output_lines(chunks: Iterable[list[dict[str, Any]]], source: str | None = None,
                 index: RequestIndex | None = None) -> Iterator[list[str]]:
    """Chunks of output rows → chunks of OpenAI batch output lines (one per request, its
    samples as its choices).

    `index` (else built from `source`, the job's input: file, folder or glob) tells each
    row's endpoint and the model name its request asked for."""
    index = index or RequestIndex.from_input(source)
    for requests in by_request(chunks):
        out = []
        for samples in requests:
            url, model = index.lookup(samples[0]["input_file"], samples[0]["input_row"])
            out.append(output_line(samples, url, model))
        yield out


def dead_letter_lines(chunks: Iterable[list[dict[str, Any]]]) -> Iterator[list[str]]:
    """Chunks of dead-letter rows → chunks of error lines (`error: {code, message}`)."""
    for rows in chunks:
        yield [error_line(r) for r in rows]


class OpenAIBatchExport:
    """outputs.jsonl and errors.jsonl in the OpenAI batch output format, written whole each time (a
    served batch's files are moved into the files store as one file each; no parts)."""

    format: ClassVar[str] = "openai-jsonl"
    files: ClassVar[Mapping[str, str]] = {"outputs": "outputs.jsonl", "errors": "errors.jsonl"}

    def write(self, eng: Engine, job_id: str, paths: Mapping[str, str],
              previous: Mapping[str, Any] | None = None) -> tuple[int, int, dict[str, Any]]:
        rows = MetricsReader(eng)
        source = job_input(eng, job_id)  # the input tells each request's endpoint and model
        return (write_jsonl(paths["outputs"], output_lines(rows.stream_rows(OutputRow, job_id), source=source)),
                write_jsonl(paths["errors"], dead_letter_lines(rows.stream_rows(DeadLetterRow, job_id))), {})
