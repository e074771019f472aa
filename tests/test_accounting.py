"""Accounting: what each per-job figure counts, pricing, utilization parsing, URL masking."""

import json
from types import SimpleNamespace

import pytest

from tokenmill.jobs.metrics import hardware as H
from tokenmill.jobs.metrics.accounting import CLOCKS, JobTerms, JobWork, job_metrics, percentile
from tokenmill.jobs.metrics.catalog import get_path
from tokenmill.jobs.metrics.pricing import gpu_price, price_table, worker_rate
from tokenmill.jobs.metrics.report import compare_metrics
from tokenmill.schemas.secrets import mask_url


def _rows():
    # 4 answered requests: 10 prompt tokens each (4 of them cached), 5/10/15/20 output tokens
    return [
        {"prompt_tokens": 10, "output_tokens": 5 * (i + 1), "cached_tokens": 4, "ttft_s": 0.1 * (i + 1),
         "tpot_s": 0.01, "e2e_s": 1.0 * (i + 1), "queue_s": 0.0, "token_count_source": "engine"}
        for i in range(4)
    ]


def _metrics(**kw):
    args = dict(
        rows=_rows(),
        batches=[{"batch_id": "r1-0.0-a-0", "worker": "h:1", "started_at": 100.0, "finished_at": 110.0,
                  "requests": 2, "tail_s": 1.0},
                 {"batch_id": "r1-0.0-a-1", "worker": "h:1", "started_at": 105.0, "finished_at": 120.0,
                  "requests": 2, "tail_s": 3.0}],
        workers=[{"worker": "h:1", "load_s": 30.0, "peak_rss_bytes": 2_000,
                  "engine_info": {"kv_cache_bytes": 1 << 20}},
                 {"worker": "h:2", "run_id": "r1", "load_s": 40.0, "peak_rss_bytes": 3_000, "engine_info": None}],
        total=6,
        failed_by_reason={"empty_prompt": 1, "prompt_too_long": 1},
        engine_config={"max_num_seqs": 32},
        token_budget=4096,
        price_per_hour=3.6,
    )
    args.update(kw)
    work = JobWork(args.pop("rows"), args.pop("batches"), args.pop("workers"),
                   failed_by_reason=args.pop("failed_by_reason"), runs=args.pop("runs", ()))
    return job_metrics(work, JobTerms(**args))


def test_percentile_interpolates_like_numpy():
    assert percentile([1, 2, 3, 4], 50) == 2.5
    assert percentile([1, 2, 3, 4], 99) == pytest.approx(3.97)
    assert percentile([], 50) is None
    assert percentile([7.0], 95) == 7.0


def test_throughput_counts_tokens_over_generation_wall_time_without_model_load():
    m = _metrics()
    th = m["throughput"]
    assert th["generation_wall_s"] == 20.0  # first batch start 100 -> last batch end 120
    assert th["model_load_s"] == 40.0  # slowest worker, reported apart
    assert th["output_tok_per_s"] == pytest.approx(50 / 20)
    assert th["total_tok_per_s"] == pytest.approx((40 + 50) / 20)
    assert th["requests_per_s"] == pytest.approx(4 / 20)
    assert th["mean_request_output_tok_per_s"] == pytest.approx(5.0)  # each request: 5k tokens in k seconds


def test_latency_percentiles_and_prefix_cache_hit_rate():
    m = _metrics()
    assert m["latency_s"]["e2e"]["p50"] == 2.5
    assert m["latency_s"]["ttft"]["max"] == pytest.approx(0.4)
    assert m["latency_s"]["tpot"]["n"] == 4
    assert m["prefix_cache"]["hit_rate"] == pytest.approx(16 / 40)


def test_failure_rate_by_reason_is_over_input_rows():
    f = _metrics()["failures"]
    assert f["rate"] == pytest.approx(2 / 6)
    assert f["by_reason"] == {"empty_prompt": 1, "prompt_too_long": 1}
    assert f["rate_by_reason"] == {"empty_prompt": pytest.approx(1 / 6), "prompt_too_long": pytest.approx(1 / 6)}


def test_cost_is_worker_hours_times_price_with_unit_costs():
    # workers that measured nothing are priced as the launcher saw the host: 2 GPUs, flat 3.6 per device-hour
    c = _metrics(device_count=2)["cost"]
    gen = 20.0 / 3600 * 3.6 * 2  # h:1 generated 100 -> 120; h:2 ran no batch
    assert c["total"] == pytest.approx(gen)
    assert c["per_1m_output_tokens"] == pytest.approx(gen / 50 * 1e6)
    assert c["per_1m_total_tokens"] == pytest.approx(gen / 90 * 1e6)
    assert c["per_successful_request"] == pytest.approx(gen / 4)
    assert c["model_load"] == pytest.approx((30.0 + 40.0) / 3600 * 3.6 * 2)  # shown apart, not in unit costs
    assert [w["generation_s"] for w in c["workers"]] == [20.0, 0.0]
    assert "cost" not in _metrics(price_per_hour=None)


def test_concurrency_memory_and_clocks_are_named():
    m = _metrics(utilization={"peak_process_tree_rss_bytes": 9_000, "cpu_util_pct_mean": 50.0})
    assert m["concurrency"]["max_num_seqs"] == 32 and m["concurrency"]["token_budget"] == 4096
    assert m["concurrency"]["workers"] == 2 and m["concurrency"]["mean_batch_requests"] == 2
    assert m["memory"]["peak_worker_rss_bytes"] == 3_000
    assert m["memory"]["kv_cache_bytes"] == 1 << 20
    assert m["memory"]["peak_process_tree_rss_bytes"] == 9_000
    assert m["utilization"]["cpu_util_pct_mean"] == 50.0
    assert set(m["clocks"]) >= {"ttft_s", "tpot_s", "e2e_s", "generation_wall_s"}
    assert m["clocks"] is CLOCKS
    json.dumps(m)  # stored in a JSON column


def test_rows_and_tokens_are_counted_by_where_their_token_counts_came_from():
    assert _metrics()["tokens"]["by_count_source"] == {"engine": {"rows": 4, "prompt": 40, "output": 50}}
    assert _metrics()["throughput"]["counts"].startswith("tokens from the engine's outputs over generation wall")
    rows = _rows()
    rows[1]["token_count_source"] = rows[2]["token_count_source"] = "local_tokenizer+stream_chunks"
    rows[3]["token_count_source"] = None  # stored before the column existed
    m = _metrics(rows=rows)
    assert m["tokens"]["by_count_source"] == {
        "engine": {"rows": 1, "prompt": 10, "output": 5},
        "local_tokenizer+stream_chunks": {"rows": 2, "prompt": 20, "output": 25},
        "not_recorded": {"rows": 1, "prompt": 10, "output": 20},
    }
    assert (m["tokens"]["prompt"], m["tokens"]["output"]) == (40, 50)  # the totals still sum every row
    assert "for 1 of 4 rows" in m["throughput"]["counts"] and "estimates" in m["throughput"]["counts"]
    assert "local_tokenizer+stream_chunks" in m["tokens"]["count_source_definition"]
    assert _metrics(rows=[])["tokens"]["by_count_source"] == {}


def test_no_answers_gives_no_rates_and_no_division_by_zero():
    m = _metrics(rows=[], batches=[], workers=[], failed_by_reason={"empty_prompt": 3}, total=3)
    assert m["throughput"]["output_tok_per_s"] is None
    assert m["prefix_cache"]["hit_rate"] is None
    assert m["cost"]["per_1m_output_tokens"] is None and m["cost"]["per_successful_request"] is None
    assert m["failures"]["rate"] == 1.0


def test_compare_gives_ratio_b_over_a_and_the_better_job():
    a = _metrics()
    b = _metrics(batches=[{"batch_id": "r1-0.0-b-0", "worker": "h:1", "started_at": 100.0, "finished_at": 110.0,
                           "requests": 4, "tail_s": 0.0}])
    rows = {r["metric"]: r for r in compare_metrics(a, b)}
    tps = rows["throughput.output_tok_per_s"]
    assert tps["ratio_b_over_a"] == pytest.approx(2.0) and tps["better"] == "b"
    cost = rows["cost.per_1m_output_tokens"]
    assert cost["ratio_b_over_a"] == pytest.approx(0.5) and cost["better"] == "b"
    assert rows["latency_s.e2e.p50"]["better"] == "same"
    assert rows["memory.kv_cache_bytes"]["better"] is None  # neutral: neither is better
    assert get_path(a, "nope.deeper") is None


# ---------------------------------------------------------------- pricing


def test_price_table_matches_gpu_models_and_prices_cpu_per_vcpu_and_gib(tmp_path, monkeypatch):
    monkeypatch.delenv("TOKENMILL_PRICES", raising=False)
    t = price_table()
    assert gpu_price("NVIDIA H100 80GB HBM3", t) == (2.99, "price table entry 'h100'")
    assert gpu_price("NVIDIA L40S", t)[0] == 1.86  # not the "l4" entry
    assert gpu_price(None, t) == (2.99, "GPU model unknown; used the H100 price")  # never the CPU price
    gpu = {"device_type": "gpu", "device_model": "NVIDIA L4", "device_count": 2}
    assert worker_rate(gpu, t)["usd_per_hour"] == pytest.approx(1.60)
    cpu = {"device_type": "cpu", "cpu_count": 4, "measure": {"peak_tree_rss_bytes": 3 * 2**30}}
    assert worker_rate(cpu, t)["usd_per_hour"] == pytest.approx(4 * 0.031611 + 3 * 0.004237)
    assert worker_rate(cpu, t, flat=0.5) == {"usd_per_hour": 0.5, "units": "4 vCPU + 3.00 GiB",
                                              "source": "job spec price_per_hour",
                                              "prices": [{"key": "price_per_hour", "usd_per_hour": 0.5,
                                                          "per": "device-hour", "origin": "job spec",
                                                          "field": "price_per_hour"}]}
    assert worker_rate(gpu, price_table({"L4": 1.0}))["usd_per_hour"] == 2.0  # the job spec's `prices`
    prices = tmp_path / "prices.json"
    prices.write_text(json.dumps({"cpu": 0.25, "h100": 2.0}))
    monkeypatch.setenv("TOKENMILL_PRICES", str(prices))
    assert worker_rate(cpu, price_table())["usd_per_hour"] == 0.25  # flat per CPU worker-hour
    assert gpu_price("NVIDIA H100", price_table())[0] == 2.0


def test_the_job_spec_takes_one_of_price_per_hour_and_prices():
    from tokenmill.schemas.config import SpecError, load_spec

    assert load_spec({"input": "a", "output": "b", "prices": {"H100": 2}}).prices == {"h100": 2.0}
    assert load_spec({"input": "a", "output": "b", "price_per_hour": 1.5}).price_per_hour == 1.5
    with pytest.raises(SpecError, match="set price_per_hour .* or prices .*not both"):
        load_spec({"input": "a", "output": "b", "prices": {"h100": 2}, "price_per_hour": 1})
    with pytest.raises(SpecError, match="prices must be >= 0"):
        load_spec({"input": "a", "output": "b", "prices": {"h100": -1}})


# ---------------------------------------------------------------- utilization (NVML parsing with a fake)


class FakeNVML:
    """The slice of pynvml the sampler uses, for two GPUs."""

    def __init__(self, power_mw=(300_000, 150_000)):
        self.power_mw = power_mw

    def nvmlDeviceGetCount(self):
        return 2

    def nvmlDeviceGetHandleByIndex(self, i):
        return i

    def nvmlDeviceGetMemoryInfo(self, h):
        return SimpleNamespace(used=(h + 1) * 2**30, total=80 * 2**30, free=0)

    def nvmlDeviceGetUtilizationRates(self, h):
        return SimpleNamespace(gpu=90 if h == 0 else 10, memory=40)

    def nvmlDeviceGetPowerUsage(self, h):
        if self.power_mw is None:
            raise RuntimeError("NVML_ERROR_NOT_SUPPORTED")
        return self.power_mw[h]


def test_nvml_sample_reads_memory_utilization_and_power_in_watts():
    s = H.nvml_sample(FakeNVML())
    assert s[0] == {"index": 0, "memory_used_bytes": 2**30, "memory_total_bytes": 80 * 2**30,
                    "util_pct": 90.0, "memory_util_pct": 40.0, "power_w": 300.0}
    assert s[1]["power_w"] == 150.0
    assert H.nvml_sample(FakeNVML(power_mw=None))[0]["power_w"] is None  # unsupported figure, not a crash
    assert H.nvml_sample(None) is None


def test_sampler_summarizes_cpu_rss_and_gpus():
    ticks = iter([0.0, 1.0, 2.0, 3.0])
    cpu = iter([50.0, 100.0])
    s = H.UtilizationSampler(nvml=FakeNVML(), cpu_percent=lambda: next(cpu), clock=lambda: next(ticks))
    s.sample()
    s.sample()
    out = s.summary()
    assert out["samples"] == 2 and out["cpu_util_pct_mean"] == 75.0 and out["cpu_util_pct_max"] == 100.0
    assert out["peak_process_tree_rss_bytes"] > 0  # this test process itself
    g0 = out["gpus"][0]
    assert g0["memory_used_bytes_max"] == 2**30 and g0["util_pct_mean"] == 90.0 and g0["power_w_mean"] == 300.0
    assert g0["energy_wh"] == pytest.approx(300.0 * out["sampled_wall_s"] / 3600)


def test_sampler_without_nvml_reports_no_gpus_and_samples_once_on_stop():
    s = H.UtilizationSampler(every_s=60, nvml=None, cpu_percent=lambda: 12.5)
    s.start()
    out = s.stop()  # shorter than one interval: stop() still takes a reading
    assert out["gpus"] is None
    assert out["samples"] == 1 and out["cpu_util_pct_mean"] == 12.5


def test_no_nvml_on_a_machine_without_nvidia_driver():
    import os

    if os.path.exists("/dev/nvidiactl"):
        assert H.load_nvml() is not None
    else:
        assert H.load_nvml() is None


# ---------------------------------------------------------------- URL masking


@pytest.mark.parametrize("url", [
    "postgresql+psycopg2://bob:s3cret@db.example:5432/prod",
    "postgresql://bob:s3cret@db.example/prod?sslmode=require",
    "not a url //bob:s3cret@host/x",
])
def test_mask_url_hides_the_password(url):
    masked = mask_url(url)
    assert "s3cret" not in masked
    assert "bob" in masked and "***" in masked


def test_mask_url_leaves_urls_without_password_alone():
    assert mask_url("sqlite:////tmp/x.db") == "sqlite:////tmp/x.db"
