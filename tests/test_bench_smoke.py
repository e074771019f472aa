"""The throughput benchmark's pure parts: seeded workloads, A B B A order, the
shared-token share, CLI flags for the subprocess arms, the docs section."""

import pyarrow.parquet as pq

from bench import arms as A
from bench import throughput as T
from bench import workloads as W


def test_workloads_are_reproducible_and_shaped_as_described(tmp_path):
    a1 = W.chat(tmp_path / "a1.parquet", 50, seed=7)
    a2 = W.chat(tmp_path / "a2.parquet", 50, seed=7)
    assert pq.read_table(a1.path).equals(pq.read_table(a2.path))
    b = W.shared_prefix(tmp_path / "b.parquet", docs=5, questions=3)
    ids = pq.read_table(b.path).column("id").to_pylist()
    assert b.rows == 15 and sorted(ids) != ids  # shuffled in the file
    c = W.long_output(tmp_path / "c.parquet", 20, min_out=10, max_out=30)
    mts = pq.read_table(c.path).column("max_tokens").to_pylist()
    assert all(10 <= m <= 30 for m in mts) and len(set(mts)) > 1


def test_abba_order_repeats_arms_mirrored():
    assert T.abba(["raw", "tm"], 2) == ["raw", "tm", "tm", "raw"]
    assert T.abba(["a", "b", "c"], 1) == ["a", "b", "c"]


def test_shared_token_share_counts_whole_blocks_after_the_first_prompt():
    doc = list(range(300))  # two whole 128-blocks shared
    rows = [{"id": "b0-0", "token_ids": doc + [1]}, {"id": "b0-1", "token_ids": doc + [2]},
            {"id": "b1-0", "token_ids": [9] * 100}]
    assert T.shared_token_share(rows, 128) == 256 / (301 + 301 + 100)


def test_server_args_turn_engine_kwargs_into_vllm_flags():
    flags = A.server_args({"model": "m", "dtype": "float32", "enforce_eager": True, "enable_prefix_caching": False,
                           "quantization": None, "max_num_seqs": 8, "disable_log_stats": False})
    assert flags == ["--dtype", "float32", "--enforce-eager", "--no-enable-prefix-caching", "--max-num-seqs", "8"]


def test_docs_section_replaces_only_the_throughput_heading(tmp_path):
    doc = tmp_path / "B.md"
    doc.write_text("# Benchmarks\n\n## Demo\nkeep\n\n## Throughput\nold\n\n## Load\nkeep too\n")
    T.write_docs("## Throughput\nnew\n", doc)
    text = doc.read_text()
    assert "new" in text and "old" not in text and "keep\n" in text and "## Load\nkeep too" in text
