"""The checks before a job reads a row, one list for `run`, `validate`, `submit` and `run-pending`.

What can fail before the first row is read is checked here, in this order:
the engine's own checks (`EngineKind.preflight`: for the `vllm` engine, the model
resolves to a local folder and its options, and the checkpoint's quantization, suit
the device the engine runs on; an engine that is sent text resolves its local
tokenizer and checks its server or binaries); the runner can start (a
DaskRunner names a scheduler that answers, has workers and the same
environment); the output path is usable; the input and output buckets exist and
accept the credentials; the input plans (files, row groups, a prompt column).  `run_job` stops at the first problem,
`tokenmill validate` reports them all on one line; both see the same messages,
so a spec that validates is one that runs.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from tokenmill.schemas.config import JobSpec
from tokenmill.transforms.engines.device import has_nvidia_gpu
from tokenmill.transforms.engines.kinds import engine_of


@dataclass
class Preflight:
    """What the checks found (`problems` empty: the job can start)."""

    spec: JobSpec
    on_gpu: bool
    """Whether this machine has an NVIDIA GPU (the engine's device)."""
    options: Any = None
    """The Beam PipelineOptions the job runs with (runner, S3 endpoint and region)."""
    model_path: str | None = None
    counter: Any = None
    """How the prompts are counted (counting.TokenCounter), as the engine's preflight found."""
    plan: Any = None
    """The input plan (read.InputPlan, or openai_batch.JsonlPlan with its endpoints and models)."""
    problems: list[str] = field(default_factory=list)

    @property
    def served_models(self) -> tuple[str, ...]:
        """Names the engine answers to in an OpenAI batch line's body `model`."""
        if self.model_path is None:
            return ()
        return engine_of(self.spec.engine.kind).served_models(self.spec.engine, self.model_path)

    def unserved_models(self) -> dict[str, int]:
        """Request lines per body model the job does not serve (they become dead letters)."""
        served = self.served_models
        models = getattr(self.plan, "models", None) or {}
        return {m: n for m, n in models.items() if served and m not in served}


#: The runner class `runner: DaskRunner` runs on: Beam's DaskRunner with the faults that lose
#: rows put right (jobs/lifecycle/dask_runner.py); Beam itself knows no short name for it.
DASK_RUNNER = "tokenmill.jobs.lifecycle.dask_runner.DaskRunner"
#: How long the preflight waits for a dask scheduler to answer (`--dask_connection_timeout` wins).
DASK_CONNECT_TIMEOUT_S = 10


def is_dask(spec: JobSpec) -> bool:
    # The exact name, as pipelines/batch.py's LOCAL_RUNNERS (engines per host) reads it.
    return spec.runner.runner == "DaskRunner"


def _has_flag(flags: list[str], *names: str) -> bool:
    return any(f == n or f.startswith(n + "=") for f in flags for n in names)


def pipeline_options(spec: JobSpec):
    """The Beam PipelineOptions of a job: runner and workers, S3 endpoint and region, extra flags."""
    from apache_beam.options.pipeline_options import PipelineOptions

    flags = [f"--runner={spec.runner.runner}"]
    if spec.runner.runner in ("DirectRunner", "direct"):
        if spec.runner.num_workers > 1:
            flags += ["--direct_running_mode=multi_processing", f"--direct_num_workers={spec.runner.num_workers}"]
        else:
            flags += ["--direct_running_mode=in_memory", "--direct_num_workers=1"]
    elif is_dask(spec):
        flags = [f"--runner={DASK_RUNNER}"]
        if not _has_flag(spec.runner.pipeline_options, "--dask_partition_size", "--dask_npartitions"):
            # One input element (a work unit) per dask task: units spread over the workers
            # one at a time, as they free up, instead of 128 to a task (Beam's default).
            flags.append("--dask_partition_size=1")
    endpoint = spec.s3_endpoint_url or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    if endpoint:
        flags.append(f"--s3_endpoint_url={endpoint}")
    # Credentials stay in the environment (boto3's default chain reads them on every
    # worker): as pipeline flags they would travel inside the pipeline proto to remote
    # workers and job services.  Only the region is passed.
    region = os.environ.get("AWS_DEFAULT_REGION") or os.environ.get("AWS_REGION")
    if region:
        flags.append(f"--s3_region_name={region}")
    flags += list(spec.runner.pipeline_options)
    return PipelineOptions(flags)


def check_dask(options, *, reach: bool = True) -> None:
    """A DaskRunner job names its scheduler (`--dask_client_address` or `--dask_scheduler_file`);
    with `reach`, the scheduler answers, has workers, and it and every worker can import
    tokenmill (they unpickle the pipeline's steps).  ValueError (one line) otherwise."""
    try:
        import distributed
        from apache_beam.runners.dask.dask_runner import DaskOptions
    except ImportError as err:
        raise ValueError(f"runner DaskRunner needs dask.distributed ({err}); install tokenmill[dask]") from None
    from tokenmill.schemas.errors import first_line

    opts = options.view_as(DaskOptions)
    if not opts.address and not opts.scheduler_file:
        raise ValueError("runner DaskRunner needs a scheduler: --pipeline-option=--dask_client_address=tcp://HOST:PORT "
                         "(or --dask_scheduler_file=PATH)")
    if not reach:
        return
    where = opts.address or f"in {opts.scheduler_file}"
    timeout = opts.timeout if isinstance(opts.timeout, int) else DASK_CONNECT_TIMEOUT_S
    if opts.scheduler_file and not os.path.isfile(opts.scheduler_file):  # dask would wait for it for ever
        raise ValueError(f"dask scheduler file {opts.scheduler_file!r} does not exist")
    if opts.address:
        _check_reachable(opts.address, timeout)  # a refused port fails now, not after dask's retries
    try:
        client = distributed.Client(address=opts.address, scheduler_file=opts.scheduler_file, timeout=timeout,
                                    set_as_default=False)
    except Exception as err:  # OSError, TimeoutError, a missing scheduler file
        raise ValueError(f"dask scheduler {where} cannot be reached: {first_line(err)}") from None
    try:
        workers = client.scheduler_info(n_workers=-1)["workers"]
        if not workers:
            raise ValueError(f"dask scheduler {where} has no workers")
        found = [("scheduler", client.run_on_scheduler(eval, _IMPORTS_TOKENMILL)),
                 *client.run(eval, _IMPORTS_TOKENMILL).items()]
        missing = [name for name, ok in found if not ok]
        if missing:
            raise ValueError(f"dask scheduler {where}: {', '.join(missing)} cannot import tokenmill "
                             "(scheduler and workers need the launcher's environment)")
    finally:
        client.close()


def _check_reachable(address: str, timeout: float) -> None:
    import socket

    from distributed.comm import parse_address, parse_host_port

    scheme, loc = parse_address(address)
    if scheme not in ("tcp", "tls"):
        return
    host, port = parse_host_port(loc)
    try:
        socket.create_connection((host, port), timeout=timeout).close()
    except OSError as err:
        raise ValueError(f"dask scheduler {address} cannot be reached: {err.strerror or err}") from None


#: Asked of the scheduler and each worker through the builtin `eval`: a function of this
#: module would itself need tokenmill there to be unpickled.
_IMPORTS_TOKENMILL = "__import__('importlib.util').util.find_spec('tokenmill.transforms') is not None"


def check_output_path(output: str) -> None:
    """The output is a usable folder path (no `..`, not an existing file); ValueError otherwise."""
    from tokenmill.jobs.lifecycle.export import OutputPathError, check_output_root

    try:
        check_output_root(output)
    except OutputPathError as err:
        raise ValueError(str(err)) from None
    if "://" not in output and os.path.exists(output) and not os.path.isdir(output):
        raise ValueError(f"output {output!r} exists and is not a folder")


def preflight(spec: JobSpec, *, engine: bool = True, fake_engine: bool = False) -> Preflight:
    """Run every check, collecting the problems (one line each) instead of stopping at the first.

    Also points Beam's filesystems (local, s3://) at the job's options in this process.
    `engine=False` leaves out the model and engine checks, and whether a dask scheduler
    answers, for a job that runs later on another machine (`submit`: the runner's models
    folder, device and network decide those).
    `fake_engine`: the engine is a test double, so no device-specific refusal applies."""
    from apache_beam.io.filesystems import FileSystems

    from tokenmill.transforms.read import InputError, check_bucket, plan_input

    pf = Preflight(spec=spec, on_gpu=has_nvidia_gpu(), options=pipeline_options(spec))
    if engine:
        found = engine_of(spec.engine.kind).preflight(spec.engine, on_gpu=pf.on_gpu or fake_engine)
        pf.model_path, pf.counter = found.model_path, found.token_counter
        pf.problems += found.problems
    if is_dask(spec):
        try:
            check_dask(pf.options, reach=engine)
        except ValueError as err:
            pf.problems.append(str(err))
    try:
        check_output_path(spec.output)
    except ValueError as err:
        pf.problems.append(str(err))
    FileSystems.set_options(pf.options)
    try:
        check_bucket(spec.input, "input", pf.options)
        pf.plan = plan_input(spec.input, spec.resolved_input_format())
        if hasattr(pf.plan, "served_models"):  # OpenAI batch lines naming another model become dead letters
            pf.plan.served_models = pf.served_models
    except InputError as err:
        pf.problems.append(str(err))
    try:
        check_bucket(spec.output, "output", pf.options)  # a missing output bucket fails now, not after the work
    except InputError as err:
        pf.problems.append(str(err))
    return pf
