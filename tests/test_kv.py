"""The KV cache sized from the job (transforms/engines/kv.py, cpu.cpu_kv_cache, the worker's
session), the engine core that runs the model itself, and the CLI's exit; the last test
starts a real engine sized for a small chunk and runs a longer one through it."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.fakes import FakeSession
from tokenmill.transforms.engines import cpu, kinds, kv, registry, vllm_engine, vllm_session, worker
from tokenmill.transforms.engines.vllm_config import VllmConfig

SMOL = {"hidden_size": 576, "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64,
        "intermediate_size": 1536, "num_hidden_layers": 30, "vocab_size": 49152, "dtype": "bfloat16"}
BF16_TOKEN = 2 * 30 * 3 * 64 * 2  # 23,040 bytes


@pytest.fixture
def smol_folder(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(SMOL))
    return str(tmp_path)


# ---------------------------------------------------------------- the formula and the job's size


def test_job_tokens_of_each_rows_prompt_plus_max_tokens():
    assert kv.JobTokens.of([10, 300, 40]) == kv.JobTokens(max_seq_tokens=300, total_seq_tokens=350, rows=3)
    assert kv.JobTokens.of([]) == kv.JobTokens(0, 0)


def test_the_job_is_held_with_headroom_in_whole_blocks_plus_the_null_block():
    job = kv.JobTokens(max_seq_tokens=491, total_seq_tokens=46169, rows=240)  # the demo's 240 rows
    s = kv.size_for_job(job, per_token=BF16_TOKEN, block_size=128, max_num_seqs=256, max_model_len=2048)
    # every row at once: its 361 blocks of tokens plus a partial block each (240 × 4 blocks is more)
    assert job.held_blocks(256, 2048, 128) == min(240 * 4, 361 + 240) == 601
    blocks = -(-601 * 5 // 4) + 1  # ⌈601 × 1.25⌉ = 752, and the null block
    assert (s.source, s.wanted_tokens, s.tokens) == ("job", 46169, blocks * 128) == ("job", 46169, 96384)
    assert s.bytes == 96384 * BF16_TOKEN


def test_short_rows_get_a_whole_block_each_so_max_num_seqs_of_them_fit():
    """73-token rows on 128-token CPU blocks: counted in tokens (32 × 73 × 1.25) the cache had 23
    usable blocks, so 23 of the 32 sequences ran at once; in blocks every one fits."""
    job = kv.JobTokens(max_seq_tokens=73, total_seq_tokens=144890, rows=2000)
    s = kv.size_for_job(job, per_token=46080, block_size=128, max_num_seqs=32, max_model_len=1024)
    assert job.held_blocks(32, 1024, 128) == 32 and s.tokens // 128 - 1 >= 32
    assert kv.JobTokens(73, 146).held_blocks(32, 1024, 128) == 32  # rows not known: taken as many
    assert kv.JobTokens(73, 146, rows=2).held_blocks(32, 1024, 128) == 2


def test_at_most_max_num_seqs_of_the_longest_row_are_held_at_once():
    job = kv.JobTokens(max_seq_tokens=3000, total_seq_tokens=1_000_000)
    s = kv.size_for_job(job, per_token=100, block_size=16, max_num_seqs=8, max_model_len=2048, headroom=1.0)
    assert s.wanted_tokens == 8 * 2048  # the longest row counts at most max_model_len
    assert s.tokens == 8 * 2048 + 16


def test_never_below_one_max_model_len_sequence():
    s = kv.size_for_job(kv.JobTokens(40, 80, rows=2), per_token=100, block_size=128, max_num_seqs=16,
                        max_model_len=512)
    assert s.source == "floor" and s.tokens == s.floor_tokens == 5 * 128 and s.bytes == 640 * 100


def test_never_above_the_ceiling():
    job = kv.JobTokens(2048, 10_000_000)
    s = kv.size_for_job(job, per_token=100, block_size=128, max_num_seqs=256, max_model_len=2048,
                        ceiling_bytes=10_000_000)
    assert s.source == "ceiling" and s.bytes == 10_000_000 and s.tokens == 99_968


def test_bad_sizes_are_one_line_errors():
    with pytest.raises(kv.KvError, match="unknown kv_cache_dtype 'int3'"):
        kv.elem_bytes("int3", "kv_cache_dtype")
    with pytest.raises(kv.KvError, match="lacks 'num_hidden_layers'"):
        kv.attention_shape({"hidden_size": 8})


# ---------------------------------------------------------------- what a CPU engine starts with


def test_the_jobs_own_kv_cache_memory_bytes_wins(smol_folder):
    cfg = VllmConfig(kv_cache_memory_bytes=1 << 30)
    assert cpu.cpu_kv_cache(cfg, smol_folder, "bfloat16", job_tokens=kv.JobTokens(10, 10), workers=3)[0] == 1 << 30


def test_without_the_work_the_default_stays(smol_folder):
    cfg = VllmConfig(gpu_memory_utilization=0.5)
    assert cpu.cpu_kv_cache(cfg, smol_folder, "bfloat16")[0] is None  # vLLM sizes one engine itself
    n, why = cpu.cpu_kv_cache(cfg, smol_folder, "bfloat16", workers=2, total_memory_bytes=8 << 30)
    assert n == 2 << 30 == cpu.kv_share_bytes(cfg, 2, 8 << 30) and why["source"] == "share"  # half of 0.5 × 8 GiB
    assert cpu.kv_share_bytes(VllmConfig(gpu_memory_utilization=0.4), 2, 10 << 30) == int((10 << 30) * 0.4 / 2)
    assert cpu.kv_share_bytes(VllmConfig(gpu_memory_utilization=0.01), 8, 1 << 30) == 64 << 20  # never below 64 MiB


def test_the_work_sizes_the_cache_in_the_engines_dtype_and_blocks(smol_folder):
    job = kv.JobTokens(max_seq_tokens=491, total_seq_tokens=46169, rows=240)
    n, why = cpu.cpu_kv_cache(VllmConfig(), smol_folder, "bfloat16", job_tokens=job, total_memory_bytes=24 << 30)
    assert n == 96384 * BF16_TOKEN and why["source"] == "job" and why["kv_bytes_per_token"] == BF16_TOKEN
    assert why["job_tokens"] == {"max_seq_tokens": 491, "total_seq_tokens": 46169, "rows": 240}
    n32, _ = cpu.cpu_kv_cache(VllmConfig(), smol_folder, "float32", job_tokens=job, total_memory_bytes=24 << 30)
    n8, _ = cpu.cpu_kv_cache(VllmConfig(kv_cache_dtype="fp8"), smol_folder, "float32", job_tokens=job,
                             total_memory_bytes=24 << 30)
    assert n32 == 2 * n and n8 == n // 2
    n512, _ = cpu.cpu_kv_cache(VllmConfig(block_size=16), smol_folder, "bfloat16", job_tokens=job,
                               total_memory_bytes=24 << 30)
    # the job's own block size: min(240 × 31, 2886 + 240) = 3126 blocks of 16 × 1.25, and the null block
    assert n512 == (-(-3126 * 5 // 4) + 1) * 16 * BF16_TOKEN


def test_a_job_wanting_more_than_the_share_keeps_the_default(smol_folder):
    big = kv.JobTokens(max_seq_tokens=2048, total_seq_tokens=10_000_000)
    n, why = cpu.cpu_kv_cache(VllmConfig(), smol_folder, "bfloat16", job_tokens=big, total_memory_bytes=4 << 30)
    assert n is None and why["source"] == "vllm" and why["job"]["source"] == "ceiling"
    n, why = cpu.cpu_kv_cache(VllmConfig(), smol_folder, "bfloat16", job_tokens=big, workers=2,
                              total_memory_bytes=4 << 30)
    assert n == 1 << 30 and why["source"] == "share"


# ---------------------------------------------------------------- the worker hands the work to a new engine


class Started(FakeSession):
    """The default factory in these tests: records what it was started for."""

    def __init__(self, cfg=None, model_path="", *, job_tokens=None, workers=1):
        super().__init__(cfg, model_path)
        self.job_tokens, self.workers = job_tokens, workers


@pytest.fixture
def default_is_started(monkeypatch):
    monkeypatch.setattr(registry, "_SESSIONS", {})
    monkeypatch.setattr(vllm_session, "VllmSession", Started)
    monkeypatch.setattr(vllm_engine.ENGINE, "job_tokens", {})
    monkeypatch.setattr(vllm_engine.ENGINE, "shared_cpu", {})
    monkeypatch.setattr(vllm_engine, "claim_cpu_slot", lambda n, group: (0, [0]))
    monkeypatch.setattr(vllm_engine, "has_nvidia_gpu", lambda: False)


def test_an_engine_is_started_for_the_first_work_and_reused_for_later_work(default_is_started):
    cfg, first, later = VllmConfig(), kv.JobTokens(100, 1000), kv.JobTokens(900, 9000)
    s = worker.worker_session(cfg, "/m", group="run", job_tokens=first)
    assert (s.job_tokens, s.workers) == (first, 1)
    assert worker.worker_session(cfg, "/m", group="run", job_tokens=later) is s  # vLLM queues what does not fit
    assert worker.worker_session(cfg, "/m", group="run") is s
    s2 = worker.worker_session(cfg, "/m", group="run", restart=True)  # a restart names no work
    assert s.shut and s2.job_tokens == later
    s3 = worker.worker_session(cfg, "/m", workers=2, group="two", job_tokens=first, restart=True)
    assert (s3.job_tokens, s3.workers) == (first, 2)


def test_a_new_job_run_whose_work_outgrew_the_engine_starts_it_again_sized_for_that_work(default_is_started):
    """A process that runs job after job (`tokenmill serve`, run-pending): an engine sized for a
    small job is started again for a larger one, and kept for a smaller one after it."""
    cfg = VllmConfig(max_num_seqs=8, max_model_len=512)
    small, large, smaller = kv.JobTokens(40, 80), kv.JobTokens(100, 5000), kv.JobTokens(50, 300)
    s = worker.worker_session(cfg, "/m", group="job-a", job_tokens=small)
    big = worker.worker_session(cfg, "/m", group="job-b", job_tokens=large)
    assert big is not s and s.shut and big.job_tokens == large
    assert worker.worker_session(cfg, "/m", group="job-c", job_tokens=smaller) is big  # it fits: no restart
    sized = VllmConfig(max_num_seqs=8, max_model_len=512, kv_cache_memory_bytes=1 << 20)
    held = worker.worker_session(sized, "/m", group="job-d", job_tokens=small)
    assert worker.worker_session(sized, "/m", group="job-e", job_tokens=large) is held  # the config sized it
    # what "holds more" means: every row, or max_num_seqs of the longest (at most max_model_len), the lesser
    assert large.held_at_once(8, 512) == 800 and kv.JobTokens(900, 9000).held_at_once(8, 512) == 4096
    assert vllm_engine.ENGINE.outgrown(cfg, {}, large) is False  # no work named: the default share


def test_an_engine_sized_for_its_capacity_is_never_started_again_for_a_larger_job(default_is_started):
    """`kv_cache_sized_for: capacity` (a server's warm engine): sized for max_num_seqs sequences of
    max_model_len whatever its first job brings, so a larger job later runs on it as it is."""
    from tokenmill.jobs.serve.config import ServeConfig

    cfg = VllmConfig(max_num_seqs=8, max_model_len=512, kv_cache_sized_for="capacity")
    s = worker.worker_session(cfg, "/m", group="job-a", job_tokens=kv.JobTokens(40, 80))
    assert s.job_tokens == kv.JobTokens(512, 8 * 512, rows=8)
    assert worker.worker_session(cfg, "/m", group="job-b", job_tokens=kv.JobTokens(512, 100_000)) is s and not s.shut
    # a served model's engine is sized so unless its config says otherwise
    served = ServeConfig.model_validate({}).job_spec("smollm2-135m", input="x.jsonl", output="o", job_id="j")
    assert served.engine.kv_cache_sized_for == "capacity"
    own = ServeConfig.model_validate({"models": {"m": {"engine": {"kv_cache_sized_for": "job"}}}})
    assert own.job_spec("m", input="x.jsonl", output="o", job_id="j").engine.kv_cache_sized_for == "job"
    assert VllmConfig().kv_cache_sized_for == "job"  # a one-shot job: sized for its own work


def test_other_factories_get_the_config_alone(default_is_started):
    s = worker.worker_session(VllmConfig(), "/m", FakeSession, workers=2, group="g", job_tokens=kv.JobTokens(1, 1))
    assert type(s) is FakeSession and vllm_engine.ENGINE.job_tokens == {}


# ---------------------------------------------------------------- the engine core runs the model itself


@pytest.mark.parametrize("bind,preload,expected", [
    ("0-1", "/lib/libtcmalloc.so.4:/venv/lib/libiomp5.so",
     {"OMP_NUM_THREADS": "2", "KMP_AFFINITY": "granularity=fine,explicit,proclist=[0,1]", "KMP_BLOCKTIME": "5",
      "KMP_TPAUSE": "0"}),
    ("2,3", "/usr/lib/libgomp.so.1", {"OMP_NUM_THREADS": "2", "GOMP_CPU_AFFINITY": "2 3"}),
    ("5", "", {"OMP_NUM_THREADS": "1", "OMP_PLACES": "{5}", "OMP_PROC_BIND": "true"}),
    ("auto", "", None), ("nobind", "", None), ("0-1|2-3", "", None), ("x", "", None),
])
def test_the_engine_cores_openmp_environment_is_what_vllm_gives_its_one_worker(monkeypatch, bind, preload, expected):
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", bind)
    monkeypatch.setenv("LD_PRELOAD", preload)
    assert cpu.single_process_omp_env() == expected


def test_a_chosen_executor_or_an_in_process_engine_core_keeps_vllms_executor(monkeypatch):
    from tokenmill.transforms.engines import vllm_session as V

    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0")
    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING", raising=False)
    assert V._single_process_env({}) == cpu.single_process_omp_env() != None  # noqa: E711
    assert V._single_process_env({"distributed_executor_backend": "mp"}) is None
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    assert V._single_process_env({}) is None


def test_an_engine_core_process_on_cpu_gets_an_executor_that_exits_with_its_owner(monkeypatch):
    from tokenmill.transforms.engines import vllm_session as V
    from tokenmill.transforms.engines.executors import OwnedMultiprocExecutor, OwnedUniProcExecutor

    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING", raising=False)
    omp = {"OMP_NUM_THREADS": "1"}
    assert V._owned_executor({}, omp, on_gpu=False) is OwnedUniProcExecutor
    assert V._owned_executor({}, None, on_gpu=False) is OwnedMultiprocExecutor
    # the job's executor, an engine core inside its owner: left alone (on a GPU: tests/test_gpu_engine.py)
    assert V._owned_executor({"distributed_executor_backend": "mp"}, None, on_gpu=False) is None
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    assert V._owned_executor({}, omp, on_gpu=False) is None


# ---------------------------------------------------------------- the CLI's exit


def test_the_cli_exits_with_the_commands_status_and_its_output_flushed(tmp_path):
    def run(*args):
        return subprocess.run([sys.executable, "-m", "tokenmill.jobs.cli", *args], capture_output=True, text=True,
                              timeout=120)

    ok = run("--version")
    assert ok.returncode == 0 and ok.stdout.startswith("tokenmill, version")
    missing = run("status", "no-such-job", "--db", f"sqlite:///{tmp_path / 'x.db'}")
    assert missing.returncode == 1 and "no job with id 'no-such-job'" in missing.stderr
    usage = run("run", "--no-such-flag")
    assert usage.returncode == 2 and "no such option" in usage.stderr.lower()


# ---------------------------------------------------------------- a real engine


@pytest.mark.engine
@pytest.mark.cpu_only
def test_an_engine_sized_for_a_small_first_chunk_runs_a_later_longer_one(model_path, monkeypatch):
    """The cache holds one 512-token sequence (the floor); three 400-token sequences
    still finish through it, one or two at a time."""
    monkeypatch.setattr(registry, "_SESSIONS", {})  # the suite's shared engine stays as it is
    monkeypatch.setattr(kinds.engine_of("vllm"), "job_tokens", {})
    cfg = VllmConfig(max_num_seqs=8, max_model_len=512)
    s = worker.worker_session(cfg, model_path, group="kv-small-first", job_tokens=kv.JobTokens(40, 80, rows=2))
    try:
        info = s.info()
        assert info["kv_sizing"]["source"] == "floor"
        assert info["kv_cache_tokens"] == info["kv_sizing"]["tokens"] == 5 * info["block_size"] == 640
        assert info["executor"] == "uni" and info["engine_kwargs"]["kv_cache_memory_bytes"] == 640 * info["kv_bytes_per_token"]
        later = kv.JobTokens(max_seq_tokens=420, total_seq_tokens=8 * 420)
        assert worker.worker_session(cfg, model_path, group="kv-small-first", job_tokens=later) is s
        for i in range(3):
            ids = [100 + (i * 7919 + j * 31) % 40000 for j in range(360)]  # no shared prefix
            s.add(f"long-{i}", ids, {"max_tokens": 40, "ignore_eos": True, "temperature": 0.0})
        done = {}
        for _ in range(100_000):
            done.update({f.request_id: f for f in s.step()})
            if not s.num_unfinished():
                break
        assert sorted(done) == [f"long-{i}" for i in range(3)]
        assert all(f.output_tokens == 40 and f.prompt_tokens == 360 for f in done.values())
    finally:
        registry.shutdown_all()
