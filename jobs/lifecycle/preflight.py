"""The checks before a job reads a row, one list for `run`, `validate`, `submit` and `run-pending`.

What can fail before the first row is read is checked here, in this order:
the engine's own checks (`EngineKind.preflight`: for the `vllm` engine, the model
resolves to a local folder and its options, and the checkpoint's quantization, suit
the device the engine runs on; an engine that is sent text resolves its local
tokenizer and checks its server or binaries; a model given as a URL is listed,
then synced into this host's cache); the runner can start (a
DaskRunner names a scheduler that answers, has workers and the same
environment); the database is one every worker shares (a SQLite file, or a
server at localhost, is refused when workers may run on other hosts); the output path is usable; the input and output buckets exist and
accept the credentials; the input plans (files, row groups, a prompt column).  `run_job` stops at the first problem,
`tokenmill validate` reports them all on one line; both see the same messages,
so a spec that validates is one that runs.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Callable, Collection

from tokenmill.jobs.lifecycle.errors import JobError
from tokenmill.schemas.config import JobSpec
from tokenmill.schemas.db import default_db_url
from tokenmill.schemas.model_sync import is_model_url
from tokenmill.transforms.engines.device import has_nvidia_gpu
from tokenmill.transforms.engines.kinds import WorkersRefused, engine_of, kinds
from tokenmill.transforms.images import image_rules


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
        adapters = self.spec.engine.lora_adapters
        return {m: n for m, n in models.items() if served and m not in served and m not in adapters}


#: The runner class `runner: DaskRunner` runs on: Beam's DaskRunner with the faults that lose
#: rows put right (jobs/lifecycle/dask_runner.py); Beam itself knows no short name for it.
DASK_RUNNER = "tokenmill.jobs.lifecycle.dask_runner.DaskRunner"
#: How long the preflight waits for a dask scheduler to answer (`--dask_connection_timeout` wins).
DASK_CONNECT_TIMEOUT_S = 10


def is_dask(spec: JobSpec) -> bool:
    # The exact name, as pipelines/batch.py's LOCAL_RUNNERS (engines per host) reads it.
    return spec.runner.runner == "DaskRunner"


def resolve_workers(spec: JobSpec, *, fake_engine: bool = False, here: bool = True,
                    say: Callable[[str], None] | None = None) -> JobSpec:
    """The spec with `runner.num_workers` a number for this host (a copy when it was `auto`:
    `LaunchSide.workers`); JobError (one line) when this host cannot run that many engines.
    `here`: the job runs here (not `submit`); `fake_engine`: a test double; `say`: LaunchSide.workers_line."""
    launch = engine_of(spec.engine.kind).launch_side(spec.engine, stand_in=fake_engine)
    try:
        n = launch.workers(spec.runner, here=here)
    except WorkersRefused as err:
        raise JobError(str(err)) from None
    if say is not None and here and (line := launch.workers_line(spec.runner, n or spec.runner.resolved_workers())):
        say(line)
    return spec if n is None else spec.model_copy(update={"runner": spec.runner.model_copy(update={"num_workers": n})})


def _has_flag(flags: list[str], *names: str) -> bool:
    return any(f == n or f.startswith(n + "=") for f in flags for n in names)


def pipeline_options(spec: JobSpec):
    """The Beam PipelineOptions of a job: runner and workers, S3 endpoint and region, extra flags."""
    from apache_beam.options.pipeline_options import PipelineOptions

    flags = [f"--runner={spec.runner.runner}"]
    if spec.runner.runner in ("DirectRunner", "direct"):
        if spec.runner.resolved_workers() > 1:
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


def check_dask(options, *, reach: bool = True) -> set[str]:
    """A DaskRunner job names its scheduler (`--dask_client_address` or `--dask_scheduler_file`);
    with `reach`, the scheduler answers, has workers, and it and every worker can import
    tokenmill (they unpickle the pipeline's steps).  ValueError (one line) otherwise.
    Returns the workers' hosts (empty without `reach`)."""
    try:
        import distributed
        from apache_beam.runners.dask.dask_runner import DaskOptions
        from distributed.comm import parse_address
    except ImportError as err:
        raise ValueError(f"runner DaskRunner needs dask.distributed ({err}); install tokenmill[dask]") from None
    from tokenmill.schemas.errors import first_line

    opts = options.view_as(DaskOptions)
    if not opts.address and not opts.scheduler_file:
        raise ValueError("runner DaskRunner needs a scheduler: --pipeline-option=--dask_client_address=tcp://HOST:PORT "
                         "(or --dask_scheduler_file=PATH)")
    if not reach:
        return set()
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
        return {str(w.get("host") or parse_address(addr)[1].rsplit(":", 1)[0]) for addr, w in workers.items()}
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


#: Runners that run every step in the launching process or its children, on this machine.
IN_PROCESS_RUNNERS = ("DirectRunner", "direct", "BundleBasedDirectRunner", "SwitchingDirectRunner",
                      "InteractiveRunner")


def _is_loopback(host: str | None) -> bool:
    import ipaddress

    if not host:
        return False
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _this_host(host: str) -> bool:
    """`host` (a name or an address a worker reported) is this machine."""
    import socket

    import psutil

    if _is_loopback(host) or host in (socket.gethostname(), socket.getfqdn()):
        return True
    mine = {a.address for addrs in psutil.net_if_addrs().values() for a in addrs}
    return host in mine


def _host_of(address: str | None) -> str | None:
    """The host of `tcp://H:P`, `H:P`, `http://H:P/x` or `[::1]:P`."""
    if not address:
        return None
    rest = address.split("://", 1)[-1].split("/", 1)[0]
    return rest.rsplit(":", 1)[0] if rest.count(":") == 1 or rest.startswith("[") else rest


def file_local_db(db_url: str) -> str | None:
    """Why `db_url` is a database only this machine can open (a SQLite file, a server named
    as localhost or by a local socket), or None when other hosts can reach it too."""
    from sqlalchemy.engine import make_url

    u = make_url(db_url)
    backend = u.get_backend_name()
    if backend in ("sqlite", "duckdb"):
        return f"a {'SQLite' if backend == 'sqlite' else 'DuckDB'} file on this machine"
    host = u.host or u.query.get("host") or os.environ.get("PGHOST")
    if isinstance(host, tuple):
        host = host[0]
    if not host or str(host).startswith("/"):
        return "a database server reached through this machine's local socket"
    if _is_loopback(str(host)):
        return f"a database server at {host} (on each worker that is the worker's own machine)"
    return None


def remote_workers(runner: str, options, dask_hosts: Collection[str] = ()) -> str | None:
    """Where a job's workers may run off this machine, in words, or None when they all run here.

    LOOPBACK runs the SDK workers in the launching process; EXTERNAL and PROCESS workers run
    where the runner runs (here when its job service or master is embedded or at localhost);
    DOCKER workers each have their own filesystem.  A Dask job's workers are where the
    scheduler says (`dask_hosts`, asked in the preflight); without them (a job submitted to
    run later) a scheduler at localhost is taken as local, the run checks again."""
    from apache_beam.options.pipeline_options import PortableOptions

    if runner in IN_PROCESS_RUNNERS:
        return None
    if runner == "DaskRunner":
        elsewhere = sorted(h for h in dask_hosts if not _this_host(h))
        if elsewhere:
            return f"has workers on {', '.join(elsewhere)}"
        if dask_hosts:
            return None
        from apache_beam.runners.dask.dask_runner import DaskOptions

        address = options.view_as(DaskOptions).address
        return f"has its scheduler at {address}" if address and not _this_host(_host_of(address) or "") else None
    if runner == "DataflowRunner":
        return "runs its workers on Dataflow's machines"
    opts = options.get_all_options(retain_unknown_options=True)
    env = (options.view_as(PortableOptions).environment_type or "").upper()
    flink, spark, endpoint = opts.get("flink_master") or "[auto]", opts.get("spark_master_url") or "local[4]", \
        opts.get("job_endpoint")
    if runner == "FlinkRunner":
        here = flink in ("[auto]", "[local]") or _is_loopback(_host_of(flink))
    elif runner == "SparkRunner":
        here = spark.startswith("local") or _is_loopback(_host_of(spark))
    elif runner == "PrismRunner":
        here, env = True, env or "LOOPBACK"
    else:
        here = not endpoint or endpoint == "embed" or _is_loopback(_host_of(endpoint))
    if runner in ("FlinkRunner", "SparkRunner") and here and not env:
        env = "LOOPBACK"  # what Beam picks for an embedded Flink or Spark
    if env == "LOOPBACK":
        return None
    if env in ("", "DOCKER"):
        return "runs its workers in Docker containers (each with its own filesystem)"
    if not here:
        return f"runs its workers where its job service runs ({endpoint or flink or spark})"
    config = opts.get("environment_config") or ""
    if env == "EXTERNAL" and not _is_loopback(_host_of(config)):
        return f"has its worker pool at {config}"
    return None


def check_shared_db(db_url: str, runner: str, options, dask_hosts: Collection[str] = ()) -> None:
    """A database only this machine can open is refused when workers may run on other hosts
    (each would write its own copy, and the launcher would find the rows missing after all
    the GPU work).  ValueError, one line naming the runner and what to use instead."""
    from sqlalchemy.engine import make_url

    why = file_local_db(db_url)
    where = remote_workers(runner, options, dask_hosts) if why else None
    if why and where:
        shown = make_url(db_url).render_as_string(hide_password=True)
        raise ValueError(f"database {shown} is {why}, but runner {runner} {where}: every worker must write to "
                         "the same database; give a PostgreSQL URL all of them reach "
                         "(--db postgresql://USER@DBHOST/DBNAME)")


def check_output_path(output: str) -> None:
    """The output is a usable folder path (no `..`, not an existing file); ValueError otherwise."""
    from tokenmill.jobs.lifecycle.export import OutputPathError, check_output_root

    try:
        check_output_root(output)
    except OutputPathError as err:
        raise ValueError(str(err)) from None
    if "://" not in output and os.path.exists(output) and not os.path.isdir(output):
        raise ValueError(f"output {output!r} exists and is not a folder")


def _check_model_url(pf: Preflight, *, sync: bool, here: bool):
    """A model URL lists (a config.json among its objects) with the job's S3 endpoint; with
    `sync`, this host's copy is made now, with that endpoint (the engine's checks and the
    prompts' tokenizer read the folder).  When the workers run elsewhere (`here` false) and
    the engine can be checked without weights (`load_format`), the copy leaves the weights
    out: each worker's own check loads and checks them on its host (transforms/generate.py).
    Returns the engine config the engine's preflight checks, or None with the problem."""
    from tokenmill.schemas.model_sync import list_model, sync_model
    from tokenmill.schemas.models import ModelNotFound
    from tokenmill.transforms.read import s3_client

    cfg = pf.spec.engine
    url = cfg.model
    weights = here or "load_format" not in type(cfg).model_fields
    try:
        client = s3_client(pf.options) if url.startswith("s3://") else None
        if not sync:
            list_model(url, client)
            return cfg
        folder = sync_model(url, client, weights=weights)
    except ModelNotFound as err:
        pf.problems.append(str(err))
        return None
    except OSError as err:  # the models cache: a full disk, no permission
        pf.problems.append(f"model {url!r} cannot be kept in this host's models cache: {err}")
        return None
    return cfg if weights else cfg.model_copy(update={"model": str(folder), "load_format": "dummy"})


def _sync_adapters(pf: Preflight, cfg) -> None:
    """This host's copy of each LoRA adapter given as a URL, with the job's S3 endpoint (the
    engine's preflight then checks it as a local folder; each worker syncs its own)."""
    from tokenmill.schemas.model_sync import sync_model
    from tokenmill.schemas.models import ModelNotFound
    from tokenmill.transforms.engines.lora import ADAPTER_CONFIG
    from tokenmill.transforms.read import s3_client

    for name, url in sorted(cfg.lora_adapters.items()):
        if not is_model_url(url):
            continue
        try:
            sync_model(url, s3_client(pf.options) if url.startswith("s3://") else None, marker=ADAPTER_CONFIG)
        except (ModelNotFound, OSError) as err:
            pf.problems.append(f"lora adapter {name!r}: {err}")


def preflight(spec: JobSpec, *, engine: bool = True, fake_engine: bool = False,
              db_url: str | None = None) -> Preflight:
    """Run every check, collecting the problems (one line each) instead of stopping at the first.

    Also points Beam's filesystems (local, s3://) at the job's options in this process.
    `engine=False` leaves out the model and engine checks, and whether a dask scheduler
    answers, for a job that runs later on another machine (`submit`: the runner's models
    folder, device and network decide those).
    `fake_engine`: the engine is a test double, so no device-specific refusal applies.
    `db_url`: the job's database (default: the spec's `db`, else the default URL)."""
    from apache_beam.io.filesystems import FileSystems

    from tokenmill.transforms.inputs import InputError, check_bucket, use_options
    from tokenmill.transforms.planning import plan_input

    workers_problem = None
    if spec.runner.num_workers == "auto":  # a caller that did not resolve it (tune): counted here, as run does
        try:
            spec = resolve_workers(spec, fake_engine=fake_engine, here=engine)
        except JobError as err:
            workers_problem = str(err)
            spec = spec.model_copy(update={"runner": spec.runner.model_copy(update={"num_workers": 1})})
    pf = Preflight(spec=spec, on_gpu=has_nvidia_gpu(), options=pipeline_options(spec))
    if workers_problem:
        pf.problems.append(workers_problem)
    hosts: set[str] = set()
    runner_problem = None
    if is_dask(spec):
        try:
            hosts = check_dask(pf.options, reach=engine)
        except ValueError as err:
            runner_problem = str(err)
    if spec.cache != "off":  # an engine whose answers cannot be keyed, said before its own checks (docs/CACHE.md)
        from tokenmill.transforms.cache import cache_problem

        elsewhere = engine and remote_workers(spec.runner.runner, pf.options, hosts) is not None
        problem = cache_problem(spec, on_gpu=pf.on_gpu or fake_engine, workers_elsewhere=elsewhere)
        if problem:
            pf.problems.append(problem)
    cfg = spec.engine
    if is_model_url(cfg.model):
        cfg = _check_model_url(pf, sync=engine, here=remote_workers(spec.runner.runner, pf.options, hosts) is None)
    if cfg is not None and cfg.lora_adapters and not engine_of(cfg.kind).serves_lora:
        pf.problems.append(f"engine kind {cfg.kind} does not run LoRA adapters (engine.lora_adapters); "
                           f"kinds that do: {', '.join(k for k in kinds() if engine_of(k).serves_lora)}")
    elif engine and cfg is not None and cfg.lora_adapters:
        _sync_adapters(pf, cfg)
    refusal = image_rules(spec).refusal if spec.images.column else None
    if refusal:
        pf.problems.append(f"images.column {spec.images.column!r}: {refusal}")
    if engine and cfg is not None:
        found = engine_of(spec.engine.kind).preflight(cfg, on_gpu=pf.on_gpu or fake_engine)
        pf.model_path, pf.counter = found.model_path, found.counter
        pf.problems += found.problems
    if runner_problem:
        pf.problems.append(runner_problem)
    try:
        check_shared_db(db_url or spec.db or default_db_url(), spec.runner.runner, pf.options, hosts)
    except ValueError as err:
        pf.problems.append(str(err))
    try:
        check_output_path(spec.output)
    except ValueError as err:
        pf.problems.append(str(err))
    FileSystems.set_options(pf.options)
    use_options(pf.options)  # planning's own S3 reads (transforms/inputs.py), apart from Beam's
    try:
        check_bucket(spec.input, "input", pf.options)
        pf.plan = plan_input(spec.input, spec.resolved_input_format(), unit_lines=spec.batching.unit_lines)
        if hasattr(pf.plan, "served_models"):  # OpenAI batch lines naming another model become dead letters
            pf.plan.served_models = pf.served_models
            pf.plan.adapters = tuple(spec.engine.lora_adapters)  # a line naming an adapter as its model runs with it
        elif spec.images.column and spec.images.column not in pf.plan.columns:
            pf.problems.append(f"images.column {spec.images.column!r} is not a column of the input "
                               f"(columns: {', '.join(pf.plan.columns)})")
    except InputError as err:
        pf.problems.append(str(err))
    try:
        check_bucket(spec.output, "output", pf.options)  # a missing output bucket fails now, not after the work
    except InputError as err:
        pf.problems.append(str(err))
    return pf
