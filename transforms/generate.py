"""Generate: the Beam step that runs each work unit through one engine per worker.

For each work unit (one `Chunk` of tokenized prompts), the prompts are ordered
and packed into batches (transforms/batching.py), and the batches are handed to
the worker's `BatchRunner` (transforms/batch_runner.py), which keeps the engine
fed and isolates failing rows.  A batch's results are committed (outputs, the
engine's dead letters, its figures: one transaction) as soon as all of its
requests are done, then emitted.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
import time
import uuid
from typing import Any

import apache_beam as beam

from tokenmill.schemas.records import Chunk
from tokenmill.transforms.batch_runner import BatchRunner, GenerateConfig
from tokenmill.transforms.batching import plan_batches
from tokenmill.transforms.cache import CacheKeys
from tokenmill.transforms.chunks import DEAD, windowed
from tokenmill.transforms.engines.kv import JobTokens
from tokenmill.transforms.engines.protocol import EngineSession
from tokenmill.transforms.engines.worker import worker_session

log = logging.getLogger(__name__)

STATS = "stats"
#: Seconds between two updates of the worker's row while a bundle runs (its counters and peak
#: memory); a bundle's end always updates it.  Per batch it cost ~4 ms (a psutil walk of the
#: process tree and a write), on the critical path of the engine loop.
REPORT_EVERY_S = 5.0


#: (job id, worker) → (admitted, generated rows, generated tokens) of this worker process's
#: finished work items: per process, since runners may give every bundle a fresh DoFn (Dask does).
_DONE: dict[tuple[str, str], tuple[int, int, int]] = {}


class GenerateFn(beam.DoFn):
    """Chunk of TokenizedPrompts → per batch: list of output rows (main), FailedRecords (`dead`), batch stats (`stats`)."""

    def __init__(self, cfg: GenerateConfig, session_factory=None):
        self.cfg = cfg
        self._factory = session_factory
        self._worker = ""
        self._last_cancel_check = 0.0
        self._cancel = False
        self._recorded = False
        self._runner: BatchRunner | None = None
        """The bundle's runner: it carries the last batches of one unit into the next."""
        self._reported_at = float("-inf")
        self._keys: CacheKeys | None = None
        """The result-cache keys of the rows in flight (`cache: read-write`): their answers are stored."""
        self._leases: dict[str, Any] = {}
        """A shared job's unit leases by batch-id prefix: what each batch's commit is fenced by."""
        self._left: dict[str, int] = {}
        """Batches of each leased unit not yet committed: at 0 the unit may be done."""

    def _session(self, restart: bool = False, job_tokens: JobTokens | None = None) -> EngineSession:
        return worker_session(self.cfg.engine, self.cfg.model_path, self._factory, workers=self.cfg.num_workers,
                              group=f"{self.cfg.job_id}-{self.cfg.run_id}", restart=restart, job_tokens=job_tokens)

    def _restart(self) -> EngineSession:
        return self._session(restart=True)

    def setup(self):
        # one row per engine a process runs: a batch file's embedding pass is an engine of its own
        task = self.cfg.engine.task
        self._worker = f"{socket.gethostname()}:{os.getpid()}" + ("" if task == "generate" else f"/{task}")
        self._recorded = False
        if self._factory is None:  # a given factory is a stand-in: what it needs is its own
            self.cfg = dataclasses.replace(self.cfg, model_path=check_worker(self.cfg))
        if self.cfg.cache == "read-write" and self.cfg.fingerprint and self.cfg.db_url:
            self._keys = CacheKeys(self.cfg.fingerprint, self.cfg.sampling, self.cfg.adapter_hashes)

    def _first_session(self, chunk: Chunk) -> EngineSession:
        """The engine, started (or reused) on the first work item: its rows' sizes size the
        KV cache (engines.kv); the worker's row is recorded then."""
        if self._recorded:
            return self._session()
        t = time.time()
        s = self._session(job_tokens=JobTokens.of(p.budget_tokens for p in chunk.items))
        if self.cfg.db_url:
            from tokenmill.transforms.write import record_worker

            record_worker(self.cfg.db_url, self.cfg.job_id, self._worker, s, started_at=t, run_id=self.cfg.run_id,
                          task=self.cfg.engine.task)
        self._recorded = True
        return s

    def _cancelled(self) -> bool:
        if not self.cfg.db_url:
            return False
        now = time.time()
        if now - self._last_cancel_check > 2.0:
            self._last_cancel_check = now
            from tokenmill.transforms.write import cancel_requested

            self._cancel = cancel_requested(self.cfg.db_url, self.cfg.job_id)
        return self._cancel

    def start_bundle(self):
        self._discard()  # a runner left by a failed bundle: its work is being retried
        self._runner = None
        if self._keys is not None:
            self._keys.clear()

    def process(self, chunk: Chunk):
        s = self._first_session(chunk)
        if self._keys is not None:
            self._keys.remember(chunk.items)
        if self._runner is None:
            self._runner = BatchRunner(self.cfg, self._session, self._restart, cancelled=self._cancelled,
                                       worker=self._worker, before_admit=self._admitting)
        # unique per attempt: a unit retried after a failure plans new batches
        prefix = f"{self.cfg.run_id}-{chunk.unit}.{chunk.part}-{uuid.uuid4().hex[:6]}-"
        batches = plan_batches(
            chunk.items,
            ordering=self.cfg.batching.ordering,
            token_budget=self.cfg.batching.token_budget,
            max_num_seqs=s.max_num_seqs,
            batch_prefix=prefix,
        )
        if chunk.lease is not None and batches:
            self._leases[prefix], self._left[prefix] = chunk.lease, len(batches)
        self._runner.feed(batches)
        # Returns once the unit's last batch is in the engine: its tail decodes while
        # the next unit is read and tokenized, and is emitted with the next unit's
        # batches (or by finish_bundle).
        for out in self._runner.advance():
            yield from self._finished(out)
            self._report()

    def finish_bundle(self):
        runner, self._runner = self._runner, None
        if runner is None:
            return
        try:
            for out in runner.drain():
                yield from windowed(self._finished(out))
        finally:
            runner.close()
        done = _DONE.get((self.cfg.job_id, self._worker), (0, 0, 0))
        _DONE[(self.cfg.job_id, self._worker)] = (done[0] + runner.admitted_rows, done[1] + runner.generated_rows,
                                  done[2] + runner.generated_tokens)
        self._report(final=True)  # every unit of the bundle answered: its final counts

    def teardown(self):
        self._discard()

    def _discard(self) -> None:
        runner, self._runner = getattr(self, "_runner", None), None
        if runner is not None:
            runner.discard()

    def _admitting(self, n: int) -> None:
        """Write ahead, before a batch's `n` requests go to the engine, the worker's admitted
        count including them (one small UPDATE a batch): a worker killed with that batch in
        flight leaves its rework countable from the engine side (Σ admitted − outputs); the
        other counters follow every REPORT_EVERY_S."""
        if not self.cfg.db_url or self._runner is None:
            return
        from tokenmill.transforms.write import update_worker_admitted

        update_worker_admitted(self.cfg.db_url, self.cfg.job_id, self._worker, self._counts()[0] + n)

    def _counts(self) -> tuple[int, int, int]:
        """(admitted, generated rows, generated tokens) of this process for the job: its
        finished bundles' (`_DONE`) plus the running bundle's."""
        admitted, rows, tokens = _DONE.get((self.cfg.job_id, self._worker), (0, 0, 0))
        r = self._runner
        if r is None:
            return admitted, rows, tokens
        return admitted + r.admitted_rows, rows + r.generated_rows, tokens + r.generated_tokens

    def _report(self, *, final: bool = False) -> None:
        """The worker's row: what its engine finished so far, and its peak memory.  At most
        every REPORT_EVERY_S while a bundle runs (a process-tree walk and a database
        write), and always at its end."""
        if not self.cfg.db_url:
            return
        now = time.monotonic()
        if not final and now - self._reported_at < REPORT_EVERY_S:
            return
        self._reported_at = now
        from tokenmill.transforms.write import update_worker_peak

        admitted, rows, tokens = self._counts()
        update_worker_peak(self.cfg.db_url, self.cfg.job_id, self._worker,
                           admitted_rows=admitted, generated_rows=rows, generated_tokens=tokens)

    def _finished(self, out):
        """One finished batch: committed (outputs, the engine's dead letters, figures: one
        transaction), then the DoFn's outputs.  In a shared job the commit is fenced by the
        unit's lease: a batch whose unit was taken over (this process stalled past its lease)
        is refused, counted as work lost, and yields nothing."""
        if self.cfg.db_url:
            from tokenmill.schemas.storage import LeaseLost
            from tokenmill.transforms.write import commit_batch, count_lost

            rows, dead, stats = out
            prefix = str(stats.get("batch_id", "")).rsplit("-", 1)[0] + "-"
            lease = self._leases.get(prefix)
            try:
                commit_batch(self.cfg.db_url, self.cfg.job_id, rows, dead, stats,
                             cache_entries=self._keys.entries(rows, dead) if self._keys is not None else (),
                             lease=lease, lease_s=self.cfg.lease_s)
            except LeaseLost as err:
                log.warning("%s", err)
                count_lost(self.cfg.db_url, lease, rows)
                return iter(())
            if lease is not None:
                self._unit_progress(prefix, lease)
        return _outputs(out)


    def _unit_progress(self, prefix: str, lease: Any) -> None:
        """One more batch of a leased unit committed; after its last, the unit is marked done if
        every row of it is answered (the other steps' dead letters may still be on their way: then
        the run settles it after the pass), so other replicas see it done, not held."""
        self._left[prefix] -= 1
        if self._left[prefix] > 0:
            return
        del self._left[prefix], self._leases[prefix]
        from tokenmill.transforms.leases import holding

        holding(str(self.cfg.db_url), self.cfg.job_id, float(self.cfg.lease_s or 0)).finish_if_complete(lease)


class WorkerCheckError(RuntimeError):
    """What a worker needs to generate is missing on its host (one line naming the host)."""


#: (engine config, the launcher's model folder) → this process's model folder: a worker
#: checks once, whatever the number of bundles (runners may give each a fresh DoFn).
_CHECKED: dict[tuple[str, str], str] = {}


def check_worker(cfg: GenerateConfig) -> str:
    """The engine's preflight, run where the worker runs, before it generates: the model
    files, the binaries, the server, on this host and its device (the launcher checked its
    own).  A model given as a URL is synced into this host's cache first, with the job's S3
    endpoint.  Returns the model folder this host uses: the launcher's when it is here too,
    else the one the model resolves to on this host; WorkerCheckError otherwise."""
    key = (cfg.engine.model_dump_json(), cfg.model_path)
    if key in _CHECKED:
        return _CHECKED[key]
    from tokenmill.schemas.model_sync import is_model_url
    from tokenmill.schemas.models import ModelNotFound
    from tokenmill.transforms.engines.device import has_nvidia_gpu
    from tokenmill.transforms.engines.kinds import engine_of
    from tokenmill.transforms.host_model import adapters_here, model_folder_here

    problems: list[str] = []
    path = cfg.model_path
    url = cfg.engine.model
    try:
        if is_model_url(url):
            path = model_folder_here(url, None)
        adapters_here(cfg.engine.lora_adapters)
        found = engine_of(cfg.engine.kind).preflight(cfg.engine, on_gpu=has_nvidia_gpu())
        problems = found.problems
        if not problems and found.model_path and not (path and os.path.exists(path)):
            path = found.model_path  # a short name resolves in this host's own models folder
    except ModelNotFound as err:
        problems = [str(err)]
    except OSError as err:  # the models cache: a full disk, no permission
        problems = [f"model {url!r} cannot be kept in this host's models cache: {err}"]
    if problems:
        raise WorkerCheckError(f"worker on host {socket.gethostname()}: {'; '.join(problems)}")
    _CHECKED[key] = path
    return path


def _outputs(out):
    """One finished batch as the DoFn's outputs: its rows (main), dead letters, stats."""
    rows, dead, stats = out
    if rows:
        yield rows
    for d in dead:
        yield beam.pvalue.TaggedOutput(DEAD, d)
    yield beam.pvalue.TaggedOutput(STATS, stats)


class Generate(beam.PTransform):
    def __init__(self, cfg: GenerateConfig, session_factory=None):
        super().__init__()
        self._fn = GenerateFn(cfg, session_factory)

    def expand(self, chunks):
        return chunks | "EngineGenerate" >> beam.ParDo(self._fn).with_outputs(DEAD, STATS, main="ok")
