"""What a rerun costs: a finished job run again, and a 90%-done job run again.

One `tokenmill run` of N chat rows (the scale check's input, with its id column,
bad rows and duplicate ids; the tiny random-weights model, one DirectRunner
worker), then the same job id again (finished: nothing to generate), then again
after deleting the outputs of every tenth input row (90% done).  Prints each
run's wall, the rerun walls as a share of the first, and how many rows each
rerun generated; writes bench/results/rerun-<stamp>.json.  Not a timed test:
a program whose figures go to docs/BENCHMARKS.md.

    python -m bench.rerun --n 20000
"""

from __future__ import annotations

import argparse
import json
import time

from bench.common import code_label, write_report
from bench.scale import ONE_WORKER, WORK, Leg, done_rows, make_input, peaks_by_kind, tokenmill_run


def drop_every_tenth(db_url: str, job_id: str) -> int:
    from sqlalchemy import delete

    from tokenmill.schemas import storage as S
    from tokenmill.schemas import tables as T

    with S.connect(db_url).begin() as c:
        o = T.outputs.c
        return c.execute(delete(T.outputs).where(o.job_id == job_id, o.input_row % 10 == 0)).rowcount


def main(argv=None) -> int:
    from bench.tinymodel import tiny_model

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=20000)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--json", default=None)
    ap.add_argument("--code", default=None, help="what code ran, when PYTHONPATH points at another tree's tokenmill")
    args = ap.parse_args(argv)
    model = str(tiny_model(args.model))
    inp = make_input(args.n)
    stamp = time.strftime("%Y%m%dT%H%M%S")
    folder = WORK / "rerun" / stamp
    job = f"rerun-{args.n}"
    legs, rows = [], {}
    for name in ("first", "rerun-finished", "rerun-90"):
        if name == "rerun-90":
            rows["deleted"] = drop_every_tenth(f"sqlite:///{folder / 'jobs.db'}", job)
        leg = tokenmill_run(Leg(name, args.n, ONE_WORKER, job, folder, model), inp)
        rows[name] = done_rows(leg.db_url, job)
        legs.append({"leg": name, "wall_s": round(leg.wall_s, 1), "exit_code": leg.exit_code,
                     "rows_done_after": rows[name], "peak_rss_mib": peaks_by_kind(leg.sampler)})
        print(f"{name}: {leg.wall_s:.1f} s, exit {leg.exit_code}, rows done {rows[name]:,}", flush=True)
    first = legs[0]["wall_s"]
    rep = {
        "n": args.n, "code": code_label(args.code),
        "legs": legs, "deleted_outputs": rows["deleted"],
        "finished_share": round(legs[1]["wall_s"] / first, 3), "ninety_share": round(legs[2]["wall_s"] / first, 3),
    }
    print(json.dumps(rep, indent=1))
    write_report(rep, args.json, f"rerun-{stamp}.json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
