"""Where a model is on the host a worker runs on: the launcher's folder when this host has
it too, else what the model's name resolves to here (a URL synced into this host's cache
with the job's S3 endpoint, schemas/model_sync.py)."""

from __future__ import annotations

import os

from tokenmill.schemas.model_sync import is_model_url, sync_model
from tokenmill.schemas.models import resolve_model
from tokenmill.transforms.engines.lora import ADAPTER_CONFIG
from tokenmill.transforms.inputs import s3_client

_CLIENTS: dict[int, tuple[object, object]] = {}


def s3_client_here():
    """The S3 client of the job's options on this worker: an SDK worker's Beam filesystems
    hold them (sdk_worker_main sets them; Beam has no public getter), else boto3's default
    chain (AWS_ENDPOINT_URL_S3), which is what Beam's S3 filesystem reads there too.  One
    client per options object per process (a client is thread-safe; making one is not cheap)."""
    from apache_beam.io.filesystems import FileSystems  # Beam: only where a worker reads s3://

    options = getattr(FileSystems, "_pipeline_options", None)
    held = _CLIENTS.get(id(options))
    if held is None or held[0] is not options:
        held = _CLIENTS[id(options)] = (options, s3_client(options))
    return held[1]


def model_folder_here(name: str, launcher_path: str | None, *, need_weights: bool = True) -> str:
    """The folder of model `name` on this host (ModelNotFound, one line, when there is none)."""
    if launcher_path and os.path.isdir(launcher_path):
        return launcher_path
    if is_model_url(name):
        return str(sync_model(name, s3_client_here() if name.startswith("s3://") else None))
    return str(resolve_model(name, need_weights=need_weights))


def adapters_here(adapters: dict[str, str]) -> None:
    """This host's copy of each LoRA adapter given as a URL (`engine.lora_adapters`), synced with
    the job's S3 endpoint; the engine then finds it where `engines.lora.local_path` says."""
    for url in adapters.values():
        if is_model_url(url):
            sync_model(url, s3_client_here() if url.startswith("s3://") else None, marker=ADAPTER_CONFIG)
