"""Every price the accounting uses says where it came from: the job spec, the user's
TOKENMILL_PRICES file (with its path), or the default table (with its source and date)."""

from __future__ import annotations

import datetime as dt
import html
import json
import os

import pytest

from tests.conftest import write_parquet
from tests.fakes import FakeSession
from tests.helpers import job_spec
from tokenmill.jobs.lifecycle.runner import run_job
from tokenmill.jobs.metrics import pricing as P
from tokenmill.jobs.metrics.accounting import JobTerms, JobWork, job_metrics
from tokenmill.jobs.metrics.report import format_report, load_report, render_html
from tokenmill.schemas import storage as S

GPU = {"device_type": "gpu", "device_model": "NVIDIA H100 80GB HBM3", "device_count": 2}
CPU = {"device_type": "cpu", "cpu_count": 4, "measure": {"peak_tree_rss_bytes": 2 * 2**30}}


@pytest.fixture(autouse=True)
def _no_user_file(monkeypatch):
    monkeypatch.delenv("TOKENMILL_PRICES", raising=False)


def test_every_default_price_carries_its_source_and_what_is_known_of_its_date():
    assert set(P.DEFAULT_PRICES) == set(P.GPU_PRICES) | set(P.CPU_PRICES)
    t = P.price_table()
    for key, p in P.DEFAULT_PRICES.items():
        assert p.source and p.as_of == P.AS_OF_2025, key
        assert t[key] == p.usd_per_hour
        assert t.origins[key] == {"origin": "default table", "source": p.source, "as_of": p.as_of}
    assert "2025" in P.AS_OF_2025 and "not re-checked" in P.AS_OF_2025  # no read date is claimed
    assert P.DEFAULT_PRICES["l4"].source == "AWS EC2 on-demand price, us-east-1, g6.xlarge (1 GPU)"
    assert "cloud.google.com/compute/vm-instance-pricing" in P.DEFAULT_PRICES["cpu_vcpu"].source


def test_a_default_price_names_the_default_table_with_source_and_date():
    r = P.worker_rate(GPU, P.price_table())
    assert r["usd_per_hour"] == pytest.approx(2 * 2.99)
    [e] = r["prices"]
    assert e == {"key": "h100", "usd_per_hour": 2.99, "per": "GPU-hour", "origin": "default table",
                 "source": "Lambda Cloud on-demand list price, H100 SXM, per GPU-hour", "as_of": P.AS_OF_2025}
    assert P.price_line(e) == ("h100 $2.99 per GPU-hour: default table (Lambda Cloud on-demand list price, "
                               f"H100 SXM, per GPU-hour; as of {P.AS_OF_2025})")
    # A GPU with no entry is priced as the H100, and says whose H100 price that was.
    unknown = P.worker_rate({"device_type": "gpu", "device_model": "Tesla K80"}, P.price_table({"h100": 2.5}))
    assert unknown["source"] == "no price for 'Tesla K80'; used the H100 price"
    assert unknown["prices"][0]["origin"] == "job spec" and unknown["usd_per_hour"] == 2.5


def test_job_spec_prices_and_price_per_hour_name_the_job_spec():
    t = P.price_table({"H100": 2.5, "cpu_gib": 0.0})
    [e] = P.worker_rate(GPU, t)["prices"]
    assert (e["origin"], e["field"], e["usd_per_hour"]) == ("job spec", "prices", 2.5)
    assert P.price_line(e) == "h100 $2.5 per GPU-hour: job spec (prices)"
    # A CPU worker's two prices each keep their own origin.
    vcpu, gib = P.worker_rate(CPU, t)["prices"]
    assert (vcpu["key"], vcpu["origin"]) == ("cpu_vcpu", "default table")
    assert (gib["key"], gib["origin"], gib["usd_per_hour"]) == ("cpu_gib", "job spec", 0.0)
    flat = P.worker_rate(GPU, t, flat=1.5)
    assert flat["usd_per_hour"] == 3.0 and flat["prices"] == [
        {"key": "price_per_hour", "usd_per_hour": 1.5, "per": "device-hour", "origin": "job spec",
         "field": "price_per_hour"}]
    assert P.price_line(flat["prices"][0]) == "price_per_hour $1.5 per device-hour: job spec (price_per_hour)"


def test_a_user_file_price_names_the_file_and_its_date_and_the_job_spec_wins_over_it(tmp_path, monkeypatch):
    f = tmp_path / "prices.json"
    f.write_text(json.dumps({"H100": 2.0, "cpu": 0.25}))
    os.utime(f, (1_764_547_200, 1_764_547_200))  # 2025-12-01 00:00 UTC
    monkeypatch.setenv("TOKENMILL_PRICES", str(f))
    [e] = P.worker_rate(GPU, P.price_table())["prices"]
    assert e == {"key": "h100", "usd_per_hour": 2.0, "per": "GPU-hour", "origin": "user file", "path": str(f),
                 "as_of": "file modified 2025-12-01"}
    assert P.price_line(e) == f"h100 $2 per GPU-hour: user file {f} (TOKENMILL_PRICES; file modified 2025-12-01)"
    assert P.worker_rate(CPU, P.price_table())["prices"][0]["key"] == "cpu"
    assert P.worker_rate(GPU, P.price_table({"h100": 3.0}))["prices"][0]["origin"] == "job spec"
    # An entry may say its own source and date.
    y = tmp_path / "prices.yaml"
    y.write_text("a100: {usd_per_hour: 1.1, source: our contract, as_of: 2026-11-01}\n")
    monkeypatch.setenv("TOKENMILL_PRICES", str(y))
    [e] = P.worker_rate({"device_type": "gpu", "device_model": "A100-SXM4-40GB"}, P.price_table())["prices"]
    assert (e["origin"], e["source"], e["as_of"], e["usd_per_hour"]) == ("user file", "our contract", "2026-11-01", 1.1)
    assert P.price_line(e).endswith(f"user file {y} (TOKENMILL_PRICES; our contract, 2026-11-01)")


def test_job_cost_names_each_workers_prices_and_lists_them_once():
    workers = [{"worker": f"h:{i}", "run_id": "r", "started_at": 0.0, "updated_at": 3600.0, **GPU} for i in (1, 2)]
    m = job_metrics(JobWork([], [], workers), JobTerms(total=0, engine_config={}, token_budget=None,
                                                        price_per_hour=None, prices=P.price_table({"h100": 2.5})))
    cost = m["cost"]
    assert [w["prices"][0]["origin"] for w in cost["workers"]] == ["job spec", "job spec"]
    assert cost["prices_used"] == [{"key": "h100", "usd_per_hour": 2.5, "per": "GPU-hour", "origin": "job spec",
                                    "field": "prices"}]
    json.dumps(m)  # stored in a JSON column


def _job(tmp_path, db, job_id, **spec):
    inp = write_parquet(tmp_path / f"{job_id}.parquet", [{"id": f"r{i}", "prompt": f"q {i}"} for i in range(4)])
    run_job(job_spec(inp, tmp_path / job_id, job_id=job_id, sampling={"max_tokens": 2}, **spec),
            db_url=db, session_factory=FakeSession)
    return load_report(S.connect(db), job_id)


def test_the_report_shows_each_price_used_beside_its_origin(tmp_path, sqlite_url, monkeypatch):
    f = tmp_path / "prices.json"
    f.write_text(json.dumps({"cpu_gib": 0.01}))
    monkeypatch.setenv("TOKENMILL_PRICES", str(f))
    data = _job(tmp_path, sqlite_url, "priced", prices={"cpu_vcpu": 0.05})
    lines = [" ".join(ln.split()) for ln in format_report(data).splitlines()]  # columns aligned: one space
    assert "price used cpu_vcpu $0.05 per vCPU-hour: job spec (prices)" in lines
    day = dt.datetime.fromtimestamp(f.stat().st_mtime, dt.timezone.utc).date().isoformat()
    assert f"price used cpu_gib $0.01 per GiB-hour: user file {f} (TOKENMILL_PRICES; file modified {day})" in lines
    page = render_html(data, tmp_path / "html").read_text()
    assert html.escape("cpu_vcpu $0.05 per vCPU-hour: job spec (prices)") in page
    assert html.escape(f"cpu_gib $0.01 per GiB-hour: user file {f}") in page

    monkeypatch.delenv("TOKENMILL_PRICES")
    data = _job(tmp_path, sqlite_url, "defaults")
    text = " ".join(format_report(data).split())
    for key in ("cpu_vcpu", "cpu_gib"):
        assert P.price_line({"key": key, "per": f"{P.DEFAULT_PRICES[key].per}-hour",
                             "usd_per_hour": P.DEFAULT_PRICES[key].usd_per_hour, "origin": "default table",
                             "source": P.DEFAULT_PRICES[key].source, "as_of": P.AS_OF_2025}) in text
    assert html.escape(f"default table ({P.DEFAULT_PRICES['cpu_vcpu'].source}") in render_html(
        data, tmp_path / "html").read_text()
