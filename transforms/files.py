"""Input files opened on a Beam filesystem (local or s3://), the bytes read counted.

`open_file` is how every Parquet read of the job opens its input (footers when planning,
row groups on the workers); what a worker reads through it adds to the Beam counter
`tokenmill/input_bytes_read`, which the job stores with its metrics (`input.bytes_read`).
"""

from __future__ import annotations

import apache_beam as beam

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
    from apache_beam.io.filesystems import FileSystems

    return CountedFile(FileSystems.open(path, compression_type="uncompressed"))
