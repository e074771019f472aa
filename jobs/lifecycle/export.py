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

The Parquet export is a folder of parts per file, as Spark and Beam write it
(`outputs.parquet/part-00000-<run>.parquet`, ...): the path is read whole by
`pandas.read_parquet` and `pyarrow.dataset`, which skip names starting with `_` or `.`
(the temporary names).  Each part of `outputs.parquet` holds the output rows of one run (its
batch ids start with the run id), and the manifest names every part with its rows, bytes and
runs.  A rerun adds a part for each run no part holds and keeps the earlier parts; when an
earlier part is missing or its size changed, or the parts' rows do not add up to the job's
stored rows (rows deleted or retracted since), it writes the whole export again.  Dead letters
are one part, written whole each time (their count, not the job's rows).
"""

from __future__ import annotations

import json
import os
import re
import uuid
from typing import Any, Callable, ClassVar, Iterator, Mapping, Protocol

import pyarrow as pa
import pyarrow.parquet as pq
from sqlalchemy.engine import Engine

from tokenmill.schemas.exported import export_schema, exported_columns, stored_names
from tokenmill.schemas.records import DeadLetterRow, OutputRow, StoredRow
from tokenmill.schemas.storage import JobStore, MetricsReader

#: A part's name under its file's folder (the export's own; ids never become paths).
PART_NAME = re.compile(r"part-\d{5}(-[0-9a-z]+)?\.parquet")

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

    folder, name = FileSystems.split(dest)
    # a hidden name: Parquet readers of the folder skip it (pyarrow's dataset ignores '.' and '_')
    tmp = FileSystems.join(folder, f".{name}.tmp-{uuid.uuid4().hex[:8]}")
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

    def write(self, eng: Engine, job_id: str, paths: Mapping[str, str],
              previous: Mapping[str, Any] | None = None) -> tuple[int, int, dict[str, Any]]:
        """Write the job's files at `paths` (key → path, as `files`), keeping what `previous` (the
        earlier export's `parts`, when it agrees) holds where the format has parts: (outputs, dead
        letters, the manifest's further keys)."""
        ...


def _write_rows(dest: str, eng: Engine, record: type[StoredRow], job_id: str, run_id: str | None = None) -> int:
    """A job's rows of one table (of one run with `run_id`), in input order, as the record's exported
    Parquet file (an embedding job's vectors as a fixed-size list of their dimension)."""
    schema = export_schema(record)  # type: ignore[arg-type]  # a class is hashable; mypy reads the instances' __hash__
    dim = MetricsReader(eng).embedding_dim(job_id) if "embedding" in schema.names else None
    if dim:
        i = schema.get_field_index("embedding")
        schema = schema.set(i, pa.field("embedding", pa.list_(pa.float32(), dim)))
    chunks = (exported_columns(record, columns)
              for columns in MetricsReader(eng).stream_columns(record, job_id, stored_names(record), run_id))
    return write_parquet(dest, schema, chunks)


def _listing(folder: str, make: bool = False) -> dict[str, int]:
    """The parts in a file's folder, name → bytes.  With `make`, the folder is made, and a file
    where it should be (an export from before parts) removed first."""
    from apache_beam.io.filesystems import FileSystems

    if "://" not in folder:
        if make and os.path.isfile(folder):
            os.unlink(folder)
        if make:
            os.makedirs(folder, exist_ok=True)
        if not os.path.isdir(folder):
            return {}
        return {e.name: e.stat().st_size for e in os.scandir(folder) if PART_NAME.fullmatch(e.name)}
    if make and FileSystems.exists(folder):  # an object at the folder's own key
        FileSystems.delete([folder])
    found = FileSystems.match([FileSystems.join(folder, "part-*")])[0].metadata_list
    return {n: m.size_in_bytes for m in found if PART_NAME.fullmatch(n := FileSystems.split(m.path)[1])}


def _size(folder: str, name: str) -> int:
    from apache_beam.io.filesystems import FileSystems

    return FileSystems.match([FileSystems.join(folder, name)])[0].metadata_list[0].size_in_bytes


def parts_intact(folder: str, parts: Any) -> bool:
    """Whether every part the manifest names is in `folder` with the size it was written with."""
    if not isinstance(parts, list):
        return False
    try:
        have = _listing(folder)
    except OSError:
        return False
    return all(isinstance(p, dict) and isinstance(p.get("rows"), int) and have.get(str(p.get("file"))) == p.get("bytes")
               for p in parts)


def _remove(folder: str, names: Any) -> None:
    from apache_beam.io.filesystems import FileSystems

    if names:
        FileSystems.delete([FileSystems.join(folder, n) for n in names])


def _part(eng: Engine, job_id: str, folder: str, name: str, runs: list[str], run_id: str | None = None) -> dict[str, Any]:
    from apache_beam.io.filesystems import FileSystems

    n = _write_rows(FileSystems.join(folder, name), eng, OutputRow, job_id, run_id)
    return {"file": name, "rows": n, "runs": runs, "bytes": _size(folder, name)}


def _output_parts(eng: Engine, job_id: str, folder: str, previous: Any) -> tuple[list[dict[str, Any]], int]:
    """`outputs.parquet`'s parts: the earlier ones kept when intact, with one added per run none of
    them holds; else (or when they do not add up to the job's stored rows) one part of every row.
    Returns (every part, rows written now)."""
    runs = [r["run_id"] for r in JobStore(eng).runs(job_id)]
    have = _listing(folder, make=True)
    parts = list(previous) if previous and parts_intact(folder, previous) else []
    if not {r for p in parts for r in p.get("runs", ())} <= set(runs):  # another database's export of this id
        parts = []
    _remove(folder, set(have) - {p["file"] for p in parts})  # parts no kept manifest names
    written = 0
    if parts:
        held = {r for p in parts for r in p.get("runs", ())}
        for run in (r for r in runs if r not in held):
            parts.append(_part(eng, job_id, folder, f"part-{len(parts):05d}-{run}.parquet", [run], run))
            written += parts[-1]["rows"]
        if sum(p["rows"] for p in parts) == MetricsReader(eng).row_count(OutputRow, job_id):
            empty = [p for p in parts if not p["rows"]] if any(p["rows"] for p in parts) else parts[:-1]
            _remove(folder, [p["file"] for p in empty])  # a run that answered nothing leaves no part
            return [p for p in parts if p not in empty], written
        _remove(folder, [p["file"] for p in parts])  # rows deleted, retracted or of no run since: all again
    part = _part(eng, job_id, folder, f"part-00000-{runs[-1] if runs else 'all'}.parquet", runs)
    return [part], part["rows"]


class ParquetExport:
    """outputs.parquet and dead_letters.parquet, each a folder of parts: the exported columns of
    `OutputRow` (a part per run, each in input order) and `DeadLetterRow` (one part, in input order)."""

    format: ClassVar[str] = "parquet"
    files: ClassVar[Mapping[str, str]] = {"outputs": "outputs.parquet", "dead_letters": "dead_letters.parquet"}

    def write(self, eng: Engine, job_id: str, paths: Mapping[str, str],
              previous: Mapping[str, Any] | None = None) -> tuple[int, int, dict[str, Any]]:
        outputs, written = _output_parts(eng, job_id, paths["outputs"], (previous or {}).get("outputs"))
        folder = paths["dead_letters"]
        _remove(folder, set(_listing(folder, make=True)) - {"part-00000.parquet"})
        n_dead = _write_rows(f"{folder}/part-00000.parquet", eng, DeadLetterRow, job_id)
        dead = [{"file": "part-00000.parquet", "rows": n_dead, "bytes": _size(folder, "part-00000.parquet")}]
        return (sum(p["rows"] for p in outputs), n_dead,
                {"parts": {"outputs": outputs, "dead_letters": dead}, "written": {"outputs": written,
                                                                                  "dead_letters": n_dead}})


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
    previous = previous_parts(output_root, job_id, exporter.format)  # read before its marker goes
    clear_markers(output_root)  # an older export is no longer complete
    allowed = frozenset(exporter.files.values())
    files = {key: join(output_root, name, allowed) for key, name in exporter.files.items()}
    n_out, n_dead, more = exporter.write(eng, job_id, files, previous)
    return {"job_id": job_id, "format": exporter.format, "outputs": n_out, "dead_letters": n_dead, "files": files,
            **more}


def previous_parts(output_root: str, job_id: str, fmt: str) -> dict[str, Any] | None:
    """The `parts` an earlier export of this job and format named in its marker (whichever marker
    is there), or None."""
    from apache_beam.io.filesystems import FileSystems

    for name in (MANIFEST, CANCELLED, FAILED):
        try:
            path = join(output_root, name)
            if not FileSystems.exists(path):
                continue
            with FileSystems.open(path) as fh:
                m = json.loads(fh.read())
        except (OSError, ValueError, OutputPathError):
            return None
        ok = isinstance(m, dict) and m.get("job_id") == job_id and m.get("format") == fmt
        return m["parts"] if ok and isinstance(m.get("parts"), dict) else None
    return None


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
    parts = manifest.get("parts") or {}
    if not all(key in files and parts_intact(files[key], p) for key, p in parts.items()):
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
