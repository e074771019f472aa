"""The engines benchmark's pure parts on injected figures: medians per arm, the targets
(met, missed, not measured), the Markdown tables and the plot; and the export check
that counts rows lost."""

import pyarrow as pa
import pyarrow.parquet as pq

from bench import engines as B


def run(tok_s, tpot_p95, *, lost=0, ttft=0.2, cost=0.05, clock="engine"):
    return {"output_tok_per_s": tok_s, "total_tok_per_s": tok_s * 5, "requests_per_s": tok_s / 32,
            "latency_s": {"ttft": {"p50": ttft, "p95": 2 * ttft}, "tpot": {"p50": tpot_p95 / 2, "p95": tpot_p95},
                          "e2e": {"p50": 1.0, "p95": 2.0}},
            "peak_rss_bytes": 512 * B.MiB, "cpu_util": 1.8, "failure_rate": 0.0, "usd_per_1m_output_tokens": cost,
            "rows_lost": lost, "clock": clock, "parallelism": "p"}


def results():
    return {
        "started_at": "s", "direct_gguf": "q8_0",
        "workloads": {"chat": {"key": "a", "rows": 8, "max_tokens": 32, "description": "d", "workers": 1},
                      "shared_prefix": {"key": "b", "rows": 9, "max_tokens": 8, "description": "d", "workers": 2}},
        "runs": {
            "chat/llamacpp_q8_0": [run(80.0, 0.05), run(100.0, 0.04), run(90.0, 0.06)],
            "chat/direct": [run(100.0, 0.04, clock="client")] * 2,
            "chat/vllm": [run(200.0, 0.02)] * 2,
            "chat/openai_vllm": [run(160.0, 0.03, clock="client")] * 2,
            "shared_prefix/llamacpp_q8_0": [run(50.0, 0.1, lost=0), run(50.0, 0.1, lost=3)],
            "shared_prefix/direct": [run(50.0, 0.1)],
        },
        "eval": {"llamacpp_q8_0": {"accuracy": 0.4}, "direct": {"accuracy": 0.4}},
    }


def test_medians_take_every_figure_from_the_runs_and_the_worst_run_for_rows_lost():
    res = results()
    B.summarize(res)
    m = res["medians"]["chat/llamacpp_q8_0"]
    assert m["runs"] == 3 and m["output_tok_per_s"] == 90.0
    assert m["tpot_p95_ms"] == 50.0 and m["ttft_p50_ms"] == 200.0 and m["peak_rss_mib"] == 512.0
    assert m["eval_accuracy"] == 0.4 and res["medians"]["chat/vllm"]["eval_accuracy"] is None
    assert res["medians"]["shared_prefix/llamacpp_q8_0"]["rows_lost"] == 3


def test_targets_say_met_missed_and_not_measured():
    res = results()
    B.summarize(res)
    t = {x["name"]: x for x in res["targets"]}
    chat = t["tokenmill+llamacpp (q8_0) / direct llama-server, output tok/s on chat"]
    assert chat["measured"] == 0.9 and chat["met"] is True  # exactly at the target counts
    assert t["openai → vllm serve / in-process vLLM, output tok/s on chat"]["measured"] == 0.8
    assert t["openai → vllm serve / in-process vLLM, output tok/s on chat"]["met"] is False
    assert t["rows lost, shared_prefix/llamacpp_q8_0 (worst run)"]["met"] is False
    assert t["rows lost, chat/direct (worst run)"]["met"] is True
    # an arm that did not run: no ratio, no verdict
    res["runs"].pop("shared_prefix/direct")
    B.summarize(res)
    t = {x["name"]: x for x in res["targets"]}
    b = t["tokenmill+llamacpp (q8_0) / direct llama-server, output tok/s on shared_prefix"]
    assert b["measured"] is None and b["met"] is None
    # neither arm of a pair ran: no such target
    for k in ("chat/openai_vllm", "chat/vllm"):
        res["runs"].pop(k)
    B.summarize(res)
    assert not any(x["name"].startswith("openai") for x in res["targets"])


def test_markdown_has_one_table_per_workload_with_every_figure_and_the_targets():
    res = results()
    B.summarize(res)
    md = B.markdown(res)
    assert md.count("| arm | runs | clock |") == 2
    header = next(ln for ln in md.splitlines() if ln.startswith("| arm |"))
    assert all(title in header for _, title, _ in B.FIGURES)
    row = next(ln for ln in md.splitlines() if ln.startswith("| openai_vllm |"))
    assert "| client |" in row and "| 160.0 |" in row
    assert "| openai → vllm serve / in-process vLLM, output tok/s on chat | 0.800 | ≥ 0.85 | no |" in md
    res["errors"] = [{"run": "chat/vllm_w8a8", "bucket": "runs", "error": "RuntimeError: boom"}]
    assert "Failed: chat/vllm_w8a8 (runs): `RuntimeError: boom`" in B.markdown(res)


def test_plot_has_one_point_per_arm_and_workload(tmp_path):
    res = results()
    B.summarize(res)
    html = B.plot(res, tmp_path / "engines.html").read_text()
    assert "Output throughput against P95 TPOT" in html and "openai_vllm" in html
    fig = B.plot_figure(res)
    assert [t.name for t in fig.data] == ["chat", "shared_prefix"]
    assert list(fig.data[0].text) == ["llamacpp_q8_0", "direct", "vllm", "openai_vllm"]
    assert list(fig.data[1].x) == [100.0, 100.0] and list(fig.data[0].y)[2] == 200.0


def test_rows_lost_counts_ids_missing_from_the_export(tmp_path):
    def write(name, ids, extra):
        pq.write_table(pa.table({"id": ids, "input_ref": [f"0:{i}" for i in ids], **extra}), tmp_path / name)

    write("outputs.parquet", ["0", "1"], {})
    write("dead_letters.parquet", ["2"], {"reason": ["bad_request"]})
    assert B.rows_lost(str(tmp_path), 3)["rows_lost"] == 0
    assert B.rows_lost(str(tmp_path), 5)["rows_lost"] == 2
    assert B.rows_lost(str(tmp_path / "missing"), 4)["rows_lost"] == 4


def test_each_arm_gets_its_own_engine(model_path):
    """Every arm's engine config is the arm's engine (a misrouted arm measured another
    engine under its name once: the `vllm` arm ran llama.cpp)."""
    import argparse

    args = argparse.Namespace(model="smollm2-135m", vllm_dtype="float32", slots=4, direct_gguf="q8_0", scale="smoke")
    b = B.Bench(args, dict(B.SCALES["smoke"]))
    b.models = {"w8a8": "/m/w8a8", "f16": "/m/f16.gguf", "q8_0": "/m/q8_0.gguf", "q4_k_m": "/m/q4_k_m.gguf"}

    class Server:
        root = "http://127.0.0.1:1"

    b.servers = {"a": Server()}
    kinds = {arm: b.arm_setup(arm, "a")["cfg"] for arm in B.ARMS}
    assert (kinds["vllm"].kind, kinds["vllm"].model, kinds["vllm"].dtype) == ("vllm", b.model_path, "float32")
    assert (kinds["vllm_w8a8"].kind, kinds["vllm_w8a8"].model) == ("vllm", "/m/w8a8")
    for q in ("f16", "q8_0", "q4_k_m"):
        assert (kinds[f"llamacpp_{q}"].kind, kinds[f"llamacpp_{q}"].model) == ("llamacpp", f"/m/{q}.gguf")
    assert kinds["openai_vllm"].kind == "openai" and kinds["direct"].model == "/m/q8_0.gguf"
