"""`tokenmill estimate`: what a job will cost and how long it will take here, before it runs
(docs/ESTIMATE.md).  One concept a module:

- `profile`: the whole input read, validated and tokenized as the job does it (a large
  input: a reproducible subset);
- `sample`: the sample's size, its draw (stratified by prompt-length band) and its file;
- `engine_model`: the batch-level engine model fitted on the sample and its simulation;
- `predict`: output lengths per band, the prefix cache, the generation wall, held time and
  cost, each with its interval (pure);
- `measure`: the sample job's measurements read back (requests, fixed part, price);
- `make`: `estimate_job` (`make_estimate` here), which runs it all and stores the estimate (`EstimateStore`);
- `beside`: the newest estimate beside what the job did (`report`, `status`);
- `render`: the estimate as a table for a person.

This package's import is light (no Beam, no engine): `report` and `status` read `beside`.
"""

from __future__ import annotations

from typing import Any, Callable


def make_estimate(spec, *, db_url: str | None = None, sample: int | None = None,
                  stage: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Estimate the job of `spec` (a JobSpec): tokenize its input, run a sample of `sample`
    rows (default: `sample.default_sample_rows`) through its own engine and settings as the
    job `<job id>:estimate`, predict the whole job, store the estimate under
    `spec.derived_job_id()` and return it (its JSON: docs/ESTIMATE.md).  `stage(line)` is
    told each step.  Raises `make.EstimateError` (one line) when it cannot be made."""
    from tokenmill.jobs.estimate.make import estimate_job

    return estimate_job(spec, db_url=db_url, sample=sample, stage=stage)
