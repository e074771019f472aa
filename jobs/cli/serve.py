"""`tokenmill serve`: the OpenAI Batch API over warm engines; `tokenmill keys
create|list|revoke|webhook|quota|usage`: its API keys, where their batch events go, their
quotas and what they used (docs/SERVING.md)."""

from __future__ import annotations

import secrets
import time
from typing import TYPE_CHECKING, Any, Callable

import click
from tabulate import tabulate

from tokenmill.jobs.cli.app import main
from tokenmill.jobs.cli.common import CONTEXT_SETTINGS, Failure, db_option, emit_json, json_option
from tokenmill.schemas.config import SpecError

if TYPE_CHECKING:
    from tokenmill.jobs.serve.config import HttpLimits

config_option = click.option("--config", "config_path", type=click.Path(dir_okay=False), default=None,
                             help="The server's YAML config (models, db, files, limits); default: embedded defaults.")
db_flag = click.option("--db", "db_url", envvar="TOKENMILL_DB_URL", default=None, metavar="URL",
                       help="Database URL, over the config's `db` (env TOKENMILL_DB_URL).")


def _config(config_path, **overrides):
    from tokenmill.jobs.serve.config import load_config

    try:
        return load_config(config_path, **overrides)
    except SpecError as err:
        raise Failure(str(err), code=2) from None


@main.command(context_settings=CONTEXT_SETTINGS)
@config_option
@db_flag
@click.option("--host", default=None, help="Address to listen on (default 127.0.0.1).")
@click.option("--port", type=int, default=None, help="Port (default 8000; 0: any free port, printed).")
@click.option("--files", "files_root", default=None, metavar="DIR|s3://…", help="Where the files' bytes live.")
def serve(config_path, db_url, host, port, files_root):
    """Serve the OpenAI Batch API (/v1/files, /v1/batches) on the configured models, each kept
    loaded between batches.  Every file and batch belongs to the API key that made it; make
    keys with `tokenmill keys create`.  A batch runs as the tokenmill job of its id, so
    `tokenmill status|report <batch id>` read it; a restarted server resumes unfinished batches.
    Before it listens, each model passes its engine's checks (the bundled smollm2-135m is
    prepared first if it is not yet); a model that cannot run a batch stops it, in one line.

    \b
    Examples:
      tokenmill keys create --name alice
      tokenmill serve --port 8000
      tokenmill serve --config serve.yaml
    """
    import socket

    from tokenmill.jobs.serve.app import asgi_app
    from tokenmill.jobs.serve.ready import NotReady, ready_models
    from tokenmill.jobs.serve.replica import Replica, ReplicaRefused
    from tokenmill.jobs.serve.service import BatchService
    from tokenmill.schemas import storage as S

    cfg = _config(config_path, db=db_url, host=host, port=port, files=files_root)
    try:  # first: a second replica over SQLite is refused before anything else is done
        replica = Replica.register(S.connect(cfg.db_url()))
    except (ReplicaRefused, S.StorageError) as err:
        raise Failure(str(err)) from None
    try:
        try:  # before the port is bound: a server that listens can run a batch of each model
            ready_models(cfg, say=lambda line: click.echo(f"tokenmill serve: {line}", err=True))
        except NotReady as err:
            raise Failure(str(err)) from None
        sock = socket.socket(socket.AF_INET6 if ":" in cfg.host else socket.AF_INET)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((cfg.host, cfg.port))
        except OSError as err:
            raise Failure(f"cannot listen on {cfg.host}:{cfg.port}: {err.strerror}") from None
        bound = sock.getsockname()[1]
        replica.serving(f"http://{cfg.host}:{bound}")
        svc = BatchService(cfg, replica=replica)
        click.echo(f"tokenmill serve: http://{cfg.host}:{bound}/v1 (models: {', '.join(cfg.models)}; "
                   f"database {cfg.db_url().split('://')[0]}; files {cfg.files_root()}; {replica.id})", err=True)
        # SIGTERM drains (svc.start_draining: no new work, the engines end their runs within
        # `drain_s`) and then exits 0; SIGINT stops at once, as before
        run_server(asgi_app(cfg, svc), sock, cfg.http, on_sigterm=svc.start_draining, log_level="warning",
                   lifespan="on", timeout_graceful_shutdown=10)
    finally:
        replica.stopped()


@main.command(context_settings=CONTEXT_SETTINGS)
@db_option
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option("--port", type=int, default=8001, show_default=True, help="Port (0: any free port, printed).")
def ui(db_url, host, port):
    """The live page of the database's jobs (run from the CLI, cron or Airflow): status,
    progress, rows/s, time left, tokens, cost so far, dead letters by reason, each job's
    figures.  Log in with the token it prints (or an API key of the database).

    \b
    Examples:
      tokenmill ui
      tokenmill ui --db postgresql://tokenmill@localhost/tokenmill --port 8080
    """
    import socket

    from tokenmill.jobs.serve.config import HttpLimits
    from tokenmill.jobs.serve.guard import JSON_BODY_BYTES, BodyLimit
    from tokenmill.jobs.serve.page import ui_app
    from tokenmill.schemas.db import default_db_url

    url = db_url or default_db_url()
    token = "tmui-" + secrets.token_urlsafe(24)
    try:
        app = ui_app(url, token)
    except Exception as err:  # the database: one line
        raise Failure(f"cannot open the database: {err}") from None
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as err:
        raise Failure(f"cannot listen on {host}:{port}: {err.strerror}") from None
    sock.listen(128)  # connections wait for the server from the moment its address is printed
    click.echo(f"tokenmill ui: http://{host}:{sock.getsockname()[1]}/ (log in with {token})", err=True)
    # the default limits trust no proxy: the client is who it is
    run_server(BodyLimit(app, JSON_BODY_BYTES), sock, HttpLimits(), log_level="warning")


def run_server(app: Any, sock: Any, limits: HttpLimits, *, on_sigterm: Callable[[], None] | None = None,
               **config: Any) -> None:
    """Serve `app` on the listening `sock` with uvicorn until it is stopped, each connection
    held to `limits` (`HttpLimits`: uvicorn's own settings, and jobs/serve/guard.py's protocol
    and head check for the bounds uvicorn has none for).  Given `on_sigterm`, a SIGTERM calls
    it and shuts the server down as a clean exit (uvicorn would raise SIGTERM again once it is
    down, ending the process by the signal); SIGINT keeps uvicorn's way.  What the
    imports and the set-up put on the heap is frozen first (`gc.freeze`), so the collector's
    full passes skip it: without that, one request in about a hundred of `make bench-page`'s
    (10,000 jobs) took 207-217 ms against a median near 30 ms."""
    import gc
    import signal

    import uvicorn

    from tokenmill.jobs.serve.guard import HeadLimit, protocol

    class Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: Any) -> None:
            if sig == signal.SIGTERM and on_sigterm is not None:
                on_sigterm()
                self.should_exit = True  # not captured: nothing is raised again after the shutdown
                return
            super().handle_exit(sig, frame)

    gc.freeze()
    Server(uvicorn.Config(HeadLimit(app, limits), http=protocol(limits), **limits.uvicorn_settings(),
                          **config)).run(sockets=[sock])


@main.group(name="keys", context_settings=CONTEXT_SETTINGS)
def keys_group() -> None:
    """API keys of `tokenmill serve`: each file and batch belongs to the key that made it; an
    admin key sees every key's.  Only a key's hash is stored: it is shown once, at creation.

    \b
    Examples:
      tokenmill keys create --name alice
      tokenmill keys list --config serve.yaml
      tokenmill keys revoke key_0123456789abcdef
    """


def _store(config_path, db_url):
    from tokenmill.schemas import storage as S

    cfg = _config(config_path, db=db_url)
    try:
        return S.KeyStore(S.connect(cfg.db_url()))
    except S.StorageError as err:
        raise Failure(str(err)) from None


@keys_group.command(name="create", context_settings=CONTEXT_SETTINGS)
@click.option("--name", required=True, help="Who or what the key is for.")
@click.option("--admin", is_flag=True, help="An admin key: sees every key's files and batches, and /metrics.")
@click.option("--webhook-url", default=None, metavar="URL",
              help="Where this key's batch events go (batch.completed|failed|expired|cancelled).")
@config_option
@db_flag
@json_option
def keys_create(name, admin, webhook_url, config_path, db_url, as_json):
    """Make a key; prints it once (only its hash is kept), with the secret its webhook events are
    signed with (Standard Webhooks' `whsec_…`; a batch's `metadata.webhook_url` uses it too).

    \b
    Examples:
      tokenmill keys create --name alice
      tokenmill keys create --name ops --admin --json
      tokenmill keys create --name ci --webhook-url https://ci.example.com/hooks/batches
    """
    from tokenmill.jobs.serve.webhooks import new_secret

    if webhook_url:
        _check_webhook(config_path, db_url, webhook_url)
    secret, signing = "tm-" + secrets.token_urlsafe(32), new_secret()
    row = _store(config_path, db_url).add("key_" + secrets.token_hex(8), name, secret, admin=admin,
                                          webhook_url=webhook_url or None,
                                          webhook_secret=_seal(config_path, db_url, signing))
    if as_json:
        emit_json({"id": row["id"], "name": name, "admin": admin, "key": secret, "webhook_url": webhook_url or None,
                   "webhook_secret": signing})
    else:
        click.echo(secret)
        click.echo(f"key {row['id']} ({name}{', admin' if admin else ''}): shown once; keep it secret", err=True)
        click.echo(f"webhook signing secret: {signing}", err=True)


def _seal(config_path, db_url, signing: str) -> str:
    """A webhook signing secret as the database keeps it: sealed with the server's key file."""
    from tokenmill.jobs.serve.webhooks import SecretBox, SecretError, key_path

    try:
        return SecretBox(key_path(_config(config_path, db=db_url).webhooks)).seal(signing)
    except (SecretError, OSError) as err:
        raise Failure(str(err)) from None


def _check_webhook(config_path, db_url, url: str) -> None:
    from tokenmill.jobs.serve.webhooks import Refused, check_url

    try:
        check_url(url, _config(config_path, db=db_url).webhooks.allow_networks)
    except Refused as err:
        raise Failure(err.detail, code=2) from None  # the operator's CLI: the address may be named
    except OSError as err:
        raise Failure(f"webhook host of {url!r} does not resolve: {err}", code=2) from None


@keys_group.command(name="webhook", context_settings=CONTEXT_SETTINGS)
@click.argument("key")
@click.option("--url", default=None, metavar="URL", help="Where the key's batch events go ('' stops them).")
@click.option("--new-secret", is_flag=True, help="Make a new signing secret (printed once).")
@config_option
@db_flag
@json_option
def keys_webhook(key, url, new_secret, config_path, db_url, as_json):
    """Set where a key's batch events go, or make a new secret they are signed with.  The URL
    must be http(s) on a public address unless the server's `webhooks.allow_networks` names
    its range (checked now and again before each delivery).

    \b
    Examples:
      tokenmill keys webhook key_0123456789abcdef --url https://ci.example.com/hooks/batches
      tokenmill keys webhook tm-q_8A0QV --new-secret --json
    """
    from tokenmill.jobs.serve.webhooks import new_secret as make_secret

    if url is None and not new_secret:
        raise Failure("give --url URL (or '' to stop the events) and/or --new-secret", code=2)
    values: dict = {}
    if url is not None:
        if url:
            _check_webhook(config_path, db_url, url)
        values["webhook_url"] = url or None
    signing = make_secret() if new_secret else None
    if signing:
        values["webhook_secret"] = _seal(config_path, db_url, signing)
    key_id = _store(config_path, db_url).update(key, **values)
    if key_id is None:
        raise Failure(f"no unrevoked key with id or prefix {key!r} (or the prefix names more than one)")
    shown = {**values, **({"webhook_secret": signing} if signing else {})}
    if as_json:
        emit_json({"id": key_id, **shown})
        return
    if "webhook_url" in values:
        click.echo(f"key {key_id}: webhook {values['webhook_url'] or 'off'}")
    if signing:
        click.echo(f"key {key_id}: new webhook signing secret {signing} (shown once)")


@keys_group.command(name="quota", context_settings=CONTEXT_SETTINGS)
@click.argument("key")
@click.option("--tokens-per-day", type=click.IntRange(min=0), default=None,
              help="Prompt + output tokens the key's batches may use per UTC day (0: the server's limit).")
@click.option("--batches-in-flight", type=click.IntRange(min=0), default=None,
              help="Batches of the key not ended at once (0: the server's limit).")
@config_option
@db_flag
def keys_quota(key, tokens_per_day, batches_in_flight, config_path, db_url):
    """Set a key's own quotas (over them a new batch gets 429, or waits in `validating` where
    the server's `limits.over_quota` is `queue`).

    \b
    Example:
      tokenmill keys quota key_0123456789abcdef --tokens-per-day 2000000 --batches-in-flight 4
    """
    values = {}
    if tokens_per_day is not None:
        values["tokens_per_day"] = tokens_per_day or None
    if batches_in_flight is not None:
        values["max_batches_in_flight"] = batches_in_flight or None
    if not values:
        raise Failure("give --tokens-per-day and/or --batches-in-flight", code=2)
    key_id = _store(config_path, db_url).update(key, **values)
    if key_id is None:
        raise Failure(f"no unrevoked key with id or prefix {key!r} (or the prefix names more than one)")
    shown = {k: ("the server's" if v is None else f"{v:,}") for k, v in values.items()}
    click.echo(f"key {key_id}: " + ", ".join(f"{k} {v}" for k, v in shown.items()))


@keys_group.command(name="usage", context_settings=CONTEXT_SETTINGS)
@click.argument("key", required=False)
@click.option("--days", type=click.IntRange(min=1), default=7, show_default=True, help="UTC days back, today included.")
@config_option
@db_flag
@json_option
def keys_usage(key, days, config_path, db_url, as_json):
    """What each key's batches used per UTC day: batches, lines, prompt and output tokens,
    engine hours and cost, counted from the batches' jobs (cost where the model is priced).

    \b
    Examples:
      tokenmill keys usage
      tokenmill keys usage key_0123456789abcdef --days 30 --json
    """
    from tokenmill.schemas import storage as S
    from tokenmill.schemas.storage.usage import DAY_S

    store = _store(config_path, db_url)
    owner = None
    if key:
        found = [k for k in store.all() if key in (k["id"], k["prefix"])]
        if len(found) != 1:
            raise Failure(f"no key with id or prefix {key!r} (or the prefix names more than one)")
        owner = found[0]["id"]
    now = time.time()
    rows = S.UsageStore(store.engine).by_day(owner, since=now - now % DAY_S - (days - 1) * DAY_S)
    names = {k["id"]: k["name"] for k in store.all()}
    for r in rows:
        r["date"] = time.strftime("%Y-%m-%d", time.gmtime(r["day"] * DAY_S))
        r["name"] = names.get(r["key_id"])
    if as_json:
        emit_json(rows)
        return
    if not rows:
        click.echo("no batches in these days")
        return
    click.echo(tabulate([[r["date"], r["key_id"], r["name"], r["batches"], r["lines"], r["prompt_tokens"],
                          r["output_tokens"], f"{r['engine_hours']:.4f}",
                          "-" if r["cost"] is None else f"{r['cost']:.4f}"] for r in rows],
                        headers=["day (UTC)", "key", "name", "batches", "lines", "prompt tokens", "output tokens",
                                 "engine h", "cost (USD)"]))


@keys_group.command(name="list", context_settings=CONTEXT_SETTINGS)
@config_option
@db_flag
@json_option
def keys_list(config_path, db_url, as_json):
    """The keys: id, name, prefix, admin, created, revoked.

    \b
    Example:
      tokenmill keys list --db postgresql://tokenmill@localhost/tokenmill
    """
    rows = _store(config_path, db_url).all()
    if as_json:
        emit_json(rows)
        return
    when = lambda t: time.strftime("%Y-%m-%d %H:%M", time.gmtime(t)) if t else ""  # noqa: E731
    click.echo(tabulate([[r["id"], r["name"], r["prefix"] + "…", "yes" if r["admin"] else "", when(r["created_at"]),
                          when(r["revoked_at"])] for r in rows],
                        headers=["id", "name", "prefix", "admin", "created (UTC)", "revoked (UTC)"]))


@keys_group.command(name="revoke", context_settings=CONTEXT_SETTINGS)
@click.argument("key")
@config_option
@db_flag
def keys_revoke(key, config_path, db_url):
    """Revoke a key by its id or prefix: its requests get 401 from then on.

    \b
    Example:
      tokenmill keys revoke tm-q_8A0QV
    """
    if not _store(config_path, db_url).revoke(key):
        raise Failure(f"no unrevoked key with id or prefix {key!r} (or the prefix names more than one)")
    click.echo(f"revoked {key}")
