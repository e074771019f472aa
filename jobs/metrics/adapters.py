"""A job's figures per LoRA adapter (`metrics["adapters"]`, docs/REQUESTS.md): rows and tokens
as the database counted them per adapter, the generation wall and costs attributed by token share."""

from __future__ import annotations

from typing import Any, Mapping, Sequence

ADAPTER_DEFINITION = (
    "per LoRA adapter (null: the base model): input rows answered (the result cache's too); the prompt and output "
    "tokens of the requests this job's engine answered; request_s = the sum of their e2e_s (measured; requests run "
    "side by side, so it exceeds the wall); generation_s, cost and held_cost = the job's generation wall and "
    "costs attributed by each adapter's share of the engine's prompt + output tokens (rows of all adapters share "
    "the engine's steps, so the wall is not measured per adapter); every figure sums to the job's")


def adapter_figures(by_adapter: Sequence[dict[str, Any]], gen_wall: float,
                    cost: Mapping[str, Any] | None) -> dict[str, Any]:
    """The job's figures per LoRA adapter (`RequestStats.by_adapter`), with the generation wall
    and the costs attributed by token share (ADAPTER_DEFINITION)."""
    total = sum(a["prompt_tokens"] + a["output_tokens"] for a in by_adapter)
    rows = []
    for a in by_adapter:
        share = (a["prompt_tokens"] + a["output_tokens"]) / total if total else 0.0
        row = {**a, "total_tokens": a["prompt_tokens"] + a["output_tokens"], "token_share": share,
               "generation_s": gen_wall * share}
        if cost is not None:
            row["cost"] = cost["total"] * share
            row["held_cost"] = cost["held"]["total"] * share
        rows.append(row)
    return {"by_adapter": rows, "definition": ADAPTER_DEFINITION}


def _name(a: Mapping[str, Any]) -> str:
    return a["adapter"] if a["adapter"] is not None else "(base model)"


def adapter_lines(m: Mapping[str, Any]) -> list[tuple[str, str]]:
    """The report's lines per adapter (none for a job without adapters)."""
    from tokenmill.jobs.metrics.catalog import fmt

    rows = (m.get("adapters") or {}).get("by_adapter") or []
    return [(_name(a), f"{fmt(a['rows'])} rows, {fmt(a['prompt_tokens'])} prompt + {fmt(a['output_tokens'])} output "
                       f"tokens ({fmt(a['token_share'], 'pct')}), generation {fmt(a['generation_s'], 's')}"
                       + (f", cost {fmt(a['cost'], 'usd')}" if a.get("cost") is not None else ""))
            for a in rows]


def compare_adapters(a: Mapping[str, Any], b: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Two jobs' figures per adapter side by side (an adapter in either job), for `compare`."""
    def by_name(m: Mapping[str, Any]) -> dict[str, Mapping[str, Any]]:
        return {_name(x): x for x in (m.get("adapters") or {}).get("by_adapter") or []}

    ra, rb = by_name(a), by_name(b)
    keys = ("rows", "prompt_tokens", "output_tokens", "generation_s", "cost")
    return [{"adapter": n, **{k: [ra.get(n, {}).get(k), rb.get(n, {}).get(k)] for k in keys}}
            for n in sorted(set(ra) | set(rb), key=lambda n: (n != "(base model)", n))]
