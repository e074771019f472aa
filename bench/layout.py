"""One row group against 8,192-row groups: the same N rows, side by side in one run.

The scale check's N chat rows (ids, bad rows and duplicate ids; the tiny
random-weights model, one DirectRunner worker, `--max-tokens 4`) written twice:
one Parquet file of one row group, and one of 8,192-row groups.  A short warm-up
job first (not counted), then `--reps` rounds of both layouts, the order
alternating (A B, B A, ...).  Every run is reported: rows/s over the job wall less
model load, peak RSS by process kind, the bytes the workers read of the file
(the job's `input.bytes_read`, counted where every Parquet read opens its file)
against the file's size, and every id exactly once; then, per round, one group ÷
small groups for rows/s and each process's peak RSS.  Not a timed test: a program
whose figures go to docs/BENCHMARKS.md.

`--s3`: both files are also uploaded to a real S3 endpoint on loopback (moto's server
in this process, bench/s3_server.py), and each round then runs both layouts again from
`s3://` input (the same order; the AWS endpoint and test credentials in the environment
of those runs only).  For those runs two counts against the file's size: the job's
`input.bytes_read` (what pyarrow read through the filesystem layer) and the body bytes
the S3 server sent in answer to GetObject requests on the file, from the job's start
to its end (the launcher's planning reads of the footer included).

    python -m bench.layout --n 200000 --reps 2 [--s3]
"""

from __future__ import annotations

import argparse
import json
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from bench.common import code_label, write_report
from bench.scale import ONE_WORKER, WORK, Leg, leg_report, make_input, tokenmill_run

LAYOUTS = {"one-group": None, "groups-8192": 8192}
#: The bucket the layouts go to with `--s3` (key: `<layout>/input.parquet`).
BUCKET = "tokenmill-layout"


def write_layouts(inp: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The input's rows as one file per layout (cached beside the input)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.concat_tables(pq.read_table(p) for p in sorted(Path(inp["path"]).glob("*.parquet")))
    out = {}
    for name, group in LAYOUTS.items():
        folder = Path(inp["path"]) / "layouts" / name
        path = folder / "input.parquet"
        if not path.is_file():
            folder.mkdir(parents=True, exist_ok=True)
            pq.write_table(table, path, row_group_size=group or table.num_rows)
        meta = pq.ParquetFile(path).metadata
        out[name] = {**inp, "path": str(path), "bytes": path.stat().st_size, "row_groups": meta.num_row_groups}
    return out


def _input_read(leg: Leg) -> dict[str, Any]:
    from tokenmill.schemas import storage as S

    job = S.JobStore(S.connect(leg.db_url)).get(leg.job_id) or {}
    return (job.get("metrics") or {}).get("input") or {}


def _run(name: str, inp: dict[str, Any], model: str, folder: Path) -> dict[str, Any]:
    leg = tokenmill_run(Leg(name, inp["rows"], ONE_WORKER, f"layout-{name}", folder / name, model), inp)
    rep = leg_report(leg, inp)
    read = _input_read(leg)
    keep = ("name", "exit_code", "status", "wall_s", "model_load_s", "rows_per_s", "peak_rss_mib_by_kind")
    out = {k: rep[k] for k in keep}
    out["accounting_ok"] = rep["accounting"].get("ok")
    out["bytes_read"] = read.get("bytes_read")
    out["file_bytes"] = inp["bytes"]
    out["bytes_read_per_file_byte"] = round(read["bytes_read"] / inp["bytes"], 3) if read.get("bytes_read") else None
    return out


def run_one(name: str, inp: dict[str, Any], model: str, folder: Path) -> dict[str, Any]:
    out = _run(name, inp, model, folder)
    print(f"{name}: {out['wall_s']} s, {out['rows_per_s']} rows/s, read {out['bytes_read_per_file_byte']}× the file, "
          f"peak RSS {out['peak_rss_mib_by_kind']} MiB, every id once: {out['accounting_ok']}", flush=True)
    return out


def run_one_s3(name: str, inp: dict[str, Any], model: str, folder: Path, s3) -> dict[str, Any]:
    """One layout from its s3:// copy (`inp["path"]`): the local run's record, plus what the
    S3 server sent of the file while the job ran."""
    s3.take()  # nothing before this job counts
    with s3.env():
        out = _run(name, inp, model, folder)
    got = s3.take()
    out.update({"input": inp["path"], "s3_get_requests": got["get_requests"], "s3_bytes_sent": got["bytes_sent"],
                "s3_bytes_sent_per_file_byte": round(got["bytes_sent"] / inp["bytes"], 3),
                "s3_bytes_asked": got["bytes_asked"],
                "s3_bytes_asked_per_file_byte": round(got["bytes_asked"] / inp["bytes"], 3),
                "s3_answers_cut_off": got["answers_cut_off"], "s3_ranges": got["ranges"]})
    print(f"{name}: {out['wall_s']} s, {out['rows_per_s']} rows/s, read {out['bytes_read_per_file_byte']}× the file "
          f"(filesystem layer), S3 server sent {out['s3_bytes_sent_per_file_byte']}× the file in "
          f"{out['s3_get_requests']} GETs ({out['s3_answers_cut_off']} cut off, "
          f"{out['s3_bytes_asked_per_file_byte']}× asked), peak RSS {out['peak_rss_mib_by_kind']} MiB, "
          f"every id once: {out['accounting_ok']}", flush=True)
    return out


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a and b else None


def main(argv=None) -> int:
    from bench.tinymodel import tiny_model

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=200000)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--warmup-rows", type=int, default=2000)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--json", default=None)
    ap.add_argument("--code", default=None, help="what code ran, when PYTHONPATH points at another tree's tokenmill")
    ap.add_argument("--s3", action="store_true", help="each round also runs both layouts from s3:// input on a "
                    "loopback S3 server (moto), counting the bytes it sends")
    args = ap.parse_args(argv)
    model = str(tiny_model(args.model))
    stamp = time.strftime("%Y%m%dT%H%M%S")
    folder = WORK / "layout" / stamp
    layouts = write_layouts(make_input(args.n))
    warm = write_layouts(make_input(args.warmup_rows))["one-group"]
    with _s3_server(args.s3) as s3:
        on_s3 = {name: {**inp, "path": s3.put_file(BUCKET, f"{name}/input.parquet", inp["path"])}
                 for name, inp in layouts.items()} if s3 else {}
        run_one("warmup", warm, model, folder)
        runs, rounds = [], []
        names = list(LAYOUTS)
        for r in range(args.reps):
            order = names if r % 2 == 0 else names[::-1]
            got = {name: run_one(f"{name}-{r}", layouts[name], model, folder) for name in order}
            runs += [got[name] for name in order]
            rounds.append({"round": r, "order": order, **_one_over_small(got)})
            if s3:
                got = {name: run_one_s3(f"s3-{name}-{r}", on_s3[name], model, folder, s3) for name in order}
                runs += [got[name] for name in order]
                rounds[-1]["s3"] = {**_one_over_small(got), "bytes_per_file_byte": {name: {
                    "filesystem_layer": got[name]["bytes_read_per_file_byte"],
                    "s3_server_sent": got[name]["s3_bytes_sent_per_file_byte"]} for name in order}}
    rep = {
        "n": args.n, "reps": args.reps, "stamp": stamp,
        "code": code_label(args.code),
        "layouts": {k: {"bytes": v["bytes"], "row_groups": v["row_groups"]} for k, v in layouts.items()},
        "runs": runs, "rounds": rounds,
    }
    if s3:
        from importlib.metadata import version

        rep["s3"] = {"server": f"moto {version('moto')} server on loopback (bench/s3_server.py)",
                     "inputs": {k: v["path"] for k, v in on_s3.items()}}
    print(json.dumps(rounds, indent=1))
    write_report(rep, args.json, f"layout-{stamp}.json")
    return 0


def _one_over_small(got: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """One group ÷ 8,192-row groups: rows/s and each process kind's peak RSS."""
    one, small = got["one-group"], got["groups-8192"]
    kinds = sorted(set(one["peak_rss_mib_by_kind"]) | set(small["peak_rss_mib_by_kind"]))
    return {"rows_per_s_one_over_small": _ratio(one["rows_per_s"], small["rows_per_s"]),
            "peak_rss_one_over_small": {k: _ratio(one["peak_rss_mib_by_kind"].get(k),
                                                  small["peak_rss_mib_by_kind"].get(k)) for k in kinds}}


@contextmanager
def _s3_server(wanted: bool) -> Iterator[Any]:
    """The loopback S3 server for `--s3` (stopped afterwards), else None."""
    if not wanted:
        yield None
        return
    from bench.s3_server import CountingS3

    with CountingS3() as s3:
        yield s3


if __name__ == "__main__":
    raise SystemExit(main())
