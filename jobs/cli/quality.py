"""CLI commands for quantized checkpoints, KV cache sizing and the quality gate:
`tokenmill quantize`, `tokenmill kv-plan`, `tokenmill compare`."""

from __future__ import annotations

import click

from tokenmill.jobs.cli.app import main
from tokenmill.jobs.cli.common import (
    CONTEXT_SETTINGS,
    EXIT_FAILED,
    EXIT_QUALITY,
    EXIT_USAGE,
    Failure,
    connect,
    db_option,
    emit_json,
    json_option,
)


def parse_bytes(text: str) -> int:
    """`4294967296`, `4GiB`, `512MiB` → bytes (kvplan.parse_bytes); Failure otherwise."""
    from tokenmill.jobs.modeltools.kvplan import parse_bytes as parse

    try:
        return parse(text or "")
    except ValueError:
        raise Failure(f"--memory must be a byte count like 4294967296 or 4GiB, got {text!r}", EXIT_USAGE) from None


@main.command(context_settings=CONTEXT_SETTINGS)
@click.option("--model", "-m", required=True, help="Short model name or full-precision model folder (gguf-* schemes: "
              "a short name or a .gguf file).")
@click.option("--scheme", required=True, help="w8a8-int8 (int8 per-channel weights, dynamic int8 activations) or w4a16 "
              "(int4 grouped weights), for vLLM; gguf-f16, gguf-q8_0 or gguf-q4_k_m (llama-quantize), for --engine llamacpp.")
@click.option("--method", default="rtn", show_default=True,
              help="rtn (round-to-nearest, no calibration; for gguf-* plain llama-quantize); calibrated, in "
                   "llmcompressor's venv: w8a8-int8 takes gptq or smoothquant+gptq, w4a16 takes gptq or awq; "
                   "gguf-q4_k_m takes imatrix (llama-imatrix's importance matrix on the calibration prompts, then "
                   "llama-quantize --imatrix).")
@click.option("--out", "-o", required=True, type=click.Path(), help="Folder for the quantized checkpoint (a .gguf file for gguf-* schemes).")
@click.option("--group-size", type=int, default=None, help="w4a16 only: input columns per scale (default 128; must divide every layer's input dim).")
@click.option("--calibration", default=None, metavar="INPUT|JOB_ID",
              help="The job's input (Parquet file, folder or glob) or an earlier job's id: calibration prompts, "
                   "tokenized with the job's chat template (rtn only checks it; plain gguf-* takes none).")
@click.option("--samples", type=int, default=None, help="Calibration prompts drawn, stratified by length (default 64).")
@click.option("--max-seq-len", type=int, default=None, help="Longest calibration prompt in tokens; longer ones are not used (default 1024).")
@click.option("--force", is_flag=True, help="Replace a non-empty output folder (only once the new one is complete).")
@db_option
@json_option
def quantize(model, scheme, method, out, group_size, calibration, samples, max_seq_len, force, db_url, as_json):
    """Write a compressed-tensors checkpoint that vLLM loads directly, or (gguf-* schemes)
    a GGUF for the llamacpp engine.

    \b
    Examples:
      tokenmill quantize --model smollm2-135m --scheme w8a8-int8 --out models/smollm2-w8a8
      tokenmill quantize --model smollm2-135m --scheme w4a16 --group-size 64 --out models/smollm2-w4a16
      tokenmill quantize --model smollm2-135m --scheme w8a8-int8 --method smoothquant+gptq \\
          --calibration nightly-2026-11-30 --out models/smollm2-w8a8-sq
      tokenmill run --model models/smollm2-w8a8 --input data/eval_set.parquet --output runs/q8
      tokenmill quantize --model smollm2-135m --scheme gguf-q8_0 --out models/smollm2-q8_0.gguf
      tokenmill run --engine llamacpp --model models/smollm2-q8_0.gguf --input data/eval_set.parquet --output runs/g8
      tokenmill quantize --model smollm2-135m --scheme gguf-q4_k_m --method imatrix \\
          --calibration nightly-2026-11-30 --out models/smollm2-q4_k_m-imat.gguf
    """
    from tokenmill.jobs.modeltools.quantize import quantize as do_quantize
    from tokenmill.jobs.modeltools.schemes import CalibrationSet, QuantizeError

    try:
        res = do_quantize(model, scheme, out, group_size=group_size, method=method,
                          calibration=CalibrationSet(calibration, samples, max_seq_len), db_url=db_url, force=force)
    except QuantizeError as err:
        raise Failure(str(err), EXIT_USAGE if err.exit_usage else EXIT_FAILED) from None
    d = res.as_dict()
    if as_json:
        emit_json(d)
        return
    from tokenmill.jobs.modeltools.kvplan import format_bytes

    g = f", group size {d['group_size']}" if d["group_size"] else ""
    unit = "tensors" if d["scheme"].startswith("gguf-") else "layers"
    click.echo(f"wrote {d['out']}: {d['scheme']} {d.get('method', 'rtn')}{g}, {d['layers']} {unit} quantized in {d['seconds']} s")
    click.echo(f"  weights on disk {format_bytes(d['weights_bytes'])} (from {format_bytes(d['source_bytes'])}, {d['size_ratio']}× smaller)")
    run = d.get("calibration_run")
    if run:
        tool = "llama-imatrix" if d["method"] == "imatrix" else "llmcompressor"
        click.echo(f"  calibration: {d['calibration_rows']} prompts ({run.get('tokens')} tokens) prepared in {d['prepare_s']} s; "
                   f"{tool} run {run.get('wall_s')} s, peak RSS {format_bytes(run.get('peak_rss_bytes') or 0)}")
    if d["sha256"]:
        click.echo(f"  checkpoint sha256 {d['sha256']}")
    for n in d["notes"]:
        click.echo(f"  note: {n}")


@main.command("kv-plan", context_settings=CONTEXT_SETTINGS)
@click.option("--model", "-m", default=None, help="Short model name or model folder (default: the --job's model).")
@click.option("--max-model-len", "-l", type=int, default=None, help="Tokens per sequence (default: the --job's max_model_len).")
@click.option("--batch", "-b", type=int, default=1, show_default=True, help="Sequences held at once.")
@click.option("--kv-cache-dtype", default="auto", show_default=True, help="auto (= model dtype), fp8, bfloat16, float16, float32.")
@click.option("--dtype", default="auto", show_default=True, help="Model dtype (auto = the checkpoint's; with --job, the job's).")
@click.option("--scheme", default=None, help="Weights scheme for the weights line (w8a8-int8, w4a16; default: read from the checkpoint).")
@click.option("--memory", default=None, metavar="BYTES", help="KV cache memory to fit (4GiB, 512MiB, or bytes).")
@click.option("--job", "job_id", default=None, help="Compare with the KV capacity vLLM reported when this job started.")
@db_option
@json_option
def kv_plan(model, max_model_len, batch, kv_cache_dtype, dtype, scheme, memory, job_id, db_url, as_json):
    """Size the KV cache and weights from the model's config.json.

    \b
    KV bytes = 2 × layers × kv_heads × head_dim × max_model_len × batch × bytes/element.
    Examples:
      tokenmill kv-plan --model smollm2-135m --max-model-len 2048 --batch 64 --memory 4GiB
      tokenmill kv-plan --job demo --batch 32 --json
    """
    from tokenmill.jobs.modeltools import kvplan as K

    info = None
    if job_id:
        from tokenmill.schemas import storage as S

        eng = connect(db_url)
        job = S.JobStore(eng).get(job_id)
        if job is None:
            raise Failure(f"no job with id {job_id!r}")
        info = K.engine_info_for_job(eng, job_id)
        if info is None:
            raise Failure(f"job {job_id!r} has no engine information (it never started an engine)")
        model = model or job.get("model")
        max_model_len = max_model_len or info.get("max_model_len")
        if dtype == "auto" and info.get("dtype"):
            dtype = info["dtype"]
        if kv_cache_dtype == "auto" and info.get("kv_cache_dtype") and info["kv_cache_dtype"] != "auto":
            kv_cache_dtype = info["kv_cache_dtype"]
    if not model:
        raise Failure("give --model (or --job to take the job's model)", EXIT_USAGE)
    if not max_model_len:
        raise Failure("give --max-model-len (or --job to take the job's)", EXIT_USAGE)
    mem = parse_bytes(memory) if memory is not None else (info.get("kv_cache_bytes") if info else None)
    try:
        cfg, _ = K.load_config(model)
        p = K.plan(cfg, max_model_len=max_model_len, batch=batch, kv_cache_dtype=kv_cache_dtype, dtype=dtype,
                   memory=mem, scheme=scheme)
    except K.PlanError as err:
        raise Failure(str(err), EXIT_USAGE) from None
    if info is not None:
        p["engine"] = K.compare_with_engine(p, info)
    if as_json:
        emit_json(p)
    else:
        click.echo(K.format_plan(p))


@main.command(context_settings=CONTEXT_SETTINGS)
@click.argument("base_job")
@click.argument("candidate_job")
@click.option("--max-drop", type=float, default=None, help="Allowed accuracy drop (or disagreement without references), "
              "and allowed schema-valid rate drop of structured rows, as a fraction; default 0.05.")
@click.option("--min-cosine", type=float, default=None, help="Embedding jobs: the lowest mean cosine similarity of "
              "the rows' vectors that passes; default 0.99.")
@click.option("--show", type=int, default=5, show_default=True, help="How many of the most different rows to list.")
@db_option
@json_option
def compare(base_job, candidate_job, max_drop, min_cosine, show, db_url, as_json):
    """Quality gate: compare a candidate job's outputs with a base job's (exit 6 if worse than allowed).

    \b
    Examples:
      tokenmill compare eval-bf16 eval-w8a8 --max-drop 0.05
      tokenmill compare embed-bf16 embed-w8a8 --min-cosine 0.995
    """
    from tokenmill.jobs.modeltools import compare as C

    try:
        c = C.compare_jobs(connect(db_url), base_job, candidate_job,
                           max_drop=C.DEFAULT_MAX_DROP if max_drop is None else max_drop,
                           min_cosine=C.DEFAULT_MIN_COSINE if min_cosine is None else min_cosine, show=show)
    except C.CompareError as err:
        raise Failure(str(err)) from None
    if as_json:
        emit_json(c.as_dict())
    else:
        click.echo(C.format_comparison(c))
    if not c.passed:
        raise SystemExit(EXIT_QUALITY)
