"""The `vllm` engine's keys: `vllm.LLM`'s arguments, named exactly as vLLM's `EngineArgs`,
so a user who knows vLLM knows these; any other `EngineArgs` field goes through `extra`."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator

from tokenmill.schemas.config import EngineConfig, one_of

#: The adapter ranks vLLM reserves room for (its `LoRAConfig.max_lora_rank`).
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
#: `gpu_memory_utilization` when the job sets none: on a GPU, and of RAM on a CPU.
GPU_MEMORY_SHARE = 0.9
CPU_MEMORY_SHARE = 0.5


class VllmConfig(EngineConfig):
    """`engine:` for `kind: vllm` (the default): vLLM in the worker process."""

    kind: Literal["vllm"] = Field("vllm", json_schema_extra={"flag": False})
    """`vllm`: vLLM in the worker process."""
    dtype: str = Field("auto", json_schema_extra={
        "flag_help": "Weights/activations dtype (auto picks by measurement on CPU)."})
    """`auto`: on a CPU the faster of float32 and bfloat16 in this engine on this model, measured
    once per CPU (transforms/engines/dtype_probe.py); on a GPU the model's own dtype."""
    quantization: str | None = Field(None, json_schema_extra={"flag_help": "vLLM quantization method of the checkpoint."})
    """vLLM's quantization method of the checkpoint."""
    kv_cache_dtype: str = Field("auto", json_schema_extra={"flag_help": "KV cache dtype: auto, fp8, ..."})
    """The KV cache dtype."""
    enable_prefix_caching: bool = Field(True, json_schema_extra={"flag": False})
    gpu_memory_utilization: float | None = Field(None, gt=0.0, le=1.0, json_schema_extra={
        "flag_help": "Share of device memory (of RAM on CPU); default 0.9 on a GPU, 0.5 on CPU."})
    """The share of device memory the engine takes (of RAM on CPU, for its KV cache); unset:
    `GPU_MEMORY_SHARE` on a GPU (the worker's leased devices are its own), `CPU_MEMORY_SHARE`
    of RAM on a CPU (the host's other processes live there too)."""
    kv_cache_memory_bytes: int | None = Field(None, ge=1, json_schema_extra={"flag": False})
    kv_cache_sized_for: Literal["job", "capacity"] = Field("job", json_schema_extra={"flag": False})
    """On a CPU, without `kv_cache_memory_bytes`: what the KV cache is sized for (vLLM-CPU
    allocates it whole at start).  `job`: the work the engine starts for, its rows held at once
    (a later job run that holds more starts the engine again); `capacity`: the most this config
    holds at once, `max_num_seqs` sequences of `max_model_len`, so the engine is never started
    again for a larger job (`tokenmill serve`'s warm engines, unless their config says).
    Either way at most the engine's default share of memory."""
    scheduling_policy: Literal["fcfs", "priority"] | None = Field(None, json_schema_extra={"flag": False})
    """vLLM's scheduler: unset, vLLM's default (`fcfs`); `priority`: a request added with a lower
    `priority` is taken from the waiting queue first, and a running request of a higher value is
    preempted when the KV cache runs out (`tokenmill serve`'s warm engines, whose online requests
    go ahead of the batch's: transforms/engines/shared_session.py)."""
    tensor_parallel_size: int = Field(1, ge=1, json_schema_extra={"flag": False})
    pipeline_parallel_size: int = Field(1, ge=1, json_schema_extra={"flag": False})
    """Pipeline stages (layers split across devices); an engine takes
    tensor_parallel_size × pipeline_parallel_size devices."""
    enforce_eager: bool | None = Field(None, json_schema_extra={"flag": False})
    """No CUDA graphs; unset: off on a GPU (graphs make small decode steps much cheaper),
    on on a CPU (where vLLM-CPU has no graphs to capture)."""
    speculative_config: dict[str, Any] | None = Field(None, json_schema_extra={"flag": False})
    load_format: str = Field("auto", json_schema_extra={"flag": False})

    def memory_share(self, *, on_gpu: bool) -> float:
        """`gpu_memory_utilization`, or its default for the device."""
        if self.gpu_memory_utilization is not None:
            return self.gpu_memory_utilization
        return GPU_MEMORY_SHARE if on_gpu else CPU_MEMORY_SHARE

    def devices(self) -> int:
        """The devices one engine takes (tensor_parallel_size × pipeline_parallel_size)."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    _dtype = field_validator("dtype")(one_of("auto", "float32", "bfloat16", "float16", "half", "float"))
    _kv_dtype = field_validator("kv_cache_dtype")(one_of("auto", "fp8", "fp8_e4m3", "fp8_e5m2", "bfloat16", "float16"))

    @field_validator("max_lora_rank")
    @classmethod
    def _lora_rank(cls, v: int) -> int:
        if v not in VLLM_LORA_RANKS:
            raise ValueError(f"vLLM takes max_lora_rank one of {list(VLLM_LORA_RANKS)}, got {v}")
        return v
