"""The exporters by output format: what `spec.output_format` picks at the end of a job.

A new sink (Delta, BigQuery) is one module with an `Exporter` (jobs/lifecycle/export.py)
and its line in `EXPORTERS`.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy.engine import Engine

from tokenmill.jobs.lifecycle.export import Exporter, ParquetExport, export
from tokenmill.jobs.lifecycle.openai_export import OpenAIBatchExport

EXPORTERS: dict[str, Exporter] = {e.format: e for e in (ParquetExport(), OpenAIBatchExport())}


def export_job(eng: Engine, job_id: str, output_root: str, fmt: str = "parquet") -> dict[str, Any]:
    """Write the job's data files in output format `fmt` (`EXPORTERS`) and return the
    manifest's export part (export.export)."""
    return export(EXPORTERS[fmt], eng, job_id, output_root)
