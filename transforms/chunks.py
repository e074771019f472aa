"""Steps over work units: each `Chunk` (one unit's records) goes in, the chunk of what
survived comes out, and every row that cannot go on leaves as a dead letter on the
`dead` output.  A step that maps row by row subclasses `MapRows`."""

from __future__ import annotations

from typing import Any, Iterable

import apache_beam as beam

from tokenmill.schemas.records import Chunk, FailedRecord

DEAD = "dead"


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


def with_dead(fn: beam.DoFn, label: str):
    """A ParDo of `fn` with its main output `ok` and dead letters on `dead`."""
    return label >> beam.ParDo(fn).with_outputs(DEAD, main="ok")
