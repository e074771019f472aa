"""`tokenmill serve` against `tokenmill run` on the same files (`make bench-serve`).

One server on loopback (the bundled model, the engine config below), driven by the `openai`
SDK; `tokenmill run` as whole processes on the same JSONL files and engine config.  After a
warm-up (the server's first batch loads its engine; one `tokenmill run` warms the page cache),
four sections, each with its arms interleaved A B B A:

- **small**: a 20-line batch on the warm server (upload, create, poll until completed, download
  the output) against `tokenmill run` on the same file (process wall).  Target: ≤ 0.3×.
- **large**: a 2,000-line batch through the server (create to completed) against `tokenmill
  run` (its process wall, and its wall less the engine's start and load, read from the job's
  metrics: the stricter comparison, since the warm server has no start to pay).  Lines per
  second; target ≥ 0.95× the stricter one.
- **polling**: the same 400-line batch with no one polling and with 20 clients each polling
  `GET /v1/batches/{id}` every 1 s and every 0.1 s (`--pollers`, `--poll-every`); target: slowed
  by ≤ 5%.  The server's and the clients' CPU per poll are measured too (process CPU times).
  Here the clients share the engine's cores.  `--poller` picks the clients: `sdk`, the `openai`
  SDK's `batches.retrieve`, or `http`, one kept-alive `http.client` connection each, a client
  whose own CPU per poll is a small share of the SDK's: it stands in for clients on another host,
  where the server's work for each poll is all the engine's host pays.  Several kinds run as
  arms of one interleaved round (A, then each kind, then back: A B C C B A; the next round starts
  from B).  Each round gives
  each kind one slowdown, its two batches' mean over the two quiet batches' mean, so a drift
  that is linear over the round cancels; the verdict is decided only when every round agrees.
  `--poller-nice 19` lowers the clients' threads' priority.

The server's walls are what it recorded, to the millisecond: a batch's `created_at` to its
`completed_at` (validation and finalization included), read from its database; the bench's own
status poll (once every `--status-every` s, 1 s by default) only tells it when to read them.
- **memory**: 50 consecutive 5-line batches; the server's RSS and its engine process tree's
  after each, and the least-squares slope per batch.

Every round is reported.  Not a timed test: its figures go to docs/BENCHMARKS.md.

    python -m bench.serve                       # every section, default sizes
    python -m bench.serve --sections small memory --large-lines 500
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from bench.common import ROOT, WORK, code_label, log, machine, utc_now, utc_stamp, write_report

ENGINE = {"max_num_seqs": 32, "max_model_len": 1024, "gpu_memory_utilization": 0.3}
MODEL = "smollm2-135m"


def lines_file(path: Path, n: int, max_tokens: int, tag: str) -> Path:
    rows = [{"custom_id": f"{tag}{i:05d}", "method": "POST", "url": "/v1/chat/completions",
             "body": {"model": MODEL, "messages": [{"role": "user", "content": f"Tell me a fact about {i}."}],
                      "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}} for i in range(n)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def run_cli(inp: Path, folder: Path, db_url: str, dtype: str) -> dict[str, Any]:
    """One `tokenmill run --json` process on a JSONL file: process wall, and the job's start-up
    and load (the part a warm server does not pay)."""
    from tokenmill.schemas import storage as S

    job = f"run-{inp.stem}-{time.time_ns()}"
    cmd = [sys.executable, "-m", "tokenmill.jobs.cli", "run", "--input", str(inp), "--output", str(folder / job),
           "--db", db_url, "--job-id", job, "--json", "--dtype", dtype, "--max-num-seqs", str(ENGINE["max_num_seqs"]),
           "--max-model-len", str(ENGINE["max_model_len"]), "--gpu-memory-utilization",
           str(ENGINE["gpu_memory_utilization"])]
    t0 = time.monotonic()
    p = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    wall = time.monotonic() - t0
    if p.returncode != 0:
        raise SystemExit(f"tokenmill run: exit {p.returncode}: {p.stderr.strip()[-2000:]}")
    summary = json.loads(p.stdout)
    workers = S.MetricsReader(S.connect(db_url)).workers(job)
    load = max((float(w.get("load_s") or 0) for w in workers), default=0.0)
    return {"process_wall_s": round(wall, 2), "rows": summary["rows_in"], "engine_load_s": round(load, 2),
            "generation_wall_s": summary.get("generation_wall_s"), "job_wall_s": summary.get("wall_s")}


class Served:
    """The bench's server and its client."""

    def __init__(self, root: Path, dtype: str, status_every_s: float):
        from tests.serve_server import Server

        self.db_url = f"sqlite:///{root / 'serve.db'}"
        cfg = {"db": self.db_url, "files": str(root / "files"), "work": str(root / "runs"),
               "models": {MODEL: {"engine": {**ENGINE, "dtype": dtype}}}}
        self.status_every_s = status_every_s
        self.server = Server(root, cfg).start()
        self.key = self.server.make_key("bench")["key"]
        self.client = self.server.client(self.key, timeout=600)

    def batch(self, inp: Path, *, pollers: int = 0, poll_every_s: float = 0.1, poller_nice: int = 0,
              poller: str = "sdk") -> dict[str, Any]:
        """Upload, create, poll until completed, download the output: its walls.  `poller`: the
        polling clients' kind (`sdk` or `http`, module docstring).  `poller_nice`: each polling
        thread's niceness (Linux sets it per thread); the server keeps its own."""
        import psutil

        server = psutil.Process(self.server.proc.pid)
        cpu0, mine0 = sum(server.cpu_times()[:2]), time.process_time()
        t0 = time.monotonic()
        with open(inp, "rb") as fh:
            f = self.client.files.create(file=fh, purpose="batch")
        b = self.client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
        t_created = time.monotonic()
        stop, polls = threading.Event(), [0]

        def poll() -> None:
            if poller_nice:
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), poller_nice)
            retrieve = self._retriever(poller, b.id)
            while not stop.is_set():
                retrieve()
                polls[0] += 1
                stop.wait(poll_every_s)

        threads = [threading.Thread(target=poll, daemon=True) for _ in range(pollers)]
        for t in threads:
            t.start()
        while b.status not in ("completed", "failed", "cancelled", "expired"):
            time.sleep(self.status_every_s)
            b = self.client.batches.retrieve(b.id)
        t_done = time.monotonic()
        stop.set()
        for t in threads:
            t.join()
        server_cpu_s, bench_cpu_s = sum(server.cpu_times()[:2]) - cpu0, time.process_time() - mine0
        if b.status != "completed":
            raise SystemExit(f"batch {b.id} ended {b.status}: {b.errors}")
        out = self.client.files.content(b.output_file_id).text
        n = sum(1 for line in out.splitlines() if line.strip())
        return {"batch_id": b.id, "lines": n, "wall_s": round(time.monotonic() - t0, 2),
                "created_to_completed_s": round(t_done - t_created, 2), **self.recorded(b.id), "polls": polls[0],
                # CPU the server process (not its engine) and this process (the SDK clients) used
                "server_cpu_s": round(server_cpu_s, 2), "bench_cpu_s": round(bench_cpu_s, 2)}

    def _retriever(self, poller: str, batch_id: str):
        """One polling client: a call that gets the batch once (and fails on anything but 200)."""
        if poller == "sdk":
            c = self.server.client(self.key)
            return lambda: c.batches.retrieve(batch_id)
        import http.client
        from urllib.parse import urlsplit

        url = urlsplit(self.server.base_url)
        conn = http.client.HTTPConnection(url.hostname, url.port, timeout=60)
        headers = {"Authorization": f"Bearer {self.key}"}

        def get() -> None:
            conn.request("GET", f"/v1/batches/{batch_id}", headers=headers)
            r = conn.getresponse()
            body = r.read()
            if r.status != 200:
                raise RuntimeError(f"GET /v1/batches/{batch_id}: {r.status} {body[:200]!r}")
        return get

    def recorded(self, batch_id: str) -> dict[str, Any]:
        """What the server recorded of the batch, to the millisecond (the SDK's timestamps are whole
        seconds, and this bench's own status polls come once every `status_every_s`): created →
        completed, and its job's generation window and engine load."""
        from tokenmill.schemas import storage as S

        eng = S.connect(self.db_url)
        row = S.BatchStore(eng).get(batch_id) or {}
        job = S.JobStore(eng).get(batch_id) or {}
        load = max((float(w.get("load_s") or 0) for w in S.MetricsReader(eng).workers(batch_id)), default=0.0)
        return {"recorded_created_to_completed_s": round(row["completed_at"] - row["created_at"], 3),
                "generation_wall_s": ((job.get("metrics") or {}).get("throughput") or {}).get("generation_wall_s"),
                "engine_load_s": round(load, 2)}

    def rss(self) -> dict[str, float]:
        import psutil

        server = psutil.Process(self.server.proc.pid)
        kids = server.children(recursive=True)
        mb = lambda ps: round(sum(p.memory_info().rss for p in ps if p.is_running()) / 2**20, 1)  # noqa: E731
        return {"server_mib": mb([server]), "engine_tree_mib": mb(kids)}


def interleave(arms: dict[str, Any], rounds: int) -> list[tuple[str, dict[str, Any]]]:
    """Each round runs every arm twice, in order then back (A B C C B A), each round starting
    from the next arm (bench.throughput.abba), so a drift linear over a round cancels."""
    from bench.throughput import abba as order

    out = []
    for i, arm in enumerate(order(list(arms), 2 * rounds)):
        got = arms[arm]()
        log(f"  round {i // (2 * len(arms)) + 1} {arm}: {got}")
        out.append((arm, got))
    return out


def abba(a, b, rounds: int) -> list[tuple[str, dict[str, Any]]]:
    return interleave({"A": a, "B": b}, rounds)


def round_slowdowns(rounds: list[tuple[str, dict[str, Any]]], arm: str, per_round: int) -> list[float]:
    """Each round's slowdown of `arm`: its batches' mean recorded wall over the quiet batches' (A) mean, less 1."""
    out = []
    for i in range(0, len(rounds), per_round):
        walls: dict[str, list[float]] = {}
        for name, got in rounds[i:i + per_round]:
            walls.setdefault(name, []).append(got["recorded_created_to_completed_s"])
        out.append(round(statistics.mean(walls[arm]) / statistics.mean(walls["A"]) - 1, 4))
    return out


def verdict(values: list[float], limit: float) -> str:
    """PASS when every round is within the limit, MISS when none is, else not resolved."""
    if all(v <= limit for v in values):
        return "PASS"
    return "MISS" if all(v > limit for v in values) else "not resolved"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sections", nargs="+", default=["small", "large", "polling", "memory"])
    ap.add_argument("--small-lines", type=int, default=20)
    ap.add_argument("--large-lines", type=int, default=2000)
    ap.add_argument("--poll-lines", type=int, default=400)
    ap.add_argument("--memory-batches", type=int, default=50)
    ap.add_argument("--pollers", type=int, default=20)
    ap.add_argument("--poll-every", type=float, nargs="+", default=[1.0, 0.1],
                    help="seconds between one poller's requests; one interleaved set of rounds per value")
    ap.add_argument("--poller", nargs="+", choices=("sdk", "http"), default=["sdk", "http"],
                    help="the polling clients: the openai SDK (B), kept-alive http.client connections (C)")
    ap.add_argument("--poller-nice", type=int, default=0,
                    help="the polling clients' niceness (19: they stand in for clients on another host, whose CPU "
                         "is not the engine's; the server's requests still are)")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=1, help="A B B A rounds per section")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--status-every", type=float, default=1.0,
                    help="seconds between this bench's own status polls (walls come from the server's records)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    WORK.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="serve-", dir=WORK))
    rep: dict[str, Any] = {"bench": "serve", "started": utc_now(), "code": code_label(None), "args": vars(args),
                           "machine": machine(), "engine": {**ENGINE, "dtype": args.dtype}, "sections": {}}
    db_url = f"sqlite:///{root / 'run.db'}"
    files = {name: lines_file(root / f"{name}.jsonl", n, args.max_tokens, name[0])
             for name, n in (("small", args.small_lines), ("large", args.large_lines), ("poll", args.poll_lines),
                             ("mem", 5))}
    log(f"starting the server in {root}")
    srv = Served(root, args.dtype, args.status_every)
    try:
        log(f"warm-up: {srv.batch(files['small'])} (the engine loads); {run_cli(files['small'], root, db_url, args.dtype)}")
        secs = rep["sections"]
        if "small" in args.sections:
            log("small: A = tokenmill run, B = a batch on the warm server")
            rounds = abba(lambda: run_cli(files["small"], root, db_url, args.dtype), lambda: srv.batch(files["small"]),
                          args.rounds)
            a = [g["process_wall_s"] for arm, g in rounds if arm == "A"]
            b = [g["wall_s"] for arm, g in rounds if arm == "B"]
            secs["small"] = {"rounds": rounds, "ratios": [round(y / x, 3) for x, y in zip(a, b)],
                             "target": "batch wall / run wall <= 0.3"}
        if "large" in args.sections:
            warm = lines_file(root / "large-warm.jsonl", 64, args.max_tokens, "w")
            log(f"large: warm-up {srv.batch(warm)} (64 lines of the large file's shape; a served "
                "engine's KV cache is sized for its config's capacity, so no batch starts it again), "
                "then A = tokenmill run, B = the batch through the server")
            rounds = abba(lambda: run_cli(files["large"], root, db_url, args.dtype), lambda: srv.batch(files["large"]),
                          args.rounds)
            a = [g for arm, g in rounds if arm == "A"]
            b = [g for arm, g in rounds if arm == "B"]
            secs["large"] = {
                "rounds": rounds, "target": "server lines/s / run lines/s (run wall less engine start and load) >= 0.95",
                "vs_run_wall": [round(x["process_wall_s"] / y["recorded_created_to_completed_s"], 3)
                                for x, y in zip(a, b)],
                "vs_run_wall_less_load": [round((x["process_wall_s"] - x["engine_load_s"]) /
                                                y["recorded_created_to_completed_s"], 3)
                                          for x, y in zip(a, b)],
                # not a target: the two generation windows alone (first batch in → last batch out)
                "generation_windows": [round(x["generation_wall_s"] / y["generation_wall_s"], 3)
                                       for x, y in zip(a, b) if x["generation_wall_s"] and y["generation_wall_s"]],
            }
        if "polling" in args.sections:
            log(f"polling: warm-up {srv.batch(files['poll'])} (the page cache and the engine warm for this batch)")
            secs["polling"] = []
            kinds = {"sdk": "B", "http": "C"}
            for every in args.poll_every:
                arms: dict[str, Any] = {"A": lambda: srv.batch(files["poll"])}
                for kind in args.poller:
                    arms[kinds[kind]] = (lambda every=every, kind=kind: srv.batch(
                        files["poll"], pollers=args.pollers, poll_every_s=every, poller_nice=args.poller_nice,
                        poller=kind))
                log(f"polling every {every} s: A = nobody polls, "
                    + ", ".join(f"{kinds[k]} = {args.pollers} {k} clients" for k in args.poller))
                rounds = interleave(arms, args.rounds)
                a = [g for arm, g in rounds if arm == "A"]
                sec: dict[str, Any] = {"rounds": rounds, "pollers": args.pollers, "poll_every_s": every,
                                       "poller_nice": args.poller_nice, "arms": {}}
                for kind in args.poller:
                    b = [g for arm, g in rounds if arm == kinds[kind]]
                    per_round = round_slowdowns(rounds, kinds[kind], 2 * len(arms))
                    sec["arms"][kinds[kind]] = {
                        "poller": kind,
                        "slowdown_by_round": per_round,
                        "verdict": verdict(per_round, 0.05),
                        # each polled batch against the quiet batch at the same place in the order
                        "slowdown_pairs": [round(y["recorded_created_to_completed_s"] /
                                                 x["recorded_created_to_completed_s"] - 1, 4) for x, y in zip(a, b)],
                        # the server's and the clients' CPU for each poll: B's less A's, over B's polls
                        "server_cpu_ms_per_poll": [round((y["server_cpu_s"] - x["server_cpu_s"]) / y["polls"] * 1e3, 3)
                                                   for x, y in zip(a, b)],
                        "client_cpu_ms_per_poll": [round((y["bench_cpu_s"] - x["bench_cpu_s"]) / y["polls"] * 1e3, 3)
                                                   for x, y in zip(a, b)]}
                    log(f"  {kind} clients every {every} s: slowdown by round {per_round}: "
                        f"{sec['arms'][kinds[kind]]['verdict']}")
                sec["target"] = "polled wall / quiet wall - 1 <= 0.05 (each round: the arms' means)"
                secs["polling"].append(sec)
        if "memory" in args.sections:
            log(f"memory: {args.memory_batches} batches of 5 lines")
            samples = []
            for i in range(args.memory_batches):
                srv.batch(files["mem"])
                samples.append({"batch": i + 1, **srv.rss()})
            xs = [s["batch"] for s in samples]
            slope = {k: round(statistics.linear_regression(xs, [s[k] for s in samples]).slope, 3)
                     for k in ("server_mib", "engine_tree_mib")}
            secs["memory"] = {"samples": samples, "slope_mib_per_batch": slope,
                              "first": samples[0], "last": samples[-1]}
            log(f"  slope per batch: {slope}; first {samples[0]}, last {samples[-1]}")
    finally:
        srv.server.stop()
    rep["finished"] = utc_now()
    write_report(rep, args.json, f"serve-{utc_stamp()}.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
