"""The result cache across jobs (docs/CACHE.md): which requests it may answer, their keys, and
`ServeCached`, the step that answers them before Generate.

A request is cached only when its answer is known before it runs (`deterministic`: greedy, or
a fixed seed).  Its key (`request_key`) is a hash of the engine's identity (`fingerprint`: the
checkpoint's content hash, the engine kind and its versions, the dtype the engine really runs
and the other engine keys that decide an answer, `ANSWER_KEYS`), the rendered prompt (the
token ids Tokenize made after the chat template; for an engine that takes text, the text or
messages too), the request's whole sampling (every `RowSampling` key, its seed + i), its
sample index and a LoRA adapter's content hash (`adapter_hashes`).  The launcher computes the fingerprint once per pipeline (`job_fingerprint`); a
checkpoint's bytes are hashed once per file version (`checkpoint_sha256`, kept on disk).

`ServeCached` (between SkipDone and Generate, `cache: read` or `read-write`) looks a chunk's
keys up at once; a row whose every sample is cached becomes output rows (the cached answer,
`cached_from` the job that computed it, this job's engine's times null), committed with the
entries' hits in one transaction; the rest goes on to Generate.  With `read-write`, Generate
stores each deterministic answer in its batch's transaction (`CacheKeys`, `cache_entry`)."""

from __future__ import annotations

import base64
import hashlib
import json
import sys
import time
from array import array
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import apache_beam as beam

from tokenmill.schemas import storage as S
from tokenmill.schemas.config import EngineConfig, JobSpec, SamplingDefaults
from tokenmill.schemas.records import CACHED_COLUMNS, Chunk, FailedRecord, OutputRow, TokenizedPrompt
from tokenmill.schemas.sampling import request_sampling, sample_requests
from tokenmill.transforms.images import images_digest

#: The recipe of keys and fingerprints: a change to what goes into them bumps it, so no old
#: entry is served under a new meaning.
KEY_FORMAT = 1
#: The engine keys that decide an answer, besides the checkpoint, the engine and its version
#: (those an engine's config has): the dtype as the engine runs it, quantization, KV cache dtype,
#: task and pooling, the weights' loader (`dummy`: random weights), speculative decoding and
#: `extra` (any other engine argument).  Sizing and scheduling keys (`max_num_seqs`, memory
#: shares, parallelism) are left out: they change how fast an answer comes, not which.
ANSWER_KEYS = ("dtype", "quantization", "kv_cache_dtype", "task", "pooling", "load_format", "speculative_config",
               "extra")
#: vLLM's other names of a dtype, as keys name it.
DTYPE_NAMES = {"half": "float16", "float": "float32"}
#: The files of a model folder whose bytes are its checkpoint: weights, config, tokenizer, chat
#: template, custom code.  A `.gguf` file is hashed whole.
CHECKPOINT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".json", ".model", ".txt", ".jinja",
                       ".tiktoken", ".py")
#: `batch_id` and `worker` of an output row served from the cache.
SERVED_BY = "cache"


# ---------------------------------------------------------------- what is cacheable, and its key


def deterministic(sampling: Mapping[str, Any]) -> bool:
    """Whether one engine request's answer is known before it runs: greedy (temperature 0) or
    seeded (`seed` set; sample i of a row is seeded seed + i, `sample_requests`).  Nothing else
    is cached or served."""
    t = sampling.get("temperature")
    return (t is not None and t == 0) or sampling.get("seed") is not None


def _canonical(v: Any) -> Any:
    """A value as keys hash it: a whole float as its int (temperature 0 and 0.0 are one key)."""
    if isinstance(v, float) and v.is_integer():
        return int(v)
    if isinstance(v, Mapping):
        return {str(k): _canonical(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_canonical(x) for x in v]
    return v


def _digest(payload: Mapping[str, Any], tail: bytes = b"") -> str:
    text = json.dumps(_canonical(payload), sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=str)
    return hashlib.sha256(text.encode() + tail).hexdigest()


def fingerprint(*, kind: str, versions: Mapping[str, str], checkpoint: str, settings: Mapping[str, Any]) -> str:
    """The engine's identity in every key: the checkpoint's content hash, the engine kind and its
    packages' versions (`EngineKind.versions`), and the answer-deciding settings (`answer_settings`)."""
    return _digest({"format": KEY_FORMAT, "kind": kind, "versions": dict(versions), "checkpoint": checkpoint,
                    "settings": dict(settings)})


def answer_settings(cfg: EngineConfig, dtype: str | None) -> dict[str, Any]:
    """The `ANSWER_KEYS` an engine config has, with `dtype` the one the engine runs (resolved
    `auto`) and the embedding pooling resolved."""
    d = cfg.model_dump(mode="json")
    out = {k: d[k] for k in ANSWER_KEYS if k in d}
    if "dtype" in out or dtype is not None:
        out["dtype"] = DTYPE_NAMES.get(dtype, dtype) if dtype else dtype
    out["pooling"] = cfg.embedding_pooling()
    return out


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
    return _digest(head, b"\0" + _token_bytes(token_ids))


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


def adapter_hashes(cfg: EngineConfig) -> dict[str, str]:
    """The content hash of each LoRA adapter a job declares (its folder's or GGUF file's
    `checkpoint_sha256`, kept per file version like a model's), for the keys of rows run with it."""
    from tokenmill.transforms.engines.kinds import engine_of

    paths = engine_of(cfg.kind).adapter_paths(cfg)
    return {name: checkpoint_sha256(path) for name, path in paths.items()}


# ---------------------------------------------------------------- the engine's identity (launcher)


def checkpoint_files(path: Path) -> list[Path]:
    """The files whose bytes are a checkpoint: the file itself, or a folder's top-level
    `CHECKPOINT_SUFFIXES` files, by name."""
    if path.is_file():
        return [path]
    return sorted((f for f in path.iterdir() if f.is_file() and not f.name.startswith(".")
                   and f.suffix in CHECKPOINT_SUFFIXES), key=lambda f: f.name)


def _hash_file(f: Path) -> str:
    h = hashlib.sha256()
    with f.open("rb") as fh:
        for block in iter(lambda: fh.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def _identity(f: Path) -> list[int]:
    """What says a file is the version hashed before: size, mtime, ctime (a rewrite that put the
    mtime back still moves it), and the file's device and inode (a copy put in its place)."""
    st = f.stat()
    return [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_dev, st.st_ino]


def checkpoint_sha256(path: str | Path, *, hashes: Path | None = None) -> str:
    """The content hash of a checkpoint (a `.gguf` file, or a model folder's `checkpoint_files`
    with their names).  Each file's sha256 is kept in `hashes` (default
    `checkpoint_sha256.json` under tokenmill's home) under its path and `_identity`, so a
    model is read once per version of its files, not once per job."""
    import filelock

    from tokenmill.schemas.models import tokenmill_home

    root = Path(path).resolve()
    store = hashes or tokenmill_home() / "checkpoint_sha256.json"
    store.parent.mkdir(parents=True, exist_ok=True)
    with filelock.FileLock(str(store) + ".lock"):
        try:
            known = json.loads(store.read_text())
        except (OSError, ValueError):
            known = {}
        changed, lines = False, []
        for f in checkpoint_files(root):
            ident, entry = _identity(f), known.get(str(f))
            if not entry or entry.get("identity") != ident:
                entry = known[str(f)] = {"identity": ident, "sha256": _hash_file(f)}
                changed = True
            lines.append(f"{f.name}\t{entry['sha256']}\n")
        if changed:
            tmp = store.with_suffix(".tmp")
            tmp.write_text(json.dumps(known, indent=0))
            tmp.replace(store)
    if root.is_file():
        return lines[0].split("\t")[1].strip()
    return hashlib.sha256("".join(lines).encode()).hexdigest()


class CacheRefused(ValueError):
    """A job whose answers cannot be cached (one line naming the key and the value)."""


def engine_fingerprint(cfg: EngineConfig, model_path: str | None, *, resolve_dtype: bool = True) -> str:
    """The fingerprint of the engine a job runs here: its checkpoint's content hash
    (`EngineKind.checkpoint`), its kind and versions, and `answer_settings` with the dtype it
    runs (`EngineKind.run_dtype`: `auto` on a CPU is the measured choice; `resolve_dtype`
    False keeps the configured one, for a stand-in engine).  CacheRefused for an engine whose
    checkpoint is out of reach."""
    from tokenmill.transforms.engines.device import has_nvidia_gpu
    from tokenmill.transforms.engines.kinds import engine_of

    engine = engine_of(cfg.kind)
    ckpt = engine.checkpoint(cfg, model_path)
    if ckpt is None:
        raise CacheRefused(refusal(cfg.kind))
    dtype = engine.run_dtype(cfg, model_path, on_gpu=has_nvidia_gpu()) if resolve_dtype else getattr(cfg, "dtype", None)
    return fingerprint(kind=cfg.kind, versions=engine.versions(), checkpoint=checkpoint_sha256(ckpt),
                       settings=answer_settings(cfg, dtype))


def job_fingerprint(spec: JobSpec, model_path: str | None, *, stand_in: bool = False) -> str | None:
    """The fingerprint of a job's engine when it uses the cache (None: `cache: off`); a stand-in
    engine (a test double) keeps its configured dtype."""
    if spec.cache == "off":
        return None
    return engine_fingerprint(spec.engine, model_path, resolve_dtype=not stand_in)


def refusal(kind: str, mode: str = "read-write") -> str:
    return (f"cache: {mode}: engine kind {kind} answers from weights tokenmill cannot read (a remote server), so "
            "no key can name its checkpoint and its answers are never cached; set cache: off")


def cache_problem(spec: JobSpec, *, on_gpu: bool, workers_elsewhere: bool) -> str | None:
    """Why a job cannot use the cache it asks for (one line), or None: an engine whose weights
    are out of reach (`openai`), or `dtype: auto` measured by workers on other hosts (the key
    must name the dtype they run, which the launcher cannot know)."""
    from tokenmill.transforms.engines.kinds import engine_of

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
