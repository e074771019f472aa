"""Images in chat prompts (`image_url` parts, `images.column`; docs/REQUESTS.md, "Images").

End to end on a tiny LLaVA made here (tests/vision_model.py: SmolLM2-135M's text weights, a
random CLIP tower of 64x64 pixels, 16 image tokens an image), which proves the path, not
answer quality: one real vLLM job whose rows give the same image as a data: URI, a local
path, an s3:// URL (a loopback moto server) and an image column's bytes, beside a text-only
twin, a corrupt image, a web URL and an image over `images.max_bytes`; then an OpenAI batch
file's image_url line on the same engine.  The rest (refusals,
limits, ordering keys, batch lines, cache keys) without an engine."""

from __future__ import annotations

import base64
import io
import json
import os
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from tests.conftest import TEST_ENGINE, write_parquet
from tests.helpers import job_spec
from tests.vision_model import IMAGE_TOKENS, vision_model
from tokenmill.schemas import records as R
from tokenmill.schemas.exported import export_schema
from tokenmill.schemas.records import DeadLetterRow, OutputRow
from tokenmill.transforms.images import ImageRules
from tokenmill.transforms.validate import validate_row

SYSTEM = "You describe pictures. " * 40  # over one 128-token KV block: a shared prefix before the image
QUESTION = "What is in the picture?"
RULES = ImageRules(max_bytes=4096, max_pixels=256 * 256)


def _png(color=(200, 30, 30), size=(8, 8), noise: bool = False) -> bytes:
    from PIL import Image

    im = Image.frombytes("RGB", size, os.urandom(size[0] * size[1] * 3)) if noise else Image.new("RGB", size, color)
    buf = io.BytesIO()
    im.save(buf, format="PNG")
    return buf.getvalue()


def _data_uri(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def _chat(url: str | None) -> str:
    user = QUESTION if url is None else [{"type": "image_url", "image_url": {"url": url}},
                                         {"type": "text", "text": QUESTION}]
    return json.dumps([{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}])


def _row(url: str, **more) -> dict:
    return {"_file_index": 0, "_row": 0, "id": "r", "messages": _chat(url), **more}


@pytest.fixture(scope="module")
def vlm(model_path) -> Path:
    return vision_model(model_path)


@pytest.fixture(scope="module")
def s3_url(tmp_path_factory):
    """An s3:// URL of the red image on a loopback moto server, the standard AWS variables set."""
    import boto3
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    mp = pytest.MonkeyPatch()
    for k, v in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1",
                 "AWS_ENDPOINT_URL_S3": f"http://{host}:{port}"}.items():
        mp.setenv(k, v)
    client = boto3.client("s3", endpoint_url=f"http://{host}:{port}")
    client.create_bucket(Bucket="pictures")
    client.put_object(Bucket="pictures", Key="red.png", Body=_png())
    yield "s3://pictures/red.png"
    mp.undo()
    server.stop()


@pytest.mark.engine
def test_images_from_a_data_uri_a_path_s3_and_a_column_reach_vllm_and_bad_ones_are_dead_letters(
        tmp_path, sqlite_url, vlm, s3_url):
    from tokenmill.jobs.lifecycle.runner import run_job

    red = _png()
    (tmp_path / "red.png").write_bytes(red)
    big = _png(size=(48, 48), noise=True)
    assert len(big) > 4096
    rows = [
        {"id": "data", "messages": _chat(_data_uri(red))},
        {"id": "path", "messages": _chat(str(tmp_path / "red.png"))},
        {"id": "s3", "messages": _chat(s3_url)},
        {"id": "column", "messages": _chat(None), "picture": red},
        {"id": "text", "messages": _chat(None)},
        {"id": "corrupt", "messages": _chat(_data_uri(b"this is not a png at all"))},
        {"id": "web", "messages": _chat("https://example.com/cat.png")},
        {"id": "huge", "messages": _chat(_data_uri(big))},
    ]
    for r in rows:
        r.setdefault("picture", None)
    inp = write_parquet(tmp_path / "in.parquet", rows)
    spec = job_spec(inp, tmp_path / "out", job_id="images", engine={**TEST_ENGINE, "model": str(vlm)},
                    sampling={"max_tokens": 4, "temperature": 0.0}, images={"column": "picture", "max_bytes": 4096})
    res = run_job(spec, db_url=sqlite_url)
    assert (res.total, res.succeeded, res.failed) == (8, 5, 3), res

    outputs = pq.read_table(tmp_path / "out" / "outputs.parquet")
    dead = pq.read_table(tmp_path / "out" / "dead_letters.parquet")
    assert outputs.schema.remove_metadata() == export_schema(OutputRow)
    assert dead.schema.remove_metadata() == export_schema(DeadLetterRow)
    assert json.loads((tmp_path / "out" / "_SUCCESS.json").read_text())["status"] == "partial"
    out = {r["id"]: r for r in outputs.to_pylist()}
    letters = {d["id"]: d for d in dead.to_pylist()}
    assert sorted(out) + sorted(letters) == sorted(["column", "data", "path", "s3", "text"]) + \
        sorted(["corrupt", "huge", "web"])

    # the engine counted each image's 19 tokens (16 and three markers) in place of its one placeholder
    from tokenmill.transforms.counting import load_tokenizer

    tok = load_tokenizer(str(vlm))
    text_ids = tok.apply_chat_template(json.loads(_chat(None)), add_generation_prompt=True, tokenize=False)
    assert out["text"]["prompt_tokens"] == len(tok(text_ids, add_special_tokens=False)["input_ids"])
    for rid in ("data", "path", "s3", "column"):
        row = out[rid]
        assert row["prompt_tokens"] == out["text"]["prompt_tokens"] + IMAGE_TOKENS, rid
        assert row["token_count_source"] == "engine" and row["output_tokens"] >= 1
    # Not asserted: that the four routes answer the same words, and that image rows read the
    # shared system block from vLLM's prefix cache.  Both were seen in the runs made here, but
    # both hang on the engine's scheduling and float rounding (one run of ten failed, its cause
    # not kept).

    assert letters["corrupt"]["reason"] == R.BAD_IMAGE and "cannot be decoded" in letters["corrupt"]["message"]
    assert letters["huge"]["reason"] == R.BAD_IMAGE and "over images.max_bytes 4,096" in letters["huge"]["message"]
    assert letters["web"]["reason"] == R.REMOTE_IMAGE
    assert "not fetched from the web" in letters["web"]["message"] and "\n" not in letters["web"]["message"]

    # an OpenAI batch line's image_url part, on the same engine: the same count, an error line for a web URL
    lines = [{"custom_id": cid, "method": "POST", "url": "/v1/chat/completions", "body": {
        "model": str(vlm), "messages": json.loads(_chat(url))}} for cid, url in (("img", s3_url), ("web", "http://x/y.png"))]
    (tmp_path / "batch.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    batch = job_spec(tmp_path / "batch.jsonl", tmp_path / "out-batch", job_id="images-batch",
                     engine={**TEST_ENGINE, "model": str(vlm)}, sampling={"max_tokens": 4, "temperature": 0.0})
    assert run_job(batch, db_url=sqlite_url).succeeded == 1
    answer = json.loads((tmp_path / "out-batch" / "outputs.jsonl").read_text())
    assert answer["response"]["body"]["usage"]["prompt_tokens"] == out["s3"]["prompt_tokens"]
    assert json.loads((tmp_path / "out-batch" / "errors.jsonl").read_text())["error"]["code"] == R.REMOTE_IMAGE


# ---------------------------------------------------------------- without an engine


def test_a_web_url_a_corrupt_image_and_limits_are_each_a_reasoned_dead_letter(tmp_path):
    cases = {
        "http://example.com/a.png": (R.REMOTE_IMAGE, "is a web URL"),
        _data_uri(b"GIF89a broken"): (R.BAD_IMAGE, "cannot be decoded"),
        _data_uri(_png(size=(300, 300))): (R.BAD_IMAGE, "over images.max_pixels 65,536"),
        "data:image/png,notbase64": (R.BAD_IMAGE, "must be base64"),
        str(tmp_path / "missing.png"): (R.BAD_IMAGE, "cannot be read"),
        "gs://bucket/a.png": (R.BAD_IMAGE, "not a data: URI, a path or an s3:// URL"),
    }
    for url, (reason, said) in cases.items():
        got = validate_row(_row(url), images=RULES)
        assert isinstance(got, R.FailedRecord) and got.reason == reason and said in got.message, (url, got)
    ok = validate_row(_row(_data_uri(_png())), images=RULES)
    assert isinstance(ok, R.PromptRecord) and ok.images == (_png(),)
    assert ok.messages[1]["content"] == [{"type": "image"}, {"type": "text", "text": QUESTION}]


def test_an_engine_without_images_refuses_image_rows_and_an_image_column_before_the_run(tmp_path):
    from tests import echo_engine
    from tokenmill.jobs.lifecycle.preflight import preflight
    from tokenmill.transforms.engines import kinds
    from tokenmill.transforms.images import image_rules

    kinds.register(echo_engine.ENGINE)
    try:
        inp = write_parquet(tmp_path / "in.parquet", [{"id": "a", "messages": _chat(None), "picture": _png()}])
        spec = job_spec(inp, tmp_path / "out", engine={"kind": "echo"}, images={"column": "picture"})
        got = validate_row(_row(_data_uri(_png())), images=image_rules(spec))
        problems = preflight(spec, engine=False).problems
        missing = preflight(job_spec(inp, tmp_path / "out", images={"column": "photo"}), engine=False).problems
    finally:
        kinds.unregister("echo")
    assert got.reason == R.BAD_REQUEST and "engine kind echo does not take images; kinds that do: vllm" in got.message
    assert "images.column 'picture': engine kind echo does not take images; kinds that do: vllm" in problems
    assert any(p.startswith("images.column 'photo' is not a column of the input") for p in missing)


def test_text_parts_alone_are_joined_and_an_image_column_goes_first_in_the_last_user_message():
    rules = ImageRules(max_bytes=4096, max_pixels=4096, column="picture")
    parts = json.dumps([{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}])
    got = validate_row({"_file_index": 0, "_row": 0, "messages": parts, "picture": None}, images=rules)
    assert got.messages == [{"role": "user", "content": "ab"}] and got.images == ()
    two = json.dumps([{"role": "user", "content": [{"type": "image_url", "image_url": _data_uri(_png((1, 2, 3)))}]},
                      {"role": "assistant", "content": "ok"}, {"role": "user", "content": "and this?"}])
    got = validate_row({"_file_index": 0, "_row": 0, "messages": two, "picture": _png()}, images=rules)
    assert got.images == (_png((1, 2, 3)), _png())  # in the order the prompt places them
    assert got.messages[2]["content"] == [{"type": "image"}, {"type": "text", "text": "and this?"}]
    prompt = validate_row({"_file_index": 0, "_row": 0, "prompt": "hi", "picture": _png()}, images=rules)
    assert prompt.reason == R.BAD_IMAGE and "a prompt row has no place for an image" in prompt.message


def test_image_rows_sharing_a_system_prompt_share_a_prefix_key_and_their_images_key_the_cache(vlm):
    from tokenmill.schemas.config import SamplingDefaults
    from tokenmill.transforms.cache import prompt_keys
    from tokenmill.transforms.counting import LocalEncoder, load_tokenizer
    from tokenmill.transforms.tokenize import RecordRules, prompt_record

    enc = LocalEncoder(load_tokenizer(str(vlm)))
    recs = [validate_row(_row(_data_uri(_png(c))), images=RULES) for c in ((255, 0, 0), (0, 255, 0))]
    other = validate_row({**_row(_data_uri(_png())), "messages": json.dumps(
        [{"role": "system", "content": "Something else entirely. " * 40}, {"role": "user", "content": QUESTION}])},
        images=RULES)
    toks = [prompt_record(r, ids, RecordRules(max_model_len=1024, default_max_tokens=4, block_size=128))
            for r, ids in zip([*recs, other], enc.encode_many([*recs, other]))]
    red, green, text = toks
    assert red.prefix_key == green.prefix_key != text.prefix_key
    image_token = load_tokenizer(str(vlm)).convert_tokens_to_ids("<image>")
    assert list(red.token_ids).count(image_token) == 1 and red.images == recs[0].images
    keys = [prompt_keys("fp", SamplingDefaults(), t) for t in (red, green)]
    assert list(red.token_ids) == list(green.token_ids) and keys[0] != keys[1]


def test_an_images_tokens_count_in_the_budget_and_the_length_check_as_the_engine_makes_them(vlm, model_path):
    from tokenmill.transforms.counting import LocalEncoder, load_tokenizer
    from tokenmill.transforms.images import ImageTokens
    from tokenmill.transforms.tokenize import RecordRules, prompt_record

    rec = validate_row(_row(_data_uri(_png(size=(40, 20)))), images=RULES)
    ids = LocalEncoder(load_tokenizer(str(vlm))).encode_many([rec])[0]
    extra = ImageTokens(str(vlm)).extra(rec.images)
    assert extra == IMAGE_TOKENS - 1  # the engine's 19 in place of the one placeholder
    assert ImageTokens(model_path).extra(rec.images) == 0  # a text model's folder: no processor that counts
    fits = prompt_record(rec, ids, RecordRules(max_model_len=len(ids) + extra + 4, default_max_tokens=4),
                         image_tokens=extra)
    assert fits.budget_tokens == len(ids) + extra + 4
    over = prompt_record(rec, ids, RecordRules(max_model_len=len(ids) + extra + 3, default_max_tokens=4),
                         image_tokens=extra)
    assert over.reason == R.PROMPT_TOO_LONG and f"prompt has {len(ids) + extra} tokens" in over.message


def test_an_openai_batch_line_keeps_its_image_parts_for_validate():
    from tokenmill.schemas.wire.openai.request import parse_request

    parts = [{"type": "text", "text": "what?"}, {"type": "image_url", "image_url": {"url": "s3://b/k.png"}}]
    got = parse_request(json.dumps({"custom_id": "a", "method": "POST", "url": "/v1/chat/completions",
                                    "body": {"model": "m", "messages": [{"role": "user", "content": parts}]}}))
    assert got["messages"][0]["content"] == parts
