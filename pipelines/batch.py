"""The batch inference pipeline: one PCollection chain, each step a labelled PTransform.

    ReadPrompts → Validate → SkipDone → DedupIds → Tokenize → RouteByPrefix
      → Generate → WriteToDatabase(outputs)
    dead letters of every step → WriteToDatabase(dead_letters)

`build_pipeline` only wires; each step's logic lives in transforms/ and is
tested there without a pipeline.  Pieces are injectable (the engine session
factory) so pipeline tests can swap the engine for a fake.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import apache_beam as beam

from tokenmill.schemas.config import JobSpec
from tokenmill.transforms.batching import RouteByPrefix
from tokenmill.transforms.generate import STATS, Generate, GenerateConfig
from tokenmill.transforms.read import InputPlan, ReadPrompts
from tokenmill.transforms.resume import SkipDone
from tokenmill.transforms.tokenize import DEFAULT_BLOCK_SIZE, Tokenize
from tokenmill.transforms.validate import DEAD, DedupIds, Validate
from tokenmill.transforms.write import WriteToDatabase


@dataclass
class PipelineParts:
    """What build_pipeline needs beyond the spec, resolved by the job lifecycle."""

    job_id: str
    run_id: str
    plan: InputPlan
    model_name: str
    model_path: str
    db_url: str
    session_factory: Callable[..., Any] | None = None
    block_size: int | None = None
    """The engine's KV block size; prefix keys align to it."""


def num_shards(spec: JobSpec) -> int:
    if spec.batching.shards:
        return spec.batching.shards
    return max(1, spec.runner.num_workers)


def build_pipeline(p: beam.Pipeline, spec: JobSpec, parts: PipelineParts) -> dict[str, beam.PCollection]:
    block = parts.block_size or spec.engine.block_size or DEFAULT_BLOCK_SIZE
    rows = p | "ReadPrompts" >> ReadPrompts(parts.plan)
    valid = rows | "Validate" >> Validate(spec.reference_column)
    todo = valid.ok | "SkipDone" >> SkipDone(parts.db_url, parts.job_id)
    unique = todo | "DedupIds" >> DedupIds()
    tok = unique.ok | "Tokenize" >> Tokenize(
        parts.model_path, spec.engine.max_model_len, spec.sampling.max_tokens, block, spec.batching.prefix_blocks
    )
    shards = tok.ok | "Batch" >> RouteByPrefix(num_shards(spec))
    gen = shards | "Generate" >> Generate(
        GenerateConfig(
            job_id=parts.job_id,
            run_id=parts.run_id,
            model_name=parts.model_name,
            model_path=parts.model_path,
            engine=spec.engine,
            sampling=spec.sampling,
            batching=spec.batching,
            db_url=parts.db_url,
            num_workers=spec.runner.num_workers if spec.runner.runner in ("DirectRunner", "direct") else 1,
        ),
        parts.session_factory,
    )
    written = gen.ok | "WriteOutputs" >> WriteToDatabase(parts.db_url, parts.job_id, "outputs")
    dead = (valid[DEAD], unique[DEAD], tok[DEAD], gen[DEAD]) | "AllDeadLetters" >> beam.Flatten()
    dead | "WriteDeadLetters" >> WriteToDatabase(parts.db_url, parts.job_id, "dead_letters")
    gen[STATS] | "WriteBatchStats" >> WriteToDatabase(parts.db_url, parts.job_id, "batches")
    return {"outputs": gen.ok, "dead": dead, "stats": gen[STATS], "written": written}
