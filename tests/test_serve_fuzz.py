"""A property-based fuzzer over `tokenmill serve`'s own OpenAPI schema (Schemathesis on
Hypothesis): every route of the batch and files API, the page and `/login`, driven in process
(ASGI, with the body limit) with data that fits the schema and data that does not, with a real
key and with none, on SQLite and PostgreSQL (NUL in text and integer widths differ there).
No answer is a 5xx, and every JSON refusal is in OpenAI's error shape.

The budget is fixed (`EXAMPLES` per operation and mode, derandomized: the same cases each run),
so the module stays well under two minutes on two cores."""

from __future__ import annotations

import json
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from starlette.testclient import TestClient

from tests.serve_server import chat_line
from tokenmill.jobs.serve.app import FORM_OVERHEAD, BodyLimit, create_app
from tokenmill.jobs.serve.config import ServeConfig
from tokenmill.jobs.serve.service import BatchService
from tokenmill.schemas import storage as S

#: Cases per operation and generation mode (schema-fitting, schema-breaking), with a key and
#: without one (then every route but the page's and /health is a 401 before it reads anything).
EXAMPLES = {True: 20, False: 5}
KEY = "tm-fuzz"

#: The page's form routes, which read their form themselves (page.py): described here so the
#: fuzzer sends them bodies too.
FORMS = {
    "/login": {"post": {"requestBody": {"content": {"application/x-www-form-urlencoded": {"schema": {
        "type": "object", "properties": {"key": {"type": "string"}}}}}},
        "responses": {"303": {"description": "logged in"}}}},
    "/logout": {"post": {"responses": {"303": {"description": "logged out"}}}},
}


def _served(tmp_path, db: str):
    """The app as uvicorn runs it (with its body limit) over a service whose scheduler is not
    started (no engine), one key, one uploaded file and a batch over it; with its schema and the
    ids that exist."""
    cfg = ServeConfig(db=db, files=str(tmp_path / "files"), work=str(tmp_path / "runs"), models={"m": {}})
    svc = BatchService(cfg)
    svc.start = svc.stop = lambda: None  # type: ignore[method-assign]
    key = S.KeyStore(svc.eng).add("key_fuzz", "fuzz", KEY)
    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps(chat_line("a", "hi", model="m")) + "\n")
    f = svc.add_file(key["id"], "in.jsonl", "batch", str(src), src.stat().st_size, 1)
    b = svc.create_batch(key["id"], f["id"], "/v1/chat/completions", "24h", None)
    app = create_app(cfg, svc)
    spec = app.openapi()
    spec["paths"].update(FORMS)
    schema = schemathesis.openapi.from_dict(spec)
    schema.app = BodyLimit(app, cfg.limits.max_file_bytes + FORM_OVERHEAD)
    return schema, {"file_id": f["id"], "batch_id": b["id"], "job_id": b["id"], "input_file_id": f["id"]}


def _with_known_ids(case, ids: dict[str, str], use: bool):
    """Half the cases name the objects that exist, so routes get past their 404s."""
    if use:
        for name in case.path_parameters or {}:
            case.path_parameters[name] = ids.get(name, case.path_parameters[name])
        if isinstance(case.body, dict) and "input_file_id" in case.body:
            case.body["input_file_id"] = ids["input_file_id"]
    return case


def _is_openai_error(body: Any) -> bool:
    err = body.get("error") if isinstance(body, dict) else None
    return (isinstance(err, dict) and set(err) == {"message", "type", "param", "code"}
            and isinstance(err["message"], str) and isinstance(err["type"], str))


@pytest.mark.parametrize("authorized", [True, False], ids=["key", "no-key"])
def test_no_input_to_any_route_gets_a_server_error_and_refusals_are_openai_errors(tmp_path, any_db_url, authorized):
    schema, ids = _served(tmp_path, any_db_url)
    headers = {"Authorization": f"Bearer {KEY}"} if authorized else {}
    failures: list[str] = []
    for result in schema.get_all_operations():
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            _fuzz(result.ok(), mode, EXAMPLES[authorized], headers, ids, failures)
    assert not failures, "\n".join(failures[:20])


def _fuzz(op, mode: GenerationMode, examples: int, headers: dict[str, str], ids: dict[str, str],
          failures: list[str]) -> None:
    """Send `examples` cases of `op` in `mode`, adding to `failures` each 5xx and each refusal of
    the API not in OpenAI's error shape."""

    @settings(max_examples=examples, derandomize=True, database=None, deadline=None,
              suppress_health_check=list(HealthCheck))
    @given(drawn=st.tuples(op.as_strategy(generation_mode=mode), st.booleans()))
    def call(drawn):
        case = _with_known_ids(drawn[0], ids, drawn[1])
        resp = case.call(headers=headers, allow_redirects=False)
        where = f"{op.method.upper()} {case.formatted_path} query={case.query} body={str(case.body)[:200]}"
        if resp.status_code >= 500:
            failures.append(f"{resp.status_code} from {where}: {resp.text[:200]}")
        elif resp.status_code >= 400 and op.path.startswith("/v1/") and not _is_openai_error(_json(resp)):
            failures.append(f"{resp.status_code} not in OpenAI's error shape from {where}: {resp.text[:200]}")

    try:
        call()
    except Unsatisfiable:  # nothing in the operation's schema to break: no parameter, no bound
        assert mode is GenerationMode.NEGATIVE, op.label


def _json(resp) -> Any:
    try:
        return resp.json()
    except ValueError:
        return None


#: The 500s found before requests.py bounded the routes' inputs (by hand and by this fuzzer;
#: issue 52): NUL and over-wide strings PostgreSQL refuses, integers past SQLite's and
#: PostgreSQL's columns, a host name the IDNA codec refuses.
FOUND = [
    ("GET", "/?offset=9223372036854775808", None),
    ("GET", "/?offset=" + "9" * 30, None),
    ("GET", "/?status=%00", None),
    ("GET", "/jobs/%00", None),
    ("GET", "/v1/files?after=%00", None),
    ("GET", "/v1/files?purpose=%00", None),
    ("GET", "/v1/batches?after=%00", None),
    ("GET", "/v1/files/%00", None),
    ("GET", "/v1/files/%00/content", None),
    ("DELETE", "/v1/files/%00", None),
    ("GET", "/v1/batches/%00", None),
    ("POST", "/v1/batches/%00/cancel", None),
    ("GET", "/v1/batches/%00/webhooks", None),
    ("POST", "/v1/batches", {"completion_window": "0000000000000000001h"}),
    ("POST", "/v1/batches", {"metadata": {"priority": "9" * 30}}),
    ("POST", "/v1/batches", {"metadata": {"priority": str(2**40)}}),
    ("POST", "/v1/batches", {"input_file_id": "\x00"}),
    ("POST", "/v1/batches", {"metadata": {"webhook_url": "http://" + "a" * 300 + ".com/"}}),
]


def test_the_inputs_that_once_got_a_500_are_refused_as_openai_errors(tmp_path, any_db_url):
    schema, ids = _served(tmp_path, any_db_url)
    client = TestClient(schema.app, raise_server_exceptions=False, headers={"Authorization": f"Bearer {KEY}"})
    got = []
    for method, url, body in FOUND:
        fields = {"input_file_id": ids["file_id"], "endpoint": "/v1/chat/completions", "completion_window": "24h"}
        resp = client.request(method, url, json={**fields, **body} if body else None)
        if url.startswith("/v1/") and not _is_openai_error(_json(resp)):
            got.append(f"{method} {url} {body}: {resp.status_code} {resp.text[:200]}")
        elif resp.status_code != 400:
            got.append(f"{method} {url} {body}: {resp.status_code}")
    assert not got, "\n".join(got)
