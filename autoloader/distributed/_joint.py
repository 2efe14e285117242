"""Trials measured by every rank of a torchrun job at once, driven by global rank 0.

Rank 0 runs the search as alone, with a :class:`JointRunner` in place of its runner:
each setting it measures is first broadcast, and every other rank, in :func:`follow`,
measures it at the same time, so that the ranks compete for cores, memory and /dev/shm
as they will in training. The loops keep in step (``NOTE [ Joint trials ]`` in
``measure/_runner.py``) through a :class:`JointLockstep`; the job's figures are its slowest
rank's (:func:`job_measurement`), and a trial failed on any rank failed for all
(:func:`job_outcome`). When the search ends, rank 0 sends what it found, the result or
the error, and every rank returns or raises the same.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from autoloader._exceptions import BaselineError, InvalidInputError, RankError
from autoloader.distributed._ranks import Ranks
from autoloader.measure import (
    DEFAULT_BUDGET_SHARE,
    Checkpoint,
    Deadlines,
    Measurement,
    MemoryBudgetExceeded,
    PeerFailed,
    TrialError,
    TrialRunner,
    WindowCallback,
    available_memory,
    format_bytes,
    parse_bytes,
    tree_memory,
)

# Seconds between checkpoints: each costs a small all-reduce, and they are spaced to
# keep it at _CHECKPOINT_SHARE of the loop's time (checkpoint_spacing): 0.05 s at least,
# at most _CHECKPOINT_MOST, since a trial ends at its first checkpoint after its time is
# up. Two local ranks on the development VM: 0.7 ms, 70 ms apart. docs/multi_node.md has
# the figures, and the model at 8 nodes x 8 ranks over TCP (55-73 ms for a flat ring):
# there the ceiling holds and checkpoints cost more than 1%.
_CHECKPOINT_SECONDS = 0.05
_CHECKPOINT_SHARE = 0.01
_CHECKPOINT_MOST = 0.25
# Checkpoints in an epoch, at least. An epoch's restart is agreed at a checkpoint and
# discards the open timing window: with checkpoints farther apart than an epoch, every
# window would be discarded and every trial end too short (it did, on epochs of 12
# batches with checkpoints 0.25 s apart).
_CHECKPOINTS_PER_EPOCH = 4
# Batches between the first checkpoints of a trial, before the pace is known.
_FIRST_STRIDE = 2


class JointLockstep:
    """Keeps this rank's loop in step with the other ranks' (``NOTE [ Joint trials ]``).

    The checkpoints are spaced by batch count, the same on every rank: the count is set
    again at each checkpoint from the longest time any rank took since the last one and
    the shortest epoch of any rank, values every rank receives alike. Its exchanges are
    a trial's, with a trial's timeout (``NOTE [ How long a rank waits ]``).
    """

    joint = True

    def __init__(self, ranks: Ranks, *, spare: Any = None) -> None:
        self.ranks = ranks.within_trial()
        self.spare = spare
        self._stride = _FIRST_STRIDE
        self._epoch_batches: int | None = None
        self.spacing = checkpoint_spacing(ranks.exchange_seconds)

    def begin(self, epoch_batches: int | None) -> None:
        self._stride = _FIRST_STRIDE
        self._epoch_batches = epoch_batches

    def every(self) -> int:
        return self._stride

    def agree(self, mine: Checkpoint) -> Checkpoint:
        flags = [f.name for f in dataclasses.fields(Checkpoint) if f.name != "seconds"]
        epoch = self._epoch_batches
        values = self.ranks.maximum(
            [float(getattr(mine, name)) for name in flags]
            + [mine.seconds, -float(epoch if epoch is not None else math.inf)],
            during="a trial's checkpoint",
        )
        agreed = Checkpoint(
            **{name: bool(v) for name, v in zip(flags, values, strict=False)}, seconds=values[-2]
        )
        shortest = -values[-1]  # the shortest epoch of any rank
        most = None if math.isinf(shortest) else max(1, int(shortest) // _CHECKPOINTS_PER_EPOCH)
        self._stride = next_stride(self._stride, agreed.seconds, self.spacing, most=most)
        return agreed

    def combine(self, estimate: Measurement) -> Measurement:
        return job_measurement(self.ranks.gather(estimate, during="a trial's timing window"))

    def decide(self, stop: bool) -> bool:
        return bool(self.ranks.broadcast(stop, during="a trial's timing window"))


def checkpoint_spacing(exchange_seconds: float) -> float:
    """Seconds between checkpoints for ranks whose all-reduce takes ``exchange_seconds``:
    far enough apart that checkpoints take ``_CHECKPOINT_SHARE`` of the loop, within
    ``_CHECKPOINT_SECONDS`` and ``_CHECKPOINT_MOST``."""
    wanted = exchange_seconds / _CHECKPOINT_SHARE
    return min(_CHECKPOINT_MOST, max(_CHECKPOINT_SECONDS, wanted))


def next_stride(
    stride: int, seconds: float, spacing: float = _CHECKPOINT_SECONDS, most: int | None = None
) -> int:
    """Batches to the next checkpoint, for checkpoints ``spacing`` seconds apart, given
    that the last ``stride`` batches took ``seconds``: at most four times more or fewer
    than before, so that one slow batch does not swing it, and at most ``most``."""
    wanted = stride * 4 if seconds <= 0 else round(stride * spacing / seconds)
    stride = max(1, min(stride * 4, max(stride // 4, wanted)))
    return stride if most is None else min(stride, most)


def job_measurement(measurements: Sequence[Measurement]) -> Measurement:
    """The job's figures from each rank's: the slowest rank's rate (a DDP job steps at
    its slowest rank's pace), the largest waits, times and errors, the fewest batches;
    memory, the largest (each node's first rank measures its whole node)."""
    if len(measurements) == 1:
        return measurements[0]

    def most(name: str) -> Any:
        return max(getattr(m, name) for m in measurements)

    def optional(name: str, pick: Any) -> Any:
        values = [getattr(m, name) for m in measurements]
        return None if any(v is None for v in values) else pick(values)

    return Measurement(
        samples_per_second=min(m.samples_per_second for m in measurements),
        relative_error=most("relative_error"),
        data_wait_fraction=most("data_wait_fraction"),
        load_seconds=most("load_seconds"),
        step_seconds=most("step_seconds"),
        time_to_first_batch=most("time_to_first_batch"),
        epoch_restart_seconds=optional("epoch_restart_seconds", max),
        batches=min(m.batches for m in measurements),
        duration=most("duration"),
        peak_memory=most("peak_memory"),
        batch_bytes=most("batch_bytes"),
        load_cpu_seconds=statistics.fmean(m.load_cpu_seconds for m in measurements),
        step_cpu_seconds=statistics.fmean(m.step_cpu_seconds for m in measurements),
        step_thread_cpu_seconds=statistics.fmean(m.step_thread_cpu_seconds for m in measurements),
        load_thread_cpu_seconds=statistics.fmean(m.load_thread_cpu_seconds for m in measurements),
        epochs_samples_per_second=optional("epochs_samples_per_second", min),
        burst_left=most("burst_left"),
        burst_seconds=most("burst_seconds"),
    )


def job_outcome(
    outcomes: Sequence[Measurement | BaseException], hosts: Sequence[str] = ()
) -> Measurement:
    """The job's measurement, or the error that failed the trial for every rank.

    Of several ranks' errors, the one that says most: a memory overrun (the node's
    whole tree passed the budget, whichever rank's workers grew), then a
    rank's failure to load a batch, then a failure in the step (a step with DDP
    collectives waits for every rank, so a rank whose worker hangs makes the others'
    steps time out too), then anything else; a rank that only stopped because another
    failed says nothing. The error names its rank; a memory overrun on a job of
    several nodes (``hosts``, by rank) names the node whose watch saw it, and its ranks.
    """
    errors = [(rank, o) for rank, o in enumerate(outcomes) if isinstance(o, BaseException)]
    if not errors:
        return job_measurement([o for o in outcomes if isinstance(o, Measurement)])

    def weight(item: tuple[int, BaseException]) -> int:
        error = item[1]
        if isinstance(error, MemoryBudgetExceeded):
            return 0
        if isinstance(error, TrialError):
            return 1 if error.stage == "loading a batch" else 2
        return 4 if isinstance(error, PeerFailed) else 3

    rank, error = min(errors, key=weight)
    if isinstance(error, MemoryBudgetExceeded) and len(set(hosts)) > 1:
        node = [r for r, host in enumerate(hosts) if host == hosts[rank]]
        tree = f"node {hosts[rank]}'s process tree (ranks {_listed(node)}, with their workers)"
        raise MemoryBudgetExceeded(error.peak, error.budget, error.projected, tree)
    if isinstance(error, TrialError):
        error.rank = rank
    if isinstance(error, PeerFailed):  # every rank says another failed: cannot be
        raise RankError("the ranks disagree about which of them failed a trial")
    raise error


def _listed(numbers: Sequence[int]) -> str:
    words = [str(n) for n in numbers]
    return words[0] if len(words) == 1 else f"{', '.join(words[:-1])} and {words[-1]}"


@dataclass(frozen=True, slots=True)
class _Measure:
    """Rank 0 to all: measure this setting now."""

    params: Mapping[str, Any]
    max_seconds: float
    deadlines: Deadlines | None
    max_batches: int | None


@dataclass(frozen=True, slots=True)
class _Done:
    """Rank 0 to all: the run is over; return ``result`` or raise ``error``."""

    result: Any = None
    error: BaseException | None = None


def measure_together(
    local: TrialRunner,
    lockstep: JointLockstep,
    command: _Measure,
    on_window: WindowCallback | None = None,
) -> Measurement:
    """Measure ``command``'s setting on this rank, in step with the others; every rank
    returns the job's measurement or raises the error that failed the trial."""
    outcome: Measurement | BaseException
    try:
        outcome = local.measure(
            command.params,
            max_seconds=command.max_seconds,
            on_window=on_window,
            deadlines=command.deadlines,
            max_batches=command.max_batches,
            lockstep=lockstep,
        )
    except RankError:
        raise
    except Exception as error:
        outcome = error
    ranks = lockstep.ranks
    return job_outcome(ranks.gather(outcome, during="the end of a trial"), ranks.hosts)


class JointRunner:
    """Rank 0's runner under torchrun: every rank measures each setting together.

    Args:
        local: measures this rank's share of a trial.
        ranks: the job's ranks.
        spare: a batch of the dataset, stepped in place of one this rank fails to
            load (``NOTE [ Joint trials ]``).
    """

    def __init__(self, local: TrialRunner, ranks: Ranks, *, spare: Any) -> None:
        self.local = local
        self.ranks = ranks
        self.lockstep = JointLockstep(ranks, spare=spare)
        self.batch_size = local.batch_size

    def measure(
        self,
        params: Mapping[str, Any],
        *,
        max_seconds: float,
        on_window: WindowCallback | None = None,
        deadlines: Deadlines | None = None,
        max_batches: int | None = None,
    ) -> Measurement:
        command = _Measure(dict(params), max_seconds, deadlines, max_batches)
        # The others wait for it outside a trial: NOTE [ How long a rank waits ].
        self.ranks.broadcast(command, during="the start of a trial")
        return measure_together(self.local, self.lockstep, command, on_window)

    def finish(self, *, result: Any = None, error: BaseException | None = None) -> None:
        """Tell the other ranks the run is over: what it found, or how it failed."""
        self.ranks.broadcast(_Done(result, error), during="the end of the run")


def follow(
    local: TrialRunner,
    ranks: Ranks,
    *,
    spare: Any,
    stop_if_interrupted: Callable[[], None] = lambda: None,
) -> Any:
    """A rank other than 0: measure each setting rank 0 sends, until it sends the
    result, which is returned (or the error, which is raised).

    ``stop_if_interrupted`` raises where Ctrl-C was noted on this rank: it is
    called at each setting sent and at each timing window, where rank 0 looks at its
    own, so that a rank whose KeyboardInterrupt was lost on its way (raised in a fork's
    at-fork hook as a worker started) stops at the same window as rank 0 rather than
    going on with the trial alone."""
    lockstep = JointLockstep(ranks, spare=spare)

    def on_window(window: int, estimate: Measurement) -> bool:
        stop_if_interrupted()
        return False  # rank 0 decides when the trial stops

    while True:
        command = ranks.broadcast(None, during="waiting for the next trial")
        if isinstance(command, _Done):
            if command.error is not None:
                raise command.error
            return command.result
        stop_if_interrupted()
        try:
            measure_together(local, lockstep, command, on_window)
        except RankError:
            raise
        except Exception:  # rank 0 saw the same and decides what it means
            continue


def agree_on_arguments(ranks: Ranks, *, error: Exception | None, arguments: Any) -> None:
    """Check, on every rank together, that every rank's arguments were valid and the
    same; raise on every rank if not (this rank's own error where it has one), so that
    no rank goes on to wait for others that have stopped."""
    said = ranks.gather((error, None if error else arguments), during="checking the arguments")
    if error is not None:
        raise error
    for rank, (theirs, _) in enumerate(said):
        if theirs is not None:
            raise RankError(f"rank {rank} could not start tuning: {theirs}")
    differ = [rank for rank, (_, args) in enumerate(said) if args != arguments]
    if differ:
        raise RankError(
            f"ranks {differ} called tune() with other arguments than rank {ranks.rank} "
            f"({arguments}); every rank must call it with the same ones."
        )


def node_memory_budget(ranks: Ranks, memory_budget: int | str | None) -> int:
    """Bytes the node's whole tree may use (every local rank and its workers): the
    budget given, or what the node's ranks use now plus a safe share of the memory
    available; the same on every rank of the node.

    Raises:
        InvalidInputError: the budget is malformed or below what the node's ranks use.
    """
    said = ranks.gather((tree_memory(), available_memory()), during="sizing the memory budget")
    node = ranks.node(said)
    in_use = int(sum(used for used, _ in node))
    if memory_budget is None:
        return in_use + int(DEFAULT_BUDGET_SHARE * min(int(free) for _, free in node))
    budget = parse_bytes(memory_budget)
    if budget <= in_use:
        raise InvalidInputError(
            f"memory_budget {format_bytes(budget)} is below what the {len(node)} ranks on "
            f"this node already use ({format_bytes(in_use)}); it is the budget of the "
            "node's whole process tree, every rank and its workers. Give a larger budget, "
            "or None for a safe share of the available memory."
        )
    return budget


def spare_batch(ranks: Ranks, read: Any) -> Any:
    """A batch read by this rank before the search, for it to step in place of one it
    fails to load (``NOTE [ Joint trials ]``); every rank fails if any rank's read
    failed (the baseline would have)."""
    batch: Any = None
    error: Exception | None = None
    try:
        batch = read()
    except Exception as failure:
        error = failure
    said = ranks.gather(error, during="reading a first batch")
    for rank, theirs in enumerate(said):
        if theirs is not None:
            raise BaselineError(
                f"rank {rank} could not read a first batch with num_workers=0: {theirs}. "
                "This is a fault in the dataset or collate_fn, not in a loader setting; "
                "fix it and tune again."
            ) from error
    return batch
