"""Export a job's outputs and dead letters from the database to files, and mark how the job ended.

`export_job` first removes any marker an earlier run left (`_SUCCESS.json`,
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
from typing import Any, Callable, Iterator

import pyarrow as pa
import pyarrow.parquet as pq
from sqlalchemy.engine import Engine

from tokenmill.schemas import storage as S
from tokenmill.schemas.records import DeadLetterRow, OutputRow, StoredRow, export_schema, exported

MANIFEST = "_SUCCESS.json"
FAILED = "_FAILED.json"
CANCELLED = "_CANCELLED.json"
#: The marker for each final job status; only a finished export gets `_SUCCESS.json`.
MARKERS = {"succeeded": MANIFEST, "partial": MANIFEST, "failed": FAILED, "cancelled": CANCELLED}

#: The only names an export writes under its output root; ids and job names never become paths.
FILE_NAMES = frozenset({"outputs.parquet", "dead_letters.parquet", "outputs.jsonl", "errors.jsonl",
                        MANIFEST, FAILED, CANCELLED})


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


def join(root: str, name: str) -> str:
    """`root/name` for one of the export's own file names; anything else is refused."""
    from apache_beam.io.filesystems import FileSystems

    if name not in FILE_NAMES:
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


def write_parquet(dest: str, schema: pa.Schema, chunks: Iterator[list[dict[str, Any]]]) -> int:
    def write(fh) -> int:
        n = 0
        with pq.ParquetWriter(fh, schema, compression="zstd") as w:
            for rows in chunks:
                w.write_table(pa.Table.from_pylist(rows, schema=schema))
                n += len(rows)
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


def _write_rows(dest: str, eng: Engine, record: type[StoredRow], job_id: str) -> int:
    """A job's rows of one table, in input order, as the record's exported Parquet file."""
    chunks = ([exported(record, r) for r in rows] for rows in S.stream_rows(eng, record, job_id))
    return write_parquet(dest, export_schema(record), chunks)


def _make_root(output_root: str) -> None:
    check_output_root(output_root)
    if "://" not in output_root:
        import os

        os.makedirs(output_root, exist_ok=True)


def clear_markers(output_root: str, keep: str | None = None) -> None:
    """Remove the markers an earlier run left under `output_root` (all but `keep`)."""
    from apache_beam.io.filesystems import FileSystems

    stale = [p for p in (join(output_root, m) for m in sorted(set(MARKERS.values())) if m != keep)
             if FileSystems.exists(p)]
    if stale:
        FileSystems.delete(stale)


def export_job(eng: Engine, job_id: str, output_root: str, fmt: str = "parquet") -> dict[str, Any]:
    """Write the job's data files (after removing any old marker: until `write_marker`, the
    folder reads as unfinished) and return the manifest's export part: format, row counts
    per file, files."""
    _make_root(output_root)
    clear_markers(output_root)  # an older export is no longer complete
    files: dict[str, Any] = {}
    if fmt == "openai-jsonl":
        from tokenmill.jobs.lifecycle.openai_export import dead_letter_lines, output_lines

        files["outputs"] = join(output_root, "outputs.jsonl")
        files["errors"] = join(output_root, "errors.jsonl")
        spec = (S.get_job(eng, job_id) or {}).get("spec") or {}  # the input tells each request's endpoint and model
        n_out = write_jsonl(files["outputs"], output_lines(S.stream_rows(eng, OutputRow, job_id), source=spec.get("input")))
        n_dead = write_jsonl(files["errors"], dead_letter_lines(S.stream_rows(eng, DeadLetterRow, job_id)))
    else:
        files["outputs"] = join(output_root, "outputs.parquet")
        files["dead_letters"] = join(output_root, "dead_letters.parquet")
        n_out = _write_rows(files["outputs"], eng, OutputRow, job_id)
        n_dead = _write_rows(files["dead_letters"], eng, DeadLetterRow, job_id)
    return {"job_id": job_id, "format": fmt, "outputs": n_out, "dead_letters": n_dead, "files": files}


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
