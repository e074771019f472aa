"""The exporters by output format: what `spec.output_format` picks at the end of a job.

A new sink (Delta, BigQuery) is one module with an `Exporter` (jobs/lifecycle/export.py)
and its line in `EXPORTERS`.  A batch-JSONL job (`openai-jsonl`) whose input is Anthropic
Message Batches requests writes Anthropic's results file instead (`batch_format`).
"""

from __future__ import annotations

from typing import Any

from sqlalchemy.engine import Engine

from tokenmill.jobs.lifecycle.anthropic_export import FORMAT as ANTHROPIC
from tokenmill.jobs.lifecycle.anthropic_export import AnthropicBatchExport, is_message_input
from tokenmill.jobs.lifecycle.export import Exporter, ParquetExport, export, job_input
from tokenmill.jobs.lifecycle.openai_export import OpenAIBatchExport

EXPORTERS: dict[str, Exporter] = {e.format: e for e in (ParquetExport(), OpenAIBatchExport(), AnthropicBatchExport())}


def batch_format(fmt: str, source: str | None) -> str:
    """The format a job's export is written in: `fmt`, but Anthropic's results for a batch-JSONL
    input of Anthropic requests (the format is told by the input's lines, not by the spec)."""
    return ANTHROPIC if fmt == "openai-jsonl" and is_message_input(source) else fmt


def export_job(eng: Engine, job_id: str, output_root: str, fmt: str = "parquet") -> dict[str, Any]:
    """Write the job's data files in output format `fmt` (`EXPORTERS`, `batch_format`) and return
    the manifest's export part (export.export)."""
    return export(EXPORTERS[batch_format(fmt, job_input(eng, job_id))], eng, job_id, output_root)
