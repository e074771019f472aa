"""Images in chat prompts (docs/REQUESTS.md, "Images"): a message's OpenAI `image_url` parts
and a job's image column (`images.column`), read, checked and carried to the engine.

An image is a `data:` URI (base64), a local path (or `file://` URL) or an `s3://` URL (read
with the job's S3 options, as the input is); an image column's cell may also hold the image's
bytes.  An http(s) URL is refused, its row a `remote_image` dead letter: nothing is fetched
from the open web.  Validate reads each image once, refuses one over `images.max_bytes`, opens
it with Pillow and refuses one over `images.max_pixels` before decoding it whole; what cannot
be read or decoded, or is too large, is the row's `bad_image` dead letter, never the job's
failure.  The record then carries each image's file bytes (`PromptRecord.images`, in the
order the prompt places them), and its message a placeholder part (`{"type": "image"}`, the
form Hugging Face chat templates take), which the model's chat template turns into its image
token; the engine is sent the decoded images with the prompt's token ids (`VllmSession.add`).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import math
from dataclasses import dataclass
from typing import Any

from tokenmill.schemas import records as R
from tokenmill.schemas.config import JobSpec

#: What an image part becomes in a message: the placeholder the chat template renders.
PLACEHOLDER = {"type": "image"}


class ContentError(ValueError):
    """A row's message content or image that cannot be served: its dead-letter reason and one line."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True)
class ImageRules:
    """How a job's Validate step takes images (picklable: it travels to the workers)."""

    max_bytes: int
    max_pixels: int
    column: str | None = None
    """The input column holding one image per row (`images.column`), or None."""
    refusal: str | None = None
    """Why this job's engine takes no images (one line), or None: it does."""


def image_rules(spec: JobSpec) -> ImageRules:
    """How `spec`'s Validate takes images: its limits and column, and, for an engine that takes
    none (`EngineKind.takes_images`), the line that refuses an image row."""
    from tokenmill.transforms.engines.kinds import engine_of, kinds

    refusal = None
    if not engine_of(spec.engine.kind).takes_images:
        refusal = (f"engine kind {spec.engine.kind} does not take images; kinds that do: "
                   f"{', '.join(k for k in kinds() if engine_of(k).takes_images)}")
    cfg = spec.images
    return ImageRules(int(cfg.max_bytes), cfg.max_pixels, cfg.column, refusal)


def _short(v: Any) -> str:
    s = repr(v)
    return s if len(s) <= 80 else s[:77] + "..."


def parse_content(content: list[Any], where: str, rules: ImageRules) -> tuple[str | list[dict[str, Any]], list[bytes]]:
    """A message's list of OpenAI content parts → the content the chat template is given (the
    text parts joined when there is no image, else the parts with each image as PLACEHOLDER)
    and the images' bytes, in order."""
    parts: list[dict[str, Any]] = []
    images: list[bytes] = []
    for j, part in enumerate(content):
        at = f"{where}.content[{j}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and isinstance(part.get("text"), str):
            parts.append({"type": "text", "text": part["text"]})
        elif kind == "image_url":
            ref = part.get("image_url")
            url = ref.get("url") if isinstance(ref, dict) else ref
            if not isinstance(url, str) or not url:
                raise ContentError(R.BAD_MESSAGES, f"{at}.image_url must hold a url string, got {_short(ref)}")
            images.append(read_image(url, at, rules))
            parts.append(dict(PLACEHOLDER))
        else:
            raise ContentError(R.BAD_MESSAGES, f"{at} must be a text or image_url part, got {_short(part)}")
    if not images:
        return "".join(p["text"] for p in parts), images
    return parts, images


def read_image(url: str, where: str, rules: ImageRules) -> bytes:
    """The checked bytes of the image at `url` (a data: URI, a path, a file:// or s3:// URL)."""
    if rules.refusal:
        raise ContentError(R.BAD_REQUEST, f"{where}: {rules.refusal}")
    low = url[:8].lower()
    if low.startswith(("http://", "https://")):
        raise ContentError(R.REMOTE_IMAGE, f"{where}: {_short(url)} is a web URL; images are not fetched from the "
                                           "web (give a data: URI, a path or an s3:// URL)")
    if low.startswith("data:"):
        data = _data_uri(url, where, rules)
    elif "://" in url and not low.startswith(("file://", "s3://")):
        raise ContentError(R.BAD_IMAGE, f"{where}: {_short(url)} is not a data: URI, a path or an s3:// URL")
    else:
        data = _read(url[len("file://"):] if low.startswith("file://") else url, where, rules)
    return check_image(data, where, rules)


def _data_uri(url: str, where: str, rules: ImageRules) -> bytes:
    head, sep, body = url.partition(",")
    if not sep or not head.lower().endswith(";base64"):
        raise ContentError(R.BAD_IMAGE, f"{where}: a data: URI must be base64 (data:image/png;base64,...)")
    if len(body) * 3 // 4 > rules.max_bytes + 2:
        raise ContentError(R.BAD_IMAGE, _too_large(where, f"about {len(body) * 3 // 4:,}", rules))
    try:
        return base64.b64decode(body, validate=True)
    except (binascii.Error, ValueError) as err:
        raise ContentError(R.BAD_IMAGE, f"{where}: the data: URI is not valid base64 ({err})") from None


def _read(path: str, where: str, rules: ImageRules) -> bytes:
    """At most max_bytes + 1 bytes of the file: one byte more says it is too large."""
    from tokenmill.transforms.files import open_file

    try:
        with open_file(path) as fh:
            data = fh.read(rules.max_bytes + 1)
    except Exception as err:  # a missing file or object, no permission: Beam's and boto3's own errors
        raise ContentError(R.BAD_IMAGE, f"{where}: {_short(path)} cannot be read: {_first(err)}") from None
    if len(data) > rules.max_bytes:
        raise ContentError(R.BAD_IMAGE, _too_large(where, f"more than {rules.max_bytes:,}", rules))
    return data


def _first(err: BaseException) -> str:
    from tokenmill.schemas.errors import first_line

    return f"{type(err).__name__}: {first_line(err)}"


def _too_large(where: str, size: str, rules: ImageRules) -> str:
    return f"{where}: the image has {size} bytes, over images.max_bytes {rules.max_bytes:,}"


def check_image(data: bytes, where: str, rules: ImageRules) -> bytes:
    """`data` when it is an image Pillow decodes whole within the job's limits; ContentError otherwise."""
    from PIL import Image, UnidentifiedImageError

    if len(data) > rules.max_bytes:
        raise ContentError(R.BAD_IMAGE, _too_large(where, f"{len(data):,}", rules))
    try:
        with Image.open(io.BytesIO(data)) as im:
            w, h = im.size
            if w * h > rules.max_pixels:
                raise ContentError(R.BAD_IMAGE, f"{where}: the image is {w}x{h} = {w * h:,} pixels, over "
                                                f"images.max_pixels {rules.max_pixels:,}")
            im.load()
    except ContentError:
        raise
    except UnidentifiedImageError:
        raise ContentError(R.BAD_IMAGE, f"{where}: the image cannot be decoded: not an image format Pillow reads") \
            from None
    except Exception as err:  # not an image, truncated, a decompression bomb: Pillow's errors vary
        raise ContentError(R.BAD_IMAGE, f"{where}: the image cannot be decoded: {_first(err)}") from None
    return data


def column_image(value: Any, column: str, rules: ImageRules) -> bytes | None:
    """A row's image column cell: its image's checked bytes, or None for a null cell."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return None
    if isinstance(value, (bytes, bytearray, memoryview)):
        if rules.refusal:
            raise ContentError(R.BAD_REQUEST, f"{column}: {rules.refusal}")
        return check_image(bytes(value), column, rules)
    if isinstance(value, str) and value.strip():
        return read_image(value.strip(), column, rules)
    raise ContentError(R.BAD_IMAGE, f"{column} must hold an image's bytes or its URL, got {_short(value)}")


def with_column_image(messages: list[dict[str, Any]], images: list[bytes], image: bytes,
                      column: str) -> tuple[list[dict[str, Any]], list[bytes]]:
    """`messages` with the image column's `image` placed first in the last user message, and
    the row's images with it in its place among the messages' own (`images`, in order)."""
    last = max((i for i, m in enumerate(messages) if m["role"] == "user"), default=None)
    if last is None:
        raise ContentError(R.BAD_IMAGE, f"{column}: the row has no user message to put its image in")
    m = messages[last]
    text = m["content"]
    content = [dict(PLACEHOLDER), *([{"type": "text", "text": text}] if isinstance(text, str) else text)]
    before = sum(part == PLACEHOLDER for x in messages[:last] if isinstance(x["content"], list) for part in x["content"])
    return ([*messages[:last], {**m, "content": content}, *messages[last + 1:]],
            [*images[:before], image, *images[before:]])


class ImageTokens:
    """How many tokens the engine makes of a row's images beyond their placeholders, for the
    token budget and the length check (Tokenize): the model's Hugging Face processor's count
    (`_get_num_multimodal_tokens`, what vLLM's Transformers backend reads) for each image's
    size; 0 for a model whose folder has no processor that counts (an image then counts as
    its one placeholder).  The processor is loaded at the first row with images."""

    def __init__(self, model_path: str):
        self._path = model_path
        self._count: Any = False  # not loaded yet

    def extra(self, images: tuple[bytes, ...]) -> int:
        from PIL import Image

        if self._count is False:
            from transformers import AutoProcessor

            try:
                processor = AutoProcessor.from_pretrained(self._path, local_files_only=True)
            except Exception:  # a text model's folder: no processor to load
                processor = None
            self._count = getattr(processor, "_get_num_multimodal_tokens", None)
        if not self._count:
            return 0
        sizes = []
        for b in images:
            with Image.open(io.BytesIO(b)) as im:  # the header alone: Validate decoded it already
                sizes.append([im.height, im.width])
        counts = self._count(image_sizes=sizes).num_image_tokens
        return sum(counts) - len(images) if counts else 0


def images_digest(images: tuple[bytes, ...] | list[bytes]) -> str:
    """One hash of a row's images in order (the result cache's keys hold it)."""
    h = hashlib.sha256()
    for b in images:
        h.update(hashlib.sha256(b).digest())
    return h.hexdigest()
