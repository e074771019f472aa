"""Steps over work units: each `Chunk` (one unit's records) goes in, the chunk of what
survived comes out, and every row that cannot go on leaves as a dead letter on the
`dead` output.  A step that maps row by row subclasses `MapRows`."""

from __future__ import annotations

import pickle
from typing import Any, Iterable

import apache_beam as beam
from apache_beam.transforms.window import GlobalWindows

from tokenmill.schemas.records import Chunk, FailedRecord

DEAD = "dead"

#: A nominal encoded size of one of a chunk's records, for `ChunkCoder.estimate_size`.
NOMINAL_RECORD_BYTES = 512


class ChunkCoder(beam.coders.Coder):
    """How a `Chunk` is encoded where it crosses between stages: pickled.

    Beam also estimates the size of a step's first outputs and a sample of the rest
    (its `OperationCounters`, for the `MeanByteCount` counter), and a pickling coder does
    that by encoding the element.  A chunk is a whole unit, thousands of rows, and a job
    has few units, so nearly every chunk was pickled after every step only to be
    measured: 6-7 s of the main thread at 100,000 rows (docs/BENCHMARKS.md).  This
    coder's estimate is the record count times a nominal record size instead; no
    figure of tokenmill's reads Beam's byte counters."""

    def encode(self, value: Chunk) -> bytes:
        return pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)

    def decode(self, encoded: bytes) -> Chunk:
        return pickle.loads(encoded)

    def is_deterministic(self) -> bool:
        return False

    def estimate_size(self, value: Chunk) -> int:
        return NOMINAL_RECORD_BYTES * len(value.items)


beam.coders.registry.register_coder(Chunk, ChunkCoder)


class MapRows(beam.DoFn):
    """Chunk → Chunk of `map_row(item)` results; FailedRecords go to `dead` (from part 0
    only: every part of a unit sees the same rows), None drops a row."""

    def map_row(self, item: Any) -> Any:
        raise NotImplementedError

    def process(self, chunk: Chunk):
        yield from self.emit(chunk, (self.map_row(item) for item in chunk.items))

    @staticmethod
    def emit(chunk: Chunk, results: Iterable[Any]):
        """The chunk of the results that go on, and a dead letter for each FailedRecord."""
        ok = []
        for out in results:
            if isinstance(out, FailedRecord):
                if chunk.part == 0:
                    yield beam.pvalue.TaggedOutput(DEAD, out)
            elif out is not None:
                ok.append(out)
        if ok:
            yield chunk.with_items(ok)


def windowed(outputs: Iterable[Any]):
    """A DoFn's outputs as `finish_bundle` must give them: each value, tagged or not, in
    the global window (the pipeline's only one)."""
    for o in outputs:
        if isinstance(o, beam.pvalue.TaggedOutput):
            yield beam.pvalue.TaggedOutput(o.tag, GlobalWindows.windowed_value(o.value))
        else:
            yield GlobalWindows.windowed_value(o)


def over_chunks(fn: beam.DoFn, label: str, *tags: str):
    """A ParDo of `fn` whose main output is chunks (encoded by `ChunkCoder`); with `tags`,
    its main output is `ok` and the tagged outputs are those."""
    step = beam.ParDo(fn).with_output_types(Chunk)
    return label >> (step.with_outputs(*tags, main="ok") if tags else step)


def with_dead(fn: beam.DoFn, label: str):
    """A ParDo of `fn` with its main output `ok` (chunks) and dead letters on `dead`."""
    return over_chunks(fn, label, DEAD)
