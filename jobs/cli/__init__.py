"""tokenmill command line: a thin click layer over the job library.

Commands parse, call, and turn domain errors into one-line messages with a
documented exit code; no traceback reaches the user for an error they can fix.

Exit codes (docs/CLI.md):
  0  succeeded
  1  failed (the job or the command)
  2  usage error (bad flags, invalid job spec)
  3  partial success: some rows are dead letters
  4  cancelled
  5  busy: the job (or the run-pending lock) is held by another live run
  6  quality gate failed (compare)
"""

from __future__ import annotations

from tokenmill.schemas.errors import first_line

import json
import logging
import os
import sys
from typing import Any

import click

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_PARTIAL, EXIT_CANCELLED, EXIT_BUSY, EXIT_QUALITY = 0, 1, 2, 3, 4, 5, 6
STATUS_EXIT = {"succeeded": EXIT_OK, "partial": EXIT_PARTIAL, "cancelled": EXIT_CANCELLED, "failed": EXIT_FAILED}
ENGINE_COMMANDS = {"run", "run-pending"}

CONTEXT_SETTINGS = {"help_option_names": ["-h", "--help"], "max_content_width": 100}


class Failure(click.ClickException):
    """A one-line error with an exit code."""

    def __init__(self, message: str, code: int = EXIT_FAILED):
        super().__init__(message)
        self.exit_code = code

    def show(self, file=None) -> None:
        click.echo(f"error: {self.format_message()}", err=True)


def db_option(f):
    return click.option(
        "--db",
        "db_url",
        envvar="TOKENMILL_DB_URL",
        default=None,
        metavar="URL",
        help="SQLAlchemy database URL (default: SQLite under ~/.cache/tokenmill; env TOKENMILL_DB_URL).",
    )(f)


def json_option(f):
    return click.option("--json", "as_json", is_flag=True, help="Print JSON for machines.")(f)


def emit_json(obj: Any) -> None:
    click.echo(json.dumps(obj, indent=2, default=str))


def connect(db_url: str | None):
    from tokenmill.schemas import storage as S
    from tokenmill.schemas.db import default_db_url

    try:
        return S.connect(db_url or default_db_url())
    except S.StorageError as err:
        raise Failure(str(err)) from None


def _quiet_logs(verbose: bool) -> None:
    level = logging.INFO if verbose else logging.WARNING
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "INFO" if verbose else "ERROR")
    # vLLM logs to stdout by default (its engine processes too); stdout is the
    # summary or, with --json, the machine-readable result.
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    for name in ("apache_beam", "root", "alembic"):
        logging.getLogger(name).setLevel(logging.ERROR if not verbose else logging.INFO)
    if not verbose:
        import warnings

        warnings.filterwarnings("ignore")


@click.group(context_settings=CONTEXT_SETTINGS)
@click.option("-v", "--verbose", is_flag=True, help="Show engine and pipeline logs.")
@click.version_option(package_name="tokenmill")
def main(verbose: bool) -> None:
    """tokenmill: offline batch LLM inference on Apache Beam and vLLM.

    \b
    Example:
      tokenmill run --input prompts.parquet --output out/ --max-tokens 64
      tokenmill status JOB_ID
    """
    _quiet_logs(verbose)


# ---------------------------------------------------------------- run


def apply_options(f, opts):
    """Apply click decorators so they show in --help in the order listed."""
    for o in reversed(opts):
        f = o(f)
    return f


def sampling_options(f):
    opts = [
        click.option("--max-tokens", type=int, default=None, help="Default max output tokens per row."),
        click.option("--temperature", type=float, default=None, help="Default sampling temperature (0 = greedy)."),
        click.option("--top-p", type=float, default=None, help="Default nucleus sampling top_p."),
        click.option("--seed", type=int, default=None, help="Default sampling seed."),
        click.option("--stop", multiple=True, help="Stop string (repeatable)."),
        click.option("--ignore-eos", is_flag=True, default=None, help="Generate max_tokens regardless of EOS."),
    ]
    return apply_options(f, opts)


def build_spec(spec_file, overrides: dict[str, Any]):
    """A JobSpec from a YAML file and/or flags; flags win over the file."""
    from tokenmill.schemas.config import SpecError, load_spec

    data: dict[str, Any] = {}
    if spec_file:
        import yaml

        try:
            with open(spec_file) as fh:
                data = yaml.safe_load(fh) or {}
        except OSError as err:
            raise Failure(f"cannot read job spec {spec_file!r}: {err.strerror}", EXIT_USAGE) from None
        except yaml.YAMLError as err:
            raise Failure(f"job spec {spec_file!r} is not valid YAML: {first_line(err)}", EXIT_USAGE) from None
        if not isinstance(data, dict):
            raise Failure(f"job spec {spec_file!r} must be a mapping of keys", EXIT_USAGE)
    for path, value in overrides.items():
        if value is None or value == () or value == []:
            continue
        cur = data
        keys = path.split(".")
        for k in keys[:-1]:
            cur = cur.setdefault(k, {})
        cur[keys[-1]] = list(value) if isinstance(value, tuple) else value
    for required in ("input", "output"):
        if required not in data:
            raise Failure(f"--{required} is required (or `{required}:` in the job spec)", EXIT_USAGE)
    try:
        return load_spec(data, source=f"job spec {spec_file}" if spec_file else "job options")
    except SpecError as err:
        raise Failure(str(err), EXIT_USAGE) from None


def engine_options(f):
    opts = [
        click.option("--model", default=None, help="Model short name or local HF folder (default smollm2-135m)."),
        click.option("--dtype", default=None, help="Weights/activations dtype (auto picks by measurement on CPU)."),
        click.option("--quantization", default=None, help="vLLM quantization method of the checkpoint."),
        click.option("--kv-cache-dtype", default=None, help="KV cache dtype: auto, fp8, ..."),
        click.option("--max-model-len", type=int, default=None, help="Context length the engine reserves."),
        click.option("--max-num-seqs", type=int, default=None, help="Sequences in flight in the engine."),
        click.option("--gpu-memory-utilization", type=float, default=None, help="Share of device memory (of RAM on CPU)."),
        click.option("--ordering", type=click.Choice(["prefix", "length", "none"]), default=None, help="Batch ordering."),
        click.option("--token-budget", type=int, default=None, help="Prompt+output tokens per batch."),
        click.option("--workers", type=int, default=None, help="Worker processes (DirectRunner)."),
        click.option("--runner", default=None, help="Beam runner (DirectRunner, PortableRunner, DataflowRunner, ...)."),
        click.option("--pipeline-option", "pipeline_options", multiple=True, help="Extra Beam pipeline flag (repeatable)."),
    ]
    return apply_options(f, opts)


def spec_overrides(kw: dict[str, Any]) -> dict[str, Any]:
    m = {
        "input": "input", "output": "output", "job_id": "job_id", "name": "name", "db_url": "db",
        "s3_endpoint_url": "s3_endpoint_url", "input_format": "input_format",
        "model": "engine.model", "dtype": "engine.dtype", "quantization": "engine.quantization",
        "kv_cache_dtype": "engine.kv_cache_dtype", "max_model_len": "engine.max_model_len",
        "max_num_seqs": "engine.max_num_seqs", "gpu_memory_utilization": "engine.gpu_memory_utilization",
        "max_tokens": "sampling.max_tokens", "temperature": "sampling.temperature", "top_p": "sampling.top_p",
        "seed": "sampling.seed", "stop": "sampling.stop", "ignore_eos": "sampling.ignore_eos",
        "ordering": "batching.ordering", "token_budget": "batching.token_budget",
        "workers": "runner.num_workers", "runner": "runner.runner", "pipeline_options": "runner.pipeline_options",
    }
    return {m[k]: v for k, v in kw.items() if k in m}


class Progress:
    """rows done / total, output tok/s and ETA on a terminal; silent otherwise."""

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self.bar = None
        self._t0 = None

    def __call__(self, done: int, total: int, out_tokens: int) -> None:
        if not self.enabled:
            return
        import time

        from tqdm import tqdm

        if self.bar is None:
            self.bar = tqdm(total=total, unit="row", dynamic_ncols=True, file=sys.stderr, desc="rows")
            self._t0 = time.time()
        self.bar.n = done
        dt = max(time.time() - self._t0, 1e-6)
        self.bar.set_postfix_str(f"{out_tokens / dt:.0f} out tok/s", refresh=False)
        self.bar.refresh()

    def close(self):
        if self.bar is not None:
            self.bar.close()


def format_summary(s: dict[str, Any]) -> str:
    def num(v, fmt="{:,.1f}"):
        return "-" if v is None else fmt.format(v)

    lines = [
        f"job {s['job_id']}: {s['status']}" + (" (resumed)" if s.get("resumed") else ""),
        f"  rows in {s['rows_in']:,} / succeeded {s['succeeded']:,} / failed {s['failed']:,}",
        f"  tokens: prompt {num(s['prompt_tokens'], '{:,}')}, output {num(s['output_tokens'], '{:,}')}, "
        f"total {num(s['total_tokens'], '{:,}')}",
        f"  wall {num(s['wall_s'])} s (model load {num(s['model_load_s'])} s, generation {num(s['generation_wall_s'])} s)",
        f"  output {num(s['output_tok_per_s'])} tok/s, total {num(s['total_tok_per_s'])} tok/s "
        f"(over generation wall time); prefix cache hit rate {num(s['prefix_cache_hit_rate'], '{:.1%}')}",
    ]
    if s.get("cost_per_1m_output_tokens") is not None:
        lines.append(f"  cost ${s['cost_per_1m_output_tokens']:.4f} per 1M output tokens")
    if s.get("outputs"):
        lines.append(f"  outputs: {s['outputs']}")
    if s.get("note"):
        lines.append(f"  note: {s['note']}")
    return "\n".join(lines)


def execute_job(spec, db_url, quiet: bool, as_json: bool) -> int:
    from tokenmill.schemas import storage as S
    from tokenmill.jobs.lifecycle.runner import JobError, run_job

    progress = Progress(enabled=not quiet and not as_json and sys.stderr.isatty())
    try:
        result = run_job(spec, db_url=db_url, progress=progress)
    except S.JobBusy as err:
        raise Failure(str(err), EXIT_BUSY) from None
    except (JobError, S.StorageError) as err:
        raise Failure(str(err)) from None
    finally:
        progress.close()
        from tokenmill.transforms.engines.registry import shutdown_all

        shutdown_all()
    summary = result.summary()
    summary["resumed"] = result.resumed
    if as_json:
        emit_json(summary)
    elif not quiet:
        click.echo(format_summary(summary))
    return STATUS_EXIT.get(result.status, EXIT_FAILED)


def job_options(f):
    """Where a job reads and writes and what it is called (run, submit, validate)."""
    opts = [
        click.option("--input", "-i", "input", default=None,
                     help="Parquet file, folder or glob (local or s3://), or OpenAI batch .jsonl."),
        click.option("--input-format", type=click.Choice(["auto", "parquet", "openai-jsonl"]), default=None),
        click.option("--output", "-o", default=None, help="Output folder (local or s3://)."),
        click.option("--job-id", default=None, help="Stable job id (default: derived from the spec); rerunning an id resumes."),
        click.option("--name", default=None, help="A human name for the job."),
        click.option("--s3-endpoint-url", default=None, envvar="AWS_ENDPOINT_URL_S3", help="S3-compatible endpoint."),
    ]
    return apply_options(f, opts)


def job_spec_options(f):
    """SPEC_FILE plus every flag that overrides a job spec key (run, submit, validate)."""
    f = apply_options(f, [job_options, db_option, engine_options, sampling_options])
    return click.argument("spec_file", required=False, type=click.Path(dir_okay=False))(f)


@main.command(context_settings=CONTEXT_SETTINGS)
@job_spec_options
@click.option("-q", "--quiet", is_flag=True, help="No progress or summary.")
@json_option
def run(spec_file, quiet, as_json, **kw):
    """Run a batch job now (from a job spec YAML and/or flags).

    \b
    Examples:
      tokenmill run --input data/sample_prompts.parquet --output runs/demo --max-tokens 64
      tokenmill run job.yaml --job-id nightly-2026-11-29
    """
    spec = build_spec(spec_file, spec_overrides(kw))
    sys.exit(execute_job(spec, kw.get("db_url"), quiet, as_json))


# ---------------------------------------------------------------- status / jobs


def job_summary_row(job: dict[str, Any]) -> dict[str, Any]:
    m = job.get("metrics") or {}
    th = m.get("throughput", {})
    return {
        "id": job["id"],
        "name": job.get("name"),
        "status": job["status"],
        "model": job.get("model"),
        "total": job.get("total"),
        "succeeded": job.get("succeeded"),
        "failed": job.get("failed"),
        "output_tok_per_s": th.get("output_tok_per_s"),
        "cost_per_1m_output_tokens": (m.get("cost") or {}).get("per_1m_output_tokens"),
        "started_at": job.get("started_at"),
        "finished_at": job.get("finished_at"),
    }


def headline_metrics(m: dict[str, Any]) -> dict[str, Any]:
    """The figures `status` adds to the counts (full set: `tokenmill report`)."""
    lat, th = m.get("latency_s") or {}, m.get("throughput") or {}
    out = {
        "ttft_p50_s": (lat.get("ttft") or {}).get("p50"),
        "ttft_p99_s": (lat.get("ttft") or {}).get("p99"),
        "tpot_p50_s": (lat.get("tpot") or {}).get("p50"),
        "e2e_p99_s": (lat.get("e2e") or {}).get("p99"),
        "total_tok_per_s": th.get("total_tok_per_s"),
        "requests_per_s": th.get("requests_per_s"),
        "generation_wall_s": th.get("generation_wall_s"),
        "model_load_s": th.get("model_load_s"),
        "prefix_cache_hit_rate": (m.get("prefix_cache") or {}).get("hit_rate"),
        "failures_by_reason": (m.get("failures") or {}).get("by_reason") or None,
        "cost_per_1m_total_tokens": (m.get("cost") or {}).get("per_1m_total_tokens"),
        "cost_per_successful_request": (m.get("cost") or {}).get("per_successful_request"),
    }
    return out


@main.command(context_settings=CONTEXT_SETTINGS)
@click.argument("job_id")
@db_option
@json_option
def status(job_id, db_url, as_json):
    """Show one job: status, counts and headline metrics.

    \b
    Example:
      tokenmill status job-1a2b3c4d5e6f --json
    """
    from tokenmill.schemas import storage as S

    eng = connect(db_url)
    job = S.get_job(eng, job_id)
    if job is None:
        raise Failure(f"no job with id {job_id!r}")
    if job["status"] == "running":  # live counts while it runs
        job.update(S.counts(eng, job_id))
    row = job_summary_row(job)
    row["reconciled"] = (
        None if job.get("total") is None or job.get("succeeded") is None
        else job["total"] == (job["succeeded"] or 0) + (job["failed"] or 0)
    )
    row["error"] = job.get("error")
    row.update(headline_metrics(job.get("metrics") or {}))
    if as_json:
        emit_json(row)
        return
    for k, v in row.items():
        if v is not None:
            if isinstance(v, float):
                v = f"{v:.4g}"
            elif isinstance(v, dict):
                v = ", ".join(f"{a}: {n}" for a, n in v.items())
            click.echo(f"{k:>28}: {v}")


@main.command(name="jobs", context_settings=CONTEXT_SETTINGS)
@click.option("--limit", default=20, show_default=True, help="How many recent jobs.")
@db_option
@json_option
def jobs_cmd(limit, db_url, as_json):
    """List recent jobs with status, counts, tok/s and cost.

    \b
    Example:
      tokenmill jobs --limit 5
    """
    from tokenmill.schemas import storage as S

    rows = [job_summary_row(j) for j in S.list_jobs(connect(db_url), limit)]
    if as_json:
        emit_json(rows)
        return
    if not rows:
        click.echo("no jobs")
        return
    click.echo(f"{'id':<28} {'status':<10} {'total':>7} {'ok':>7} {'failed':>7} {'out tok/s':>10} {'$/1M out':>9}")
    for r in rows:
        tps = "-" if r["output_tok_per_s"] is None else f"{r['output_tok_per_s']:.1f}"
        cost = "-" if r["cost_per_1m_output_tokens"] is None else f"{r['cost_per_1m_output_tokens']:.3f}"
        click.echo(
            f"{r['id']:<28} {r['status']:<10} {r['total'] or 0:>7} {r['succeeded'] or 0:>7} {r['failed'] or 0:>7} {tps:>10} {cost:>9}"
        )


@main.command(context_settings=CONTEXT_SETTINGS)
@click.argument("job_id")
@db_option
def cancel(job_id, db_url):
    """Ask a running job to stop after the batches in flight (pending jobs are cancelled at once).

    \b
    Example:
      tokenmill cancel job-1a2b3c4d5e6f
    """
    from tokenmill.schemas import storage as S

    eng = connect(db_url)
    try:
        job = S.request_cancel(eng, job_id)
    except S.StorageError as err:
        raise Failure(str(err)) from None
    click.echo(f"job {job_id}: {'cancel requested' if job['status'] == 'running' else job['status']}")


# ---------------------------------------------------------------- models / db


@main.group(context_settings=CONTEXT_SETTINGS)
def models():
    """Prepare and list local models (nothing is downloaded from a hub).

    \b
    Example:
      tokenmill models prepare smollm2-135m && tokenmill models list
    """


@models.command("prepare", context_settings=CONTEXT_SETTINGS)
@click.argument("name", default="smollm2-135m")
@click.option("--force", is_flag=True, help="Convert again even if the folder exists.")
def models_prepare(name, force):
    """Convert a bundled model into a Hugging Face folder under the models folder.

    \b
    Example:
      tokenmill models prepare smollm2-135m
    """
    from tokenmill.jobs.modeltools.prepare import PrepareError, prepare

    try:
        path = prepare(name, force=force)
    except PrepareError as err:
        raise Failure(str(err)) from None
    click.echo(str(path))


@models.command("list", context_settings=CONTEXT_SETTINGS)
def models_list():
    """List the model folders tokenmill can use by short name.

    \b
    Example:
      tokenmill models list
    """
    from tokenmill.schemas.models import BUILTIN_MODELS, is_model_folder, models_dir

    seen = set()
    for d in sorted(models_dir().glob("*")):
        if is_model_folder(d):
            seen.add(d.name)
            click.echo(f"{d.name:<24} {d}")
    for name, desc in BUILTIN_MODELS.items():
        if name not in seen:
            click.echo(f"{name:<24} (not prepared: tokenmill models prepare {name}) {desc}")


@main.group(context_settings=CONTEXT_SETTINGS)
def db():
    """Database schema commands.

    \b
    Example:
      tokenmill db upgrade --db sqlite:///jobs.db
    """


@db.command("upgrade", context_settings=CONTEXT_SETTINGS)
@db_option
def db_upgrade(db_url):
    """Apply migrations up to the newest schema (also done automatically on first use).

    \b
    Example:
      tokenmill db upgrade --db postgresql://user@127.0.0.1/test
    """
    from tokenmill.schemas import storage as S
    from tokenmill.schemas.db import default_db_url, mask_url

    url = db_url or default_db_url()
    eng = connect(url)
    with eng.connect() as conn:
        click.echo(f"{mask_url(url)}: schema at revision {S.current_revision(conn)}")


# ---------------------------------------------------------------- command modules

#: Further commands live in their own modules (jobs/cli/<area>.py), each adding
#: commands to `main` with @main.command(); listed here so they load with the CLI.
COMMAND_MODULES = ("report", "quality", "orchestrate")


def _load_command_modules() -> None:
    import importlib

    for mod in COMMAND_MODULES:
        name = f"tokenmill.jobs.cli.{mod}"
        try:
            importlib.import_module(name)
        except ModuleNotFoundError as err:
            if err.name != name:
                raise


_load_command_modules()


# ---------------------------------------------------------------- entry point


def _maybe_reexec() -> None:
    """vLLM-CPU runs much faster with tcmalloc and Intel OpenMP preloaded, which
    only works at process start: re-execute once with LD_PRELOAD set."""
    if os.environ.get("TOKENMILL_NO_REEXEC") or os.environ.get("TOKENMILL_REEXECED"):
        return
    args = sys.argv[1:]
    if not any(a in ENGINE_COMMANDS for a in args[:3]):
        return
    if any(a in ("-h", "--help") for a in args):
        return
    from tokenmill.transforms.engines.cpu import cpu_runtime_env

    env = dict(os.environ)
    extra = cpu_runtime_env()
    if extra.get("LD_PRELOAD", "") == env.get("LD_PRELOAD", ""):
        return
    env.update(extra)
    env["TOKENMILL_REEXECED"] = "1"
    try:
        os.execve(sys.executable, [sys.executable, "-m", "tokenmill.jobs.cli", *args], env)
    except OSError:
        return


def cli_entry() -> None:
    _maybe_reexec()
    main(prog_name="tokenmill")

