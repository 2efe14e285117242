"""How long a batch, and a worker's start, may take before a trial counts as hung."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from autoloader.measure import FIRST_STEP_TIMEOUT, STARTUP_PER_WORKER, Deadlines, Measurement
from autoloader.search._cost_model import CPU_BOUND_SHARE
from autoloader.search._objective import MIN_TRIAL_SECONDS
from autoloader.search._outcome import Trial, baseline_measurement

# NOTE [ Hang deadlines ]
# A batch (loading it, or the step on it) is hung once it takes _TIMEOUT_FACTOR times
# the baseline's time per batch, and never less than _MIN_BATCH_TIMEOUT seconds. With
# more workers than CPUs a CPU-bound batch legitimately slows by workers / CPUs; the
# first batch of an epoch also waits for workers to start (Deadlines.per_batch).
# Before the baseline there is nothing to derive from: a baseline batch may take
# _BASELINE_SHARE of the time budget, at least _MIN_BASELINE_TIMEOUT seconds, so that a
# dataset or step that blocks forever fails the baseline (BaselineError) within the
# checks' share of the budget plus that (4 s at a 5 s budget, 36 s at 60 s) rather than
# a minute past a short budget. Within a trial, its own pace tightens the deadline
# (NOTE [ Pace deadline ] in measure/_clock.py).
_TIMEOUT_FACTOR = 20.0
_MIN_BATCH_TIMEOUT = 3.0
# A batch late by its sibling workers' pace (NOTE [ Sibling pace ] in
# measure/_deadlines.py) gets _TIMEOUT_FACTOR times a worker's time per batch, at least
# _MIN_SIBLING_TIMEOUT: the other workers' deliveries show that the loop itself moves.
_MIN_SIBLING_TIMEOUT = 1.0
# A worker may take this many times the measured start-up to start, and at least
# _MIN_START_TIMEOUT seconds, before its first batch is overdue.
_START_TIMEOUT_FACTOR = 3.0
_MIN_START_TIMEOUT = 0.5
_BASELINE_SHARE = 0.5
_MIN_BASELINE_TIMEOUT = 3.0


@dataclass(frozen=True)
class HangRules:
    """The deadlines of ``NOTE [ Hang deadlines ]`` for a run.

    Args:
        time_budget: seconds of the whole run.
        usable_cpus: CPUs this process may run on.
        worker_start: seconds to start one worker process, as measured before the
            search, or ``None``.
    """

    time_budget: float
    usable_cpus: int
    worker_start: float | None

    def deadlines(self, params: Mapping[str, Any], history: Sequence[Trial]) -> Deadlines:
        """How long one batch may take with ``params`` (see ``NOTE [ Hang deadlines ]``)."""
        workers = int(params["num_workers"])
        measured = baseline_measurement(history)
        if measured is None:
            limit = max(_MIN_BASELINE_TIMEOUT, _BASELINE_SHARE * self.time_budget)
            # The run's first call of step_fn (NOTE [ The first step ]).
            first_step = max(FIRST_STEP_TIMEOUT, self.time_budget)
            return Deadlines(first=limit, each=limit, first_step=first_step)
        per_batch = measured.load_seconds + measured.step_seconds
        slowdown = max(1.0, workers / self.usable_cpus)
        each = max(_MIN_BATCH_TIMEOUT, _TIMEOUT_FACTOR * per_batch * slowdown)
        per_worker = self._worker_load_seconds(measured, workers)
        sibling = min(each, max(_MIN_SIBLING_TIMEOUT, _TIMEOUT_FACTOR * per_worker))
        start = self.start_each(history)
        start_each = (
            STARTUP_PER_WORKER
            if start is None
            else max(_MIN_START_TIMEOUT, _START_TIMEOUT_FACTOR * start)
        )
        return Deadlines.per_batch(each, workers=workers, sibling=sibling, start_each=start_each)

    def start_each(self, history: Sequence[Trial]) -> float | None:
        """Seconds one worker process takes to start, or ``None`` if not measured: the
        measurement before the search, or the slowest start per worker a trial with
        workers showed (its time to first batch, less a batch's load, over its
        workers: they start one after the other), whichever is larger."""
        measured = baseline_measurement(history)
        if self.worker_start is None or measured is None:
            return self.worker_start
        seen: list[float] = [
            (
                trial.measurement.time_to_first_batch
                - self._worker_load_seconds(measured, trial.params["num_workers"])
            )
            / trial.params["num_workers"]
            for trial in history
            if trial.measurement is not None
            and trial.measurement.batches > 0
            and trial.params["num_workers"] > 0
            and trial.params.get("worker_kind", "processes") == "processes"
        ]
        return max([self.worker_start, *seen])

    def _worker_load_seconds(self, measured: Measurement, workers: int) -> float:
        """Seconds a worker takes to load a batch with ``workers`` at once: the
        baseline's load time, slower only where loading is CPU work and the workers
        outnumber the CPUs."""
        cpu_bound = measured.load_cpu_seconds >= CPU_BOUND_SHARE * measured.load_seconds
        slowdown = max(1.0, workers / self.usable_cpus) if cpu_bound else 1.0
        return measured.load_seconds * slowdown

    def startable(self, history: Sequence[Trial], seconds_left: float) -> int | None:
        """The most worker processes that start, one after the other, in ``seconds_left``
        with a moment left to measure; ``None`` where start-up was not measured. A trial
        cannot be stopped while its workers start (DataLoader starts them in
        ``iter()``): one that cannot start in the time left would overrun the budget."""
        start = self.start_each(history)
        if not start:
            return None
        return max(0, int((seconds_left - 0.5 * MIN_TRIAL_SECONDS) / start))

    def startup_seconds(self, params: Mapping[str, Any], history: Sequence[Trial]) -> float:
        """Seconds ``params``'s workers are expected to take to start, which a trial gets
        on top of its time to measure (0 where not measured, or for threads)."""
        start = self.start_each(history)
        if start is None or params.get("worker_kind", "processes") != "processes":
            return 0.0
        return start * int(params["num_workers"])
