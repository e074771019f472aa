"""The coordinator: which of the queued jobs start now.  The jobs table is the queue
(`JobStore.queued`: highest priority first, then oldest); `run-pending` (queue.py) and the
server's scheduler (jobs/serve/scheduler.py) both take jobs through `take`, then hand each
to a launcher (jobs/lifecycle/launchers/)."""

from __future__ import annotations

from typing import Any, Callable, Collection, Iterable, Mapping, TypeVar

Q = TypeVar("Q")


def queue_order(row: Mapping[str, Any], *, at: str = "submitted_at") -> tuple:
    """A queued row's place: higher `priority` first, then older (`at`), then by id."""
    return (-int(row.get("priority") or 0), row.get(at), row["id"])


def take(queued: Iterable[Q], *, slots: int, busy: Collection[str] = (),
         model_of: Callable[[Q], str] = lambda row: "") -> list[Q]:
    """The jobs to start now, from `queued` in queue order: at most `slots` jobs running at
    once (`busy`: the models running one now, each a slot), at most one per model, none of a
    model that runs one already; a job of a busy model waits its turn, later ones pass it."""
    started: list[Q] = []
    models = set(busy)
    for job in queued:
        if len(models) >= slots:
            break
        if model_of(job) in models:
            continue
        models.add(model_of(job))
        started.append(job)
    return started
