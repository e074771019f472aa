"""Two revisions of tokenmill side by side on one machine in one run (a redesign's "no loss",
issue 51): each revision's four product folders are taken from git (`git archive`) into
bench/work/revs/<rev>/ and laid out as the `tokenmill` namespace; a child process runs that
revision's code by having it first on PYTHONPATH (the editable install's own tree comes after).

Sections, each A B B A over `--rounds` (A = the first revision, B = the second):

- **serve**: one warm `tokenmill serve` per revision, both started and warmed first (a 20-line
  batch, then 64 lines of the large file's shape: the engine is loaded and its KV cache sized),
  the same engine config as bench/serve.py; then the 20-line batch alternating between the two
  servers, then the `--large-lines` batch.  Walls are what each server recorded, `created_at` to
  `completed_at`, read from its own database with plain SQL (the revisions' tables differ).  An
  idle server's engine waits on its queue; it takes no core from the other.
- **ceiling**: bench/ceiling.py's tokenmill-1 and plain arms (the stand-in engine, `--n` rows),
  one process per revision per turn, the revision's own tokenmill first on PYTHONPATH and this
  checkout's bench harness: tokenmill-1's wall and its ratio to the plain loop of the same turn.

Every run is reported; a ratio's verdict only where every round agrees.

    python -m bench.revs --revs 02989a7 HEAD --sections serve ceiling
    python -m bench.revs --revs 02989a7 HEAD --sections serve --large-lines 500 --rounds 2
"""

from __future__ import annotations

import argparse
import json
import os
import sqlite3
import subprocess
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from bench.common import ROOT, WORK, log, machine, utc_now, utc_stamp, write_report
from bench.serve import Served, abba, lines_file

FOLDERS = ("jobs", "pipelines", "transforms", "schemas")


def tree(rev: str) -> tuple[str, Path]:
    """The revision's short hash and a folder whose `tokenmill/` holds its four product folders."""
    short = subprocess.run(["git", "rev-parse", "--short", rev], cwd=ROOT, capture_output=True, text=True,
                           check=True).stdout.strip()
    base = WORK / "revs" / short
    src, ns = base / "src", base / "ns" / "tokenmill"
    if not (src / "jobs").is_dir():
        src.mkdir(parents=True, exist_ok=True)
        archive = subprocess.run(["git", "archive", short, *FOLDERS], cwd=ROOT, capture_output=True, check=True)
        subprocess.run(["tar", "-x", "-C", str(src)], input=archive.stdout, check=True)
    ns.mkdir(parents=True, exist_ok=True)
    for name in FOLDERS:
        link = ns / name
        if not link.is_symlink():
            link.symlink_to(src / name)
    return short, base / "ns"


@contextmanager
def running(ns: Path) -> Iterator[None]:
    """Child processes started inside run the revision under `ns` (PYTHONPATH first)."""
    old = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join([str(ns), *([old] if old else [])])
    try:
        yield
    finally:
        if old is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = old


def resolved(ns: Path) -> str:
    """Where a child with this PYTHONPATH finds `tokenmill.jobs` (shown, so a run proves which code ran)."""
    with running(ns):
        return subprocess.run([sys.executable, "-c", "import tokenmill.jobs as j; print(list(j.__path__)[0])"],
                              cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()


class RevServed(Served):
    """A warm server of one revision; its walls read from its database with plain SQL."""

    def recorded(self, batch_id: str) -> dict[str, Any]:
        with sqlite3.connect(self.db_url.removeprefix("sqlite:///")) as con:
            created, completed = con.execute("SELECT created_at, completed_at FROM api_batches WHERE id = ?",
                                             (batch_id,)).fetchone()
        return {"recorded_created_to_completed_s": round(completed - created, 3)}


def serve_section(revs: list[tuple[str, Path]], args: argparse.Namespace, root: Path) -> dict[str, Any]:
    files = {"small": lines_file(root / "small.jsonl", args.small_lines, args.max_tokens, "s"),
             "large": lines_file(root / "large.jsonl", args.large_lines, args.max_tokens, "l"),
             "warm": lines_file(root / "warm.jsonl", 64, args.max_tokens, "w")}
    servers = []
    try:
        for short, ns in revs:
            with running(ns):
                folder = root / f"serve-{short}"
                folder.mkdir()
                srv = RevServed(folder, args.dtype, args.status_every)
            servers.append(srv)
            log(f"{short}: server pid {srv.server.proc.pid}; warm-up {srv.batch(files['small'])}, "
                f"{srv.batch(files['warm'])}")
        out: dict[str, Any] = {}
        for name in ("small", "large"):
            log(f"serve {name}: A = {revs[0][0]}, B = {revs[1][0]}")
            f = files[name]
            rounds = abba(lambda f=f: servers[0].batch(f), lambda f=f: servers[1].batch(f), args.rounds)
            walls = {arm: [g["recorded_created_to_completed_s"] for a, g in rounds if a == arm] for arm in "AB"}
            out[name] = {"rounds": rounds, "lines": len(f.read_text().splitlines()),
                         "b_over_a_per_round": [round((walls["B"][i] + walls["B"][i + 1]) /
                                                      (walls["A"][i] + walls["A"][i + 1]), 3)
                                                for i in range(0, len(walls["A"]), 2)]}
            log(f"serve {name}: B ÷ A per round {out[name]['b_over_a_per_round']}")
        return out
    finally:
        for srv in servers:
            srv.server.stop()


def ceiling_turn(short: str, ns: Path, args: argparse.Namespace, root: Path, turn: int) -> dict[str, Any]:
    out = root / f"ceiling-{turn}-{short}.json"
    with running(ns):
        subprocess.run([sys.executable, "-m", "bench.ceiling", "--arms", "tokenmill-1,plain", "--rounds", "1",
                        "--no-profile", "--n", str(args.n), "--code", short, "--json", str(out)], cwd=ROOT, check=True)
    got = json.loads(out.read_text())["rounds"][0]
    walls = {r["arm"]: r["wall_s"] for r in got["runs"]}
    return {"rev": short, "order": got["order"], "tokenmill_1_wall_s": walls["tokenmill-1"],
            "plain_wall_s": walls["plain"], "tokenmill_1_over_plain": got["tokenmill_1_over_plain"]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--revs", nargs=2, required=True, metavar=("A", "B"), help="two git revisions (A before, B after)")
    ap.add_argument("--sections", nargs="+", choices=("serve", "ceiling"), default=["serve", "ceiling"])
    ap.add_argument("--small-lines", type=int, default=20)
    ap.add_argument("--large-lines", type=int, default=2000)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=1, help="A B B A rounds per section")
    ap.add_argument("--n", type=int, default=100_000, help="the ceiling's rows")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--status-every", type=float, default=1.0)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    WORK.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="revs-", dir=WORK))
    revs = [tree(r) for r in args.revs]
    rep: dict[str, Any] = {"bench": "revs", "started": utc_now(), "args": vars(args), "machine": machine(),
                           "revs": {short: resolved(ns) for short, ns in revs}, "sections": {}}
    log(f"revisions and where their children import tokenmill.jobs from: {rep['revs']}")
    if "serve" in args.sections:
        rep["sections"]["serve"] = serve_section(revs, args, root)
    if "ceiling" in args.sections:
        turns = [revs[i] for _ in range(args.rounds) for i in (0, 1, 1, 0)]
        runs = []
        for turn, (short, ns) in enumerate(turns):
            runs.append(ceiling_turn(short, ns, args, root, turn))
            log(f"ceiling turn {turn + 1} {short}: {runs[-1]}")
        rep["sections"]["ceiling"] = {"runs": runs}
    rep["finished"] = utc_now()
    write_report(rep, args.json, f"revs-{utc_stamp()}.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
