"""The result cache across jobs (docs/CACHE.md): which requests it may answer, their keys, and
`ServeCached`, the step that answers them before Generate.

A request is cached only when its answer is known before it runs (`deterministic`: greedy, or
a fixed seed).  Its key (`request_key`) is a hash of the engine's identity (`fingerprint`: the
checkpoint's content hash, the engine kind and its versions, the dtype the engine really runs
and the other engine keys that decide an answer, `ANSWER_KEYS`), the rendered prompt (the
token ids Tokenize made after the chat template; for an engine that takes text, the text or
messages too), the request's whole sampling (every `RowSampling` key, its seed + i), its
sample index and a LoRA adapter's content hash (`adapter_hashes`).  The engine's identity
(`fingerprint`, `checkpoint_sha256`, `adapter_hashes`) is transforms/engines/identity.py's: the
launcher computes it once per pipeline (`EngineKind.launch_side`), without Beam.

`ServeCached` (between SkipDone and Generate, `cache: read` or `read-write`) looks a chunk's
keys up at once; a row whose every sample is cached becomes output rows (the cached answer,
`cached_from` the job that computed it, this job's engine's times null), committed with the
entries' hits in one transaction; the rest goes on to Generate.  With `read-write`, Generate
stores each deterministic answer in its batch's transaction (`CacheKeys`, `cache_entry`)."""

from __future__ import annotations

import base64
import json
import sys
import time
from array import array
from typing import Any, Callable, Mapping, Sequence

import apache_beam as beam

from tokenmill.schemas import storage as S
from tokenmill.schemas.config import JobSpec, SamplingDefaults
from tokenmill.schemas.records import CACHED_COLUMNS, Chunk, FailedRecord, OutputRow, TokenizedPrompt
from tokenmill.schemas.sampling import request_sampling, sample_requests
from tokenmill.transforms.engines.identity import digest, refusal
from tokenmill.transforms.engines.kinds import engine_of
from tokenmill.transforms.images import images_digest

#: `batch_id` and `worker` of an output row served from the cache.
SERVED_BY = "cache"


# ---------------------------------------------------------------- what is cacheable, and its key


def deterministic(sampling: Mapping[str, Any]) -> bool:
    """Whether one engine request's answer is known before it runs: greedy (temperature 0) or
    seeded (`seed` set; sample i of a row is seeded seed + i, `sample_requests`).  Nothing else
    is cached or served."""
    t = sampling.get("temperature")
    return (t is not None and t == 0) or sampling.get("seed") is not None


def _token_bytes(token_ids: Sequence[int]) -> bytes:
    a = token_ids if isinstance(token_ids, array) and token_ids.typecode == "i" else array("i", token_ids)
    if sys.byteorder == "big":  # keys are the same on every machine: little-endian
        a = array("i", a)
        a.byteswap()
    return a.tobytes()


def request_key(fingerprint: str, token_ids: Sequence[int], source: Any, sampling: Mapping[str, Any],
                sample: int, adapter: str | None = None, images: str | None = None) -> str:
    """The key of one engine request: sha256 of the engine's `fingerprint`, the rendered prompt
    (`token_ids`; `source`, the text or messages an engine that takes text is sent, else None),
    the request's whole sampling (as `sample_requests` gives it: its seed is seed + sample), the
    sample index and, for a row run with a LoRA adapter, the adapter's content hash (`adapter`;
    a base-model request's key has none, as before adapters) and, for a row with images, their
    hash (`images`, transforms/images.images_digest: the token ids hold only their placeholders)."""
    head = {"engine": fingerprint, "source": source, "sampling": dict(sampling), "sample": sample,
            "tokens": len(token_ids)}
    if adapter is not None:
        head["adapter"] = adapter
    if images is not None:
        head["images"] = images
    return digest(head, b"\0" + _token_bytes(token_ids))


def prompt_keys(fingerprint: str, defaults: SamplingDefaults, p: TokenizedPrompt,
                adapters: Mapping[str, str] | None = None) -> list[str] | None:
    """The key of each of a row's samples, or None when its requests are not deterministic
    (or name an adapter whose content hash `adapters` lacks)."""
    samples = sample_requests(request_sampling(defaults, p))
    if not all(deterministic(s) for s in samples):
        return None
    adapter = None if p.adapter is None else (adapters or {}).get(p.adapter)
    if p.adapter is not None and adapter is None:
        return None
    images = images_digest(p.images) if p.images else None
    return [request_key(fingerprint, p.token_ids, p.source, s, i, adapter, images) for i, s in enumerate(samples)]



def cache_problem(spec: JobSpec, *, on_gpu: bool, workers_elsewhere: bool) -> str | None:
    """Why a job cannot use the cache it asks for (one line), or None: an engine whose weights
    are out of reach (`openai`), or `dtype: auto` measured by workers on other hosts (the key
    must name the dtype they run, which the launcher cannot know)."""
    if spec.cache == "off":
        return None
    engine, cfg = engine_of(spec.engine.kind), spec.engine
    if not engine.local_weights:
        return refusal(cfg.kind, spec.cache)
    if workers_elsewhere and engine.measures_cpu_dtype and getattr(cfg, "dtype", None) == "auto" and not on_gpu:
        return (f"cache: {spec.cache} with engine.dtype auto: workers on other hosts measure the dtype they run, "
                "which every cache key names; set engine.dtype (float32 or bfloat16)")
    return None


# ---------------------------------------------------------------- entries and served rows


def answer_of(row: Mapping[str, Any]) -> dict[str, Any]:
    """An output row's answer as the cache keeps it (`CACHED_COLUMNS`; an embedding's bytes as base64)."""
    out = {k: row.get(k) for k in CACHED_COLUMNS}
    if out["embedding"] is not None:
        out["embedding"] = base64.b64encode(out["embedding"]).decode()
    return out


def cache_entry(row: Mapping[str, Any], key: str, fingerprint: str, now: float) -> dict[str, Any]:
    """The `result_cache` row of one answered request (an output row as `OutputRow.as_dict` gives it)."""
    answer = answer_of(row)
    size = len(json.dumps(answer, separators=(",", ":"), ensure_ascii=False, default=str).encode())
    return {"key": key, "fingerprint": fingerprint, "job_id": row["job_id"], "id": row["id"],
            "sample": row.get("sample", 0), "model": row.get("model"), "prompt_tokens": row.get("prompt_tokens"),
            "output_tokens": row.get("output_tokens"), "size_bytes": size, "created_at": now, "used_at": None,
            "hits": 0, "answer": answer}


def served_row(job_id: str, p: TokenizedPrompt, sample: int, entry: Mapping[str, Any], *, model: str,
               batch_id: str) -> dict[str, Any]:
    """The output row of one sample served from the cache: the cached answer and its token counts,
    `cached_from` the job that computed it; no times (this job's engine did not run it)."""
    answer = dict(entry["answer"])
    if answer.get("embedding") is not None:
        answer["embedding"] = base64.b64decode(answer["embedding"])
    return OutputRow(job_id=job_id, id=p.id, sample=sample, input_file=p.input_file, input_row=p.input_row,
                     model=model, adapter=p.adapter, reference=p.reference, batch_id=batch_id, worker=SERVED_BY,
                     cached_from=entry["job_id"], **{k: answer.get(k) for k in CACHED_COLUMNS}).as_dict()


def serve(prompts: list[TokenizedPrompt], lookup: Callable[[list[str]], Mapping[str, Mapping[str, Any]]], *,
          fingerprint: str, defaults: SamplingDefaults, job_id: str, model: str,
          batch_id: str, adapters: Mapping[str, str] | None = None
          ) -> tuple[list[TokenizedPrompt], list[dict[str, Any]], list[str]]:
    """(the prompts left for the engine, the output rows served, the keys served): a row is
    served when every one of its samples is cached; `lookup(keys)` is one lookup for all;
    `adapters`: the LoRA adapters' content hashes (`adapter_hashes`)."""
    keyed = [(p, prompt_keys(fingerprint, defaults, p, adapters)) for p in prompts]
    found = lookup([k for _, ks in keyed if ks for k in ks])
    rest, rows, used = [], [], []
    for p, ks in keyed:
        if not ks or any(k not in found for k in ks):
            rest.append(p)
            continue
        rows += [served_row(job_id, p, i, found[k], model=model, batch_id=batch_id) for i, k in enumerate(ks)]
        used += ks
    return rest, rows, used


class CacheKeys:
    """The keys of the rows a worker has in flight, so each answered deterministic request is
    stored with its batch (Generate, `cache: read-write`); a row's keys are dropped once its
    answer or dead letter is out."""

    def __init__(self, fingerprint: str, defaults: SamplingDefaults, adapters: Mapping[str, str] | None = None):
        self.fingerprint, self._defaults, self._adapters = fingerprint, defaults, dict(adapters or {})
        self._keys: dict[tuple[int, int], list[str]] = {}

    def remember(self, prompts: list[TokenizedPrompt]) -> None:
        for p in prompts:
            ks = prompt_keys(self.fingerprint, self._defaults, p, self._adapters)
            if ks:
                self._keys[(p.input_file, p.input_row)] = ks

    def entries(self, rows: list[dict[str, Any]], dead: list[FailedRecord]) -> list[dict[str, Any]]:
        """The cache entries of a finished batch's output rows (dead letters are never cached)."""
        now, out = time.time(), []
        for r in rows:
            ks = self._keys.get((r["input_file"], r["input_row"]))
            if ks and r["sample"] < len(ks):
                out.append(cache_entry(r, ks[r["sample"]], self.fingerprint, now))
        for pos in {(r["input_file"], r["input_row"]) for r in rows} | {(d.input_file, d.input_row) for d in dead}:
            self._keys.pop(pos, None)
        return out

    def clear(self) -> None:
        self._keys.clear()


# ---------------------------------------------------------------- the Beam step


class ServeCachedFn(beam.DoFn):
    """Chunk → the chunk of rows the cache could not answer (none: nothing goes to the engine);
    the rows it answered are committed here, one transaction per chunk."""

    def __init__(self, db_url: str, job_id: str, run_id: str, fingerprint: str, defaults: SamplingDefaults,
                 model: str, adapters: Mapping[str, str] | None = None):
        self._url, self._job_id, self._run_id = db_url, job_id, run_id
        self._fp, self._defaults, self._model, self._adapters = fingerprint, defaults, model, dict(adapters or {})
        self._served = beam.metrics.Metrics.counter("tokenmill", "rows_served_from_cache")

    def process(self, chunk: Chunk):
        eng = S.connect(self._url)
        rest, rows, used = serve(chunk.items, S.CacheStore(eng).lookup, fingerprint=self._fp,
                                 defaults=self._defaults, job_id=self._job_id, model=self._model,
                                 batch_id=f"{self._run_id}-{SERVED_BY}", adapters=self._adapters)
        if rows:
            S.ResultWriter(eng).commit_batch(rows, [], [], cache_used=used)
            self._served.inc(len(chunk.items) - len(rest))
        if rest:
            yield chunk.with_items(rest)


class ServeCached(beam.PTransform):
    def __init__(self, db_url: str, job_id: str, run_id: str, fingerprint: str, defaults: SamplingDefaults,
                 model: str, adapters: Mapping[str, str] | None = None):
        super().__init__()
        self._fn = ServeCachedFn(db_url, job_id, run_id, fingerprint, defaults, model, adapters)

    def expand(self, chunks):
        return chunks | "AnswerFromCache" >> beam.ParDo(self._fn)
