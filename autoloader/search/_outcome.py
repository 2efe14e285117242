"""What a trial is asked to measure, and what came of it: the records the policy reads.

A trial ends in one of three typed outcomes::

    Completed(measurement, value)        measured to the end; value is the objective
    Pruned(kind, reason)                 stopped or not counted: slower, too short, memory
    Failed(kind, reason)                 the setting made the pipeline fail

The kinds are enums, so no rule reads a reason's words back. Reasons are for people.
"""

from __future__ import annotations

import enum
import socket
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any

from optuna.trial import TrialState

from autoloader.loader import Params
from autoloader.measure import Deadlines, Measurement


class Phase(str, enum.Enum):
    """Which part of a run a trial belongs to."""

    BASELINE = "baseline"  # num_workers=0 defaults: validates the pipeline
    SEARCH = "search"  # the ladder, the guesses, bisection and the sampler's proposals
    RUNOFF = "runoff"  # close candidates and the baseline measured again, interleaved


class PruneKind(str, enum.Enum):
    """Why a trial's rate is not counted, though nothing is broken."""

    SLOWER = "slower"  # voted out during the trial: clearly slower than the best so far
    TOO_SHORT = "too short"  # its time ran out before its rate could be trusted
    MEMORY = "memory"  # over the memory budget, or an out-of-memory error
    KILLED = "killed"  # SIGKILLed, likely by the kernel's OOM killer


class FaultKind(str, enum.Enum):
    """Why a setting made the pipeline fail."""

    WORKER_CRASHED = "worker crashed"  # a worker died of a signal or exited
    TIMEOUT = "timeout"  # a batch (or the step on it) hung
    SHARED_MEMORY = "shared memory"  # /dev/shm ran out (SIGBUS, ENOSPC)
    OPEN_FILES = "too many open files"
    PROCESS_DIED = "trial process died"  # under isolation="subprocess"
    ERROR = "error"  # user code raised with this setting
    INTERRUPTED = "interrupted"  # Ctrl-C, or the tuning process died: not the setting


# Faults that come with the number of workers (the worker index, shards per worker,
# resources per worker): a count that met one fails at any larger count too, once two
# counts have shown it (see NOTE [ Failure boundary ]).
WORKER_COUNT_FAULTS = frozenset(
    {FaultKind.WORKER_CRASHED, FaultKind.TIMEOUT, FaultKind.ERROR, FaultKind.OPEN_FILES}
)


@dataclass(frozen=True, slots=True)
class TrialSpec:
    """One trial, as every process that runs it must agree on it (picklable).

    Attributes:
        number: the trial's number in the study.
        phase: which part of the run it belongs to.
        params: the DataLoader settings to measure.
        max_seconds: the longest it may measure.
        deadlines: how long one batch may take before the trial is failed as hung.
        max_batches: stop after this many timed batches, if set: a length every process
            of a trial can agree on, where ``max_seconds`` is one process's clock.
    """

    number: int
    phase: Phase
    params: Params
    max_seconds: float
    deadlines: Deadlines
    max_batches: int | None = None


@dataclass(frozen=True, slots=True)
class Completed:
    """Measured to the end: ``value`` is the objective (epoch samples per second)."""

    measurement: Measurement
    value: float


@dataclass(frozen=True, slots=True)
class Pruned:
    """Not counted. ``same_as`` is the trial it was known from, if it was not run."""

    kind: PruneKind
    reason: str
    measurement: Measurement | None = None
    peak_memory: int | None = None
    same_as: int | None = None


@dataclass(frozen=True, slots=True)
class Failed:
    """The setting failed. ``same_as`` is the trial it was known from, if it was not run."""

    kind: FaultKind
    reason: str
    peak_memory: int | None = None
    same_as: int | None = None


Outcome = Completed | Pruned | Failed


@dataclass(frozen=True, slots=True)
class Trial:
    """A finished trial: what it measured and what came of it.

    Attributes:
        earlier: it was run by an earlier tuning run on the same stored study (one that
            was killed, or stopped), not by this one.
    """

    number: int
    phase: Phase
    params: Params
    outcome: Outcome
    earlier: bool = False

    @property
    def value(self) -> float | None:
        return self.outcome.value if isinstance(self.outcome, Completed) else None

    @property
    def measurement(self) -> Measurement | None:
        if isinstance(self.outcome, (Completed, Pruned)):
            return self.outcome.measurement
        return None

    @property
    def workers(self) -> int:
        return int(self.params["num_workers"])

    @property
    def skipped(self) -> bool:
        """Recorded without being run: known to fail from an earlier trial."""
        return not isinstance(self.outcome, Completed) and self.outcome.same_as is not None


def outcome_attrs(outcome: Outcome) -> dict[str, Any]:
    """The outcome as study user attributes (JSON), for :func:`outcome_from_attrs`."""
    attrs: dict[str, Any] = {"state": _STATE[type(outcome)]}
    if isinstance(outcome, Completed):
        attrs["value"] = outcome.value
    else:
        attrs.update(kind=outcome.kind.value, reason=outcome.reason, same_as=outcome.same_as)
        attrs["peak_memory"] = outcome.peak_memory
    return attrs


def outcome_from_attrs(attrs: dict[str, Any], measurement: Measurement | None) -> Outcome:
    """Rebuild an outcome stored by :func:`outcome_attrs`.

    Raises:
        KeyError, ValueError: the attributes are not an outcome.
    """
    state = attrs["state"]
    if state == "complete":
        if measurement is None:
            raise ValueError("a complete trial without its measurement")
        return Completed(measurement, float(attrs["value"]))
    if state == "pruned":
        return Pruned(
            PruneKind(attrs["kind"]),
            str(attrs["reason"]),
            measurement,
            attrs.get("peak_memory"),
            attrs.get("same_as"),
        )
    if state == "failed":
        return Failed(
            FaultKind(attrs["kind"]),
            str(attrs["reason"]),
            attrs.get("peak_memory"),
            attrs.get("same_as"),
        )
    raise ValueError(f"unknown state {state!r}")


_MEASUREMENT_FIELDS = frozenset(f.name for f in fields(Measurement))
_STATE: dict[type, str] = {Completed: "complete", Pruned: "pruned", Failed: "failed"}


def stored_outcome(attrs: Mapping[str, Any]) -> Outcome | None:
    """The outcome ``Driver._tell`` stored in a trial's ``attrs``; ``None`` if none.

    Raises:
        KeyError, TypeError, ValueError: the attributes are not an outcome.
    """
    if "outcome" not in attrs:
        return None
    raw = attrs.get("measurement")
    measurement = (
        Measurement(**{k: v for k, v in raw.items() if k in _MEASUREMENT_FIELDS})
        if isinstance(raw, Mapping)
        else None
    )
    return outcome_from_attrs(attrs["outcome"], measurement)


def told(outcome: Outcome) -> dict[str, Any]:
    """How Optuna's ``study.tell()`` is told ``outcome``: a value, or a state."""
    if isinstance(outcome, Completed):
        return {"values": outcome.value}
    return {"state": TrialState.PRUNED if isinstance(outcome, Pruned) else TrialState.FAIL}


def orphan_reason(owner: Mapping[str, Any]) -> str:
    """Why a trial left running by a tuning process that died failed."""
    host = owner.get("host")
    on = f" on {host}" if host is not None and host != socket.gethostname() else ""
    return f"interrupted: the tuning process (pid {owner.get('pid')}{on}) died"


def state_of(outcome: Outcome) -> str:
    """``"complete"``, ``"pruned"`` or ``"failed"``."""
    return _STATE[type(outcome)]


def baseline_measurement(history: Sequence[Trial]) -> Measurement | None:
    """What the first complete baseline trial measured, or ``None`` before it."""
    for trial in history:
        if trial.phase is Phase.BASELINE and isinstance(trial.outcome, Completed):
            return trial.outcome.measurement
    return None
