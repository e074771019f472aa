"""Input files opened on a Beam filesystem (local or s3://), the bytes read counted.

`open_file` is how every Parquet read of the job opens its input (footers when planning,
row groups on the workers); what a worker reads through it adds to the Beam counter
`tokenmill/input_bytes_read`, which the job stores with its metrics (`input.bytes_read`).
An s3:// object is read by ranged GETs of exactly the bytes asked for (`S3Ranges`):
Beam's S3 reader asks for the object from the read position to its end and buffers
16 MiB of it, so each row group read would fetch the rest of the file.
"""

from __future__ import annotations

import io

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


class S3Ranges(io.RawIOBase):
    """An s3:// object as a seekable file whose every read is one ranged GET of the bytes
    asked for (a client of the job's S3 options: `host_model.s3_client_here`)."""

    def __init__(self, client, url: str):
        super().__init__()
        self._client = client
        self._bucket, self._key = url[len("s3://"):].split("/", 1)
        self._size = client.head_object(Bucket=self._bucket, Key=self._key)["ContentLength"]
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        self._pos = max(0, offset + {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._size}[whence])
        return self._pos

    def tell(self) -> int:
        return self._pos

    def read(self, size: int | None = -1) -> bytes:
        end = self._size if size is None or size < 0 else min(self._size, self._pos + size)
        if end <= self._pos:
            return b""
        got = self._client.get_object(Bucket=self._bucket, Key=self._key, Range=f"bytes={self._pos}-{end - 1}")
        data = got["Body"].read()
        self._pos += len(data)
        return data

    def readinto(self, buf) -> int:
        data = self.read(len(buf))
        buf[:len(data)] = data
        return len(data)


def open_file(path: str) -> CountedFile:
    from apache_beam.io.filesystems import FileSystems

    if path.startswith("s3://"):
        from tokenmill.transforms.host_model import s3_client_here

        return CountedFile(S3Ranges(s3_client_here(), path))
    return CountedFile(FileSystems.open(path, compression_type="uncompressed"))
