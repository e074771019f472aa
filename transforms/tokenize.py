"""Tokenize: chat template + token ids + prefix key, on CPU, before any engine work.

The engine later receives these token ids as they are (`TokensPrompt`), so the
prompt it serves is exactly the one counted here, and `prompt_tokens` in the
outputs still comes from the engine's own output.  An engine sent text is counted
the way its `counting.TokenCounter` says (a local tokenizer, the server's, or an
estimate).
"""

from __future__ import annotations

import functools
import hashlib
import os
from array import array
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Sequence

import apache_beam as beam

from tokenmill.schemas import records as R
from tokenmill.schemas.config import JobSpec
from tokenmill.schemas.errors import first_line
from tokenmill.schemas.records import Chunk, FailedRecord, PromptRecord, TokenizedPrompt
from tokenmill.transforms.chunks import MapRows, windowed, with_dead
from tokenmill.transforms.counting import CountRefused, Encoder, TokenCounter, encode_each
from tokenmill.transforms.engines.device import allowed_cores
from tokenmill.transforms.host_model import model_folder_here
from tokenmill.transforms.images import ImageTokens

DEFAULT_BLOCK_SIZE = 16  # vLLM's KV block size on CUDA; the job passes the engine's real one (128 on CPU)


def prefix_key(token_ids, block_size: int = DEFAULT_BLOCK_SIZE, blocks: int = 4) -> str:
    """Hash of the leading full KV blocks (at most `blocks` of them).

    Aligned to the engine's block size because vLLM's prefix cache shares whole
    blocks only; a prompt shorter than one block gets a key of its own tokens."""
    n = min(len(token_ids) // block_size, blocks) * block_size
    head = token_ids[:n] if n else token_ids
    return hashlib.blake2b(head if isinstance(head, array) else array("i", head), digest_size=8).hexdigest()


@dataclass(frozen=True)
class RecordRules:
    """How a row's encoded prompt becomes the record the engine gets (`prompt_record`)."""

    max_model_len: int
    default_max_tokens: int
    """A row's `max_tokens` where its sampling gives none."""
    block_size: int = DEFAULT_BLOCK_SIZE
    """The engine's KV block size: the prefix key aligns to it."""
    prefix_blocks: int = 4
    """Blocks of the prompt's head in its prefix key."""
    keep_source: bool = False
    """Keep the prompt's text or messages on the record (an engine that takes text)."""
    default_samples: int = 1
    """A row's samples where its sampling gives no `n`."""


def record_rules(spec: JobSpec, block_size: int = DEFAULT_BLOCK_SIZE) -> RecordRules:
    """How a job's rows become the engine's records: a batch's Tokenize step's and an online
    request's (`tokenmill serve`) alike, so both send the engine the same prompt."""
    from tokenmill.transforms.engines.kinds import engine_of

    return RecordRules(spec.engine.max_model_len, 0 if spec.engine.task == "embed" else spec.sampling.max_tokens,
                       block_size, spec.batching.prefix_blocks, keep_source=engine_of(spec.engine.kind).takes_text,
                       default_samples=spec.sampling.n)


def tokenize_record(encoder: Encoder, rec: PromptRecord, rules: RecordRules) -> TokenizedPrompt | FailedRecord:
    """One row: its prompt encoded, then `prompt_record` by the same rules."""
    return prompt_record(rec, encode_each(encoder, [rec])[0], rules)


def prompt_record(rec: PromptRecord, ids: Sequence[int] | Exception, rules: RecordRules, *,
                  image_tokens: int = 0) -> TokenizedPrompt | FailedRecord:
    """A row with its encoded prompt (`ids`, or the exception encoding it raised) → the record
    the engine gets, or its dead letter (the counter refused it, its template failed, it is
    longer than the model takes); `image_tokens`: what its images add beyond their placeholders
    (`images.ImageTokens`)."""
    max_model_len, block_size, prefix_blocks = rules.max_model_len, rules.block_size, rules.prefix_blocks
    default_max_tokens, keep_source, default_samples = rules.default_max_tokens, rules.keep_source, rules.default_samples
    max_tokens = rec.sampling.get("max_tokens", default_max_tokens)
    if isinstance(ids, CountRefused):
        return FailedRecord(rec.input_file, rec.input_row, rec.id, R.BAD_REQUEST, first_line(ids))
    if isinstance(ids, Exception):  # a template that rejects the conversation, for example
        return FailedRecord(rec.input_file, rec.input_row, rec.id, R.BAD_MESSAGES, f"chat template failed: {first_line(ids)}")
    limit = max_model_len - max_tokens
    if len(ids) + image_tokens > limit:
        return FailedRecord(
            rec.input_file,
            rec.input_row,
            rec.id,
            R.PROMPT_TOO_LONG,
            f"prompt has {len(ids) + image_tokens} tokens; the limit is max_model_len {max_model_len} - max_tokens {max_tokens} = {limit}",
        )
    # 4 bytes a token, not a Python int's 36: a unit's prompts stay small (a local encoder's are already)
    token_ids = ids if isinstance(ids, array) and ids.typecode == "i" else array("i", ids)
    return TokenizedPrompt(
        id=rec.id,
        input_file=rec.input_file,
        input_row=rec.input_row,
        token_ids=token_ids,
        prefix_key=prefix_key(token_ids, block_size, prefix_blocks),
        max_tokens=max_tokens,
        sampling=rec.sampling,
        reference=rec.reference,
        source=(rec.messages if rec.messages is not None else rec.prompt) if keep_source else None,
        samples=rec.sampling.get("n", default_samples),
        adapter=rec.adapter,
        images=rec.images,
        image_tokens=image_tokens,
    )


class TokenizeFn(MapRows):
    """Each chunk's prompts are encoded on the process's tokenize-ahead thread while the
    step hands on the chunk before it: the steps after Tokenize (Generate and its commits)
    run on the bundle's thread while the tokenizer works (a fast tokenizer's Rust code
    runs without the GIL), instead of the worker waiting for each unit's encoding.  So a
    chunk is emitted when the next one arrives, the last by `finish_bundle`, and a worker
    holds at most two units' prompts."""

    def __init__(self, counter: TokenCounter, rules: RecordRules, workers: int = 1):
        self._counter = counter
        self._rules = rules
        self._workers = workers
        """Workers sharing this host's cores: each encodes on its share of them."""
        self._encoder: Encoder | None = None
        self._images: ImageTokens | None = None
        self._encoding: tuple[Chunk, Future] | None = None
        """The chunk being encoded on the tokenize-ahead thread, and its encoding."""

    def setup(self):
        counter = self._counter
        if counter.source == "local" and counter.model:
            # the launcher's folder, or on a worker of another host the same model's as this host has it
            counter = replace(counter, model_path=model_folder_here(counter.model, counter.model_path,
                                                                    need_weights=False))
        self._encoder = counter.open(threads=max(1, len(allowed_cores()) // self._workers))
        self._images = ImageTokens(counter.model_path) if counter.source == "local" and counter.model_path else None

    def start_bundle(self):
        self._encoding = None  # a failed bundle's chunk: it is retried with its bundle

    def process(self, chunk: Chunk):
        """The chunk's prompts start encoding (`Encoder.encode_many`, the whole chunk in one
        call); the chunk before it comes out: each row's record or dead letter, as
        `MapRows` gives them."""
        assert self._encoder is not None
        before, self._encoding = self._encoding, (chunk, ahead_thread().submit(self._encoder.encode_many, chunk.items))
        if before is not None:
            yield from self._records(*before)

    def finish_bundle(self):
        last, self._encoding = self._encoding, None
        if last is not None:
            yield from windowed(self._records(*last))

    def _records(self, chunk: Chunk, encoding: Future):
        encoded = encoding.result()  # a counter that fails (a server that does not answer) fails the step here
        extra = self._images.extra if self._images else lambda images: 0
        return self.emit(chunk, (prompt_record(rec, ids, self._rules, image_tokens=extra(rec.images) if rec.images else 0)
                                 for rec, ids in zip(chunk.items, encoded)))


@functools.cache
def ahead_thread() -> ThreadPoolExecutor:
    """The process's one tokenize-ahead thread: chunks are encoded one at a time, in order.
    One per process, not per step instance: a Dask worker runs a step's setup and teardown
    for every task (jobs/lifecycle/dask_runner.py), and a thread made and ended per task
    grew the worker's peak memory with the job's length (docs/BENCHMARKS.md, "What grew in the Dask worker")."""
    return ThreadPoolExecutor(1, thread_name_prefix="tokenize-ahead")


os.register_at_fork(after_in_child=ahead_thread.cache_clear)  # a forked child has the executor, not its thread


class Tokenize(beam.PTransform):
    """Each row's record by `rules` (`RecordRules`); `workers`: the workers that share this
    host's cores (each worker tokenizes on a thread per core of its share, not on every core:
    two workers of a 2-core host do not run four tokenizing threads)."""

    def __init__(self, counter: TokenCounter, rules: RecordRules, workers: int = 1):
        super().__init__()
        self._fn = TokenizeFn(counter, rules, workers)

    def expand(self, chunks):
        return chunks | with_dead(self._fn, "ChatTemplateAndCount")
