"""What any line-per-request batch format needs, whatever its fields: the error a line raises,
and the per-line index written once when a file is validated.

A `LineIndex` holds, for every physical line of one input file (blank lines included, so line
numbers and shard cuts match a scan of the file): its byte range, and for a request line its
`custom_id`, endpoint and model.  It is stored beside the file (`index_location`), and read by
whatever would otherwise parse the file again: planning, the export and finalization."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import IO, Iterable, Iterator

from tokenmill.schemas.records import UNSUPPORTED_PARAMETER

#: What `index_location` adds to an input file's location.
INDEX_SUFFIX = ".index.json"
#: The index's own format version (a reader meeting another builds the index again).
INDEX_VERSION = 1


class LineError(ValueError):
    """A line that is not a usable request; the message says what is wrong.  `code` and `param`
    name the fault as a batch API's per-line error does (`invalid_request` when nothing narrower)."""

    def __init__(self, message: str, *, code: str = "invalid_request", param: str | None = None,
                 detail: str | None = None):
        super().__init__(message)
        self.code, self.param = code, param
        self.detail = detail if detail is not None else message
        """The underlying reason alone (a JSON decoder's message), without the line's framing."""


class Unsupported(LineError):
    """A well-formed request asking for what the engine cannot do (tools, reasoning, ...): a
    batch's validation lets the line through, and the line alone fails when the batch runs (a
    dead letter whose reason is this error's `code`, OpenAI's name for such a refusal), so the
    rest of the batch goes on."""

    def __init__(self, message: str, *, param: str | None = None, code: str = UNSUPPORTED_PARAMETER):
        super().__init__(message, code=code, param=param)


def short(v: object, limit: int = 80) -> str:
    """`repr(v)`, cut to about `limit` characters (a value quoted in an error message)."""
    s = repr(v)
    return s if len(s) <= limit else s[:limit - 3] + "..."


def scan(fh: IO[bytes] | Iterable[bytes]) -> Iterator[tuple[int, int, bytes]]:
    """(0-based line number, byte offset, line bytes) for every line of an open binary file."""
    offset = 0
    for i, line in enumerate(fh):
        yield i, offset, line
        offset += len(line)


def index_location(input_url: str) -> str:
    """Where the index of the input file at `input_url` (a path or an s3:// URL) is stored."""
    return input_url + INDEX_SUFFIX


@dataclass
class LineIndex:
    """Every physical line of one input file, by 0-based line number: its byte range, and for a
    request line its `custom_id`, endpoint (`?` for a line that does not name one, None for a blank
    line) and body model.  `size` is the file's byte size, so an index of other bytes is refused."""

    size: int = 0
    offsets: list[int] = field(default_factory=list)
    lengths: list[int] = field(default_factory=list)
    custom_ids: list[str | None] = field(default_factory=list)
    endpoints: list[str | None] = field(default_factory=list)
    models: list[str | None] = field(default_factory=list)

    def add(self, offset: int, length: int, custom_id: str | None = None, endpoint: str | None = None,
            model: str | None = None) -> None:
        self.offsets.append(offset)
        self.lengths.append(length)
        self.custom_ids.append(custom_id)
        self.endpoints.append(endpoint)
        self.models.append(model)
        self.size = max(self.size, offset + length)

    def __len__(self) -> int:
        return len(self.offsets)

    def is_request(self, line: int) -> bool:
        """Whether the line is not blank (blank lines are not requests)."""
        return self.endpoints[line] is not None

    @property
    def requests(self) -> int:
        return sum(1 for e in self.endpoints if e is not None)

    def request_ids(self) -> list[str]:
        """The custom_ids of the request lines, in input order (lines without one have none)."""
        return [c for c in self.custom_ids if c]

    def to_bytes(self) -> bytes:
        return json.dumps({"version": INDEX_VERSION, "size": self.size, "offsets": self.offsets,
                           "lengths": self.lengths, "custom_ids": self.custom_ids, "endpoints": self.endpoints,
                           "models": self.models}, separators=(",", ":")).encode()

    @classmethod
    def from_bytes(cls, data: bytes, size: int | None = None) -> "LineIndex | None":
        """The index stored as `data`; None when it is not one this version reads or, given the
        input's `size`, not the index of that file."""
        try:
            obj = json.loads(data)
            if obj.get("version") != INDEX_VERSION or (size is not None and obj["size"] != size):
                return None
            idx = cls(obj["size"], obj["offsets"], obj["lengths"], obj["custom_ids"], obj["endpoints"], obj["models"])
        except (ValueError, KeyError, TypeError, AttributeError):
            return None
        return idx if len({len(idx.offsets), len(idx.lengths), len(idx.custom_ids), len(idx.endpoints),
                           len(idx.models)}) == 1 else None
