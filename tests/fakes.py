"""Test engine sessions: a fake for unit and pipeline tests, and a wrapper that makes
the real engine fail on a marked prompt (the real engine has its own tests)."""

from __future__ import annotations

import threading
import time
from typing import Any

from tokenmill.transforms.engines.protocol import Finished


class FakeSession:
    """Answers each request with `echo:<first prompt token>` after `max_tokens` steps or fewer.

    `poison_token`: a prompt containing this token id makes `step` raise (an engine
    crash), and the session then reports itself dead until replaced.
    `block_token`: a prompt containing it makes `step` block (a frozen engine core)
    until `kill()`, then raise.

    `instances`: the fakes made in the current test, oldest first (the autouse
    fixture in conftest starts each test with a new, empty list)."""

    instances: list["FakeSession"] = []

    def __init__(self, cfg=None, model_path: str = "", *, max_num_seqs: int = 8, poison_token: int | None = None,
                 reject_token: int | None = None, block_token: int | None = None):
        self.cfg = cfg
        self.max_num_seqs = getattr(cfg, "max_num_seqs", None) or max_num_seqs
        self.poison_token = poison_token
        self.reject_token = reject_token
        self.block_token = block_token
        self.killed = threading.Event()
        self.reqs: dict[str, dict[str, Any]] = {}
        self.added: list[str] = []
        self.steps = 0
        self.max_inflight = 0
        self.dead = False
        self.shut = False
        FakeSession.instances.append(self)

    def add(self, request_id, token_ids, sampling):
        if self.reject_token is not None and self.reject_token in token_ids:
            raise ValueError(f"token {self.reject_token} is out of vocabulary")
        self.reqs[request_id] = {
            "ids": list(token_ids), "left": int(sampling["max_tokens"]), "n": 0, "t0": time.time(), "first": None,
        }
        self.added.append(request_id)

    def step(self):
        if self.dead:
            raise RuntimeError("engine is dead")
        self.steps += 1
        running = list(self.reqs)[: self.max_num_seqs]
        self.max_inflight = max(self.max_inflight, len(self.reqs))
        if self.poison_token is not None and any(self.poison_token in self.reqs[r]["ids"] for r in running):
            self.dead = True
            raise RuntimeError("EngineCore died")
        if self.block_token is not None and any(self.block_token in self.reqs[r]["ids"] for r in running):
            if not self.killed.wait(60):
                raise AssertionError("nobody killed the blocked fake engine within 60 s")
            raise RuntimeError("EngineDeadError: engine core died")
        out = []
        now = time.time()
        for rid in running:
            r = self.reqs[rid]
            r["n"] += 1
            r["left"] -= 1
            r["first"] = r["first"] or now
            if r["left"] <= 0:
                del self.reqs[rid]
                out.append(
                    Finished(
                        request_id=rid, text=f"echo:{r['ids'][0]}", finish_reason="length",
                        prompt_tokens=len(r["ids"]), output_tokens=r["n"], cached_tokens=0,
                        ttft_s=r["first"] - r["t0"], tpot_s=0.001, e2e_s=now - r["t0"], queue_s=0.0, finished_at=now,
                    )
                )
        return out

    def num_unfinished(self):
        return len(self.reqs)

    def abort(self, ids):
        for i in ids:
            self.reqs.pop(i, None)

    def alive(self):
        return not self.dead

    def kill(self):
        self.dead = True
        self.killed.set()

    def info(self):
        return {"device": "fake", "load_s": 0.0, "kv_cache_tokens": 1000}

    def shutdown(self):
        self.shut = True


class PoisonedVllm:
    """The process's real engine, whose `step` raises while a request whose prompt
    contains `MARKER` is in it (an engine crash on one row) and works again once that
    request is aborted.  The real engine comes from the registry (the default factory),
    so it is loaded once per test process, and this wrapper's `shutdown` leaves it loaded."""

    MARKER = "POISON"

    def __init__(self, cfg, model_path: str):
        from tokenmill.transforms.engines import registry

        self.real = registry.get_session(cfg, model_path)
        self.max_num_seqs = self.real.max_num_seqs
        self._decode = self.real.llm.get_tokenizer().decode
        self.poisoned: set[str] = set()

    def add(self, request_id, token_ids, sampling):
        self.real.add(request_id, token_ids, sampling)
        if self.MARKER in self._decode(token_ids):
            self.poisoned.add(request_id)

    def step(self):
        if self.poisoned:
            raise RuntimeError(f"EngineCore died on a {self.MARKER} request")
        return self.real.step()

    def abort(self, ids):
        self.poisoned.difference_update(ids)
        self.real.abort(ids)

    def num_unfinished(self):
        return self.real.num_unfinished()

    def alive(self):
        return self.real.alive()

    def kill(self):
        self.real.kill()

    def info(self):
        return self.real.info()

    def shutdown(self):
        pass  # the real engine belongs to the registry: the next test reuses it


class FakeNvmlHost:
    """The slice of pynvml a worker's meter reads, for a host of `count` GPUs of one model.

    Each device's energy counter (mJ) advances by `power_w` × the seconds of `clock`;
    `procs`: (pid, bytes) of the compute processes NVML lists on every device.  `mig`: GPU
    index → its MIG instances (that GPU is in MIG mode; instance handles are `(gpu, slot)`,
    with no energy or power, as NVML gives none per instance)."""

    NVML_DEVICE_MIG_ENABLE = 1

    def __init__(self, count: int = 8, name: str = "NVIDIA L4", power_w: float = 70.0, util_pct: float = 95.0,
                 procs: list[tuple[int, int]] = (), memory_total: int = 24 * 2**30, clock=None,
                 mig: dict[int, int] | None = None):
        from types import SimpleNamespace

        self._ns = SimpleNamespace
        self.count, self.name, self.power_w, self.util_pct = count, name, power_w, util_pct
        self.procs, self.memory_total = list(procs), memory_total
        self.clock = clock or time.time
        self.t0 = self.clock()
        self.mig = dict(mig or {})

    def nvmlDeviceGetCount(self):
        return self.count

    def nvmlDeviceGetHandleByIndex(self, i):
        if not 0 <= i < self.count:
            raise RuntimeError("NVML_ERROR_INVALID_ARGUMENT")
        return i

    def nvmlDeviceGetUUID(self, h):
        if isinstance(h, tuple):
            return f"MIG-{h[0]:08d}-{h[1]:04d}-fake"
        return f"GPU-{h:08d}-fake"

    def nvmlDeviceGetName(self, h):
        if isinstance(h, tuple):
            return f"{self.name} MIG 1g.10gb"
        return self.name.encode()  # older nvidia-ml-py returns bytes

    def nvmlDeviceGetMemoryInfo(self, h):
        total = self.memory_total // 8 if isinstance(h, tuple) else self.memory_total
        used = 2**30 + sum(b for _, b in self.procs)
        return self._ns(used=used, total=total, free=total - used)

    def nvmlDeviceGetMigMode(self, h):
        if h not in self.mig:
            raise RuntimeError("NVML_ERROR_NOT_SUPPORTED")
        return (1, 1)

    def nvmlDeviceGetMaxMigDeviceCount(self, h):
        return 7

    def nvmlDeviceGetMigDeviceHandleByIndex(self, h, slot):
        if slot >= self.mig.get(h, 0):
            raise RuntimeError("NVML_ERROR_NOT_FOUND")
        return (h, slot)

    def nvmlDeviceGetUtilizationRates(self, h):
        return self._ns(gpu=self.util_pct, memory=30)

    def nvmlDeviceGetPowerUsage(self, h):
        if isinstance(h, tuple):
            raise RuntimeError("NVML_ERROR_NOT_SUPPORTED")
        return int(self.power_w * 1000)  # milliwatts

    def nvmlDeviceGetTotalEnergyConsumption(self, h):
        if isinstance(h, tuple):
            raise RuntimeError("NVML_ERROR_NOT_SUPPORTED")
        return int(1e9 + self.power_w * (self.clock() - self.t0) * 1000)  # millijoules since "driver load"

    def nvmlDeviceGetComputeRunningProcesses(self, h):
        return [self._ns(pid=p, usedGpuMemory=b) for p, b in self.procs]
