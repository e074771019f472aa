"""An engine's identity, as the result cache's keys name it (docs/CACHE.md): its checkpoint's
content hash (`checkpoint_sha256`, kept on disk per file version), its kind and versions, and
the settings that decide an answer (`answer_settings`), digested into one `fingerprint`; and a
LoRA adapter's content hash (`adapter_hashes`).  The launcher computes these before the
pipeline starts (`EngineKind.launch_side`), so this module imports no Beam step: the keys
themselves and the step that serves them are transforms/cache.py's."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Mapping

from tokenmill.schemas import engine_kinds
from tokenmill.schemas.config import EngineConfig
from tokenmill.schemas.model_home import locked_record
from tokenmill.schemas.models import tokenmill_home
from tokenmill.transforms.engines.device import has_nvidia_gpu

#: The recipe of keys and fingerprints: a change to what goes into them bumps it, so no old
#: entry is served under a new meaning.
KEY_FORMAT = 1
#: The engine keys that decide an answer, besides the checkpoint, the engine and its version
#: (those an engine's config has): the dtype as the engine runs it, quantization, KV cache dtype,
#: task and pooling, the weights' loader (`dummy`: random weights), speculative decoding and
#: `extra` (any other engine argument).  Sizing and scheduling keys (`max_num_seqs`, memory
#: shares, parallelism) are left out: they change how fast an answer comes, not which.
ANSWER_KEYS = ("dtype", "quantization", "kv_cache_dtype", "task", "pooling", "load_format", "speculative_config",
               "extra")
#: vLLM's other names of a dtype, as keys name it.
DTYPE_NAMES = {"half": "float16", "float": "float32"}
#: The files of a model folder whose bytes are its checkpoint: weights, config, tokenizer, chat
#: template, custom code.  A `.gguf` file is hashed whole.
CHECKPOINT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".json", ".model", ".txt", ".jinja",
                       ".tiktoken", ".py")


def canonical(v: Any) -> Any:
    """A value as keys hash it: a whole float as its int (temperature 0 and 0.0 are one key)."""
    if isinstance(v, float) and v.is_integer():
        return int(v)
    if isinstance(v, Mapping):
        return {str(k): canonical(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [canonical(x) for x in v]
    return v


def digest(payload: Mapping[str, Any], tail: bytes = b"") -> str:
    text = json.dumps(canonical(payload), sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=str)
    return hashlib.sha256(text.encode() + tail).hexdigest()


def fingerprint(*, kind: str, versions: Mapping[str, str], checkpoint: str, settings: Mapping[str, Any]) -> str:
    """The engine's identity in every key: the checkpoint's content hash, the engine kind and its
    packages' versions (`EngineKind.versions`), and the answer-deciding settings (`answer_settings`)."""
    return digest({"format": KEY_FORMAT, "kind": kind, "versions": dict(versions), "checkpoint": checkpoint,
                    "settings": dict(settings)})


def answer_settings(cfg: EngineConfig, dtype: str | None) -> dict[str, Any]:
    """The `ANSWER_KEYS` an engine config has, with `dtype` the one the engine runs (resolved
    `auto`) and the embedding pooling resolved."""
    d = cfg.model_dump(mode="json")
    out = {k: d[k] for k in ANSWER_KEYS if k in d}
    if "dtype" in out or dtype is not None:
        out["dtype"] = DTYPE_NAMES.get(dtype, dtype) if dtype else dtype
    out["pooling"] = cfg.embedding_pooling()
    return out



def adapter_hashes(cfg: EngineConfig) -> dict[str, str]:
    """The content hash of each LoRA adapter a job declares (its folder's or GGUF file's
    `checkpoint_sha256`, kept per file version like a model's), for the keys of rows run with it."""
    paths = engine_kinds.registered(cfg.kind).adapter_paths(cfg)
    return {name: checkpoint_sha256(path) for name, path in paths.items()}


def checkpoint_files(path: Path) -> list[Path]:
    """The files whose bytes are a checkpoint: the file itself, or a folder's top-level
    `CHECKPOINT_SUFFIXES` files, by name."""
    if path.is_file():
        return [path]
    return sorted((f for f in path.iterdir() if f.is_file() and not f.name.startswith(".")
                   and f.suffix in CHECKPOINT_SUFFIXES), key=lambda f: f.name)


def _hash_file(f: Path) -> str:
    h = hashlib.sha256()
    with f.open("rb") as fh:
        for block in iter(lambda: fh.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def _identity(f: Path) -> list[int]:
    """What says a file is the version hashed before: size, mtime, ctime (a rewrite that put the
    mtime back still moves it), and the file's device and inode (a copy put in its place)."""
    st = f.stat()
    return [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_dev, st.st_ino]


def checkpoint_sha256(path: str | Path, *, hashes: Path | None = None) -> str:
    """The content hash of a checkpoint (a `.gguf` file, or a model folder's `checkpoint_files`
    with their names).  Each file's sha256 is kept in `hashes` (default
    `checkpoint_sha256.json` under tokenmill's home) under its path and `_identity`, so a
    model is read once per version of its files, not once per job."""
    root = Path(path).resolve()
    lines = []
    with locked_record(hashes or tokenmill_home() / "checkpoint_sha256.json") as known:
        for f in checkpoint_files(root):
            ident, entry = _identity(f), known.get(str(f))
            if not entry or entry.get("identity") != ident:
                entry = known[str(f)] = {"identity": ident, "sha256": _hash_file(f)}
            lines.append(f"{f.name}\t{entry['sha256']}\n")
    if root.is_file():
        return lines[0].split("\t")[1].strip()
    return hashlib.sha256("".join(lines).encode()).hexdigest()


class CacheRefused(ValueError):
    """A job whose answers cannot be cached (one line naming the key and the value)."""


def engine_fingerprint(cfg: EngineConfig, model_path: str | None, *, resolve_dtype: bool = True) -> str:
    """The fingerprint of the engine a job runs here: its checkpoint's content hash
    (`EngineKind.checkpoint`), its kind and versions, and `answer_settings` with the dtype it
    runs (`EngineKind.run_dtype`: `auto` on a CPU is the measured choice; `resolve_dtype`
    False keeps the configured one, for a stand-in engine).  CacheRefused for an engine whose
    checkpoint is out of reach."""
    engine = engine_kinds.registered(cfg.kind)
    ckpt = engine.checkpoint(cfg, model_path)
    if ckpt is None:
        raise CacheRefused(refusal(cfg.kind))
    dtype = engine.run_dtype(cfg, model_path, on_gpu=has_nvidia_gpu()) if resolve_dtype else getattr(cfg, "dtype", None)
    return fingerprint(kind=cfg.kind, versions=engine.versions(), checkpoint=checkpoint_sha256(ckpt),
                       settings=answer_settings(cfg, dtype))


def refusal(kind: str, mode: str = "read-write") -> str:
    return (f"cache: {mode}: engine kind {kind} answers from weights tokenmill cannot read (a remote server), so "
            "no key can name its checkpoint and its answers are never cached; set cache: off")

