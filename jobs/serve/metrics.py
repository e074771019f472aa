"""`GET /metrics`: the service in Prometheus' text format (prometheus_client), read at each
scrape: batches by status (from the database), batches queued per model, engines loaded, the
service's live replicas,
and since the server started, lines (completed, failed) and tokens (input, output) per model,
whose rates are the lines and tokens per second."""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from tokenmill.jobs.serve.objects import batch_status
from tokenmill.schemas import storage as S

if TYPE_CHECKING:
    from tokenmill.jobs.serve.service import BatchService

CONTENT_TYPE = CONTENT_TYPE_LATEST
STATUSES = ("validating", "failed", "in_progress", "finalizing", "completed", "expired", "cancelling", "cancelled")


class _Collector:
    def __init__(self, svc: "BatchService"):
        self.svc = svc

    def collect(self):
        svc = self.svc
        rows = svc.batches.by_status_times()
        by_status = Counter(batch_status(b) for b in rows)
        g = GaugeMetricFamily("tokenmill_serve_batches", "Batches by status (all kept in the database)",
                              labels=["status"])
        for s in STATUSES:
            g.add_metric([s], by_status.get(s, 0))
        yield g
        lost = S.LeaseStore(svc.eng).totals()  # replicas over one database (docs/SERVING.md, "Replicas")
        w = GaugeMetricFamily("tokenmill_serve_work_lost", "Engine work lost to replicas that died or froze, all "
                              "batches: units taken over after their lease expired, rows and output tokens whose "
                              "commit a lost lease refused", labels=["what"])
        for what, n in lost.items():
            w.add_metric([what], n)
        yield w
        running = {e.running for e in svc.scheduler.engines.values() if e.running}
        queued = Counter(b["model"] or "" for b in rows if batch_status(b) == "in_progress" and b["id"] not in running)
        q = GaugeMetricFamily("tokenmill_serve_queued_batches", "Batches validated and waiting for their model's engine",
                              labels=["model"])
        for model in svc.cfg.models:
            q.add_metric([model], queued.get(model, 0))
        yield q
        loaded = GaugeMetricFamily("tokenmill_serve_engines_loaded", "1 where the model's engine is loaded now",
                                   labels=["model"])
        for model in svc.cfg.models:
            e = svc.scheduler.engines.get(model)
            loaded.add_metric([model], 1 if e is not None and e.alive() and (e.loaded or e.running) else 0)
        yield loaded
        yield GaugeMetricFamily("tokenmill_serve_replicas", "Replicas of the service live now (registered, heartbeat "
                                "fresh, not stopped)", value=len(S.ReplicaStore(svc.eng).live()))
        with svc._lock:
            counters = dict(svc.counters)
        lines = CounterMetricFamily("tokenmill_serve_lines", "Batch lines finished since the server started",
                                    labels=["model", "outcome"])
        tokens = CounterMetricFamily("tokenmill_serve_tokens", "Tokens of finished batches since the server started",
                                     labels=["model", "kind"])
        ended = CounterMetricFamily("tokenmill_serve_batches_ended", "Batches ended since the server started",
                                    labels=["model", "status"])
        for (metric, model, label), v in sorted(counters.items()):
            fam = {"lines": lines, "tokens": tokens, "batches": ended}.get(metric)
            if fam is not None:
                fam.add_metric([model, label], v)
        yield lines
        yield tokens
        yield ended
        if svc.scheduler.online is not None:
            yield from _online(svc.scheduler.online, list(svc.cfg.models))


def _online(on, models: list[str]):
    """The online API's figures (jobs/serve/online.py): what each engine holds now (online
    requests, the batch's share and its requests in the engine and held back, the engine's
    unfinished count, batch requests preempted), requests ended by status, TTFT and TPOT."""
    from tokenmill.jobs.serve.online import TPOT_BUCKETS, TTFT_BUCKETS

    held = GaugeMetricFamily("tokenmill_serve_online_engine", "What each model's shared engine holds now: online "
                             "requests, the running batch's share of max_num_seqs, its requests in the engine and "
                             "held back, the engine's unfinished requests; batch requests preempted so far",
                             labels=["model", "what"])
    for model in models:
        for what, n in sorted((on.states.get(model) or {}).items()):
            held.add_metric([model, what], n)
    yield held
    ended = CounterMetricFamily("tokenmill_serve_online_requests", "Online requests ended since the server started, "
                                "by HTTP status (499: the client left)", labels=["model", "status"])
    for (model, status), n in sorted(on.ended.items()):
        ended.add_metric([model, str(status)], n)
    yield ended
    for name, bounds, what in (("ttft", TTFT_BUCKETS, "time to first token"), ("tpot", TPOT_BUCKETS,
                                                                                 "time per output token")):
        h = HistogramMetricFamily(f"tokenmill_serve_online_{name}_seconds", f"Online requests' {what}",
                                  labels=["model"])
        for model in models:
            counts = on.hist.get((model, name))
            if counts is None:
                continue
            buckets = [(str(b), counts[i]) for i, b in enumerate(bounds)] + [("+Inf", counts[-1])]
            h.add_metric([model], buckets, sum_value=counts[-2])
        yield h


def exposition(svc: "BatchService") -> bytes:
    reg = CollectorRegistry()
    reg.register(_Collector(svc))
    return generate_latest(reg)
