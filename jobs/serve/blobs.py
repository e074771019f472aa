"""The files store: the bytes of the service's files, each under its id (`file-<hex>`), in a
local folder or under an `s3://bucket/prefix`.  A client names a file only by its id, which
must match FILE_ID, so no request can reach a path outside the store.  Beside an input file
lies its per-line index (`<file id>.jsonl.index.json`, schemas/wire/lines.py), written once
when the file is validated; a job reading the file as its input finds it there."""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Iterator

from tokenmill.schemas.wire.lines import index_location

FILE_ID = re.compile(r"file-[0-9a-f]{24}")
CHUNK = 1 << 20


#: The store's files and its folder are its owner's alone: they hold the clients' requests and answers.
FILE_MODE, DIR_MODE = 0o600, 0o700


def _private(path: Path) -> IO[bytes]:
    """`path` opened for writing, new or emptied, readable by its owner only from its first byte."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, FILE_MODE)
    os.fchmod(fd, FILE_MODE)  # a file left by an earlier run keeps its mode through O_CREAT
    return os.fdopen(fd, "wb")


class BlobError(ValueError):
    """A file id that is not one of the store's (never a path)."""


def _check(file_id: str) -> str:
    if not FILE_ID.fullmatch(file_id):
        raise BlobError(f"not a file id: {file_id[:80]!r}")
    return file_id


class LocalBlobs:
    """Files in a local folder, `<root>/<file id>.jsonl`; written under a temporary name and
    renamed, so a file is there whole or not at all; each file 0600, a folder made here 0700."""

    def __init__(self, root: str):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True, mode=DIR_MODE)

    def path(self, file_id: str) -> Path:
        return self.root / f"{_check(file_id)}.jsonl"

    def url(self, file_id: str) -> str:
        """What a job reads as its input."""
        return str(self.path(file_id))

    def put_file(self, file_id: str, src: str) -> None:
        dst = self.path(file_id)
        tmp = dst.with_suffix(".part")
        with open(src, "rb") as fh, _private(tmp) as out:
            shutil.copyfileobj(fh, out, CHUNK)
        os.replace(tmp, dst)

    def move_file(self, file_id: str, src: str) -> None:
        """`put_file`, taking `src` itself where it can (a rename: its bytes are not written again)."""
        dst = self.path(file_id)
        tmp = dst.with_suffix(".part")
        shutil.move(src, tmp)
        os.chmod(tmp, FILE_MODE)  # the job wrote it with its own mode
        os.replace(tmp, dst)

    @contextmanager
    def writer(self, file_id: str) -> Iterator[IO[bytes]]:
        """A file written straight into the store, there whole once the block ends without error."""
        dst = self.path(file_id)
        tmp = dst.with_suffix(".part")
        try:
            with _private(tmp) as fh:
                yield fh
            os.replace(tmp, dst)
        finally:
            tmp.unlink(missing_ok=True)

    def put_index(self, file_id: str, data: bytes) -> None:
        dst = Path(index_location(self.url(file_id)))
        tmp = dst.with_suffix(".part")
        with _private(tmp) as fh:
            fh.write(data)
        os.replace(tmp, dst)

    def open(self, file_id: str) -> IO[bytes]:
        return open(self.path(file_id), "rb")

    def read_index(self, file_id: str) -> bytes | None:
        """The file's stored per-line index, None when it has none."""
        try:
            return Path(index_location(self.url(file_id))).read_bytes()
        except FileNotFoundError:
            return None

    def delete(self, file_id: str) -> None:
        self.path(file_id).unlink(missing_ok=True)
        Path(index_location(self.url(file_id))).unlink(missing_ok=True)

    def local_copy(self, file_id: str) -> tuple[str, bool]:
        """A local path to the file's bytes, and whether it is a temporary copy to remove."""
        return str(self.path(file_id)), False


class S3Blobs:
    """Files under `s3://bucket/prefix/<file id>.jsonl` (the endpoint and credentials from the
    environment, as the jobs' own S3 reads take them)."""

    def __init__(self, url: str):
        from tokenmill.transforms.read import s3_client

        rest = url[len("s3://"):]
        self.bucket, _, prefix = rest.partition("/")
        self.prefix = prefix.strip("/")
        self.client = s3_client()

    def _key(self, file_id: str) -> str:
        name = f"{_check(file_id)}.jsonl"
        return f"{self.prefix}/{name}" if self.prefix else name

    def url(self, file_id: str) -> str:
        return f"s3://{self.bucket}/{self._key(file_id)}"

    def put_file(self, file_id: str, src: str) -> None:
        self.client.upload_file(src, self.bucket, self._key(file_id))

    def move_file(self, file_id: str, src: str) -> None:
        self.put_file(file_id, src)
        os.unlink(src)

    @contextmanager
    def writer(self, file_id: str) -> Iterator[IO[bytes]]:
        """A file written into the store: spooled here, uploaded once the block ends without error."""
        with tempfile.TemporaryFile() as fh:
            yield fh
            fh.seek(0)
            self.client.upload_fileobj(fh, self.bucket, self._key(file_id))

    def put_index(self, file_id: str, data: bytes) -> None:
        self.client.put_object(Bucket=self.bucket, Key=index_location(self._key(file_id)), Body=data)

    def open(self, file_id: str) -> IO[bytes]:
        return self.client.get_object(Bucket=self.bucket, Key=self._key(file_id))["Body"]

    def read_index(self, file_id: str) -> bytes | None:
        """The file's stored per-line index, None when it has none."""
        try:
            return self.client.get_object(Bucket=self.bucket, Key=index_location(self._key(file_id)))["Body"].read()
        except self.client.exceptions.NoSuchKey:
            return None

    def delete(self, file_id: str) -> None:
        self.client.delete_object(Bucket=self.bucket, Key=self._key(file_id))
        self.client.delete_object(Bucket=self.bucket, Key=index_location(self._key(file_id)))

    def local_copy(self, file_id: str) -> tuple[str, bool]:
        fd, tmp = tempfile.mkstemp(suffix=".jsonl")
        os.close(fd)
        self.client.download_file(self.bucket, self._key(file_id), tmp)
        return tmp, True


Blobs = LocalBlobs | S3Blobs


def blob_store(root: str) -> Blobs:
    return S3Blobs(root) if root.startswith("s3://") else LocalBlobs(root)


def iter_bytes(fh: IO[bytes]) -> Iterator[bytes]:
    """A file's bytes in chunks, closing it at the end (a streamed download's body)."""
    try:
        while chunk := fh.read(CHUNK):
            yield chunk
    finally:
        fh.close()
