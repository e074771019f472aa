"""`tokenmill quantize --scheme gguf-q4_k_m --method imatrix`: llama-imatrix on the job's
own calibration prompts, then llama-quantize --imatrix.  Bad requests refused in one line
with nothing left behind; (llamacpp) a real run on a few prompts whose record names the
recipe, the calibration source, the llama.cpp build and the file's hash, and whose GGUF
the llamacpp engine serves."""

from __future__ import annotations

import json

import pytest

from tests.conftest import write_parquet
from tests.helpers import assert_one_line_error, cli, job_spec
from tests.test_calibrated_quantize import chat_rows
from tokenmill.jobs.modeltools import gguf as G
from tokenmill.jobs.modeltools.schemes import QuantizeError, check_method


def test_imatrix_goes_only_where_llama_cpps_quantizer_reads_it():
    check_method("gguf-q4_k_m", "imatrix")
    with pytest.raises(QuantizeError, match=r"'imatrix' does not apply to scheme 'gguf-q8_0' \(llama.cpp's Q8_0 quantizer ignores"):
        check_method("gguf-q8_0", "imatrix")
    with pytest.raises(QuantizeError, match=r"'imatrix' does not apply to scheme 'gguf-f16' \(F16 rounds no weights"):
        check_method("gguf-f16", "imatrix")
    with pytest.raises(QuantizeError, match=r"'imatrix' does not apply to scheme 'w8a8-int8' \(imatrix is llama.cpp's"):
        check_method("w8a8-int8", "imatrix")
    with pytest.raises(QuantizeError, match=r"'gptq' does not apply to scheme 'gguf-q4_k_m' \(gptq is llmcompressor's.*"
                                            r"takes rtn or imatrix"):
        check_method("gguf-q4_k_m", "gptq")


def test_imatrix_context_holds_two_chunks_of_the_text():
    assert G.imatrix_context(20_000, 1024) == 512  # 39 chunks, 32 tokens unused
    assert G.imatrix_context(20_000, 200) == 128  # never longer than --max-seq-len
    assert G.imatrix_context(1100, 1024) == 256  # two chunks of 512 and a tenth to spare would need 1138
    assert G.imatrix_context(600, 1024) == 64  # 256 and 128 would leave 88 tokens (15%) unused, 64 leaves 24
    assert G.imatrix_context(1835, 1024) == 256  # 512 would leave 299 tokens (16%) unused, 256 leaves 43
    assert G.imatrix_context(60, 1024) is None


def test_the_calibration_text_is_the_jobs_prompts_with_their_special_tokens(model_path):
    from tokenmill.schemas.records import PromptRecord
    from tokenmill.transforms.counting import encode, load_tokenizer

    tok = load_tokenizer(model_path)
    ids = [encode(tok, PromptRecord(id=r["id"], input_file=0, input_row=0, messages=r["messages"])) for r in chat_rows(2)]
    text = G.calibration_text(ids, tok)
    assert text.count("<|im_start|>system\nAnswer in one sentence.<|im_end|>") == 2
    assert text.endswith("<|im_start|>assistant\n")
    # tokenized again with special tokens parsed (what llama-imatrix --parse-special does), the same ids
    again = tok(text, add_special_tokens=False)["input_ids"]
    assert again == ids[0] + ids[1]


def test_bad_imatrix_requests_are_one_line_and_leave_nothing(tmp_path):
    cal = write_parquet(tmp_path / "cal.parquet", chat_rows(12))
    out = tmp_path / "q.gguf"
    cases = [
        (["--scheme", "gguf-q4_k_m", "--method", "imatrix"], 2, "needs --calibration"),
        (["--scheme", "gguf-q8_0", "--method", "imatrix", "--calibration", cal], 2, "Q8_0 quantizer ignores"),
        (["--scheme", "gguf-f16", "--method", "imatrix", "--calibration", cal], 2, "F16 rounds no weights"),
        (["--scheme", "gguf-q4_k_m", "--method", "gptq", "--calibration", cal], 2, "gptq is llmcompressor's"),
        (["--scheme", "gguf-q4_k_m", "--calibration", cal], 2, "takes no --calibration"),
        (["--scheme", "gguf-q4_k_m", "--method", "imatrix", "--calibration", cal, "--samples", "16"], 2,
         "has 12 usable rows of 12 read"),
        (["--scheme", "gguf-q4_k_m", "--method", "imatrix", "--calibration", tmp_path / "nope.parquet"], 2, "does not exist"),
        (["--scheme", "gguf-q4_k_m", "--method", "imatrix", "--calibration", cal, "--group-size", "32"], 2,
         "takes no --group-size"),
    ]
    for args, code, expected in cases:
        res = cli("quantize", "--model", "smollm2-135m", "--out", out, *args)
        assert_one_line_error(res, code, expected)
        assert sorted(p.name for p in tmp_path.iterdir()) == ["cal.parquet"], args
    res = cli("quantize", "--model", "w8a8", "--scheme", "w8a8-int8", "--method", "imatrix", "--calibration", cal,
              "--out", tmp_path / "w")
    assert_one_line_error(res, 2, "imatrix is llama.cpp's importance matrix, for the gguf-* schemes")


# ---------------------------------------------------------------- a real llama-imatrix run


@pytest.mark.llamacpp
def test_an_imatrix_q4_k_m_is_recorded_listed_and_served(tmp_path, model_path, sqlite_url, monkeypatch):
    import hashlib

    import pyarrow.parquet as pq

    from tokenmill.jobs.lifecycle.runner import run_job
    from tokenmill.schemas import storage as S
    from tokenmill.transforms.engines.llamacpp_session import binary

    binary("llama-imatrix")  # built by `make llamacpp`, or fail here naming it
    models = tmp_path / "models"
    models.mkdir()
    (models / "smollm2-135m").symlink_to(model_path)  # the tokenizer, found by short name
    monkeypatch.setenv("TOKENMILL_MODELS", str(models))
    cal = write_parquet(tmp_path / "nightly.parquet", chat_rows(24, words=20))
    out = models / "smol-q4km-imat.gguf"
    res = cli("quantize", "--model", "smollm2-135m", "--scheme", "gguf-q4_k_m", "--method", "imatrix",
              "--calibration", cal, "--samples", "8", "--max-seq-len", "256", "--out", out, "--json")
    assert res.exit_code == 0, res.output
    d = json.loads(res.output)
    assert out.read_bytes()[:4] == b"GGUF"
    assert [p.name for p in models.iterdir() if ".partial-" in p.name] == []  # the work folder is gone

    rec = json.loads((models / "smol-q4km-imat.gguf.tokenmill.json").read_text())
    assert (rec["scheme"], rec["method"], rec["type"], rec["tokenizer"]) == ("gguf-q4_k_m", "imatrix", "Q4_K_M", "smollm2-135m")
    assert rec["calibration"]["source"] == str(cal) and rec["calibration"]["input_rows"] == 24
    assert rec["calibration"]["samples"] == rec["calibration_rows"] == 8
    assert rec["checkpoint"]["sha256"] == hashlib.sha256(out.read_bytes()).hexdigest() == d["sha256"]
    assert "commit" in rec["libraries"]["llama.cpp"] and rec["llama_cpp"]["version"].startswith("version:")
    # the bundled GGUF is Q4_1: the importance matrix was computed on its F16
    assert rec["recipe"]["imatrix_computed_on"]["type"] == "F16"
    assert "--imatrix" in rec["recipe"]["quantize_args"] and "--parse-special" in rec["recipe"]["imatrix_args"]
    run = rec["calibration_run"]
    assert run["samples"] == 8 and run["peak_rss_bytes"] > 50 << 20 and run["wall_s"] > 0
    assert run["chunks"] >= 2 and run["tokens_used"] == run["chunks"] * run["n_ctx"] <= run["tokens"]

    plain = tmp_path / "plain.gguf"
    assert cli("quantize", "--model", "smollm2-135m", "--scheme", "gguf-q4_k_m", "--out", plain).exit_code == 0
    from gguf import GGUFReader

    a, b = GGUFReader(str(plain)), GGUFReader(str(out))
    # the same tensors in the same types, rounded otherwise; the imatrix named in the metadata
    assert [(t.name, t.tensor_type) for t in a.tensors] == [(t.name, t.tensor_type) for t in b.tensors]
    assert any((x.data != y.data).any() for x, y in zip(a.tensors, b.tensors) if x.tensor_type.name == "Q4_K")
    assert "quantize.imatrix.file" in b.fields and "quantize.imatrix.file" not in a.fields

    listed = cli("models", "list")
    assert "smol-q4km-imat.gguf" in listed.output and "gguf-q4_k_m imatrix, calibrated on" in listed.output
    assert rec["checkpoint"]["sha256"][:12] in listed.output

    q = write_parquet(tmp_path / "q.parquet", chat_rows(2))
    spec = job_spec(q, tmp_path / "o", job_id="q4km-imat", sampling={"max_tokens": 8, "temperature": 0.0},
                    engine={"kind": "llamacpp", "model": str(out), "max_in_flight": 1, "max_model_len": 256})
    r = run_job(spec, db_url=sqlite_url)
    assert r.status == "succeeded" and r.succeeded == 2, r
    got = pq.read_table(tmp_path / "o" / "outputs.parquet").to_pylist()
    assert all(o["output_tokens"] > 0 for o in got), got
    info = S.MetricsReader(S.connect(sqlite_url)).engine_info("q4km-imat")
    assert info["gguf"] == str(out.resolve())
    assert info["checkpoint"]["method"] == "imatrix" and info["checkpoint"]["checkpoint_sha256"] == rec["checkpoint"]["sha256"]

    # --force replaces only with a complete file; a failing run (too few tokens) leaves the old one
    before = out.read_bytes()
    short = write_parquet(tmp_path / "short.parquet", [{"id": f"s{i}", "prompt": f"Hi {i}"} for i in range(8)])
    res = cli("quantize", "--model", "smollm2-135m", "--scheme", "gguf-q4_k_m", "--method", "imatrix",
              "--calibration", short, "--samples", "8", "--out", out, "--force")
    assert_one_line_error(res, 2, "too few for llama-imatrix")
    assert out.read_bytes() == before and [p.name for p in models.iterdir() if ".partial-" in p.name] == []


def test_a_tools_peak_memory_is_its_own_not_its_parents(tmp_path):
    """On Linux a child's ru_maxrss keeps the parent's RSS from before exec: a tool started
    from a process holding 512 MiB reported 512 MiB.  The peak recorded is the tool's own."""
    import sys

    from tokenmill.jobs.modeltools import llmc_calibrate

    ballast = bytearray(512 << 20)
    ballast[::4096] = b"x" * len(ballast[::4096])  # touched, so resident
    grow = "b = bytearray(96 << 20); b[::4096] = b'x' * len(b[::4096]); import time; time.sleep(0.5)"
    code, peak = G._run_bound([sys.executable, "-c", grow], [], tmp_path, tmp_path / "log")
    assert code == 0 and 96 << 20 < peak < 256 << 20, peak
    import subprocess

    out = subprocess.run([sys.executable, "-c", f"import runpy; m = runpy.run_path({llmc_calibrate.__file__!r}); "
                          "print(m['_peak_rss_bytes']())"], capture_output=True, text=True, check=True).stdout
    assert int(out) < 256 << 20, out
    del ballast
