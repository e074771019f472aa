"""`tokenmill serve`: the OpenAI Batch API over warm engines; `tokenmill keys create|list|revoke`:
its API keys (docs/SERVING.md)."""

from __future__ import annotations

import secrets
import time

import click
from tabulate import tabulate

from tokenmill.jobs.cli.app import main
from tokenmill.jobs.cli.common import CONTEXT_SETTINGS, Failure, emit_json, json_option
from tokenmill.schemas.config import SpecError

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

    \b
    Examples:
      tokenmill keys create --name alice
      tokenmill serve --port 8000
      tokenmill serve --config serve.yaml
    """
    import socket

    import uvicorn

    from tokenmill.jobs.serve.app import asgi_app

    cfg = _config(config_path, db=db_url, host=host, port=port, files=files_root)
    sock = socket.socket(socket.AF_INET6 if ":" in cfg.host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((cfg.host, cfg.port))
    except OSError as err:
        raise Failure(f"cannot listen on {cfg.host}:{cfg.port}: {err.strerror}") from None
    bound = sock.getsockname()[1]
    click.echo(f"tokenmill serve: http://{cfg.host}:{bound}/v1 (models: {', '.join(cfg.models)}; "
               f"database {cfg.db_url().split('://')[0]}; files {cfg.files_root()})", err=True)
    server = uvicorn.Server(uvicorn.Config(asgi_app(cfg), log_level="warning", lifespan="on",
                                           timeout_graceful_shutdown=10))
    server.run(sockets=[sock])


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
@config_option
@db_flag
@json_option
def keys_create(name, admin, config_path, db_url, as_json):
    """Make a key; prints it once (only its hash is kept).

    \b
    Examples:
      tokenmill keys create --name alice
      tokenmill keys create --name ops --admin --json
    """
    secret = "tm-" + secrets.token_urlsafe(32)
    row = _store(config_path, db_url).add("key_" + secrets.token_hex(8), name, secret, admin=admin)
    if as_json:
        emit_json({"id": row["id"], "name": name, "admin": admin, "key": secret})
    else:
        click.echo(secret)
        click.echo(f"key {row['id']} ({name}{', admin' if admin else ''}): shown once; keep it secret", err=True)


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
