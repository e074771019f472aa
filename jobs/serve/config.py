"""The server's settings (`tokenmill serve --config serve.yaml`, or the embedded defaults):
where it listens, keeps rows and files, which models it serves (name → the job spec keys of
its engine), and the limits a client is held to."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Literal, Mapping

from pydantic import BaseModel, ConfigDict, Field, IPvAnyNetwork, field_validator, model_validator

from tokenmill.schemas.config import DEFAULT_ENGINE_KIND, JobSpec, SpecError, format_validation_error, read_spec_file
from tokenmill.schemas.db import default_db_url
from tokenmill.schemas.models import tokenmill_home

#: The model served when the config names none: the bundled SmolLM2 on the default engine.
DEFAULT_MODEL = "smollm2-135m"
#: Lines per work unit of a replicated service's batches: a unit is what one replica's engine
#: takes at a time, so a batch of a few thousand lines spreads over several replicas.
SHARED_UNIT_LINES = 256
#: The job spec keys a served model may set (the rest are the batch's: input, output, ids).
MODEL_KEYS = ("engine", "sampling", "batching", "runner", "cache", "price_per_hour", "prices", "s3_endpoint_url")
_WINDOW = re.compile(r"(\d+)([smhd])")
#: A completion window as a JSON Schema pattern (the body's schema: jobs/serve/requests.py).
WINDOW_PATTERN = f"^{_WINDOW.pattern}$"
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def window_seconds(text: str) -> int | None:
    """A completion window (`24h`, `90m`, `30s`, `2d`) in seconds; None when it is not one."""
    m = _WINDOW.fullmatch(text or "")
    return int(m.group(1)) * _UNIT_S[m.group(2)] if m else None


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Limits(_Strict):
    """What one client may send; each refusal is an OpenAI error object."""

    max_file_bytes: int = Field(200 * 1024 * 1024, gt=0)
    """An uploaded file's size (OpenAI's batch limit: 200 MB)."""
    max_file_lines: int = Field(50_000, gt=0)
    """Requests in one batch file (OpenAI's: 50,000)."""
    max_message_batch_requests: int = Field(100_000, gt=0)
    """Requests in one Anthropic Message Batch (Anthropic's: 100,000)."""
    max_message_batch_bytes: int = Field(256 * 1024 * 1024, gt=0)
    """The body of one `POST /v1/messages/batches` (Anthropic's: 256 MB)."""
    max_batches_in_flight: int = Field(20, gt=0)
    """Batches of one key not ended yet; one more is refused with 429 (a key's own
    `tokenmill keys quota --batches-in-flight` replaces it for that key)."""
    tokens_per_day: int | None = Field(None, gt=0)
    """Prompt + output tokens one key's batches may use in a UTC day; a batch created once they
    are used is refused with 429 (none: no limit; a key's own `tokenmill keys quota
    --tokens-per-day` replaces it for that key). A batch is counted on the day it was created."""
    over_quota: Literal["refuse", "queue"] = "refuse"
    """A batch over a key's quota: `refuse` (429, naming the limit and what is left), or `queue`
    (held in `validating` until the key is under both limits again)."""
    max_completion_window_s: int = Field(7 * 86400, gt=0)
    """The longest `completion_window` accepted (`24h`, OpenAI's only value, is always within)."""
    max_metadata_keys: int = 16
    max_line_errors: int = 100
    """Validation errors listed in a failed batch (the first ones, by line)."""


class HttpLimits(_Strict):
    """What one connection may hold of the server (jobs/serve/guard.py): each bound refuses or
    closes before the server reads or keeps more (docs/SERVING.md, "Limits at the HTTP layer")."""

    max_head_bytes: int = Field(16 * 1024, ge=1024)
    """The request line and headers together (uvicorn's `h11_max_incomplete_event_size`);
    past it: 400 and the connection closed, before the rest is read."""
    max_url_bytes: int = Field(8 * 1024, ge=256)
    """The request target, path and query (414)."""
    max_headers: int = Field(100, ge=8)
    """Header lines in one request (431)."""
    head_timeout_s: float = Field(10.0, gt=0)
    """From a connection's start, or its previous response, to the end of its request's
    headers; past it: 408 (or, when nothing was sent, a quiet close)."""
    body_timeout_s: float = Field(30.0, gt=0)
    """The longest a request body may pause; also the grace before `min_body_bytes_per_s`
    holds.  Past either, the connection is closed."""
    min_body_bytes_per_s: int = Field(4096, gt=0)
    """A body's mean rate from its start, once `body_timeout_s` has passed (the server's own
    waits, while the route has not read what came, do not count)."""
    keep_alive_s: float = Field(5.0, gt=0)
    """An idle connection between requests is closed after this (uvicorn's `timeout_keep_alive`)."""
    max_connections: int = Field(1000, ge=1)
    """Open connections at once; one more is answered 503 and closed before it is read."""
    max_connections_per_client: int = Field(64, ge=1)
    """Open connections from one client address (behind a proxy: the proxy's, so set it to
    `max_connections` there and bound clients at the proxy)."""
    trusted_proxies: list[IPvAnyNetwork] = Field(default_factory=list)
    """Address ranges (CIDR) of the proxies whose `X-Forwarded-Proto` and `X-Forwarded-For` are
    believed (uvicorn's `forwarded_allow_ips`), e.g. `127.0.0.1/32` for an nginx on the same
    host; none (the default): those headers are ignored from every client, so no client on
    the host can claim https or another address."""

    def proxy_settings(self) -> dict[str, Any]:
        """uvicorn's settings for the proxy headers: believed from `trusted_proxies` only."""
        return {"proxy_headers": bool(self.trusted_proxies),
                "forwarded_allow_ips": [str(n) for n in self.trusted_proxies] or None}

    def uvicorn_settings(self) -> dict[str, Any]:
        """The bounds uvicorn has settings for, by uvicorn's names."""
        return {"h11_max_incomplete_event_size": self.max_head_bytes, "timeout_keep_alive": self.keep_alive_s,
                **self.proxy_settings()}


class Webhooks(_Strict):
    """Where and how batch events are sent (jobs/serve/webhooks.py, docs/SERVING.md)."""

    allow_networks: list[str] = Field(default_factory=list)
    """Address ranges (CIDR) a webhook may reach although they are not public addresses
    (loopback, link-local, private, metadata ranges are refused otherwise), e.g. `10.0.0.0/8`."""
    timeout_s: float = Field(10.0, gt=0)
    """One attempt's wait for the receiver's answer."""
    first_retry_s: float = Field(5.0, gt=0)
    """The wait after the first failed attempt; each later wait doubles, up to `max_retry_s`."""
    max_retry_s: float = Field(3600.0, gt=0)
    retry_for_s: float = Field(86400.0, gt=0)
    """How long after the batch ended an event is still tried; then it is given up."""
    secret_key_file: str | None = None
    """The key that seals the keys' webhook signing secrets in the database (made at first use,
    mode 0600); default `~/.cache/tokenmill/serve/webhook-secrets.key`.  `tokenmill keys` and
    the server must read the same file."""

    @field_validator("allow_networks")
    @classmethod
    def _networks(cls, v: list[str]) -> list[str]:
        import ipaddress

        for net in v:
            try:
                ipaddress.ip_network(net, strict=False)
            except ValueError:
                raise ValueError(f"allow_networks: {net!r} is not an address range like 10.0.0.0/8") from None
        return v


class Page(_Strict):
    """The live page's login (jobs/serve/page.py): its sessions and how it knows it is behind TLS."""

    behind_tls: bool = False
    """The server is reached through a TLS proxy only: the page's session cookie is always
    `Secure`.  Without it, the cookie is `Secure` when the request came over https (the
    `X-Forwarded-Proto: https` of a proxy in `http.trusted_proxies` included)."""
    session_ttl_s: float = Field(12 * 3600.0, gt=0, le=30 * 86400)
    """How long a login lasts; then the page asks for the key again."""


class Online(_Strict):
    """The OpenAI online API on the served models' warm engines (jobs/serve/online.py,
    transforms/engines/shared_session.py; docs/SERVING.md, "Online requests")."""

    max_per_key: int = Field(8, ge=1)
    """Online requests of one key in flight at once; one more is refused with 429 at once."""
    max_queue: int = Field(64, ge=1)
    """Online requests in flight for one model (all keys); one more is refused with 429 at once
    rather than waiting without bound."""
    batch_floor: float = Field(0.5, gt=0.0, le=1.0)
    """The least share of an engine's sequences (`max_num_seqs`) a running batch keeps while
    online requests run."""
    reserve_seqs: int = Field(1, ge=0)
    """Seats kept free beyond the online requests running, while online traffic lasts, so the
    next one starts at once."""
    idle_s: float = Field(2.0, ge=0.0)
    """How long after the last online request the batch's share stays shrunk, then grows back."""


class ServeConfig(_Strict):
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    db: str | None = None
    """The database URL (default: tokenmill's, `TOKENMILL_DB` or ~/.cache/tokenmill/tokenmill.db):
    batches are jobs there, so `tokenmill status|report <batch id>` read them."""
    files: str | None = None
    """Where the files' bytes live: a local folder (default ~/.cache/tokenmill/serve/files) or
    `s3://bucket/prefix`."""
    work: str | None = None
    """A local folder for the batches' job outputs before they become output files (default
    ~/.cache/tokenmill/serve/runs)."""
    models: dict[str, dict[str, Any]] = Field(default_factory=lambda: {DEFAULT_MODEL: dict[str, Any]()},
                                              validate_default=True)
    """Model name (what a request's `body.model` names) → its job spec keys (`engine`, `sampling`,
    `batching`, ...).  `engine.model` defaults to the name."""
    limits: Limits = Field(default_factory=Limits)
    webhooks: Webhooks = Field(default_factory=Webhooks)
    http: HttpLimits = Field(default_factory=HttpLimits)
    page: Page = Field(default_factory=Page)
    online: Online = Field(default_factory=Online)
    idle_unload_s: float = Field(900.0, gt=0)
    """An engine idle this long is unloaded (its model worker stays, and loads it again)."""
    concurrent_models: int = Field(1, ge=1)
    """Models whose batches run at the same time (each in its own engine process); on a GPU host,
    one per device group; 1 on a small CPU host, where two engines would share its cores."""
    lease_s: float = Field(30.0, ge=1, le=3600)
    """How long a replica's engine holds a unit of a shared batch without renewing it (renewed
    every third of it): after a replica is killed its units wait this long before another
    replica takes them; shorter takes over sooner and renews (writes) more often."""
    drain_s: float = Field(30.0, ge=0, le=3600)
    """On SIGTERM, how long the replica lets its engines finish or hand back their units in
    flight before it stops them (a spot notice: GCP's 30 s, AWS's 2 min); then it exits 0."""
    sweep_s: float = Field(60.0, gt=0, le=86400)
    """How often the scheduler removes expired files (their bytes in the files store and their
    rows); an expired file is not found from its `expires_at` on, whenever the sweep runs."""

    @field_validator("models")
    @classmethod
    def _models(cls, v: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
        if not v:
            raise ValueError("names no model; serve at least one")
        out = {}
        for name, keys in v.items():
            keys = dict(keys or {})
            bad = sorted(set(keys) - set(MODEL_KEYS))
            if bad:
                raise ValueError(f"model {name!r}: keys {bad} are not served model keys (allowed: {list(MODEL_KEYS)})")
            engine = dict(keys.get("engine") or {})
            engine.setdefault("model", name)
            for key, value in _warm_defaults(engine).items():  # a warm engine is sized for any batch
                engine.setdefault(key, value)
            if engine["model"] != name:
                raise ValueError(f"model {name!r}: engine.model is {engine['model']!r}; a served model's name is the "
                                 "model the engine answers to, so name it the same")
            keys["engine"] = engine
            out[name] = keys
        answered: dict[str, str] = {}  # a name a request may give -> what it names; one thing each
        for name, keys in out.items():
            for i, n in enumerate(_names(name, keys)):
                what = f"served model {name!r}" if i == 0 else f"an adapter of served model {name!r}"
                if n in answered:
                    raise ValueError(f"the name {n!r} is both {answered[n]} and {what}; a request's body.model "
                                     "must name one of them, so rename one")
                answered[n] = what
        return out

    @model_validator(mode="after")
    def _specs(self) -> "ServeConfig":
        for name in self.models:  # every model's keys make a valid job spec now, not at its first batch
            self.job_spec(name, input="x.jsonl", output="out", job_id="check")
        return self

    def home(self) -> Path:
        return tokenmill_home() / "serve"

    def db_url(self) -> str:
        return self.db or default_db_url()

    def replicated(self) -> bool:
        """Whether replicas may share this service's database (PostgreSQL): each batch's job then
        runs shared, unit by unit, on every replica's engine for its model."""
        from sqlalchemy.engine import make_url

        return make_url(self.db_url()).get_backend_name() != "sqlite"  # the replica registry's rule (replica.py)

    def files_root(self) -> str:
        return self.files or str(self.home() / "files")

    def work_root(self) -> Path:
        return Path(self.work) if self.work else self.home() / "runs"

    def names(self, model: str) -> tuple[str, ...]:
        """The names a request's `body.model` may give to run on served `model`: its own, then
        its LoRA adapters' (`engine.lora_adapters`), as vLLM's OpenAI server answers to them."""
        return _names(model, self.models[model])

    def served_names(self) -> dict[str, str]:
        """Every name a request may give → the served model whose engine answers it."""
        return {n: model for model in self.models for n in self.names(model)}

    def job_spec(self, model: str, *, input: str, output: str, job_id: str) -> JobSpec:
        """The job a batch for `model` runs: the model's keys, the batch's input file, its own
        output folder and id; OpenAI batch JSONL in and out."""
        data = {**self.models[model], "input": input, "input_format": "openai-jsonl", "output": output,
                "output_format": "openai-jsonl", "job_id": job_id, "name": f"batch {job_id}"}
        if self.replicated():  # every replica's engine may run a unit of it (docs/SERVING.md, "Replicas")
            data["runner"] = {**(data.get("runner") or {}), "lease_s": self.lease_s}
            data["batching"] = {"unit_lines": SHARED_UNIT_LINES, **(data.get("batching") or {})}
        try:
            return JobSpec.model_validate(data)
        except Exception as err:
            from pydantic import ValidationError

            if isinstance(err, ValidationError):
                raise SpecError(format_validation_error(err, f"served model {model!r}")) from None
            raise


def _warm_defaults(engine: dict[str, Any]) -> Mapping[str, Any]:
    """The keys the served engine's kind starts a warm engine with (`EngineKind.warm_defaults`);
    none for a kind not registered (the job spec's check then names it)."""
    from tokenmill.schemas.engine_kinds import UnknownEngine
    from tokenmill.transforms.engines.kinds import engine_of

    try:
        return engine_of(str(engine.get("kind") or DEFAULT_ENGINE_KIND)).warm_defaults
    except UnknownEngine:
        return {}


def _names(model: str, keys: dict[str, Any]) -> tuple[str, ...]:
    adapters = (keys.get("engine") or {}).get("lora_adapters") or {}
    return (model, *(adapters if isinstance(adapters, dict) else ()))  # not a mapping: the job spec refuses it


def load_config(path: str | None, **overrides: Any) -> ServeConfig:
    """The server's config from a YAML file (or the embedded defaults), flags applied over it;
    SpecError in one line when it is not valid."""
    from pydantic import ValidationError

    data = read_spec_file(path) if path else {}
    data.update({k: v for k, v in overrides.items() if v is not None})
    try:
        return ServeConfig.model_validate(data)
    except ValidationError as err:
        raise SpecError(format_validation_error(err, f"serve config {path or '(defaults)'}")) from None
