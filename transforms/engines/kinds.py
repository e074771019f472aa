"""One registered object per engine: what the launcher and the workers need to know of it.

An engine is a module in this folder (or a plugin's, or a test's) that defines its config
model (an `EngineConfig` subclass fixing `kind`), its `EngineSession`, and an `EngineKind`
object, registered through the `tokenmill.engines` entry points (setup.cfg) or with
`register`.  Everything outside the engine's own modules asks this object, never the
kind's name: the job spec's validation (its `config`), the CLI's `--engine` choices and
flags, the preflight, the worker's session and start keywords, the clocks and versions a
report shows.  The defaults here are those of an engine that runs in the worker on
token ids and counts its own tokens.
"""

from __future__ import annotations

import platform
from dataclasses import dataclass, field
from importlib import metadata
from typing import Any, Callable, ClassVar, Generic, Mapping, TypeVar

from tokenmill.schemas import engine_kinds
from tokenmill.schemas import records as R
from tokenmill.schemas.config import DEFAULT_ENGINE_KIND, EngineConfig, RunnerConfig
from tokenmill.schemas.models import ModelNotFound, resolve_model
from tokenmill.transforms.counting import TokenCounter
from tokenmill.transforms.engines.checks import effective_block_size
from tokenmill.transforms.engines.cpu_workers import WorkersRun, auto_workers, feed_note, host_record, now_utc, remember
from tokenmill.transforms.engines.device import allowed_cores, visible_gpus
from tokenmill.transforms.engines.identity import adapter_hashes, engine_fingerprint
from tokenmill.transforms.engines.kv import JobTokens
from tokenmill.transforms.engines.leases import leasable_groups
from tokenmill.transforms.engines.protocol import EngineSession


@dataclass
class EngineCheck:
    """What an engine's preflight found: the local folder Tokenize reads (the model, or
    only its tokenizer), and the problems (one line each; none: the engine can start)."""

    model_path: str | None = None
    problems: list[str] = field(default_factory=list)
    counter: TokenCounter | None = None
    """How Tokenize counts the prompts; None: with the model's own tokenizer (`model_path`)."""


C = TypeVar("C", bound=EngineConfig)

#: The runners whose workers are processes of this host: `num_workers` counts this host's engines.
HOST_RUNNERS = ("DirectRunner", "direct")


class WorkersRefused(ValueError):
    """A runner asking for more engines than this host's GPUs make groups (one line)."""


@dataclass(frozen=True)
class LaunchSide:
    """What a job's launcher needs from its engine before the pipeline starts, and all it needs
    (as Beam's RunInference asks only its ModelHandler): how many engines fit this host, the KV
    block size prefix keys align to, the launcher's own preparation (the vLLM engine measures
    `dtype: auto` here), and the engine's identity in the result cache's keys.  These are asked
    at different moments of a run (workers before the preflight, the dtype after a cap's check,
    the fingerprint per pass), so they are methods of one object, not values computed at once.
    Made by `EngineKind.launch_side`."""

    engine: EngineKind[Any]
    cfg: EngineConfig
    stand_in: bool = False
    """The engine is a test double: it leases no device, measures nothing here, and its cache
    fingerprint keeps the configured dtype."""

    def workers(self, runner: RunnerConfig, *, here: bool = True) -> int | None:
        """`runner.num_workers` as a number for this host, or None when it is one already and fits:
        `auto` is one engine per device group this host can lease (engines/leases.py); on a host
        without GPUs (or for an engine that needs none) what this host measured of the engine's
        workers decides (`cpu_workers.auto_workers`: 1 where nothing is known).  With `here` (the
        job runs on this host), WorkersRefused (one line) when a runner of this host's processes
        asks more engines than its GPUs make groups; without it (`submit`: the job may run
        elsewhere), or for a stand-in, `auto` counts as 1."""
        asked = runner.num_workers
        local = runner.runner in HOST_RUNNERS
        if asked == "auto" and not local:
            raise WorkersRefused(f"runner.num_workers: auto counts this host's device groups, for "
                                 f"{' or '.join(HOST_RUNNERS)}; with runner {runner.runner}, give the number of workers")
        per = 0 if self.stand_in else self.engine.devices_per_engine(self.cfg)
        gpus = visible_gpus() if (here and local and per) else []
        if asked == "auto" and not gpus and here and not self.stand_in:
            return auto_workers(host_record(self.cfg.kind, self.cfg.model), len(allowed_cores()))[0]
        groups = leasable_groups(per, gpus)
        if gpus and (asked == "auto" or asked > groups):
            host = platform.node()
            if not groups:
                raise WorkersRefused(f"runner.num_workers: an engine of {self.cfg.kind} here needs {per} GPUs but "
                                     f"host {host} shows {len(gpus)}")
            if asked != "auto":
                raise WorkersRefused(f"runner.num_workers: {asked} engines of {per} GPU(s) each do not fit host "
                                     f"{host}'s {len(gpus)} visible GPUs ({groups} engines at most; or give auto)")
        return None if asked != "auto" else max(1, groups)

    def workers_line(self, runner: RunnerConfig, chosen: int) -> str | None:
        """The terminal's one line on the `chosen` workers of a job this CPU host runs (no GPU,
        or an engine that needs none; not a stand-in): why `auto` chose them, or the warning for
        an explicit number its cores cannot feed (`cpu_workers.feed_note`); None otherwise."""
        if not self._cpu_host(runner):
            return None
        record, cores = host_record(self.cfg.kind, self.cfg.model), len(allowed_cores())
        if runner.num_workers == "auto":
            return f"workers: auto is {chosen} on this CPU host: {auto_workers(record, cores)[1]}"
        return feed_note(chosen, record, cores)

    def remember_run(self, runner: RunnerConfig, rows: int, wall_s: float, cpu_s: float) -> None:
        """Keep a finished job (its rows, wall and its processes' CPU seconds) in this CPU host's
        record that `auto` reads (`cpu_workers.remember`: a job under MIN_RECORD_ROWS is not kept);
        nothing for a stand-in, a GPU engine on a GPU host or a runner whose workers run elsewhere."""
        if self._cpu_host(runner):
            remember(self.cfg.kind, self.cfg.model,
                     WorkersRun(runner.resolved_workers(), rows, round(wall_s, 3), round(cpu_s, 3), now_utc()))

    def _cpu_host(self, runner: RunnerConfig) -> bool:
        """The job's workers run on this host's cores: no GPU of its own, not a stand-in."""
        return (not self.stand_in and runner.runner in HOST_RUNNERS
                and not (self.engine.devices_per_engine(self.cfg) and visible_gpus()))

    def block_size(self, *, on_gpu: bool) -> int:
        """The KV block size the engine will use (checks.effective_block_size)."""
        return effective_block_size(self.cfg, on_gpu=on_gpu)

    def prepare(self, model_path: str | None, say: Callable[[str], None]) -> None:
        """The launcher's preparation when the workers run on this machine (`EngineKind.prepare_launcher`;
        nothing for a stand-in); EngineStartError (one line) when it cannot be done."""
        if not self.stand_in:
            self.engine.prepare_launcher(self.cfg, model_path, say)

    def fingerprint(self, cache: str, model_path: str | None) -> str | None:
        """The engine's identity in the result cache's keys (identity.engine_fingerprint); None
        with `cache: off`."""
        if cache == "off":
            return None
        return engine_fingerprint(self.cfg, model_path, resolve_dtype=not self.stand_in)

    def adapter_hashes(self, cache: str) -> dict[str, str] | None:
        """The LoRA adapters' content hashes in those keys (identity.adapter_hashes); None with
        `cache: off` or no adapter."""
        return adapter_hashes(self.cfg) if cache != "off" and self.cfg.lora_adapters else None


class EngineKind(Generic[C]):
    """The contract of a registered engine (subclass it, naming its config model: one
    instance per engine).  Its methods are given the job's engine config, of that model."""

    kind: ClassVar[str]
    """The `engine.kind` that selects it."""
    config: ClassVar[type[EngineConfig]]
    """Its config model (the `engine:` keys)."""
    display_name: ClassVar[str]
    """How reports name it ("vLLM")."""
    summary: ClassVar[str]
    """`--engine`'s help for it: the kind and, in brackets, what it is."""
    takes_text: ClassVar[bool] = False
    """The engine is sent each prompt's text or messages (`add(..., source=...)`), not only
    token ids: Tokenize keeps them on the record for it."""
    measures_prefix_cache: ClassVar[bool] = True
    """The engine reports prefix-cache hits; otherwise a job with no cached-token figure
    has an unknown hit rate, not zero."""
    prefix_cache_per_slot: ClassVar[bool] = False
    """The engine's prefix cache is each slot's last prompt (llama-server), not a pool of blocks
    that outlives its requests (vLLM): how `tokenmill estimate` models its hits."""
    local_weights: ClassVar[bool] = True
    """The engine runs weights tokenmill can read (`checkpoint`), so the result cache can name them
    in its keys; False: a remote server's, whose answers are never cached (docs/CACHE.md)."""
    serves_lora: ClassVar[bool] = False
    """The engine runs LoRA adapters (`engine.lora_adapters`), one per request as a row names it
    (`add(..., adapter=)`); a job declaring adapters for another engine is refused in the preflight."""
    takes_images: ClassVar[bool] = False
    """The engine is sent a row's images with its prompt (`add(..., images=)`; the model must be a
    vision model); a row with images for another engine is its `bad_request` dead letter, and a
    job naming `images.column` for it is refused in the preflight (transforms/images.py)."""
    warm_defaults: ClassVar[Mapping[str, Any]] = {}
    """Engine keys an engine kept warm between jobs (`tokenmill serve`'s) starts with where its
    config leaves them unset: sized for whatever job comes next, not the first one."""
    measures_cpu_dtype: ClassVar[bool] = False
    """On a CPU, `dtype: auto` is the faster dtype measured on this machine (vLLM's; `tune`
    screens candidate dtypes by that measurement)."""
    clocks: ClassVar[Mapping[str, str]] = {}
    """Figures measured on another clock than the default's (jobs/metrics/accounting.CLOCKS)."""
    packages: ClassVar[tuple[str, ...]] = ()
    """The distributions whose versions say what ran (reports list them)."""
    token_count_source: ClassVar[str] = R.TOKENS_BY_ENGINE
    """Where the rows' token counts come from when the engine says nothing else
    (records.TOKEN_COUNT_SOURCES).  An engine that counts with a local tokenizer
    resolves one in its `preflight`; one that asks its server (`/tokenize`) says so here."""

    # -- the worker side
    def session_factory(self) -> Callable[..., EngineSession]:
        """The session class (or factory) the worker calls as `factory(cfg, model_path, **start)`."""
        raise NotImplementedError

    def start_kwargs(self, cfg: C, model_path: str, *, workers: int, group: str,
                     job_tokens: JobTokens | None) -> dict[str, Any]:
        """The start keywords for a session made now in this worker: `workers` engines of
        this job share the host (`group`: the job run), `job_tokens` the work it is for."""
        return {}

    def outgrown(self, cfg: C, started: dict[str, Any], job_tokens: JobTokens | None) -> bool:
        """Whether a running engine, made with the start keywords `started`, is too small for
        the work `job_tokens` a new job run brings (then it is started again, sized for it):
        a process that runs job after job (`tokenmill serve`, run-pending) must not run a
        large job on an engine sized for a small one.  Default: never."""
        return False

    def devices_per_engine(self, cfg: C) -> int:
        """The GPUs one engine of this job takes on its host: a worker on a host with GPUs
        leases that many of its own before the engine starts and the engine sees only those
        (engines/leases.py); `--workers auto` starts one engine per group.  0 (the default):
        the engine needs no GPU of the worker's (a server's client, a CPU program)."""
        return 0

    # -- the launcher side
    def launch_side(self, cfg: C, *, stand_in: bool = False) -> LaunchSide:
        """Everything the launcher needs of this engine for a job's `cfg` before its pipeline
        starts (`stand_in`: a test double).  The hooks below it (`devices_per_engine`,
        `prepare_launcher`, `run_dtype`, `checkpoint`, `adapter_paths`) are what an engine
        overrides; a launcher asks only this."""
        return LaunchSide(self, cfg, stand_in)

    def preflight(self, cfg: C, *, on_gpu: bool) -> EngineCheck:
        """Every check of this engine before a row is read (`on_gpu`: the device it runs on,
        or True for a test double that any device runs).  Default: the model is a local
        folder with weights."""
        check = EngineCheck()
        try:
            check.model_path = str(resolve_model(cfg.model))
        except ModelNotFound as err:
            check.problems.append(str(err))
        return check

    def prepare_launcher(self, cfg: C, model_path: str | None, say: Callable[[str], None]) -> None:
        """What the launcher does before the pipeline when the workers run on this machine
        (the vLLM engine measures `dtype: auto` there), telling the terminal with `say(line)`;
        EngineStartError (one line) when it cannot be done.  Default: nothing."""

    def checkpoint(self, cfg: C, model_path: str | None) -> str | None:
        """The local folder or file whose bytes decide this engine's answers: the result cache
        hashes it into every key (transforms/cache.py).  None where `local_weights` is False.
        Default: the model folder."""
        return model_path if self.local_weights else None

    def adapter_paths(self, cfg: C) -> dict[str, str]:
        """Each declared LoRA adapter's local folder or file, whose bytes the result cache hashes
        into the keys of the rows run with it (engines/lora.py).  Default: the declared paths."""
        from tokenmill.transforms.engines.lora import adapter_paths

        return adapter_paths(cfg)

    def run_dtype(self, cfg: C, model_path: str | None, *, on_gpu: bool) -> str | None:
        """The dtype the engine runs `cfg` with on this device, as the result cache's key names
        it (None: the engine has no dtype key).  Default: `dtype` as given."""
        return getattr(cfg, "dtype", None)

    def served_models(self, cfg: C, model_path: str) -> tuple[str, ...]:
        """The names an OpenAI batch line's body `model` may give for this job's model."""
        return (cfg.model,)

    def describe(self, cfg: C, model_path: str | None) -> str:
        """The model as `validate` names it."""
        return str(model_path)

    def versions(self) -> dict[str, str]:
        """The versions of `packages` installed here."""
        out = {}
        for pkg in self.packages:
            try:
                out[pkg] = metadata.version(pkg)
            except metadata.PackageNotFoundError:
                pass
        return out

    def engine_version(self, versions: Mapping[str, str]) -> str | None:
        """The engine's own version among a job's recorded `versions`."""
        return next((versions[p] for p in self.packages if p in versions), None)


def register(engine: EngineKind[Any]) -> EngineKind[Any]:
    """Add an engine (a plugin's or a test's); the built-in ones come from the entry points."""
    return engine_kinds.register(engine)


def unregister(kind: str) -> None:
    engine_kinds.unregister(kind)


def engine_of(kind: str) -> EngineKind[Any]:
    """The registered engine of `kind`; UnknownEngine (one line, naming the registered kinds) otherwise."""
    return engine_kinds.registered(kind)


def kinds() -> list[str]:
    """The registered kinds, the default first."""
    return sorted(engine_kinds.registered_kinds(), key=lambda k: k != DEFAULT_ENGINE_KIND)


def engine_for(engine_config: Mapping[str, Any]) -> EngineKind[Any] | None:
    """The engine of a stored engine config (a job row's `engine_config`), or None when its
    kind is no longer registered (a job run by a plugin since removed)."""
    try:
        return engine_of(str(engine_config.get("kind") or DEFAULT_ENGINE_KIND))
    except engine_kinds.UnknownEngine:
        return None


def local_tokenizer(kind: str, name: str, check: EngineCheck) -> str | None:
    """The local folder of the tokenizer an engine that is sent text counts and orders the
    prompts with (no weights needed); a problem on `check` (and None) when there is none."""
    try:
        return str(resolve_model(name, need_weights=False))
    except ModelNotFound as err:
        check.problems.append(f"engine kind {kind} counts tokens with a local tokenizer: {err} "
                              "(set engine.tokenizer to a local model folder or short name)")
        return None
