"""`make bench-replicas` (issue 54): one batch's lines/s on 1, 2 and 3 `tokenmill serve` replicas
over one PostgreSQL database, and what a replica's kill -9 and drain cost in work done twice.

The engine is the sleeping stand-in (bench/standin.py, `--step-s` asleep per step, `--max-num-seqs`
lines a step): it stands in for each replica's GPU, so on a 2-core machine the replicas are bound
by simulated device time, not by the shared cores, as replicas on their own GPUs would be.  The
replicas are tests/serve_replicas.py's (real servers on loopback, the `openai` SDK as the client,
one fresh database per service, dropped after).

- **Scaling**: per round, a service of 1, 2 and 3 replicas (even rounds 1 2 3, odd rounds 3 2 1:
  A B C C B A over two rounds), each started fresh, a warm-up batch of `--warmup` lines through
  it (not counted: engine processes spawned, the tokenizer loaded), then the `--n`-line batch
  created through replica 0.  Per run: lines/s from the batch's creation to its `completed`
  (polled every 0.2 s), units committed per replica, every custom_id once.  Per round: the 2-
  and 3-replica runs' lines/s over the 1-replica run's (targets: ≥ 1.8 and ≥ 2.6).
- **kill -9**: a service of 3 replicas (a warm-up first), the batch; once a replica holds a unit,
  its process group is killed (kill -9) and restarted.  Lines generated twice (the stand-in's logs: a prompt generated more
  than once; every line's prompt is its own) against the lines of the units the killed replica
  held (units × lines per unit; target: at most that), and the product's own `lost_rows`.
- **drain**: then on the same service, another batch; once a replica holds a unit it gets SIGTERM: its exit code,
  seconds (against `--drain-s`), and lines generated twice (target: none).

Every run is reported; nothing is asserted.  Results: bench/results/replicas-<stamp>.json.

    python -m bench.replicas                     # 3,000 lines, 2 rounds, the drills; about 15 min on 2 cores
    python -m bench.replicas --smoke             # 300 fast lines, 1 round, the drills: about 2.5 min
"""

from __future__ import annotations

import argparse
import math
import shutil
import time
from pathlib import Path
from typing import Any

from bench.common import WORK, code_label, log, machine, utc_now, utc_stamp, write_report

ARMS = (1, 2, 3)
TARGETS = {2: 1.8, 3: 2.6}


def _service(root: Path, n: int, db_url: str, args: argparse.Namespace):
    from tests.serve_replicas import MODEL, Replicas, standin_model

    model = standin_model(step_s=args.step_s, max_num_seqs=args.max_num_seqs, max_tokens=args.max_tokens)
    return Replicas(root, n, db_url, {MODEL: model}, lease_s=args.lease_s, drain_s=args.drain_s)


def _batch(reps, n: int, prefix: str, args: argparse.Namespace, i: int | None = 0) -> tuple[str, list[str], float]:
    """Submit an `n`-line batch (through replica `i`): its id, custom_ids, and when it was created."""
    from tests.serve_replicas import lines

    batch = lines(n, prefix, max_tokens=args.max_tokens)
    file_id = reps.upload(batch, f"{prefix}.jsonl", i)
    t0 = time.monotonic()
    return reps.create(file_id, i), [x["custom_id"] for x in batch], t0


def _finish(reps, bid: str, ids: list[str], t0: float, timeout: float) -> dict[str, Any]:
    """Wait for the batch; its wall, lines/s, status, accounting and units per replica."""
    from tests.serve_replicas import accounting

    b = reps.wait(bid, timeout=timeout, every=0.2)
    wall = time.monotonic() - t0
    out, err = reps.outputs(b)
    per_replica: dict[str, int] = {}
    for holder, units in reps.holders(bid).items():
        i = reps.replica_of(holder)
        key = f"replica {i}" if i is not None else f"{holder} (gone)"
        per_replica[key] = per_replica.get(key, 0) + units
    return {"batch": bid, "status": b.status, "wall_s": round(wall, 2), "lines_per_s": round(len(ids) / wall, 1),
            "problems": accounting(b, out, err, ids), "units_done_by": per_replica,
            "lease_state": reps.lease_state(bid)}


def scaling_run(root: Path, n_replicas: int, label: str, args: argparse.Namespace) -> dict[str, Any]:
    from tests.serve_replicas import fresh_database

    shutil.rmtree(root, ignore_errors=True)
    with fresh_database("tm_bench_replicas") as url, _service(root, n_replicas, url, args) as reps:
        warm, wids, w0 = _batch(reps, args.warmup, f"warm-{label}", args)
        warm_run = _finish(reps, warm, wids, w0, args.timeout)
        bid, ids, t0 = _batch(reps, args.n, f"run-{label}", args)
        run = _finish(reps, bid, ids, t0, args.timeout)
    run.update(replicas=n_replicas, warmup_wall_s=warm_run["wall_s"], warmup_problems=warm_run["problems"])
    log(f"{n_replicas} replica(s): {run['lines_per_s']} lines/s ({run['wall_s']} s), units by {run['units_done_by']}"
        + (f"; PROBLEMS {run['problems']}" if run["problems"] else ""))
    return run


def drills(root: Path, args: argparse.Namespace) -> tuple[dict[str, Any], dict[str, Any]]:
    """On one service of 3 replicas after a warm-up: the kill -9 drill, then (the killed replica
    restarted) the drain drill, each on its own batch."""
    from tests.serve_replicas import fresh_database

    shutil.rmtree(root, ignore_errors=True)
    with fresh_database("tm_bench_replicas") as url, _service(root, 3, url, args) as reps:
        warm, wids, w0 = _batch(reps, args.warmup, "warm-drills", args)
        _finish(reps, warm, wids, w0, args.timeout)
        return drill(reps, "kill9", args), drill(reps, "drain", args)


def drill(reps, what: str, args: argparse.Namespace) -> dict[str, Any]:
    """kill -9 (then a restart) or SIGTERM of one of the replicas once it holds a unit of a new batch."""
    from tests.serve_replicas import twice

    before = reps.generations()
    bid, ids, t0 = _batch(reps, args.n, what, args)
    res: dict[str, Any] = {"drill": what}
    k = _holder(reps, bid, res, args.timeout / 4)
    if k is not None:
        victim = reps[k]
        held = [h for h in reps.held(bid) if reps.replica_of(h["holder"]) == k]  # its units in flight now
        res.update(replica=k, units_held=len(held))
        if what == "kill9":
            victim.kill9()
            res["killed_after_s"] = round(time.monotonic() - t0, 2)
            victim.restart()
        else:
            rc, took = victim.term(args.drain_s + 60)
            res.update(exit_code=rc, exit_s=round(took, 2), drain_s=args.drain_s)
    res.update(_finish(reps, bid, ids, t0, args.timeout))
    new = reps.generations() - before
    res["generated"] = sum(new.values())
    res["generated_twice"] = twice(new)
    if k is not None:
        units = max(1, res["lease_state"]["units"])
        res["lines_per_unit"] = math.ceil(len(ids) / units)
        res["in_flight_lines_bound"] = res["units_held"] * res["lines_per_unit"]
    if what == "kill9" and "in_flight_lines_bound" in res:
        ok = res["generated_twice"] <= res["in_flight_lines_bound"]
        res["verdict"] = f"{'PASS' if ok else 'FAIL'} (twice {res['generated_twice']} ≤ {res['in_flight_lines_bound']})"
    elif what == "drain" and "exit_code" in res:
        ok = res["generated_twice"] == 0 and res["exit_code"] == 0 and res["exit_s"] <= args.drain_s
        res["verdict"] = (f"{'PASS' if ok else 'FAIL'} (exit {res['exit_code']} in {res['exit_s']} s of "
                          f"{args.drain_s}; twice {res['generated_twice']})")
    log(f"{what}: {res.get('verdict') or res.get('error')}; {res['lines_per_s']} lines/s"
        + (f"; PROBLEMS {res['problems']}" if res["problems"] else ""))
    return res


def _holder(reps, bid: str, res: dict[str, Any], timeout: float) -> int | None:
    """The first replica seen holding a unit of the batch; None (and why, in `res`) when the
    batch ends first or none holds one within `timeout` (the batch ran without leases)."""
    from tests.serve_replicas import ENDED

    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            return reps.wait_holding(bid, timeout=2)[1]
        except AssertionError as err:
            if reps.retrieve(bid).status in ENDED:
                res["error"] = f"the batch ended before a replica was seen holding a unit: {err}"
                return None
    res["error"] = f"no replica held a unit of the batch within {timeout} s: {reps.lease_state(bid)}"
    return None


def round_ratios(runs: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """Each arm's lines/s over the 1-replica run's in the same round, with its target's verdict."""
    base = runs[1]["lines_per_s"]
    out = {}
    for n, target in TARGETS.items():
        if n in runs and base:
            r = round(runs[n]["lines_per_s"] / base, 3)
            out[f"{n}_over_1"] = {"ratio": r, "target": f"≥ {target}", "pass": r >= target}
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--n", type=int, default=3000, help="lines of the measured batch (default 3000)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=100, help="lines of each service's warm-up batch")
    ap.add_argument("--step-s", type=float, default=0.25, help="the stand-in's seconds asleep per step")
    ap.add_argument("--max-num-seqs", type=int, default=16, help="the stand-in's lines per step")
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--lease-s", type=float, default=5.0)
    ap.add_argument("--drain-s", type=float, default=30.0)
    ap.add_argument("--timeout", type=float, default=900.0, help="the longest one batch may take")
    ap.add_argument("--no-drills", action="store_true", help="the scaling rounds only")
    ap.add_argument("--smoke", action="store_true", help="300 fast lines, 1 round: shows it works (about 2.5 min, mostly replicas starting)")
    ap.add_argument("--json", help="where to write the results (default bench/results/replicas-<stamp>.json)")
    ap.add_argument("--code", help="what code this is (default: HEAD's short hash)")
    args = ap.parse_args(argv)
    if args.smoke:
        args.n, args.rounds, args.warmup, args.step_s, args.timeout = 300, 1, 20, 0.05, 300.0
    for name in ("n", "rounds", "warmup", "max_num_seqs"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")

    root = WORK / "replicas"
    rep: dict[str, Any] = {"benchmark": "replicas", "issue": 54, "started": utc_now(), "code": code_label(args.code),
                           "machine": machine(), "params": {k: v for k, v in vars(args).items() if k != "json"},
                           "rounds": []}
    for r in range(args.rounds):
        order = ARMS if r % 2 == 0 else tuple(reversed(ARMS))
        log(f"round {r + 1}/{args.rounds}: {' '.join(map(str, order))} replicas")
        runs = {n: scaling_run(root / f"r{r}-{n}", n, f"{r}-{n}", args) for n in order}
        rep["rounds"].append({"order": list(order), "runs": [runs[n] for n in order], "ratios": round_ratios(runs)})
        log(f"round {r + 1}: {rep['rounds'][-1]['ratios']}")
    if not args.no_drills:
        rep["kill9"], rep["drain"] = drills(root / "drills", args)
    rep["ended"] = utc_now()
    if args.smoke and not args.json:  # a smoke run's figures are not results
        args.json = str(WORK / f"replicas-smoke-{utc_stamp()}.json")
    write_report(rep, args.json, f"replicas-{utc_stamp()}.json")
    return rep


if __name__ == "__main__":
    main()
