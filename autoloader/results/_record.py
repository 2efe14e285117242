"""One measured setting as a result reports it: :class:`TrialRecord`."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from autoloader.search import Completed, Trial, state_of


@dataclass(frozen=True, slots=True)
class TrialRecord:
    """One measured setting.

    Attributes:
        number: the trial's number in the Optuna study.
        phase: ``"baseline"`` (``num_workers=0`` defaults), ``"search"`` or ``"runoff"``
            (a close candidate measured again to decide between settings).
        params: the DataLoader settings measured.
        state: ``"complete"``, ``"pruned"`` or ``"failed"``.
        samples_per_second: steady rate of the training loop.
        epoch_samples_per_second: the objective: samples per second over a whole
            epoch, worker start-up included (see ``NOTE [ Epoch model ]``).
        data_wait_fraction: share of loop time blocked waiting for a batch.
        time_to_first_batch: seconds from ``iter(loader)`` to the first batch.
        peak_memory: bytes, highest PSS of the process tree.
        relative_error: 95% confidence half-width of ``samples_per_second``, relative.
        duration: seconds the trial took.
        reason: why the trial was pruned or failed, for people.
        kind: what the reason is, for programs: for a pruned trial ``"slower"``,
            ``"too short"``, ``"memory"`` or ``"killed"``; for a failed one ``"worker
            crashed"``, ``"timeout"``, ``"shared memory"``, ``"too many open files"``,
            ``"trial process died"``, ``"error"`` or ``"interrupted"``.
        load_seconds: mean seconds per batch the loop was blocked waiting for data.
        step_seconds: mean seconds per batch in the step.
        load_cpu_seconds: mean CPU seconds of the main process per batch while it
            waited (with ``num_workers=0``: the CPU part of loading).
        batch_bytes: bytes of the tensors in one batch.
        step_cpu_seconds: mean CPU seconds of the main process per batch in the step,
            all its threads counted (a step training on the CPU keeps that many cores
            busy per second of step).
        step_thread_cpu_seconds: the same for the thread that ran the step alone:
            close to ``step_seconds`` where the step works on the CPU, close to 0 where
            it waits (see ``NOTE [ Step threads ]``).
    """

    number: int
    phase: str
    params: dict[str, Any]
    state: str
    samples_per_second: float | None = None
    epoch_samples_per_second: float | None = None
    data_wait_fraction: float | None = None
    time_to_first_batch: float | None = None
    peak_memory: int | None = None
    relative_error: float | None = None
    duration: float | None = None
    reason: str | None = None
    load_seconds: float | None = None
    step_seconds: float | None = None
    load_cpu_seconds: float | None = None
    batch_bytes: int | None = None
    step_cpu_seconds: float | None = None
    kind: str | None = None
    step_thread_cpu_seconds: float | None = None

    @property
    def too_short(self) -> bool:
        """Whether the trial ran out of time before its rate could be trusted: it was
        pruned, and its rate is not a finding."""
        return self.state == "pruned" and self.kind == "too short"

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def record_of(trial: Trial) -> TrialRecord:
    """A finished trial of the search, as the result reports it."""
    outcome = trial.outcome
    m = trial.measurement
    value = outcome.value if isinstance(outcome, Completed) else None
    peak = m.peak_memory if m is not None else None
    if not isinstance(outcome, Completed) and outcome.peak_memory is not None:
        peak = outcome.peak_memory
    return TrialRecord(
        number=trial.number,
        phase=trial.phase.value,
        params=dict(trial.params),
        state=state_of(outcome),
        samples_per_second=m.samples_per_second if m else None,
        epoch_samples_per_second=value,
        data_wait_fraction=m.data_wait_fraction if m else None,
        time_to_first_batch=m.time_to_first_batch if m else None,
        peak_memory=peak,
        relative_error=m.relative_error if m and math.isfinite(m.relative_error) else None,
        duration=m.duration if m else None,
        reason=None if isinstance(outcome, Completed) else outcome.reason,
        load_seconds=m.load_seconds if m else None,
        step_seconds=m.step_seconds if m else None,
        load_cpu_seconds=m.load_cpu_seconds if m else None,
        batch_bytes=m.batch_bytes if m else None,
        step_cpu_seconds=m.step_cpu_seconds if m else None,
        kind=None if isinstance(outcome, Completed) else outcome.kind.value,
        step_thread_cpu_seconds=m.step_thread_cpu_seconds if m else None,
    )
