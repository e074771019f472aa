"""`tokenmill models` (prepare, list) and `tokenmill db` (upgrade)."""

from __future__ import annotations

import click

from tokenmill.jobs.cli.app import main
from tokenmill.jobs.cli.common import CONTEXT_SETTINGS, Failure, connect, db_option


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
    """List the model folders tokenmill can use by short name, and the GGUF files (the
    bundled one, those in the models folder) for --engine llamacpp; a folder or GGUF that
    `tokenmill quantize` wrote says its scheme, method, calibration source and hash.

    \b
    Example:
      tokenmill models list
    """
    from tokenmill.schemas.models import (
        BUILTIN_MODELS,
        checkpoint_summary,
        describe_checkpoint,
        is_model_folder,
        models_dir,
        quantization_record,
    )

    seen = set()
    for d in sorted(models_dir().glob("*")):
        if is_model_folder(d):
            seen.add(d.name)
            q = describe_checkpoint(checkpoint_summary(quantization_record(d)))
            click.echo(f"{d.name:<24} {d}" + (f"  [{q}]" if q else ""))
    for name, desc in BUILTIN_MODELS.items():
        if name not in seen:
            click.echo(f"{name:<24} (not prepared: tokenmill models prepare {name}) {desc}")
    # GGUF files for --engine llamacpp: the bundled one (by short name) and any in the models folder
    from tokenmill.schemas.models import PrepareError, bundled_gguf

    try:
        click.echo(f"{'smollm2-135m':<24} {bundled_gguf()} (GGUF, --engine llamacpp)")
    except PrepareError:
        pass
    for f in sorted(models_dir().glob("*.gguf")):
        q = describe_checkpoint(checkpoint_summary(quantization_record(f)))
        click.echo(f"{f.name:<24} {f} (GGUF, --engine llamacpp)" + (f"  [{q}]" if q else ""))


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
    from tokenmill.schemas.db import default_db_url
    from tokenmill.schemas.secrets import mask_url

    url = db_url or default_db_url()
    eng = connect(url)
    with eng.connect() as conn:
        click.echo(f"{mask_url(url)}: schema at revision {S.current_revision(conn)}")
