"""The rules of a trial's clock, in one place for both drivers of a trial.

A trial is timed by one of two loops: :class:`~autoloader.measure._timing_loop.TimingLoop`
calls the user's step itself (``tune()``, ``diagnose()``), and
:class:`~autoloader.measure._live.LiveTrial` is called by the user's own training loop
(``AutoLoader``). What a batch counts for, when the warm-up ends, when a timing window
may close, when the rate is known well enough, how long a batch may take once the pace
is known, and whether an overdue batch was really memory growth: those are the rules of
:class:`TrialClock`, and the two loops only feed it what each batch cost.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, fields
from typing import Any

from autoloader.measure._measurement import Measurement, t95

# The most of a trial's time its warm-up may take (NOTE [ Warm-up ]). Each rank of a
# torchrun job has a share of the cores and drains its burst slower: with 2 ranks on 2
# cores, 8 workers x prefetch 2 took about 1 s of a 3 s trial, and at 0.3 every setting
# of 8 workers or more was pruned as too short (the joint choice fell to 4 workers).
WARMUP_SHARE = 0.5

# NOTE [ Warm-up ]
# At start-up every worker loads prefetch_factor batches at once, so the first
# workers * prefetch_factor batches arrive faster than the steady rate. They are
# excluded, or an under-provisioned setting would look fast in a short trial. The
# exclusion is capped at WARMUP_SHARE of the trial's time once its first batch came
# (workers that take seconds to start, spawned, leave it the rest), so a slow loader
# still leaves time to measure. Without workers there is no burst, and the first window
# opens once the first batch (timed alone: time_to_first_batch) is stepped; it opened a
# batch later before, which cost the reuse check's probe of the defaults a batch of its
# 2% (NOTE [ The defaults' loop first ], in _reuse_check.py).
# Where the cap starts the clock with burst_left of the burst still queued, some may
# have been loaded before it, and would count as loaded in the time: they come with
# less waiting than the batches after the burst. So the first burst_left batches timed
# are charged the mean wait of the batches timed after them where that is more
# (Measurement.burst_seconds): a loader slower than the step, whose queued batches run
# out, is measured at its own pace; one that keeps up, or one that was loading the
# burst at its pace anyway, waits as long before and after, and loses nothing. Where
# burst_left is half the batches timed or more, the batches after it are too few to
# tell: the trial goes on however well its windows agree, and if its time runs out so,
# it is too short (Measurement.burst_undrained). Pruned at a tenth before, a 10 s
# budget's 1 s trials of 14-15 workers x prefetch 2 on 3 ms reads (5-14 of 28-30 left)
# were all pruned, and tune() chose num_workers=0 at 1.00x where workers run 7x
# faster (the tutorial, in CI).

# NOTE [ Pace deadline ]
# A hang in one worker while the others deliver (a fault at worker index k and above)
# stalls the loop at that worker's batch. The trial's deadlines come from the
# baseline, with a floor of seconds; once a timing window has shown this trial's own
# pace, a batch may take no more than _PACE_FACTOR times what each worker takes per
# batch at that pace (workers x seconds per batch: batches come in turn), and at least
# _MIN_PACE_SECONDS. A log-normal latency with sigma 1 stays an order of magnitude
# under it; a hung worker is found in seconds instead of the baseline's floor. Without
# workers (the baseline) there is no worker to hang, and a false timeout there would
# stop the run: the baseline keeps its own deadline.
_PACE_FACTOR = 20.0
_MIN_PACE_SECONDS = 2.0

# NOTE [ Memory growth against the hang deadline ]
# A worker that fills memory slowly delivers nothing while it grows: the tree would pass
# the budget soon after the deadline. If it grows that fast, the memory watch would have
# stopped it given the time the trial had left: it is a memory fault, not a hang. A
# trial with no end of its own (a torchrun job's trial of set length, or a chosen
# setting serving training) looks _UNTIMED_HORIZON seconds ahead.
# Under torchrun only a node's first rank watches the node's whole tree (every rank's
# workers): another rank of the node asks a watch of its own tree alone, short of its
# siblings' memory, and on a slow machine a worker filling 1 GiB on rank 3 was called
# hung there before node-b's watch, on rank 2, saw the budget passed (a flaky two-node
# test). So a rank's hang is said at the trial's next checkpoint (Checkpoint.hung), and
# each rank that did not fail asks its own watch there: a node's watching rank
# whose tree passed the budget or outgrows it within the horizon reports that memory
# fault, which the job's outcome prefers to the hang (job_outcome).
_UNTIMED_HORIZON = 1.0


def memory_horizon(overdue: float, deadline: float, now: float) -> float:
    """Seconds ahead to project memory growth for a batch ``overdue`` seconds late."""
    left = deadline - now if math.isfinite(deadline) else _UNTIMED_HORIZON
    return max(overdue, left)


@dataclass(slots=True)
class Totals:
    """Sums over measured batches."""

    samples: int = 0
    batches: int = 0
    seconds: float = 0.0
    wait: float = 0.0
    # CPU seconds asked for, run or waited for (NOTE [ CPU demand ]): the process's, and
    # this thread's alone (NOTE [ Step threads ]).
    wait_cpu: float = 0.0
    step: float = 0.0
    step_cpu: float = 0.0
    step_own_cpu: float = 0.0
    wait_own_cpu: float = 0.0

    def add(self, other: Totals) -> None:
        for name in (f.name for f in fields(Totals)):
            setattr(self, name, getattr(self, name) + getattr(other, name))


def pace_limit(total: Totals, workers: int) -> float:
    """The longest a batch may take at the pace ``total`` shows (NOTE [ Pace deadline ])."""
    per_batch = total.seconds / total.batches if total.batches else math.inf
    return max(_MIN_PACE_SECONDS, _PACE_FACTOR * max(1, workers) * per_batch)


def _window_batches(params: Any) -> int:
    """A window has at least a batch from each worker (batches come in turn)."""
    return max(2, int(params.get("num_workers", 0)))


def _warmup_batches(params: Any) -> int:
    """The start-up burst: ``prefetch_factor`` batches from each worker (NOTE [ Warm-up ])."""
    return int(params.get("num_workers", 0)) * int(params.get("prefetch_factor") or 0)


def measurable_batches(params: Any, windows: int) -> int:
    """The fewest batches in which a trial of ``params`` with no end in time (a torchrun
    job's segment) closes ``windows`` timing windows: its whole warm-up, then a batch
    from each worker a window."""
    return _warmup_batches(params) + windows * _window_batches(params)


class TrialClock:
    """The warm-up, the timing windows and their sums for one trial of ``params``.

    The driver hands it each batch as it is stepped: :meth:`warming` while no window is
    open, :meth:`add` while one is; it opens and closes windows where the driver's
    decision falls (at once alone, at an agreed checkpoint in a joint trial) and asks
    :meth:`converged` whether to stop.

    Args:
        params: the setting measured (``num_workers``, ``prefetch_factor``).
        min_windows: timing windows needed before the rate counts as known.
        min_window_seconds: the shortest timing window.
        target_relative_error: the rate is known once its error is below this.
    """

    def __init__(
        self,
        params: Any,
        *,
        min_windows: int,
        min_window_seconds: float,
        target_relative_error: float,
    ) -> None:
        self.workers = int(params.get("num_workers", 0))
        self.min_windows = min_windows
        self.min_window_seconds = min_window_seconds
        self.target_relative_error = target_relative_error
        self.window_batches = _window_batches(params)
        self.warmup = _warmup_batches(params)
        self.to_skip = self.warmup  # batches of the warm-up still to skip
        self.warmup_deadline = math.inf  # set by first_batch
        self.burst_left = 0  # what the warm-up's cap left queued (Measurement.burst_left)
        self.burst_waits = Totals()  # the first burst_left batches timed
        self.crossed_epoch = False
        # The open timing window (None during the warm-up), the closed ones, their sums.
        self.window: Totals | None = None
        self.window_start = 0.0
        self.windows: list[Totals] = []
        self.total = Totals()

    def first_batch(self, at: float, deadline: float) -> None:
        """The first batch came ``at``; the trial ends at ``deadline``: the warm-up may
        take up to WARMUP_SHARE of what is left (NOTE [ Warm-up ])."""
        self.warmup_deadline = at + WARMUP_SHARE * max(0.0, deadline - at)

    def warming(self, now: float) -> bool:
        """A batch of the warm-up ended at ``now``: whether the warm-up goes on."""
        warming = self.to_skip > 0 and now < self.warmup_deadline
        self.to_skip -= warming
        return warming

    def open(self, start: float) -> None:
        """Open a timing window at ``start``."""
        if not self.windows and not self.crossed_epoch:
            self.burst_left = self.to_skip  # the first window: what the cap left queued
        self.window, self.window_start = Totals(), start

    def epoch_edge(self, seconds: float) -> None:
        """A new epoch's first batch took ``seconds`` to come (NOTE [ Trials span
        epochs ]): off the open window's clock."""
        self.crossed_epoch = True
        if self.window is not None:
            self.window_start += seconds

    def burst_over(self) -> None:
        """The warm-up ends here, what it had left to skip counted from now on (a live
        trial's first epoch edge, NOTE [ Live trials span epochs ], in _live.py)."""
        self.to_skip = 0

    def pause(self, seconds: float) -> None:
        """The trial stood still for ``seconds``: a live trial at an epoch's edge, while
        the loop does its own work (NOTE [ Live trials span epochs ], in _live.py). Its
        warm-up's deadline and its open window move on by as much."""
        self.warmup_deadline += seconds
        if self.window is not None:
            self.window_start += seconds

    def add(self, batch: Totals, end: float) -> bool:
        """Count ``batch``, stepped by ``end``, in the open window; whether the window is
        long enough to close."""
        window = self.window
        assert window is not None
        window.add(batch)
        if self.burst_waits.batches < self.burst_left:
            self.burst_waits.add(batch)
        return (
            window.batches >= self.window_batches
            and end - self.window_start >= self.min_window_seconds
        )

    def close(self, end: float) -> None:
        """Close the open window at ``end``; none is open until :meth:`open`."""
        window = self.window
        assert window is not None
        window.seconds = end - self.window_start
        self.windows.append(window)
        self.total.add(window)
        self.window = None

    def converged(self, estimate: Measurement) -> bool:
        """Whether the rate is known well enough to stop (the driver may need more):
        not while too few batches came after the burst to tell (NOTE [ Warm-up ])."""
        return (
            len(self.windows) >= self.min_windows
            and estimate.relative_error <= self.target_relative_error
            and not estimate.burst_undrained
        )

    def paced(self, limit: float | None) -> float | None:
        """``limit`` for a batch, tightened to this trial's pace (NOTE [ Pace deadline ])."""
        if limit is None or self.workers == 0:
            return limit
        return min(limit, pace_limit(self.total, self.workers))

    def finish(self, now: float, *, first_samples: int, time_to_first_batch: float) -> None:
        """The trial ends at ``now``: a window open before any closed counts (flagged
        uncertain: no error estimate); with none, the first batch alone, of
        ``first_samples`` (none: a trial that delivered nothing, with no rate at all)."""
        window = self.window
        if not self.windows and window is not None and window.batches > 0:
            window.seconds = max(1e-9, now - self.window_start)
            self.windows.append(window)
            self.total = window
        if not self.windows and first_samples:
            self.total = Totals(
                samples=first_samples,
                batches=1,
                seconds=max(1e-9, time_to_first_batch),
                wait=time_to_first_batch,
            )

    def estimate(
        self,
        *,
        time_to_first_batch: float,
        restarts: list[float],
        duration: float,
        peak_memory: int,
        batch_bytes: int,
        epochs_samples_per_second: float | None,
    ) -> Measurement:
        """The measurement of the windows closed so far: the rate over their sums, and
        its error from the spread of the windows' rates."""
        total, windows = self.total, self.windows
        burst_seconds = self.burst_seconds()
        seconds = total.seconds + burst_seconds
        rate = total.samples / seconds if total.seconds > 0 else 0.0
        relative_error = math.inf
        if len(windows) >= 2 and rate > 0:
            rates = [w.samples / w.seconds for w in windows]
            spread = statistics.stdev(rates) / math.sqrt(len(rates))
            relative_error = t95(len(rates) - 1) * spread / statistics.fmean(rates)
        batches = max(1, total.batches)
        return Measurement(
            samples_per_second=rate,
            relative_error=relative_error,
            data_wait_fraction=min(1.0, total.wait / total.seconds) if total.seconds else 1.0,
            load_seconds=total.wait / batches,
            step_seconds=total.step / batches,
            time_to_first_batch=time_to_first_batch,
            epoch_restart_seconds=statistics.median(restarts) if restarts else None,
            batches=total.batches,
            duration=duration,
            peak_memory=peak_memory,
            batch_bytes=batch_bytes,
            load_cpu_seconds=total.wait_cpu / batches,
            step_cpu_seconds=total.step_cpu / batches,
            step_thread_cpu_seconds=total.step_own_cpu / batches,
            load_thread_cpu_seconds=total.wait_own_cpu / batches,
            epochs_samples_per_second=epochs_samples_per_second,
            burst_left=self.burst_left,
            burst_seconds=burst_seconds,
        )

    def burst_seconds(self) -> float:
        """Seconds the first ``burst_left`` batches timed would have waited more at the
        mean wait of the batches timed after them (NOTE [ Warm-up ])."""
        burst, total = self.burst_waits, self.total
        after = total.batches - burst.batches
        if not burst.batches or after <= 0:
            return 0.0
        later_wait = (total.wait - burst.wait) / after
        return max(0.0, later_wait * burst.batches - burst.wait)
