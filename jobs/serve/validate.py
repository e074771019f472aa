"""A batch's input file checked before anything runs, as OpenAI's `validating` step does: every
line a request tokenmill serves, each `custom_id` once, one served model (a line may name it or
one of its LoRA adapters).  A batch with any bad line fails whole, its errors naming the line
(1-based, blank lines counted), and no engine works on it; a well-formed line asking for what
is not served (`Unsupported`: a `/v1/responses` line's tools, reasoning, ...) passes, and fails
alone when the batch runs.  Each line is parsed once, by the
wire format (schemas/wire/openai/request.py), and the check gives the file's per-line index
(schemas/wire/lines.py) that the job's planning, export and finalization read instead of the file."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import IO, Any, Iterable, Mapping

from tokenmill.schemas.wire.lines import LineError, LineIndex, Unsupported, scan
from tokenmill.schemas.wire.openai.objects import line_error
from tokenmill.schemas.wire.openai.request import ENDPOINTS, check_sampling, decode, request_fields, request_line


@dataclass
class Checked:
    """What validation found: the requests, the one served model they run on (the base model,
    whether the lines name it or its adapters), and the errors (each OpenAI's `BatchError`:
    code, message, param, line)."""

    lines: int = 0
    model: str | None = None
    errors: list[dict[str, Any]] = field(default_factory=list)
    error_count: int = 0
    index: LineIndex = field(default_factory=LineIndex)
    """Every line read, with its byte range, custom_id, endpoint and model (complete when there
    are no errors)."""


#: How long a `model_not_found` message's list of the served names may grow.
SERVED_LIST_CHARS = 300


def served_list(served: Mapping[str, str], limit: int = SERVED_LIST_CHARS) -> str:
    """The names a line may give, each served model with its adapters (`m (adapters: a, b), n`),
    cut at about `limit` characters with how many names there are in all."""
    adapters: dict[str, list[str]] = {}
    for name, model in served.items():
        adapters.setdefault(model, [])
        if name != model:
            adapters[model].append(name)
    text = ", ".join(m + (f" (adapters: {', '.join(a)})" if a else "") for m, a in adapters.items())
    return text if len(text) <= limit else f"{text[:limit].rstrip(', ')}… ({len(served)} names in all)"


def check_lines(lines: Iterable[bytes], served: Mapping[str, str], *, max_lines: int,
                max_errors: int = 100) -> Checked:
    """Check a batch file's lines; stops listing errors after `max_errors` (all are counted).
    `served`: each name a line may give → the served model that answers it
    (`ServeConfig.served_names`)."""
    out = Checked()
    seen: set[str] = set()
    named: dict[str, tuple[int, str]] = {}  # served model -> its first line and the name that line gave

    def fail(code: str, message: str, line: int | None, param: str | None = None) -> None:
        out.error_count += 1
        if len(out.errors) < max_errors:
            out.errors.append(line_error(code, message, line, param))

    for i, offset, raw in scan(lines):
        n = i + 1
        if not raw.strip():
            out.index.add(offset, len(raw))
            continue
        out.lines += 1
        if out.lines > max_lines:
            fail("too_many_requests", f"the file has more than {max_lines:,} requests, the most a batch takes", n)
            break
        try:
            obj = decode(raw)
        except LineError as err:
            fail("invalid_json_line", f"line {n} is not valid JSON: {err.detail[:200]}", n)
            continue
        if not isinstance(obj, dict):
            fail("invalid_json_line", f"line {n} is not a JSON object", n)
            continue
        if obj.get("method", "POST") != "POST":
            fail("invalid_method", f"line {n}: method must be POST, got {str(obj.get('method'))[:40]!r}", n, "method")
            continue
        if obj.get("url") not in ENDPOINTS:
            fail("invalid_url", f"line {n}: url must be one of {list(ENDPOINTS)}, got {str(obj.get('url'))[:80]!r}",
                 n, "url")
            continue
        try:
            req = request_fields(obj)
            check_sampling(req)  # out of range fails here, as OpenAI's validation does, not at run time
        except Unsupported:  # the line alone fails when the batch runs: its envelope is checked here
            env = request_line(obj)
            req = {"custom_id": env.custom_id, "url": env.url, "model": env.model}
        except LineError as err:
            fail(err.code, f"line {n}: {err}", n, err.param)
            continue
        cid = req["custom_id"]
        if cid in seen:
            fail("duplicate_custom_id", f"line {n}: custom_id {cid[:80]!r} appears on an earlier line; each request "
                                        "needs its own", n, "custom_id")
            continue
        seen.add(cid)
        model = req.get("model")
        if not isinstance(model, str) or model not in served:
            fail("model_not_found", f"line {n}: model {str(model)[:80]!r} is not served here (served: "
                                    f"{served_list(served)})", n, "body.model")
            continue
        named.setdefault(served[model], (n, model))
        out.index.add(offset, len(raw), cid, req["url"], model)
    if len(named) > 1:
        (line_a, a), (line_b, b) = sorted(named.values())[:2]
        fail("mismatched_model", f"line {line_b}: model {_named(b, served)}, but line {line_a} names "
                                 f"{_named(a, served)}; a batch runs on one model", line_b, "body.model")
    if out.lines == 0 and not out.errors:
        fail("empty_file", "the input file has no requests", None)
    out.model = next(iter(named), None)
    return out


def _named(name: str, served: Mapping[str, str]) -> str:
    return repr(name) if served[name] == name else f"{name!r} (an adapter of {served[name]!r})"


def check_file(fh: IO[bytes], served: Mapping[str, str], *, max_lines: int, max_errors: int = 100) -> Checked:
    with fh:
        return check_lines(fh, served, max_lines=max_lines, max_errors=max_errors)
