"""Input planning without Beam (transforms/inputs.py, planning.py): files matched as Beam's
filesystems match them, and `quantize` and `tune` planning an input without loading Beam."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tokenmill.transforms import inputs
from tokenmill.transforms.inputs import InputError, expand_input, match


@pytest.fixture(autouse=True)
def _no_earlier_jobs_s3_options(monkeypatch):
    """Planning falls back on the S3 options the last job's preflight set in this process
    (`inputs.use_options`, as Beam's filesystems keep theirs): an earlier test module's job
    would leave its own, now closed, endpoint there; a worker's reads take Beam's (host_model)."""
    from apache_beam.io.filesystems import FileSystems

    monkeypatch.setattr(inputs, "_options", None)
    monkeypatch.setattr(FileSystems, "_pipeline_options", None)

PATTERNS = ["*.parquet", "*", "**", "**.parquet", "a?.parquet", "[ab]*.parquet", "[!a]*.parquet", "sub/",
            "sub/*.parquet", "*/*.parquet", ".hidden.parquet", "a1.parquet", "nothing*.parquet", "no-such-file",
            "sub", "[unclosed"]


@pytest.fixture
def tree(tmp_path):
    for rel in ["a1.parquet", "a2.parquet", "b1.parquet", ".hidden.parquet", "c.txt", "sub/d1.parquet",
                "sub/deeper/e.parquet", "[unclosed"]:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_bytes(b"x")
    return tmp_path


@pytest.mark.parametrize("pattern", PATTERNS)
def test_a_local_pattern_matches_the_files_beams_filesystems_match(tree, pattern):
    from apache_beam.io.filesystems import FileSystems

    full = os.path.join(str(tree), pattern)
    beam = sorted(m.path for m in FileSystems.match([full])[0].metadata_list)
    assert sorted(match(full)) == beam


def test_a_folder_gives_its_own_parquet_files_and_a_path_without_any_one_line(tree):
    assert expand_input(str(tree)) == sorted(str(tree / f) for f in (".hidden.parquet", "a1.parquet", "a2.parquet",
                                                                     "b1.parquet"))
    with pytest.raises(InputError, match="matched no \\*.parquet files"):
        expand_input(str(tree / "sub" / "deeper" / "*.jsonl"))
    with pytest.raises(InputError, match="does not exist"):
        expand_input(str(tree / "nope.parquet"))


def _without_beam(code: str, tmp_path) -> subprocess.CompletedProcess:
    path = tmp_path / "in.parquet"
    pq.write_table(pa.table({"id": [f"r{i}" for i in range(40)], "prompt": [f"p{i}" for i in range(40)]}), path,
                   row_group_size=16)
    prog = textwrap.dedent(code).replace("PATH", repr(str(path))).replace("OUT", repr(str(tmp_path / "out")))
    prog += "\nassert 'apache_beam' not in sys.modules, sorted(m for m in sys.modules if m.startswith('apache_beam'))[:3]\n"
    return subprocess.run([sys.executable, "-c", "import sys\n" + prog], capture_output=True, text=True, timeout=300)


def test_quantize_counts_a_calibration_input_without_loading_beam(tmp_path):
    res = _without_beam("""
        from tokenmill.jobs.modeltools.quantize import count_calibration
        assert count_calibration(PATH) == 40
        """, tmp_path)
    assert res.returncode == 0, res.stderr


def test_tune_draws_its_sample_without_loading_beam(tmp_path):
    res = _without_beam("""
        import types
        from pathlib import Path
        from tokenmill.jobs.modeltools.tune.sample import draw_sample
        spec = types.SimpleNamespace(input=PATH, resolved_input_format=lambda: "parquet")
        path, n = draw_sample(spec, 10, 7, Path(OUT))
        assert n == 10 and path.is_file()
        """, tmp_path)
    assert res.returncode == 0, res.stderr


@pytest.mark.s3
def test_an_s3_pattern_matches_the_objects_beams_filesystems_match(s3, monkeypatch):
    from apache_beam.io.filesystems import FileSystems
    from apache_beam.options.pipeline_options import PipelineOptions

    monkeypatch.setattr(FileSystems, "_pipeline_options", PipelineOptions([]))  # Beam's S3 needs options set
    b = s3.buckets["in"]
    for key in ["p/a1.parquet", "p/a2.parquet", "p/b.jsonl", "p/sub/c.parquet", "pq/d.parquet", "p/.h.parquet"]:
        s3.put_object(Bucket=b, Key=key, Body=b"x")
    for pattern in ["p/*.parquet", "p/**", "p/a?.parquet", "p/[!a]*", "p/", "p/a1.parquet", "p/none*", "p/sub"]:
        url = f"s3://{b}/{pattern}"
        beam = sorted(m.path for m in FileSystems.match([url])[0].metadata_list)
        assert sorted(match(url)) == beam, pattern


@pytest.mark.s3
def test_an_openai_batch_file_on_s3_is_planned_and_read_plain_and_gzipped(s3):
    import gzip
    import json

    from tokenmill.transforms.planning import plan_input
    from tokenmill.transforms.read import read_unit

    lines = [json.dumps({"custom_id": f"q{i}", "method": "POST", "url": "/v1/chat/completions",
                         "body": {"model": "m", "messages": [{"role": "user", "content": f"hi {i}"}]}})
             for i in range(5)]
    text = ("\n".join(lines) + "\n").encode()
    for key, body in (("b/in.jsonl", text), ("g/in.jsonl.gz", gzip.compress(text))):
        s3.put_object(Bucket=s3.buckets["in"], Key=key, Body=body)
        plan = plan_input(f"s3://{s3.buckets['in']}/{key.split('/')[0]}/", "openai-jsonl")
        assert (plan.total_rows, plan.endpoints) == (5, {"/v1/chat/completions": 5})
        rows = [r for u in plan.shards for r in read_unit(u)]
        assert [r["id"] for r in rows] == [f"q{i}" for i in range(5)]
