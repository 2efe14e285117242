"""What one trial measured: the record, and the statistics of its timing windows."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

# Two-sided 95% Student t quantiles by degrees of freedom; 1.96 beyond the table.
_T95 = (12.71, 4.30, 3.18, 2.78, 2.57, 2.45, 2.36, 2.31, 2.26, 2.23, 2.20, 2.18, 2.16, 2.14,
        2.13, 2.12, 2.11, 2.10, 2.09, 2.09, 2.08, 2.07, 2.07, 2.06, 2.06, 2.06, 2.05, 2.05,
        2.05, 2.04)  # fmt: skip


def t95(df: int) -> float:
    return _T95[df - 1] if df <= len(_T95) else 1.96


@dataclass(frozen=True, slots=True)
class Measurement:
    """What one trial measured of the training loop ``next(loader)`` then ``step_fn``.

    Attributes:
        samples_per_second: steady-state rate of the loop, warm-up excluded, over the
            time timed and ``burst_seconds``.
        relative_error: half-width of the 95% confidence interval of that rate, as a
            fraction of it (``inf`` when too few windows were measured to tell).
        data_wait_fraction: share of the loop's time spent blocked in ``next()``.
        load_seconds: mean seconds per batch blocked in ``next()``.
        step_seconds: mean seconds per batch in the step (transfer included).
        time_to_first_batch: seconds from ``iter(loader)`` to the first batch: worker
            start-up plus the first batch's load.
        epoch_restart_seconds: the same for a later epoch, if the trial crossed one.
        burst_left: batches of the start-up burst (``num_workers x prefetch_factor``)
            not yet drained when the warm-up's time cap started the timing.
        burst_seconds: what the first ``burst_left`` batches timed would have waited
            more at the mean wait of those after them (queued before the clock started,
            they came sooner), added to the time of ``samples_per_second`` (``NOTE [
            Warm-up ]``).
        epochs_samples_per_second: the rate over whole epochs, timed from the first
            batch after warm-up to the same batch of the next epoch (see
            ``NOTE [ Whole epochs ]``), if the trial got that far; ``None`` if not.
        batches: batches measured after warm-up.
        duration: seconds the whole trial took.
        peak_memory: bytes, highest PSS of the process tree during the trial.
        batch_bytes: bytes of the tensors in the first batch.
        load_cpu_seconds: mean CPU seconds this process used, or was ready to use and
            waited for (``NOTE [ CPU demand ]``), per batch while blocked in
            ``next()``. With ``num_workers=0`` it tells CPU-bound loading (close to
            ``load_seconds``) from waiting on I/O (close to 0).
        step_cpu_seconds: the same per batch in the step, all its threads counted: a
            step that trains on the CPU keeps as many cores busy as
            ``step_cpu_seconds / step_seconds``, cores workers then compete for.
        step_thread_cpu_seconds: the same for the thread that runs the step alone. It
            tells a step that works on the CPU (close to ``step_seconds``) from one that
            waits, on an accelerator or in a sleep, whose ``step_cpu_seconds`` can still
            count torch's pool spinning after the loading's ops (see
            ``NOTE [ Step threads ]``).
        load_thread_cpu_seconds: the same as ``load_cpu_seconds`` for this thread
            alone: with ``num_workers=0``, loading that is CPU work keeps it busy, and
            loading that waits does not, whatever torch's pool spins after the step.
    """

    samples_per_second: float
    relative_error: float
    data_wait_fraction: float
    load_seconds: float
    step_seconds: float
    time_to_first_batch: float
    epoch_restart_seconds: float | None
    batches: int
    duration: float
    peak_memory: int
    batch_bytes: int = 0
    load_cpu_seconds: float = 0.0
    step_cpu_seconds: float = 0.0
    epochs_samples_per_second: float | None = None
    burst_left: int = 0
    burst_seconds: float = 0.0
    step_thread_cpu_seconds: float = 0.0
    load_thread_cpu_seconds: float = 0.0

    @property
    def too_short(self) -> bool:
        """Whether the trial was too short to trust: fewer than two timing windows (the
        rate has no error estimate: the time ran out during start-up and warm-up), or
        timing began before the start-up burst drained (see ``burst_undrained``)."""
        return not math.isfinite(self.relative_error) or self.burst_undrained

    @property
    def burst_undrained(self) -> bool:
        """Whether timing began with so much of the start-up burst still queued (half
        the batches timed or more) that the batches timed after it are too few to tell
        how long the burst's would have waited (``NOTE [ Warm-up ]``), and no whole epoch
        was timed to stand in for it. Counted as they came, they make a loader slower
        than the step look as fast as the step: 7 workers x prefetch 8 on an epoch of 63
        batches measured 1,810 samples/s, and ran 1,134 in training."""
        undrained = self.burst_left > 0 and self.burst_left >= 0.5 * self.batches
        return undrained and self.epochs_samples_per_second is None

    @property
    def only_queued(self) -> bool:
        """Whether every batch timed was queued as the workers started, the clock started
        by the warm-up's cap (``NOTE [ Warm-up ]``): none came at the loader's own pace,
        and the wait for data says nothing of it."""
        return self.burst_left > 0 and self.batches <= self.burst_left

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


# Called after each timing window with the window's number and the estimate so far;
# returns True to stop the trial there (a vote, not an exception: the runner returns
# the estimate as measured, and every process of a trial can stop at the same window).
WindowCallback = Callable[[int, Measurement], bool]
