"""What every command module shares: exit codes, the one-line Failure, shared
options (derived from the job spec models where they set a spec key), the job
spec built from a YAML file and flags, JSON output, the database connection
and the progress bar."""

from __future__ import annotations

import json
import sys
from typing import Any, Literal, get_args, get_origin

import click
from pydantic import BaseModel
from pydantic.fields import FieldInfo

from tokenmill.schemas.config import CACHE_MODES, EngineConfig, SamplingDefaults, engine_flag
from tokenmill.schemas.sampling import base_type, is_str_list
from tokenmill.transforms.engines.kinds import engine_of, kinds

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_PARTIAL, EXIT_CANCELLED, EXIT_BUSY, EXIT_QUALITY = 0, 1, 2, 3, 4, 5, 6
STATUS_EXIT = {"succeeded": EXIT_OK, "partial": EXIT_PARTIAL, "cancelled": EXIT_CANCELLED, "failed": EXIT_FAILED}

CONTEXT_SETTINGS = {"help_option_names": ["-h", "--help"], "max_content_width": 100}


class Failure(click.ClickException):
    """A one-line error with an exit code."""

    def __init__(self, message: str, code: int = EXIT_FAILED):
        super().__init__(message)
        self.exit_code = code  # type: ignore[misc]  # click reads the instance's; its stubs say ClassVar

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


def field_option(name: str, info: FieldInfo, help_text: str, metavar: str | None = None):
    """The flag of one model field: `--max-tokens` for `max_tokens`, its type from the
    annotation (a bool is a flag, a list of strings a repeatable option).  Unset, it is
    None, so it does not override the spec."""
    flag, tp = "--" + name.replace("_", "-"), base_type(info.annotation)
    if tp is bool:
        return click.option(flag, is_flag=True, default=None, help=help_text)
    if is_str_list(tp):
        return click.option(flag, multiple=True, help=f"{help_text.rstrip('.')} (repeatable).")
    if get_origin(tp) is Literal:
        tp = click.Choice([str(v) for v in get_args(tp)])
    if get_origin(tp) is dict:  # given as JSON text, which the model reads
        tp, metavar = str, metavar or "JSON"
    return click.option(flag, type=tp, default=None, metavar=metavar, help=help_text)


def model_options(model: type[BaseModel]) -> list:
    """One flag per field of `model`, its help from the field's docstring."""
    return [field_option(name, info, info.description or "") for name, info in model.model_fields.items()]


def sampling_options(f):
    """The job's default sampling (`sampling:` keys of the spec); rows may override them."""
    return apply_options(f, model_options(SamplingDefaults))


def engine_fields() -> dict[str, FieldInfo]:
    """Every engine config field that is a flag (`config.engine_flag`), once: the keys every
    engine reads first, then each registered engine's own, in registration order."""
    taken = set(SamplingDefaults.model_fields) | set(SPEC_PATHS)
    fields: dict[str, FieldInfo] = {}
    models: list[type[EngineConfig]] = [EngineConfig, *(engine_of(k).config for k in kinds())]
    for model in models:
        for name, info in model.model_fields.items():
            if name not in fields and name not in taken and engine_flag(info)[0]:
                fields[name] = info
    return fields


def _engine_choice_help() -> str:
    parts = [engine_of(k).summary for k in kinds()]
    return (", ".join(parts[:-1]) + " or " + parts[-1] if len(parts) > 1 else parts[0]) + "."


class _Workers(click.ParamType):
    """`--workers`: a whole number, or `auto` (runner.num_workers)."""

    name = "N|auto"

    def convert(self, value, param, ctx):
        if isinstance(value, int) or value == "auto":
            return value
        try:
            return int(value)
        except ValueError:
            self.fail(f"must be a whole number or 'auto', got {value!r}", param, ctx)


WORKERS = _Workers()


def engine_options(f):
    """`--engine` (the registered kinds) and one flag per engine config field, then how the job is batched and run."""
    opts = [click.option("--engine", "engine_kind", type=click.Choice(kinds()), default=None, help=_engine_choice_help())]
    for name, info in engine_fields().items():
        extra = info.json_schema_extra if isinstance(info.json_schema_extra, dict) else {}
        opts.append(field_option(name, info, engine_flag(info)[1], extra.get("metavar")))
    opts += [
        click.option("--ordering", type=click.Choice(["prefix", "length", "none"]), default=None, help="Batch ordering."),
        click.option("--token-budget", type=int, default=None, help="Prompt+output tokens per batch."),
        click.option("--workers", type=WORKERS, default=None, help="Worker processes on this machine (DirectRunner, DaskRunner): each runs one engine, on its share of the cores or its own leased GPUs; auto: one per GPU group of this host; on CPU, the worker count this host's finished jobs ran fastest, 1 where none is known (DirectRunner)."),
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
        click.option("--cache", type=click.Choice(CACHE_MODES), default=None,
                     help="Result cache across jobs: read-write, read or off (default; docs/CACHE.md)."),
        click.option("--max-cost", type=float, default=None, metavar="USD",
                     help="Refuse to start, or stop cleanly, when the estimated cost exceeds this (docs/ESTIMATE.md)."),
        click.option("--max-hours", type=float, default=None, metavar="H",
                     help="Refuse to start, or stop cleanly, when the estimated wall time exceeds this."),
    ]
    return apply_options(f, opts)


def job_spec_options(f):
    """SPEC_FILE plus every flag that overrides a job spec key (run, submit, validate)."""
    f = apply_options(f, [job_options, db_option, engine_options, sampling_options])
    return click.argument("spec_file", required=False, type=click.Path(dir_okay=False))(f)


#: Flag (parameter name) → job spec key path, for the flags that are neither a sampling key nor an engine key.
SPEC_PATHS = {
    "input": "input", "output": "output", "job_id": "job_id", "name": "name", "db_url": "db",
    "s3_endpoint_url": "s3_endpoint_url", "input_format": "input_format",
    "cache": "cache", "max_cost": "max_cost", "max_hours": "max_hours",
    "engine_kind": "engine.kind",
    "ordering": "batching.ordering", "token_budget": "batching.token_budget",
    "workers": "runner.num_workers", "runner": "runner.runner", "pipeline_options": "runner.pipeline_options",
}


def spec_overrides(kw: dict[str, Any]) -> dict[str, Any]:
    """The job spec key paths the given flags set (`sampling.max_tokens` for `--max-tokens`)."""
    paths = {**SPEC_PATHS, **{k: f"sampling.{k}" for k in SamplingDefaults.model_fields},
             **{k: f"engine.{k}" for k in engine_fields()}}
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
        self.bar: Any = None  # a tqdm bar (untyped) once this run answers rows
        self._t0 = 0.0  # when the bar appeared
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
