"""Export a job's outputs and dead letters from the database to files, and mark how the job ended.

An `Exporter` writes one output format's files from the database (this module's
`ParquetExport`; jobs/lifecycle/openai_export.py's `OpenAIBatchExport`);
jobs/lifecycle/sinks.py picks one by `spec.output_format`.  `export_job` there first removes any marker an earlier run left (`_SUCCESS.json`,
`_FAILED.json`, `_CANCELLED.json`), then writes the data files, each under a
temporary name renamed into place; it writes no marker.  The runner reconciles
the row counts and decides the job's final status, and only then calls
`write_marker`: `_SUCCESS.json` for a `succeeded` or `partial` job, `_FAILED.json`
or `_CANCELLED.json` (with the reason) otherwise, each holding the final status,
totals and files.  A folder without `_SUCCESS.json` is not a finished export,
whatever else it holds: a crash mid-export leaves no marker at all.
"""

from __future__ import annotations

import json
import uuid
from typing import Any, Callable, ClassVar, Iterator, Mapping, Protocol

import pyarrow as pa
import pyarrow.parquet as pq
from sqlalchemy.engine import Engine

from tokenmill.schemas.exported import export_schema, exported_columns, stored_names
from tokenmill.schemas.records import DeadLetterRow, OutputRow, StoredRow
from tokenmill.schemas.storage import JobStore, MetricsReader

MANIFEST = "_SUCCESS.json"
FAILED = "_FAILED.json"
CANCELLED = "_CANCELLED.json"
#: The marker for each final job status; only a finished export gets `_SUCCESS.json`.
MARKERS = {"succeeded": MANIFEST, "partial": MANIFEST, "failed": FAILED, "cancelled": CANCELLED}

#: The markers' file names: with the exporters' declared `files`, the only names an export
#: writes under its output root (ids and job names never become paths).
MARKER_FILES = frozenset(MARKERS.values())


class OutputPathError(ValueError):
    """An output location that could write outside its output root; the message is one line."""


def check_output_root(output: str) -> None:
    """Refuse an output root with `..` segments (it would resolve outside the folder the
    user named) or an empty path; files are only ever written directly under it."""
    if not output or not output.strip():
        raise OutputPathError("output path is empty")
    path = output.split("://", 1)[1] if "://" in output else output
    if any(seg == ".." for seg in path.replace("\\", "/").split("/")):
        raise OutputPathError(f"output {output!r} contains a '..' segment; give the folder itself")
    if "://" in output and not path.split("/", 1)[0]:
        raise OutputPathError(f"output {output!r} has no bucket")


def join(root: str, name: str, allowed: frozenset[str] = MARKER_FILES) -> str:
    """`root/name` for one of the export's own file names (`allowed`: the markers, or an
    exporter's declared files); anything else is refused."""
    from apache_beam.io.filesystems import FileSystems

    if name not in allowed:
        raise OutputPathError(f"refusing to write {name!r}: not one of the export's files")
    return FileSystems.join(root, name)


def _atomic_write(dest: str, write: Callable[[Any], int]) -> int:
    from apache_beam.io.filesystems import FileSystems

    tmp = f"{dest}.tmp-{uuid.uuid4().hex[:8]}"
    try:
        with FileSystems.create(tmp) as fh:
            n = write(fh)
        if FileSystems.exists(dest):
            FileSystems.delete([dest])
        FileSystems.rename([tmp], [dest])
    except BaseException:
        try:
            FileSystems.delete([tmp])
        except Exception:
            pass
        raise
    return n


def write_parquet(dest: str, schema: pa.Schema, chunks: Iterator[dict[str, list[Any]]]) -> int:
    """Chunks of columns (name → values, as `schema` names them) as one Parquet file."""
    def write(fh) -> int:
        n = 0
        with pq.ParquetWriter(fh, schema, compression="zstd") as w:
            for columns in chunks:
                table = pa.Table.from_pydict(columns, schema=schema)
                w.write_table(table)
                n += table.num_rows
        return n

    return _atomic_write(dest, write)


def write_jsonl(dest: str, lines: Iterator[list[str]]) -> int:
    def write(fh) -> int:
        n = 0
        for chunk in lines:
            if chunk:
                fh.write(("\n".join(chunk) + "\n").encode("utf-8"))
                n += len(chunk)
        return n

    return _atomic_write(dest, write)


class Exporter(Protocol):
    """One output format of a finished job: the files it writes under the output root, from
    the database.  Markers (`write_marker`) are the runner's, whatever the format."""

    format: ClassVar[str]
    """The `output_format` of a job spec that picks this exporter."""
    files: ClassVar[Mapping[str, str]]
    """Manifest key → file name under the output root, for every file it writes."""

    def write(self, eng: Engine, job_id: str, paths: Mapping[str, str]) -> tuple[int, int]:
        """Write the job's files at `paths` (key → path, as `files`); (outputs, dead letters) written."""
        ...


def _write_rows(dest: str, eng: Engine, record: type[StoredRow], job_id: str) -> int:
    """A job's rows of one table, in input order, as the record's exported Parquet file (an
    embedding job's vectors as a fixed-size list of their dimension)."""
    schema = export_schema(record)  # type: ignore[arg-type]  # a class is hashable; mypy reads the instances' __hash__
    dim = MetricsReader(eng).embedding_dim(job_id) if "embedding" in schema.names else None
    if dim:
        i = schema.get_field_index("embedding")
        schema = schema.set(i, pa.field("embedding", pa.list_(pa.float32(), dim)))
    chunks = (exported_columns(record, columns)
              for columns in MetricsReader(eng).stream_columns(record, job_id, stored_names(record)))
    return write_parquet(dest, schema, chunks)


class ParquetExport:
    """outputs.parquet and dead_letters.parquet: the exported columns of `OutputRow` and
    `DeadLetterRow`, in input order."""

    format: ClassVar[str] = "parquet"
    files: ClassVar[Mapping[str, str]] = {"outputs": "outputs.parquet", "dead_letters": "dead_letters.parquet"}

    def write(self, eng: Engine, job_id: str, paths: Mapping[str, str]) -> tuple[int, int]:
        return (_write_rows(paths["outputs"], eng, OutputRow, job_id),
                _write_rows(paths["dead_letters"], eng, DeadLetterRow, job_id))


def job_input(eng: Engine, job_id: str) -> str | None:
    """The input a job's spec names (an exporter that reads it back: the OpenAI batch format)."""
    return ((JobStore(eng).get(job_id) or {}).get("spec") or {}).get("input")


def _make_root(output_root: str) -> None:
    check_output_root(output_root)
    if "://" not in output_root:
        import os

        os.makedirs(output_root, exist_ok=True)


def clear_markers(output_root: str, keep: str | None = None) -> None:
    """Remove the markers an earlier run left under `output_root` (all but `keep`)."""
    from apache_beam.io.filesystems import FileSystems

    stale = [p for p in (join(output_root, m) for m in sorted(MARKER_FILES) if m != keep)
             if FileSystems.exists(p)]
    if stale:
        FileSystems.delete(stale)


def export(exporter: Exporter, eng: Engine, job_id: str, output_root: str) -> dict[str, Any]:
    """Write the job's data files with `exporter` (after removing any old marker: until
    `write_marker`, the folder reads as unfinished) and return the manifest's export part:
    format, row counts, files."""
    _make_root(output_root)
    clear_markers(output_root)  # an older export is no longer complete
    allowed = frozenset(exporter.files.values())
    files = {key: join(output_root, name, allowed) for key, name in exporter.files.items()}
    n_out, n_dead = exporter.write(eng, job_id, files)
    return {"job_id": job_id, "format": exporter.format, "outputs": n_out, "dead_letters": n_dead, "files": files}


def finished_export(output_root: str, expected: Mapping[str, Any]) -> dict[str, Any] | None:
    """The manifest of the finished export under `output_root` when its `_SUCCESS.json` holds every
    value in `expected` (job id, status, counts, format) and every file it lists exists; else None."""
    from apache_beam.io.filesystems import FileSystems

    try:
        path = join(output_root, MANIFEST)
        if not FileSystems.exists(path):
            return None
        with FileSystems.open(path) as fh:
            manifest = json.loads(fh.read())
    except (OSError, ValueError, OutputPathError):
        return None
    if not isinstance(manifest, dict) or any(manifest.get(k) != v for k, v in expected.items()):
        return None
    files = manifest.get("files")
    if not isinstance(files, dict) or not all(isinstance(f, str) and FileSystems.exists(f) for f in files.values()):
        return None
    return manifest


def write_marker(output_root: str, status: str, manifest: dict[str, Any], reason: str | None = None) -> str:
    """Write the marker for the job's final `status` (`MARKERS`), holding `manifest` with the
    status and, for a failed or cancelled job, the reason; remove the other markers.  Returns its path."""
    if status not in MARKERS:
        raise ValueError(f"no export marker for job status {status!r}")
    _make_root(output_root)
    name = MARKERS[status]
    clear_markers(output_root, keep=name)
    body = {**manifest, "status": status}
    if name != MANIFEST:
        body["reason"] = reason or status
    path = join(output_root, name)

    def write(fh) -> int:
        fh.write(json.dumps(body, indent=2, default=str).encode())
        return 1

    _atomic_write(path, write)
    return path
