"""What every command module shares: exit codes, the one-line Failure, shared
options (derived from the job spec models where they set a spec key), the job
spec built from a YAML file and flags, JSON output, the database connection
and the progress bar."""

from __future__ import annotations

import json
import sys
from typing import Any

import click
from pydantic import BaseModel

from tokenmill.schemas.config import SamplingDefaults
from tokenmill.schemas.sampling import base_type, is_str_list

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_PARTIAL, EXIT_CANCELLED, EXIT_BUSY, EXIT_QUALITY = 0, 1, 2, 3, 4, 5, 6
STATUS_EXIT = {"succeeded": EXIT_OK, "partial": EXIT_PARTIAL, "cancelled": EXIT_CANCELLED, "failed": EXIT_FAILED}

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


def apply_options(f, opts):
    """Apply click decorators so they show in --help in the order listed."""
    for o in reversed(opts):
        f = o(f)
    return f


def model_options(model: type[BaseModel]) -> list:
    """One flag per field of `model`: `--max-tokens` for `max_tokens`, its type from the
    annotation (a bool is a flag, a list of strings a repeatable option), its help from
    the field's docstring.  Unset flags are None, so they do not override the spec."""
    opts = []
    for name, info in model.model_fields.items():
        flag, tp, help_text = "--" + name.replace("_", "-"), base_type(info.annotation), info.description or ""
        if tp is bool:
            opts.append(click.option(flag, is_flag=True, default=None, help=help_text))
        elif is_str_list(tp):
            opts.append(click.option(flag, multiple=True, help=f"{help_text.rstrip('.')} (repeatable)."))
        else:
            opts.append(click.option(flag, type=tp, default=None, help=help_text))
    return opts


def sampling_options(f):
    """The job's default sampling (`sampling:` keys of the spec); rows may override them."""
    return apply_options(f, model_options(SamplingDefaults))


def engine_options(f):
    opts = [
        click.option("--engine", "engine_kind", type=click.Choice(["vllm", "openai", "llamacpp"]), default=None,
                     help="vllm (in the worker, default), openai (an OpenAI-compatible server at --base-url) or "
                     "llamacpp (a llama-server each worker starts on the GGUF --model names)."),
        click.option("--base-url", default=None, help="--engine openai: the server's API root, e.g. http://HOST:8000/v1."),
        click.option("--api-key-env", default=None, metavar="VAR",
                     help="--engine openai: the environment variable holding the API key (never the key)."),
        click.option("--model", default=None, help="Model short name or local HF folder (default smollm2-135m); "
                     "with --engine openai, the name the server serves; with --engine llamacpp, a .gguf file or a short name."),
        click.option("--tokenizer", default=None, help="--engine openai or llamacpp: the local model folder or short name whose "
                     "tokenizer counts and orders the prompts (default: --model, if it is a local folder)."),
        click.option("--dtype", default=None, help="Weights/activations dtype (auto picks by measurement on CPU)."),
        click.option("--quantization", default=None, help="vLLM quantization method of the checkpoint."),
        click.option("--kv-cache-dtype", default=None, help="KV cache dtype: auto, fp8, ..."),
        click.option("--max-model-len", type=int, default=None, help="Context length the engine reserves."),
        click.option("--max-num-seqs", type=int, default=None, help="Sequences in flight in the engine."),
        click.option("--gpu-memory-utilization", type=float, default=None, help="Share of device memory (of RAM on CPU)."),
        click.option("--ordering", type=click.Choice(["prefix", "length", "none"]), default=None, help="Batch ordering."),
        click.option("--token-budget", type=int, default=None, help="Prompt+output tokens per batch."),
        click.option("--workers", type=int, default=None, help="Worker processes on this machine (DirectRunner, DaskRunner): each runs one engine on its share of the cores."),
        click.option("--runner", default=None, help="Beam runner (DirectRunner, DaskRunner, PortableRunner, DataflowRunner, ...)."),
        click.option("--pipeline-option", "pipeline_options", multiple=True, help="Extra Beam pipeline flag (repeatable)."),
    ]
    return apply_options(f, opts)


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


#: Flag (parameter name) → job spec key path, for the flags that are not a sampling key.
SPEC_PATHS = {
    "input": "input", "output": "output", "job_id": "job_id", "name": "name", "db_url": "db",
    "s3_endpoint_url": "s3_endpoint_url", "input_format": "input_format",
    "engine_kind": "engine.kind", "base_url": "engine.base_url", "api_key_env": "engine.api_key_env",
    "model": "engine.model", "tokenizer": "engine.tokenizer", "dtype": "engine.dtype", "quantization": "engine.quantization",
    "kv_cache_dtype": "engine.kv_cache_dtype", "max_model_len": "engine.max_model_len",
    "max_num_seqs": "engine.max_num_seqs", "gpu_memory_utilization": "engine.gpu_memory_utilization",
    "ordering": "batching.ordering", "token_budget": "batching.token_budget",
    "workers": "runner.num_workers", "runner": "runner.runner", "pipeline_options": "runner.pipeline_options",
}


def spec_overrides(kw: dict[str, Any]) -> dict[str, Any]:
    """The job spec key paths the given flags set (`sampling.max_tokens` for `--max-tokens`)."""
    paths = {**SPEC_PATHS, **{k: f"sampling.{k}" for k in SamplingDefaults.model_fields}}
    return {paths[k]: v for k, v in kw.items() if k in paths}


def build_spec(spec_file, overrides: dict[str, Any]):
    """A JobSpec from a YAML file and/or flags; flags win over the file."""
    from tokenmill.schemas.config import SpecError, load_spec, read_spec_file

    try:
        data: dict[str, Any] = read_spec_file(spec_file) if spec_file else {}
    except SpecError as err:
        raise Failure(str(err), EXIT_USAGE) from None
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


class Progress:
    """The row bar on a terminal: rows done of the total, rows/s and the time left (tqdm's,
    from the rows finished since the bar appeared), and output tok/s; silent otherwise."""

    def __init__(self, enabled: bool, file=None):
        self.enabled = enabled
        self.file = file
        self.bar = None
        self._t0 = None
        self._tokens0 = 0
        self._before: int | None = None

    @classmethod
    def for_output(cls, quiet: bool, as_json: bool, file=None) -> "Progress":
        """Shown unless --quiet or --json, and only when `file` (stderr) is a terminal."""
        file = file or sys.stderr
        try:
            tty = file.isatty()
        except ValueError:
            tty = False
        return cls(enabled=not quiet and not as_json and tty, file=file)

    def __call__(self, done: int, total: int, out_tokens: int) -> None:
        if not self.enabled:
            return
        import time

        from tqdm import tqdm

        if self._before is None:  # the first call comes while the engine loads: rows answered by earlier runs
            self._before, self._tokens0 = done, out_tokens
        if self.bar is None and done <= self._before:
            return  # nothing answered by this run yet (a stage line says the engine loads): no rate to show
        if self.bar is None:
            self.bar = tqdm(total=total, initial=self._before, unit="row", dynamic_ncols=True, file=self.file,
                            desc="rows", smoothing=0.1,
                            bar_format="{desc} {n_fmt}/{total_fmt} |{bar}| {rate_fmt}, {remaining} left{postfix}")
            self._t0 = time.time()
        if done > self.bar.n:
            self.bar.update(done - self.bar.n)
        dt = max(time.time() - self._t0, 1e-6)
        self.bar.set_postfix_str(f"{(out_tokens - self._tokens0) / dt:.0f} out tok/s", refresh=False)
        self.bar.refresh()

    def close(self):
        if self.bar is not None:
            self.bar.close()
