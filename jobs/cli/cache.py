"""`tokenmill cache stats|prune`: list, size and prune the result cache across jobs (docs/CACHE.md)."""

from __future__ import annotations

import datetime as dt
import re
import time
from typing import Any

import click
from tabulate import tabulate

from tokenmill.jobs.cli.app import main
from tokenmill.jobs.cli.common import CONTEXT_SETTINGS, Failure, connect, db_option, emit_json, json_option

#: Seconds per unit of a `--older-than` age.
AGE_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def parse_age(text: str) -> float:
    """`30d`, `12h`, `90m`, `45s`, `2w` → seconds; click.BadParameter (one line) otherwise."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhdw])\s*", text or "")
    if not m:
        raise click.BadParameter(f"give a number and a unit (s, m, h, d or w), e.g. 30d; got {text!r}")
    return float(m.group(1)) * AGE_UNITS[m.group(2)]


def _when(t: float | None) -> str | None:
    return None if t is None else dt.datetime.fromtimestamp(t, dt.timezone.utc).isoformat(timespec="seconds")


def _size(n: int) -> str:
    from tokenmill.jobs.modeltools.kvplan import format_bytes

    return format_bytes(n)


def _dated(figures: dict[str, Any]) -> dict[str, Any]:
    return {k: _when(v) if k.endswith("_at") else v for k, v in figures.items()}


@main.group(name="cache", context_settings=CONTEXT_SETTINGS)
def cache_group() -> None:
    """The result cache across jobs: deterministic answers (greedy, or a fixed seed) kept in the
    job database and served to any later job with the same checkpoint, engine settings, rendered
    prompt and sampling (docs/CACHE.md).

    \b
    Examples:
      tokenmill cache stats
      tokenmill cache prune --older-than 30d
    """


@cache_group.command(name="stats", context_settings=CONTEXT_SETTINGS)
@db_option
@json_option
def stats(db_url, as_json):
    """What the cache holds: entries, bytes, hits, oldest and newest entry, last use; per
    fingerprint (one engine identity: checkpoint, engine version, dtype, ...) with its models.

    \b
    Example:
      tokenmill cache stats --db sqlite:///jobs.db --json
    """
    from tokenmill.schemas import storage as S

    s = S.CacheStore(connect(db_url)).stats()
    out = {**_dated({k: v for k, v in s.items() if k != "by_fingerprint"}),
           "by_fingerprint": [_dated(g) for g in s["by_fingerprint"]]}
    if as_json:
        emit_json(out)
        return
    click.echo(f"{out['entries']:,} entries, {_size(out['bytes'])}, {out['hits']:,} hits; oldest "
               f"{out['oldest_created_at'] or '-'}, newest {out['newest_created_at'] or '-'}, last used "
               f"{out['last_used_at'] or '-'}")
    if out["by_fingerprint"]:
        rows = [(g["fingerprint"][:16], ", ".join(g["models"]), f"{g['entries']:,}", _size(g["bytes"]),
                 f"{g['hits']:,}", g["newest_created_at"], g["last_used_at"] or "-") for g in out["by_fingerprint"]]
        click.echo(tabulate(rows, headers=["fingerprint", "model", "entries", "size", "hits", "newest", "last used"],
                            disable_numparse=True))


@cache_group.command(name="prune", context_settings=CONTEXT_SETTINGS)
@click.option("--older-than", "older_than", required=True, metavar="AGE",
              help="Delete entries not used (served or, never served, stored) for this long: 30d, 12h, 90m, 2w.")
@click.option("--fingerprint", default=None, metavar="F",
              help="Only entries of this fingerprint (its full hex, as `cache stats --json` lists it).")
@db_option
@json_option
def prune(older_than, fingerprint, db_url, as_json):
    """Delete entries by last use: an entry served recently stays, whatever its age.

    \b
    Example:
      tokenmill cache prune --older-than 30d
    """
    from tokenmill.schemas import storage as S

    try:
        age = parse_age(older_than)
    except click.BadParameter as err:
        raise Failure(f"--older-than: {err.message}", 2) from None
    cutoff = time.time() - age
    store = S.CacheStore(connect(db_url))
    gone = store.prune(cutoff, fingerprint=fingerprint)
    left = store.stats()
    out = {"deleted_entries": gone["entries"], "deleted_bytes": gone["bytes"], "unused_since": _when(cutoff),
           "fingerprint": fingerprint, "entries_left": left["entries"], "bytes_left": left["bytes"]}
    if as_json:
        emit_json(out)
        return
    click.echo(f"deleted {gone['entries']:,} entries ({_size(gone['bytes'])}) unused since {out['unused_since']}"
               + (f" of fingerprint {fingerprint}" if fingerprint else "")
               + f"; {left['entries']:,} entries ({_size(left['bytes'])}) left")
