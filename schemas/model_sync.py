"""A model given as a URL (`s3://bucket/models/smol`, or any fsspec URL): one copy per host.

A cluster's workers share no filesystem, so each host keeps its own copy of the model
folder in its models cache (`<models>/synced/<digest of the URL>/<name>`), made once and
kept while the remote objects are unchanged:

- the copy is checksummed: the manifest (`.tokenmill-sync.json`) records each object's
  size and ETag; a sync compares the listing with it and fetches only what changed
  (an unchanged file is hard-linked from the old copy);
- a partial download never looks complete: files go to a temporary folder, the manifest
  is written last, and the folder is renamed into place;
- two workers on one host sync once: the sync holds a lock on a file beside the copy
  (`fcntl.flock`, freed by the kernel when a process dies, so a killed sync never
  blocks the next).

S3 goes through boto3 (the client the caller passes carries the job's endpoint, as
Beam's S3 filesystem builds it); other schemes through fsspec.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from tokenmill.schemas.errors import first_line
from tokenmill.schemas.model_home import ModelNotFound, models_dir

MANIFEST = ".tokenmill-sync.json"


def is_model_url(name: str) -> bool:
    """A model named by a URL to sync (`file://` included: it stands for a shared mount)."""
    return "://" in name


@dataclass(frozen=True)
class RemoteFile:
    rel: str
    """The path under the model's URL (`config.json`, `tokenizer/vocab.json`)."""
    size: int
    etag: str
    """What changes when the object does: S3's ETag, else the store's checksum or mtime."""


#: The files a launcher whose workers run elsewhere leaves where they are: it reads the
#: config and the tokenizer, the workers load the weights.
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")


def synced_folder(url: str, *, weights: bool = True) -> Path:
    """Where this host keeps its copy of the model at `url` (`weights=False`: the copy
    without the weights); its last path part is the model's name (served model names and
    reports show it)."""
    digest = hashlib.sha256(url.rstrip("/").encode()).hexdigest()[:16]
    name = url.rstrip("/").rsplit("/", 1)[-1] or "model"
    return models_dir() / "synced" / (digest if weights else f"{digest}-no-weights") / name


def is_synced(url: str) -> bool:
    """This host holds a complete copy (its manifest written) of the model at `url`."""
    return (synced_folder(url) / MANIFEST).is_file()


class _S3:
    def __init__(self, url: str, client: Any):
        self.bucket, _, prefix = url[len("s3://"):].partition("/")
        self.prefix = prefix.strip("/") + "/" if prefix.strip("/") else ""
        self.client = client

    def list(self) -> list[RemoteFile]:
        out = []
        for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=self.prefix):
            for o in page.get("Contents", []):
                rel = o["Key"][len(self.prefix):]
                if rel and not rel.endswith("/"):
                    out.append(RemoteFile(rel, int(o["Size"]), str(o.get("ETag", "")).strip('"')))
        return out

    def get(self, rel: str, dest: Path) -> None:
        self.client.download_file(self.bucket, self.prefix + rel, str(dest))


class _Fsspec:
    def __init__(self, url: str):
        import fsspec

        self.fs, root = fsspec.core.url_to_fs(url)
        self.root = root.rstrip("/")

    def list(self) -> list[RemoteFile]:
        out = []
        for path, info in self.fs.find(self.root, detail=True).items():
            if info.get("type") == "directory":
                continue
            tag = info.get("ETag") or info.get("etag") or info.get("md5") or info.get("mtime") or info.get("LastModified")
            out.append(RemoteFile(path[len(self.root):].lstrip("/"), int(info.get("size") or 0), str(tag or "")))
        return out

    def get(self, rel: str, dest: Path) -> None:
        self.fs.get_file(f"{self.root}/{rel}", str(dest))


def _store(url: str, s3_client: Any = None):
    if url.startswith("s3://"):
        if s3_client is None:
            import boto3  # its default chain reads the endpoint from AWS_ENDPOINT_URL_S3

            s3_client = boto3.client("s3")
        return _S3(url, s3_client)
    return _Fsspec(url)


def list_model(url: str, s3_client: Any = None, *, marker: str = "config.json") -> list[RemoteFile]:
    """The model's objects, or ModelNotFound (one line): unreadable, empty, or no `marker`
    (config.json; a LoRA adapter's: adapter_config.json).  Reads the listing only, not the weights."""
    try:
        files = _store(url, s3_client).list()
    except ModelNotFound:
        raise
    except Exception as err:  # botocore's ClientError/EndpointConnectionError, fsspec's OSError
        raise ModelNotFound(f"model {url!r} cannot be listed: {first_line(err)}") from None
    if not files:
        raise ModelNotFound(f"model {url!r}: no objects under that URL")
    if not any(f.rel == marker for f in files):
        what = "a Hugging Face model folder" if marker == "config.json" else f"a folder with {marker}"
        raise ModelNotFound(f"model {url!r} has no {marker} ({what} is expected there)")
    return files


def _manifest(folder: Path) -> dict[str, dict] | None:
    try:
        return json.loads((folder / MANIFEST).read_text())["files"]
    except (OSError, ValueError, KeyError, TypeError):
        return None


@contextlib.contextmanager
def _host_lock(folder: Path) -> Iterator[None]:
    folder.parent.mkdir(parents=True, exist_ok=True)
    with open(folder.parent / f".{folder.name}.lock", "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)  # waits while another process of this host syncs
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _md5_ok(path: Path, etag: str) -> bool:
    """A single-part S3 upload's ETag is its MD5 (a multipart one has a `-N` suffix: size only)."""
    if len(etag) != 32 or "-" in etag:
        return True
    h = hashlib.md5(usedforsecurity=False)
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest() == etag


def sync_model(url: str, s3_client: Any = None, *, weights: bool = True, marker: str = "config.json") -> Path:
    """This host's complete copy of the model at `url`, fetched or refreshed as needed
    (see the module docstring); ModelNotFound (one line) when it cannot be.
    `weights=False`: a copy of everything but the weights (WEIGHT_SUFFIXES); `marker`: the
    file that must be there (`list_model`)."""
    folder = synced_folder(url, weights=weights)
    with _host_lock(folder):
        files = [f for f in list_model(url, s3_client, marker=marker)
                 if weights or not f.rel.endswith(WEIGHT_SUFFIXES)]
        want = {f.rel: {"size": f.size, "etag": f.etag} for f in files}
        have = _manifest(folder)
        if have == want:
            return folder
        tmp = folder.with_name(f".{folder.name}.partial-{uuid.uuid4().hex[:8]}")
        store = _store(url, s3_client)
        try:
            for f in files:
                dest = tmp / f.rel
                dest.parent.mkdir(parents=True, exist_ok=True)
                old = folder / f.rel
                if have and have.get(f.rel) == want[f.rel] and old.is_file():
                    os.link(old, dest)  # unchanged since the last sync
                    continue
                try:
                    store.get(f.rel, dest)
                except Exception as err:
                    raise ModelNotFound(f"model {url!r}: {f.rel} cannot be fetched: {first_line(err)}") from None
                if dest.stat().st_size != f.size or not _md5_ok(dest, f.etag):
                    raise ModelNotFound(f"model {url!r}: {f.rel} arrived damaged (size or checksum differs)")
            (tmp / MANIFEST).write_text(json.dumps({"url": url, "synced_at": time.time(), "files": want}))
            if folder.exists():
                stale = folder.with_name(f".{folder.name}.stale-{uuid.uuid4().hex[:8]}")
                folder.rename(stale)
                shutil.rmtree(stale, ignore_errors=True)
            tmp.rename(folder)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return folder
