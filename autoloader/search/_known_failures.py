"""What the trials that failed tell about settings not yet run: a setting known to fail
is recorded without running, and a failure boundary is bisected, not searched above.

:class:`~autoloader.search.Policy` applies these rules; like it, they are pure
functions of the finished trials.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from autoloader.loader import Params
from autoloader.search._outcome import (
    WORKER_COUNT_FAULTS,
    Completed,
    Failed,
    FaultKind,
    Outcome,
    Pruned,
    PruneKind,
    Trial,
)


def params_key(params: Mapping[str, Any]) -> str:
    """A setting's identity: trials with the same key measured the same setting."""
    return json.dumps(dict(params), sort_keys=True)


def known_failure(params: Mapping[str, Any], history: Sequence[Trial]) -> Outcome | None:
    """The outcome an earlier trial shows ``params`` would have, if it would fail;
    ``None`` if it is worth running.

    A setting that failed fails again (crashes and hangs are rarely a matter of
    luck, and measuring a hang again costs its whole deadline). Memory only grows
    with workers, prefetch and pinning, so a setting that asks at least as much as
    one that passed the memory budget (or was OOM-killed) would pass it too. Past a
    failure boundary (``NOTE [ Failure boundary ]``) every count fails. Once thread
    workers failed (the dataset raised or hung when read from several threads, see
    ``NOTE [ Thread workers ]``), no thread setting is run again.
    """
    threads = params.get("worker_kind") == "threads"
    for trial in history:
        outcome = trial.outcome
        if _over_memory(outcome) and _asks_at_least(params, trial.params):
            assert isinstance(outcome, Pruned)
            note = f" (not run: asks at least as much memory as trial {trial.number})"
            return Pruned(outcome.kind, outcome.reason + note, same_as=trial.number)
        same = params_key(params) == params_key(trial.params)
        if same and isinstance(outcome, Failed) and outcome.kind is not FaultKind.INTERRUPTED:
            return Failed(outcome.kind, outcome.reason, same_as=trial.number)
        if threads and _threads_failed(trial):
            assert isinstance(outcome, Failed)
            note = f" (not run: thread workers failed in trial {trial.number})"
            return Failed(outcome.kind, outcome.reason + note, same_as=trial.number)
    return None if threads else _beyond_boundary(params, history)


# NOTE [ Failure boundary ]
# Some faults come with the worker count: a WebDataset with k shards fails every
# count above k; a dataset that crashes or hangs in workers >= k fails every count
# above k; a worker SIGKILLed (by the OOM killer or not) is such a fault too.
# Once failures of such a kind are seen at two counts or more above the
# largest count that worked, every count from the smallest of them up is known to
# fail (the sampler draws fewer workers, and a proposal there would be recorded
# without running), and the search bisects between the largest success and the
# smallest failure to find the most workers that work, instead of spending the
# budget above the boundary.
def boundary(history: Sequence[Trial]) -> tuple[int, int] | None:
    """``(largest count that worked, smallest count that failed above it)``, when
    failures of a worker-count kind lie above every success; else ``None``. Thread
    workers have no such faults: only worker processes count."""
    history = [t for t in history if t.params.get("worker_kind") != "threads"]
    largest = max((t.workers for t in history if _ran(t.outcome)), default=0)
    failed = [t.workers for t in _worker_count_failures(history) if t.workers > largest]
    if not failed:
        return None
    return largest, min(failed)


def bisection(history: Sequence[Trial]) -> Params | None:
    """A setting halfway between the largest count that worked and the smallest that
    failed, if there is room between them (the best setting's other options)."""
    found = boundary(history)
    if found is None:
        return None
    worked, failed = found
    if failed - worked <= 1 or worked == 0:
        return None
    best = max(
        (t for t in history if isinstance(t.outcome, Completed) and t.workers > 0),
        key=lambda t: t.outcome.value,  # type: ignore[union-attr]
        default=None,
    )
    if best is None:
        return None
    return {**best.params, "num_workers": (worked + failed) // 2}


def failing_from(history: Sequence[Trial]) -> int | None:
    """The worker count from which every count is known to fail (``NOTE [ Failure
    boundary ]``): failures of a worker-count kind at two counts or more above every
    count that ran. The sampler is then asked for fewer workers only."""
    found = boundary(history)
    if found is None:
        return None
    _, smallest = found
    counts = {t.workers for t in _worker_count_failures(history) if t.workers >= smallest}
    return smallest if len(counts) >= 2 else None


def _beyond_boundary(params: Mapping[str, Any], history: Sequence[Trial]) -> Outcome | None:
    smallest = failing_from(history)
    if smallest is None or int(params["num_workers"]) < smallest:
        return None
    first = min(
        (t for t in _worker_count_failures(history) if t.workers >= smallest),
        key=lambda t: t.workers,
    )
    outcome = first.outcome
    note = f" (not run: every count from {smallest} workers up failed so far)"
    if isinstance(outcome, Pruned):
        return Pruned(outcome.kind, outcome.reason + note, same_as=first.number)
    assert isinstance(outcome, Failed)
    return Failed(outcome.kind, outcome.reason + note, same_as=first.number)


def _worker_count_failures(history: Sequence[Trial]) -> list[Trial]:
    """Trials run that failed with a fault that comes with the worker count, or whose
    workers were SIGKILLed: by the OOM killer, more workers only ask more memory; by
    anything else (a worker index that a job's scheduler kills), more workers meet it too."""
    return [
        t for t in history
        if not t.skipped and (
            (isinstance(t.outcome, Failed) and t.outcome.kind in WORKER_COUNT_FAULTS)
            or (isinstance(t.outcome, Pruned) and t.outcome.kind is PruneKind.KILLED)
        )
    ]  # fmt: skip


def _threads_failed(trial: Trial) -> bool:
    """Whether ``trial`` ran thread workers and failed for the setting's sake."""
    outcome = trial.outcome
    return (
        trial.params.get("worker_kind") == "threads"
        and isinstance(outcome, Failed)
        and outcome.kind is not FaultKind.INTERRUPTED
    )


def _over_memory(outcome: Outcome) -> bool:
    return isinstance(outcome, Pruned) and outcome.kind in (PruneKind.MEMORY, PruneKind.KILLED)


def _ran(outcome: Outcome) -> bool:
    """Whether the setting ran without failing: complete, or not counted for its pace."""
    return isinstance(outcome, Completed) or (
        isinstance(outcome, Pruned) and outcome.kind in (PruneKind.SLOWER, PruneKind.TOO_SHORT)
    )


def _asks_at_least(params: Mapping[str, Any], other: Mapping[str, Any]) -> bool:
    """Whether ``params`` holds at least as many batches, as pinned, as ``other``, with
    workers of the same kind (worker processes copy what thread workers share)."""
    return (
        params.get("worker_kind") == other.get("worker_kind")
        and params["num_workers"] >= other["num_workers"] > 0
        and (params["prefetch_factor"] or 0) >= (other["prefetch_factor"] or 0)
        and params["pin_memory"] >= other["pin_memory"]
    )
