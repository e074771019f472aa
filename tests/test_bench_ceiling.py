"""The pipeline-ceiling benchmark's two sides on a few rows (bench/ceiling.py): the stand-in
engine reaches only the processes the benchmark starts, and a stand-in job and the plain loop
do the same work (every id answered once, the same prompt tokens counted)."""

from __future__ import annotations

import subprocess
import sys

from bench import ceiling, plain_loop, standin
from bench.common import ROOT
from tests.helpers import job_spec
from tokenmill.schemas.models import resolve_model
from tokenmill.transforms.engines import kinds

KINDS = "from tokenmill.transforms.engines.kinds import kinds; print(','.join(kinds()))"


def test_the_standin_engine_is_an_entry_point_only_of_processes_started_with_the_bench_environment(tmp_path):
    env = standin.plugin_env(tmp_path, ROOT)
    seen = subprocess.run([sys.executable, "-c", KINDS], env=env, capture_output=True, text=True, check=True, cwd=tmp_path)
    assert "standin" in seen.stdout.split(",")
    plain = subprocess.run([sys.executable, "-c", KINDS], capture_output=True, text=True, check=True, cwd=tmp_path)
    assert "standin" not in plain.stdout.split(",")


def test_a_standin_job_and_the_plain_loop_answer_every_id_once_with_the_same_prompt_tokens(tmp_path, sqlite_url):
    from tokenmill.jobs.lifecycle.runner import run_job

    n = 200
    inp = ceiling.make_input(n, root=tmp_path)
    loop = plain_loop.run(str(inp), tmp_path / "plain", str(resolve_model("smollm2-135m", need_weights=False)), 4)
    assert ceiling.outputs_check(tmp_path / "plain" / "outputs.parquet", n, sqlite=tmp_path / "plain" / "outputs.db")["ok"]

    kinds.register(standin.ENGINE)
    try:
        res = run_job(job_spec(inp, tmp_path / "out", engine={"kind": "standin"}, sampling={"max_tokens": 4}),
                      db_url=sqlite_url)
    finally:
        kinds.unregister(standin.KIND)
    assert (res.status, res.succeeded, res.failed) == ("succeeded", n, 0)
    check = ceiling.outputs_check(tmp_path / "out" / "outputs.parquet", n, tmp_path / "out" / "dead_letters.parquet")
    assert check["ok"], check
    assert res.metrics["tokens"]["prompt"] == loop["prompt_tokens"] and res.metrics["tokens"]["output"] == 4 * n


def test_a_rounds_ratios_compare_cpu_a_row_and_auto_against_the_faster_arm_with_each_targets_direction():
    def arm(rows_per_s, cpu_ms):
        return {"rows_per_s": rows_per_s, "cpu_ms_per_row": cpu_ms}

    got = ceiling.round_ratios({"tokenmill-1": arm(4000, 0.40), "plain": arm(4800, 0.21),
                                "tokenmill-2": arm(3600, 0.48), "tokenmill-auto": arm(3900, 0.41)})
    assert got == {"tokenmill_1_over_plain": 0.833, "tokenmill_2_over_tokenmill_1": 0.9,
                   "tokenmill_2_cpu_per_row_over_tokenmill_1": 1.2, "tokenmill_auto_over_faster": 0.975,
                   "tokenmill_2_window_cpu_per_row_over_tokenmill_1": None}
    two = ceiling.round_ratios({"tokenmill-1": arm(4000, 0.40), "tokenmill-2": arm(4200, 0.42)})
    summary = ceiling.summarize([got, two], ceiling.DEFAULT_N)
    assert summary["tokenmill_2_cpu_per_row_over_tokenmill_1"]["verdict"].startswith("not resolved")  # 1.2, 1.05
    assert summary["tokenmill_2_cpu_per_row_over_tokenmill_1"]["target"] == "≤ 1.1"
    assert ceiling.summarize([two], ceiling.DEFAULT_N)["tokenmill_2_cpu_per_row_over_tokenmill_1"]["verdict"] == \
        "met (one round)"
    assert summary["tokenmill_1_over_plain"]["verdict"] == "met (one round)"
