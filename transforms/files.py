"""Input files opened on a Beam filesystem (local or s3://), the bytes read counted.

`open_file` is how every Parquet read of the job opens its input (footers when planning,
row groups on the workers); what a worker reads through it adds to the Beam counter
`tokenmill/input_bytes_read`, which the job stores with its metrics (`input.bytes_read`).
An s3:// object is read by ranged GETs of exactly the bytes asked for (`inputs.S3Ranges`):
Beam's S3 reader asks for the object from the read position to its end and buffers
16 MiB of it, so each row group read would fetch the rest of the file.  (Planning reads
footers without Beam and without counting: transforms/inputs.py.)
"""

from __future__ import annotations

import apache_beam as beam
from apache_beam.io.filesystems import FileSystems

from tokenmill.transforms.host_model import s3_client_here
from tokenmill.transforms.inputs import S3Ranges

#: Bytes the job's workers read of its input files (Parquet), through `open_file`.
BYTES_READ = beam.metrics.Metrics.counter("tokenmill", "input_bytes_read")


class CountedFile:
    """A file opened on a Beam filesystem (local or s3://), adding the bytes read through it
    to BYTES_READ when it closes (outside a pipeline, as when planning, nothing counts)."""

    def __init__(self, fh):
        self._fh, self._n = fh, 0

    def read(self, *args):
        data = self._fh.read(*args)
        self._n += len(data)
        return data

    def readinto(self, buf):
        n = self._fh.readinto(buf)
        self._n += n or 0
        return n

    def close(self) -> None:
        BYTES_READ.inc(self._n)
        self._n = 0
        self._fh.close()

    def __getattr__(self, name: str):
        return getattr(self._fh, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def open_file(path: str) -> CountedFile:
    """A worker's input file, its reads counted: an s3:// object by ranged GETs
    (`inputs.S3Ranges`) on this worker's client of the job's S3 options, anything else on
    Beam's filesystem."""
    if path.startswith("s3://"):
        return CountedFile(S3Ranges(s3_client_here(), path))
    return CountedFile(FileSystems.open(path, compression_type="uncompressed"))
