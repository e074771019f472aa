"""A quantized checkpoint on disk: its output folder checked before any weight is touched and
replaced only by a complete one, its hash and the library versions its record carries, and
what a written compressed-tensors checkpoint must hold to be loaded by vLLM.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any

from tokenmill.jobs.modeltools.schemes import QuantizeError, QuantizeFailed
from tokenmill.schemas.errors import first_line

#: The checkpoint format each scheme must come out in (config.json quantization_config.format).
FORMATS = {"w8a8-int8": "int-quantized", "w4a16": "pack-quantized"}


def prepare_out(out: Path, force: bool) -> None:
    """Raise unless `out` is a folder that may be written: absent, empty, or `force`d."""
    if out.exists() and not out.is_dir():
        raise QuantizeError(f"output {str(out)!r} is a file, not a folder")
    if out.exists() and any(out.iterdir()) and not force:
        raise QuantizeError(f"output folder {str(out)!r} is not empty (use --force to replace it)")


def publish(tmp: Path, out: Path) -> None:
    """Move the finished folder `tmp` to `out`, replacing what `out` held only now."""
    old = None
    if out.exists():
        old = out.with_name(f".{out.name}.old-{os.getpid()}")
        out.rename(old)
    tmp.rename(out)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def weights_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.glob("*.safetensors"))


def library_versions(*names: str) -> dict[str, str]:
    """Installed versions of the named distributions (those not installed are left out)."""
    from importlib import metadata

    out = {}
    for n in names:
        try:
            out[n] = metadata.version(n)
        except metadata.PackageNotFoundError:
            pass
    return out


def checkpoint_hash(path: Path) -> dict[str, Any]:
    """sha256 of each weights file of a model folder, and one digest over (name, digest) of
    them all; of a single file (a GGUF), the file's own sha256 (what `sha256sum` prints)."""
    files = {}
    for f in sorted(path.glob("*.safetensors")) if path.is_dir() else [path]:
        h = hashlib.sha256()
        with open(f, "rb") as fh:
            for block in iter(lambda: fh.read(1 << 20), b""):
                h.update(block)
        files[f.name] = h.hexdigest()
    if not path.is_dir():
        return {"sha256": files[path.name], "files": files}
    whole = hashlib.sha256("".join(f"{n}:{d}\n" for n, d in files.items()).encode()).hexdigest()
    return {"sha256": whole, "files": files}


def check_checkpoint(folder: Path, scheme: str, g: int | None, layers: int) -> int:
    """What this process requires of a written checkpoint: the scheme's format in
    `config.json`, readable by the installed compressed-tensors (the one vLLM uses),
    the expected group size, and one weight scale for each of the `layers` Linear
    layers.  Returns the number of quantized layers; raises QuantizeFailed."""
    from compressed_tensors.quantization import QuantizationConfig
    from safetensors import safe_open

    try:
        qc = json.loads((folder / "config.json").read_text())["quantization_config"]
        parsed = QuantizationConfig.model_validate(qc)
    except Exception as err:
        raise QuantizeFailed(f"the written checkpoint's quantization_config cannot be read by compressed-tensors "
                             f"{library_versions('compressed-tensors').get('compressed-tensors')}: {first_line(err)}") from None
    if qc.get("format") != FORMATS[scheme]:
        raise QuantizeFailed(f"the written checkpoint has format {qc.get('format')!r}, expected {FORMATS[scheme]!r} for {scheme}")
    w = next(iter(parsed.config_groups.values())).weights
    if g is not None and w.group_size != g:
        raise QuantizeFailed(f"the written checkpoint has group size {w.group_size}, expected {g}")
    scales = 0
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(str(f), "pt") as fh:
            scales += sum(1 for k in fh.keys() if k.endswith(".weight_scale"))
    if scales != layers:
        raise QuantizeFailed(f"the written checkpoint quantizes {scales} layers, expected {layers}")
    return scales
