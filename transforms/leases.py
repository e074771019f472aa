"""The worker side of a shared job's unit leases (schemas/storage/leases.py): who this process is
as a holder, the leases it holds and the thread that renews them, and whether it is draining.

A process draining (`start_draining`: a `tokenmill serve` replica told SIGTERM, a spot instance's
notice) takes no new unit; the units it holds are finished or handed back by its job run within
the replica's `drain_s`."""

from __future__ import annotations

import logging
import threading

from tokenmill.schemas import storage as S
from tokenmill.schemas.errors import first_line

log = logging.getLogger(__name__)

_DRAIN = threading.Event()


def start_draining() -> None:
    """Take no new unit from now on (this process)."""
    _DRAIN.set()


def draining() -> bool:
    return _DRAIN.is_set()


def lease_key(task: str, unit: str) -> str:
    """A unit's lease key: per engine task, since a batch file mixing chat and embedding lines
    runs each unit once per task (one pipeline pass each)."""
    return f"{task}/{unit}"


def holder() -> str:
    """This process as a lease holder: host and pid."""
    return S.owner_tag()


class Holding:
    """The leases this process holds for one job, renewed every `lease_s / 3` seconds by a
    thread; a lease found lost (taken over after this process stalled past its expiry) is
    dropped (the commits under it are refused by their fence, `LeaseStore.fence`)."""

    def __init__(self, eng, lease_s: float):
        self.store, self.lease_s = S.LeaseStore(eng), lease_s
        self.held: dict[str, S.Lease] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._renew, daemon=True, name="tokenmill-leases")
        self._thread.start()

    def take(self, job_id: str, unit: str) -> S.Lease | None:
        """The unit's lease for this process, renewed from now on; None when another holder has
        it or this process is draining."""
        if draining():
            return None
        lease = self.store.take(job_id, unit, holder(), self.lease_s)
        if lease is not None:
            with self._lock:
                self.held[unit] = lease
        return lease

    def finish(self, lease: S.Lease) -> None:
        """The unit's rows are all answered: done, no longer renewed."""
        self.store.finish(lease)
        self.drop(lease.unit)

    def finish_if_complete(self, lease: S.Lease) -> bool:
        """Done, and no longer renewed, if the lease still holds the unit and every row of it is
        answered or dead-lettered (the resume lookup, `ResultWriter.done_rows`); else still held."""
        rows = self.store.unit_rows(lease)
        if rows is None:
            return False
        f, first, n = rows
        if len(S.ResultWriter(self.store.engine).done_rows(lease.job_id, f, first, first + n - 1)) < n:
            return False
        if self.store.finish(lease):
            self.drop(lease.unit)
            return True
        return False

    def drop(self, unit: str) -> None:
        with self._lock:
            self.held.pop(unit, None)

    def mine(self) -> list[S.Lease]:
        with self._lock:
            return list(self.held.values())

    def _renew(self) -> None:
        while not self._stop.wait(self.lease_s / 3):
            with self._lock:
                held = list(self.held.values())
            try:
                for lease in self.store.renew(held, self.lease_s):
                    log.warning("lease on unit %s of job %s lost (epoch %d): its commits are refused",
                                lease.unit, lease.job_id, lease.epoch)
                    self.drop(lease.unit)
            except Exception as err:  # the database away for a moment: the next round tries again
                log.warning("lease renewal failed: %s", first_line(err))

    def close(self) -> None:
        self._stop.set()


_HOLDINGS: dict[tuple[str, str], Holding] = {}
_HOLDINGS_LOCK = threading.Lock()


def holding(db_url: str, job_id: str, lease_s: float) -> Holding:
    """This process's holding of `job_id`'s units (one renewal thread per job per process)."""
    with _HOLDINGS_LOCK:
        h = _HOLDINGS.get((db_url, job_id))
        if h is None:
            h = _HOLDINGS[(db_url, job_id)] = Holding(S.connect(db_url), lease_s)
        return h


def release(db_url: str, job_id: str) -> Holding | None:
    """Stop renewing `job_id`'s leases in this process (its run ended); the holding, if any."""
    with _HOLDINGS_LOCK:
        h = _HOLDINGS.pop((db_url, job_id), None)
    if h is not None:
        h.close()
    return h
