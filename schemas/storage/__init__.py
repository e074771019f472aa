"""Job storage: every SQL statement of tokenmill, over SQLite (embedded default) and
PostgreSQL (production); the same contract tests run against both.

`connect(url)` gives the SQLAlchemy engine for a URL (one per URL per process, the
schema migrated to head on first use).  Small stores over that engine hold
the SQL, each returning plain rows (dicts of a table's columns):

- `JobStore`: job rows and run ownership, runs, cancel requests, the pending-job
  queue, a named lock;
- `ResultWriter`: the rows workers write (outputs, dead letters, batch stats,
  workers: records of schemas/records.py) and the resume and id-claim lookups;
- `MetricsReader`: what exports, status, reports and comparisons read back;
- `RequestSummary`: a job's per-request figures summed, counted and ranked by the
  database (`RequestStats`), for metrics and reports of any size;
- `EstimateStore`: the estimates `tokenmill estimate` made, newest first;
- `CacheStore`: the result cache across jobs (lookups by key, inserts, stats, pruning);
- `LeaseStore`: the work units of a job shared by several processes (serve replicas): leases
  with an expiry and a fencing token, checked inside every commit;
- `ReplicaStore`: the `tokenmill serve` replicas over this database (started, heartbeat,
  draining, stopped), which are live, and SQLite's refusal of a second one;
- `KeyStore`, `FileStore`, `BatchStore`: what `tokenmill serve` keeps (API keys, files, batches);
  `WebhookStore`: its batch events and their delivery attempts; `UsageStore`: what each key
  used per day, counted from the jobs' own rows and metrics; `WatchReader`: what the live
  page reads (jobs by status, one page of jobs, running jobs' live counts); `SessionStore`: the
  page's login sessions (a random id's hash, its key, its expiry); `OnlineStore`: the online
  requests it answered (one row each: key, model, tokens, times, status).
"""

from tokenmill.schemas.storage.cache import CacheStore
from tokenmill.schemas.storage.database import (
    StorageError,
    alembic_config,
    connect,
    current_revision,
    head_revision,
    owner_tag,
    upgrade,
    utcnow,
)
from tokenmill.schemas.storage.estimates import EstimateStore
from tokenmill.schemas.storage.jobs import STALE_AFTER_S, JobBusy, JobStore, is_live
from tokenmill.schemas.storage.leases import Lease, LeaseLost, LeaseStore
from tokenmill.schemas.storage.merged import RunSummaries
from tokenmill.schemas.storage.online import OnlineStore
from tokenmill.schemas.storage.reader import CHUNK_ROWS, MetricsReader
from tokenmill.schemas.storage.replicas import ReplicaLive, ReplicaStore
from tokenmill.schemas.storage.results import ResultWriter
from tokenmill.schemas.storage.serve import BatchStore, FileStore, KeyStore
from tokenmill.schemas.storage.sessions import SessionStore
from tokenmill.schemas.storage.summary import RequestStats, RequestSummary
from tokenmill.schemas.storage.usage import UsageStore
from tokenmill.schemas.storage.watch import WatchReader
from tokenmill.schemas.storage.webhooks import WebhookStore

__all__ = [
    "BatchStore", "CHUNK_ROWS", "STALE_AFTER_S", "CacheStore", "FileStore", "KeyStore", "EstimateStore", "JobBusy", "JobStore", "Lease", "LeaseLost", "LeaseStore", "MetricsReader", "OnlineStore", "ReplicaLive", "ReplicaStore", "RequestStats", "RequestSummary", "ResultWriter", "RunSummaries", "SessionStore", "StorageError", "UsageStore", "WatchReader", "WebhookStore",
    "alembic_config", "connect", "current_revision", "head_revision", "is_live", "owner_tag", "upgrade", "utcnow",
]
