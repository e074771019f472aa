"""A test-only engine that needs GPUs (`devices_per_engine`: its `tensor_parallel_size`), so
a worker leases devices before making it; it records what it was given and holds the
lease like a real engine (tests/test_leases.py).

Each session writes `<record_dir>/<pid>.json` when made: the `CUDA_VISIBLE_DEVICES` it
sees, the devices its process leased, its pid.  With a file `<record_dir>/kill-once`,
the first engine to take that file (a rename: one process wins) kills its own process
with SIGKILL at its first step, as the OOM killer would."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from typing import Any, Literal

from pydantic import Field

from tests.echo_engine import EchoSession
from tokenmill.schemas.config import EngineConfig
from tokenmill.transforms.counting import TokenCounter
from tokenmill.transforms.engines import leases
from tokenmill.transforms.engines.kinds import EngineCheck, EngineKind
from tokenmill.transforms.engines.protocol import Finished


class LeasingConfig(EngineConfig):
    kind: Literal["leasing"] = Field(json_schema_extra={"flag": False})
    tensor_parallel_size: int = Field(1, ge=1, json_schema_extra={"flag": False})
    record_dir: str = Field("", json_schema_extra={"flag": False})
    step_s: float = Field(0.0, json_schema_extra={"flag": False})
    """How long a step takes (a slower engine keeps every worker of a cluster busy)."""


class LeasingSession(EchoSession):
    """The echo engine's bookkeeping; its answer is the `CUDA_VISIBLE_DEVICES` it sees."""

    def __init__(self, cfg: LeasingConfig, model_path: str = ""):
        super().__init__(cfg, model_path)
        lease = leases.held()
        record = {"pid": os.getpid(), "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
                  "leased": lease.uuids if lease is not None else None}
        Path(cfg.record_dir, f"{os.getpid()}.json").write_text(json.dumps(record))

    def add(self, request_id: str, token_ids, sampling: dict[str, Any], *, source=None) -> None:
        self.requests[request_id] = (time.time(), list(token_ids), "", dict(sampling))

    def step(self) -> list[Finished]:
        marker = Path(self.cfg.record_dir, "kill-once")
        if marker.exists():
            try:
                marker.rename(marker.with_name(f"killed-{os.getpid()}"))
            except OSError:
                pass  # another worker took it
            else:
                os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(self.cfg.step_s)
        now = time.time()
        done = [Finished(request_id=rid, text=os.environ.get("CUDA_VISIBLE_DEVICES", ""), finish_reason="length",
                         prompt_tokens=len(ids), output_tokens=1, cached_tokens=0, ttft_s=now - t0, tpot_s=None,
                         e2e_s=now - t0, queue_s=None, finished_at=now)
                for rid, (t0, ids, _, _) in self.requests.items()]
        self.requests.clear()
        return done

    def info(self) -> dict[str, Any]:
        return {"device": "cuda", "engine": "leasing", "load_s": 0.0,
                "engine_kwargs": {"tensor_parallel_size": self.cfg.tensor_parallel_size}}


class LeasingEngine(EngineKind[LeasingConfig]):
    kind = "leasing"
    config = LeasingConfig
    display_name = "Leasing (tests)"
    summary = "leasing (records its leased GPUs; tests only)"

    def session_factory(self):
        return LeasingSession

    def devices_per_engine(self, cfg: LeasingConfig) -> int:
        return cfg.tensor_parallel_size

    def preflight(self, cfg: LeasingConfig, *, on_gpu: bool) -> EngineCheck:
        return EngineCheck(model_path=cfg.model, counter=TokenCounter("estimate"))


ENGINE = LeasingEngine()
