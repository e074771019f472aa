"""The batch inference pipeline: each step a labelled PTransform over work units.

    PlanUnits → ReadPrompts → ClaimIds → Validate → DedupIds → Tokenize → TakePart → SkipDone
        → ServeCached (`cache: read` or `read-write`) → Generate
    dead letters of Validate, DedupIds, Tokenize → WriteDeadLetters (one writer each)
    Generate commits each finished batch itself: outputs, its dead letters, its figures

ReadPrompts reads only the rows of a unit the job has not answered or dead-lettered (a
done unit is not opened).  ClaimIds claims the ids of the rows it read; no step waits
for the whole input: a duplicate answered before its id's first row was read is settled
where rows are written (transforms/dedup.py, `ResultWriter.claim_ids`/`commit_batch`).

Every element after PlanUnits is one `Chunk`: a unit's rows, carried together
from the read to the engine, so the chain fuses into one stage per worker and
no runner buffers prompts between steps.  `build_pipeline` only wires; each
step's logic lives in transforms/ and is tested there.  The engine session
factory is injectable so pipeline tests can swap the engine for a fake.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import apache_beam as beam

from tokenmill.schemas.config import JobSpec
from tokenmill.transforms.batching import TakePart
from tokenmill.transforms.cache import ServeCached
from tokenmill.transforms.chunks import DEAD
from tokenmill.transforms.counting import TokenCounter
from tokenmill.transforms.dedup import ClaimIds, DedupIds
from tokenmill.transforms.generate import STATS, Generate, GenerateConfig
from tokenmill.transforms.images import image_rules
from tokenmill.transforms.read import InputPlan, PlanUnits, ReadPrompts, plan_units, plan_work
from tokenmill.transforms.resume import SkipDone
from tokenmill.transforms.tokenize import DEFAULT_BLOCK_SIZE, Tokenize, record_rules
from tokenmill.transforms.validate import Validate, used_columns
from tokenmill.transforms.write import WriteDeadLetters

#: Runners whose workers all run on the launching machine (their engines share its cores).
LOCAL_RUNNERS = ("DirectRunner", "direct", "DaskRunner")


@dataclass
class PipelineParts:
    """What build_pipeline needs beyond the spec, resolved by the job lifecycle."""

    job_id: str
    run_id: str
    plan: InputPlan
    model_name: str
    model_path: str
    db_url: str
    counter: TokenCounter | None = None
    """How Tokenize counts the prompts (the engine's preflight says); None: with the
    tokenizer at `model_path`."""
    session_factory: Callable[..., Any] | None = None
    block_size: int | None = None
    """The engine's KV block size; prefix keys align to it."""
    fingerprint: str | None = None
    """The engine's identity in the result cache's keys (`LaunchSide.fingerprint`, transforms/engines/kinds.py);
    None: the job does not use the cache."""
    adapter_hashes: dict[str, str] | None = None
    """The LoRA adapters' content hashes in those keys (transforms/engines/identity.adapter_hashes)."""


def engines_per_host(spec: JobSpec) -> int:
    """Engines that share one machine's cores: every worker of a local runner, else one."""
    return spec.runner.resolved_workers() if spec.runner.runner in LOCAL_RUNNERS else 1


def build_pipeline(p: beam.Pipeline, spec: JobSpec, parts: PipelineParts) -> dict[str, Any]:
    block = parts.block_size or spec.engine.block_size or DEFAULT_BLOCK_SIZE
    plan = parts.plan
    served = plan.rules() if hasattr(plan, "rules") else None  # an OpenAI batch input's lines
    units = plan_units(plan, spec.batching.unit_bytes)
    # a shared job's units are leased whole: never cut into parts (each part would need its own lease)
    shared = spec.runner.lease_s
    work = p | "PlanUnits" >> PlanUnits(plan_work(units, 1 if shared else spec.runner.resolved_workers()))
    ids = not (plan.format == "parquet" and "id" not in plan.columns)  # else ids come from positions: no duplicates
    columns = used_columns(plan.columns, spec.reference_column, spec.images.column) if plan.format == "parquet" else None
    rows = work | "ReadPrompts" >> ReadPrompts(columns, served, parts.db_url, parts.job_id, shared,
                                                spec.engine.task)
    if ids:
        rows = rows | "ClaimIds" >> ClaimIds(parts.db_url, parts.job_id)
    valid = rows | "Validate" >> Validate(spec.reference_column, spec.engine.lora_adapters, image_rules(spec))
    dead = {"Validate": valid[DEAD]}
    unique = valid.ok
    if ids:
        dedup = valid.ok | "DedupIds" >> DedupIds(parts.db_url, parts.job_id)
        unique, dead["DedupIds"] = dedup.ok, dedup[DEAD]
    tok = unique | "Tokenize" >> Tokenize(
        parts.counter or TokenCounter.local(parts.model_path, model=spec.engine.model),
        record_rules(spec, block),
        workers=engines_per_host(spec),
    )
    dead["Tokenize"] = tok[DEAD]
    # The part is taken from the whole unit, before the database is asked what is done,
    # so every part of a unit cuts the same order whatever the others have committed.
    mine = tok.ok | "TakePart" >> TakePart(spec.batching.ordering)
    todo = mine | "SkipDone" >> SkipDone(parts.db_url, parts.job_id)
    if spec.cache != "off" and parts.fingerprint:  # after the claims and SkipDone: every id once, resumable
        todo = todo | "ServeCached" >> ServeCached(parts.db_url, parts.job_id, parts.run_id, parts.fingerprint,
                                                   spec.sampling, parts.model_name, parts.adapter_hashes)
    gen = todo | "Generate" >> Generate(
        GenerateConfig(
            job_id=parts.job_id,
            run_id=parts.run_id,
            model_name=parts.model_name,
            model_path=parts.model_path,
            engine=spec.engine,
            sampling=spec.sampling,
            batching=spec.batching,
            db_url=parts.db_url,
            num_workers=engines_per_host(spec),
            cache=spec.cache,
            fingerprint=parts.fingerprint,
            adapter_hashes=parts.adapter_hashes,
            lease_s=shared,
        ),
        parts.session_factory,
    )
    # Generate has committed each batch (outputs, dead letters, figures) when it finished:
    # on every runner, fused with a writer or not, a failure loses only the batches in flight.
    # One dead-letter writer per other step, not a Flatten: each stays fused with its step,
    # so no runner buffers a job's dead letters between stages.
    for step, pc in dead.items():
        pc | f"WriteDeadLetters{step}" >> WriteDeadLetters(parts.db_url, parts.job_id)
    return {"outputs": gen.ok, "dead": (*dead.values(), gen[DEAD]), "stats": gen[STATS]}
