"""A B B A of `tokenmill run` on one JSONL file: A = code at 1159aa0 (KV sized by tokens),
B = 3806bf8 (whole blocks per sequence). Same engine config as bench/serve.py."""
import json, os, subprocess, sys, time
sys.path.insert(0, "/tmp/bt_serve2")
from bench.serve import lines_file, ENGINE
from pathlib import Path
root = Path("/tmp/kvab"); n = int(sys.argv[1]); rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 1
inp = lines_file(root / f"l{n}.jsonl", n, 32, "k")
trees = {"A": ("/tmp/ns_serve:/tmp/bt_serve", "/tmp/bt_serve"), "B": ("/tmp/ns_serve2:/tmp/bt_serve2", "/tmp/bt_serve2")}
py = "/work/main/.venv/bin/python"
out = []
def one(arm):
    pp, cwd = trees[arm]
    job = f"kv-{arm}-{time.time_ns()}"
    db = f"sqlite:///{root / (arm + '.db')}"
    cmd = [py, "-m", "tokenmill.jobs.cli", "run", "--input", str(inp), "--output", str(root / job), "--db", db,
           "--job-id", job, "--json", "--dtype", "float32", "--max-num-seqs", str(ENGINE["max_num_seqs"]),
           "--max-model-len", str(ENGINE["max_model_len"]), "--gpu-memory-utilization", str(ENGINE["gpu_memory_utilization"])]
    env = dict(os.environ, PYTHONPATH=pp)
    t0 = time.monotonic(); p = subprocess.run(cmd, capture_output=True, text=True, cwd=cwd, env=env); wall = time.monotonic() - t0
    assert p.returncode == 0, p.stderr[-2000:]
    s = json.loads(p.stdout)
    kv = subprocess.run(["sqlite3", str(root / (arm + ".db")), f"select json_extract(engine_info,'$.kv_sizing.tokens') from workers where job_id='{job}'"], capture_output=True, text=True).stdout.strip()
    r = {"arm": arm, "wall_s": round(wall, 2), "generation_wall_s": round(s.get("generation_wall_s") or 0, 2), "rows": s["rows_in"], "kv_tokens": kv}
    print(time.strftime("%H:%M:%S"), r, flush=True); out.append(r)
one("A")  # warm-up, not counted
out.clear()
for r in range(rounds):
    for arm in (("A", "B", "B", "A") if r % 2 == 0 else ("B", "A", "A", "B")):
        one(arm)
json.dump(out, open(root / f"kvab-{n}.json", "w"), indent=1)
