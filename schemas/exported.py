"""A stored row as the exported files show it (jobs/lifecycle/export.py): which columns, their
Arrow types, and the stored values turned into those columns.  The names and types follow from
the records' fields (schemas/records.py), declared there once."""

from __future__ import annotations

import dataclasses
import json
from functools import cache
from typing import Any

import pyarrow as pa

from tokenmill.schemas.records import StoredRow, embedding_values, format_ref

#: A stored column's Arrow type in the files, by its SQL kind, where the field names none.
ARROW = {"str": pa.string(), "text": pa.string(), "int": pa.int64(), "bigint": pa.int64(), "float": pa.float64(),
         "json": pa.string(), "bool": pa.bool_(), "bytes": pa.binary()}


@cache
def _export_names(record: type[StoredRow]) -> tuple[str, ...]:
    """Exported column names: the exported fields, with input_file/input_row shown as `input_ref`."""
    names: list[str] = []
    for f in dataclasses.fields(record):
        if not f.metadata["export"] or f.name == "input_row":
            continue
        names.append("input_ref" if f.name == "input_file" else f.name)
    return tuple(names)


@cache
def export_schema(record: type[StoredRow]) -> pa.Schema:
    """The Arrow schema of the record's exported file."""
    types = {f.name: f.metadata["arrow"] or ARROW[f.metadata["sql"].split(":")[0]] for f in dataclasses.fields(record)}
    types["input_ref"] = pa.string()
    return pa.schema([(n, types[n]) for n in _export_names(record)])  # type: ignore[arg-type]  # a record class is hashable


@cache
def _json_text_columns(record: type[StoredRow]) -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(record)
                 if f.metadata["sql"] == "json" and f.metadata["arrow"] is None and f.metadata["export"])


def stored_names(record: type[StoredRow]) -> tuple[str, ...]:
    """The table columns `exported_columns` reads: the exported fields, `input_ref` as
    `input_file` and `input_row`."""
    return tuple(n for k in _export_names(record) for n in (("input_file", "input_row") if k == "input_ref" else (k,)))  # type: ignore[arg-type]  # a record class is hashable


def exported_columns(record: type[StoredRow], columns: dict[str, list[Any]]) -> dict[str, list[Any]]:
    """Stored rows as columns (name → values, `stored_names`) → the exported files' columns:
    a json column without an Arrow type as its JSON text, an embedding as its floats, the
    input position as `input_ref`."""
    out: dict[str, list[Any]] = {}
    for k in _export_names(record):  # type: ignore[arg-type]  # a record class is hashable
        if k == "input_ref":
            out[k] = [format_ref(f, r) for f, r in zip(columns["input_file"], columns["input_row"])]
        elif k in _json_text_columns(record):  # type: ignore[arg-type]  # a record class is hashable
            out[k] = [None if v is None else json.dumps(v, ensure_ascii=False) for v in columns[k]]
        elif k == "embedding":
            out[k] = [None if v is None else embedding_values(v) for v in columns[k]]
        else:
            out[k] = columns[k]
    return out
