"""A row group larger than a unit is decoded once per machine, not once per unit.

Parquet (pyarrow) reads a row group from its first row: a unit in the middle of a
1M-row group would decode, and over S3 fetch, every row before it, so a group cut
into k units costs about k/2 reads of the group.  Instead, the first unit of such a
group to be read on a machine streams the whole group once (a read batch at a
time) and writes each unit's rows to its own compressed Arrow IPC file under the
spill folder; every unit of the group then reads its file and removes it.  Memory
stays one read batch plus one unit; the disk holds at most the group's not-yet-read
units (about its compressed size).

Files are keyed by job, input file identity (path, size, modification time), row
group and unit size, so a changed input or another job never reads them; a lock file
per group lets the engine processes of one machine share a split.  A unit whose rows
are all done is not written (the reader never asks for it).  A unit asked for again
after its file was read (a retried bundle) splits the group again.

The folder: `$TOKENMILL_SPILL_DIR`, else `tokenmill-spill` in the system temp folder;
`remove_job_spill` clears a job's files when it ends (the launcher's machine; a
remote worker's folder is its own to clear).
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

from tokenmill.transforms.inputs import READ_BATCH_ROWS

#: Compression of the spilled unit files (Arrow IPC).
SPILL_CODEC = "lz4"


def spill_root() -> Path:
    return Path(os.environ.get("TOKENMILL_SPILL_DIR") or Path(tempfile.gettempdir()) / "tokenmill-spill")


def _source(shard) -> str:
    """Size and modification time of the unit's input file: as planned (`Shard.source`),
    else asked of its filesystem."""
    if shard.source:
        return shard.source
    from apache_beam.io.filesystems import FileSystems  # the worker's own S3 options; a unit planned without them only

    meta = FileSystems.match([shard.path])[0].metadata_list[0]
    return f"{meta.size_in_bytes}:{meta.last_updated_in_seconds}"


def group_dir(job_id: str, shard) -> Path:
    key = f"{shard.path}\0{_source(shard)}\0{shard.row_group}\0{shard.unit_rows}"
    return spill_root() / _safe(job_id) / hashlib.sha256(key.encode()).hexdigest()[:24]


def _safe(name: str) -> str:
    return "".join(c if c.isalnum() or c in "._-" else "_" for c in name)[:100]


@contextmanager
def _locked(folder: Path) -> Iterator[None]:
    spill_root().mkdir(mode=0o700, parents=True, exist_ok=True)  # prompts: this user's only
    folder.parent.mkdir(parents=True, exist_ok=True)
    with open(f"{folder}.lock", "a+") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


#: A row group's record batches as the reader gives them: (shard, columns) → (position in the
#: group of the batch's first row, record batch), the group read from its first row.
GroupBatches = Callable[..., Iterator[tuple[int, Any]]]


def split_group(shard, columns: list[str] | None, folder: Path, wanted: Callable[[int, int], bool],
                group_batches: GroupBatches) -> int:
    """Stream `shard`'s row group once (`group_batches`: read.group_batches) and write each
    unit of it (runs of `shard.unit_rows` rows from the group's start) that `wanted(start,
    rows)` to `<start>.arrow` in `folder`.  Returns the units written."""
    import pyarrow as pa

    folder.mkdir(parents=True, exist_ok=True)
    step, total = shard.unit_rows, shard.group_rows
    written, writer, start, tmp = 0, None, -1, folder / ".part"
    options = pa.ipc.IpcWriteOptions(compression=SPILL_CODEC)

    def close():
        nonlocal writer, written
        if writer is not None:
            writer.close()
            os.replace(tmp, folder / f"{start}.arrow")  # a unit's file appears whole or not at all
            written += 1
        writer = None

    for at, rb in group_batches(shard, columns):
        while rb.num_rows:
            unit = at // step * step
            take = min(rb.num_rows, unit + step - at)
            if unit != start:
                close()
                start = unit
                if wanted(unit, min(step, total - unit)):
                    writer = pa.ipc.new_file(str(tmp), rb.schema, options=options)
            if writer is not None:
                writer.write_batch(rb.slice(0, take))
            rb, at = rb.slice(take), at + take
    close()
    return written


def read_spilled(job_id: str, shard, columns: list[str] | None,
                 wanted: Callable[[int, int], bool], group_batches: GroupBatches) -> Iterator:
    """The record batches of one unit of a large row group, from its spilled file (the
    group split first, read by `group_batches`, where this machine has no file for the unit)."""
    import pyarrow as pa

    folder = group_dir(job_id, shard)
    mine = folder / f"{shard.start}.arrow"
    with _locked(folder):
        if not mine.exists():
            split_group(shard, columns, folder, lambda s, n: s == shard.start or wanted(s, n), group_batches)
        with pa.OSFile(str(mine), "rb") as src:
            table = pa.ipc.open_file(src).read_all()
        mine.unlink()
    yield from table.to_batches(READ_BATCH_ROWS)


def remove_job_spill(job_id: str) -> None:
    shutil.rmtree(spill_root() / _safe(job_id), ignore_errors=True)
