"""A reused setting checked by measurement before it is trusted.

NOTE [ A reused setting checked ]
A result file is reused where its problem's description matches (``_reuse.py``), and
the description cannot see everything that sets the speed: the storage (a cold cache,
a remote disk), a dataset's attribute (a latency, a resolution), code reached through
objects (``NOTE [ Code fingerprints ]``). So a reused setting is measured first, and
its rate compared with the rate of the saved trial of the same setting:

- ``tune()`` runs one short trial of it, through the runner its search would use: at
  most ``_SHARE`` of the time budget, and no less than ``_LEAST_SECONDS`` (a rate needs
  a few timing windows), stopped at the first window where the verdict is clear;
- ``AutoLoader`` times the first batches it loads with it (:class:`FirstBatchesCheck`):
  the training's own batches, at no cost but the timing.

The rate may differ from the saved one, by a factor either way, of 1 plus the saved
trial's own error (its 95% interval) and the check's: never less than 1.25
(``_LEAST_BAND``), so noise alone does not tune again, and never more than 2
(``_MOST_BAND``), so a noisy saved trial still sees a rate halved. A check too short
for an error of its own (fewer than two timing windows) is allowed 1.5
(``_TOO_SHORT_BAND``). Outside the band, the run tunes again, and a
warning says what moved, loading or the step, by how much (``loading 11x slower than
when tuned``); a setting that fails its check tunes again too. Inside, the result is
reused, and its notes say what the check measured. Under torchrun the ranks reuse the
file unchecked: a trial there is every rank's at once, which the reuse does not start.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import dataclass
from pathlib import Path

from autoloader.measure import (
    Deadlines,
    Measurement,
    MemoryBudgetExceeded,
    Runner,
    TrialError,
    format_seconds,
)
from autoloader.results import TrialRecord, TuneResult

_logger = logging.getLogger("autoloader")

# tune(): the check's share of the time budget, and its least seconds.
_SHARE = 0.02
_LEAST_SECONDS = 1.0
# The band, a factor either way: at least 1.25 (noise never tunes again), at most 2 (a
# noisy saved trial still sees a rate halved), and 1.5 for a check too short to tell
# its own error.
_LEAST_BAND = 0.25
_MOST_BAND = 1.0
_TOO_SHORT_BAND = 0.5
# A batch of the check may take this many times the saved trial's before it is hung.
_HUNG = 20.0


@dataclass(frozen=True, slots=True)
class ReuseCheck:
    """A reused setting's rate, measured, against its saved trial's.

    Attributes:
        then: samples per second of the saved trial, and ``now``: of the check.
        band: the change of rate allowed: ``now`` may be ``then`` times or divided by
            ``1 + band``.
        load_then, load_now: seconds per batch the loop waited for data.
        step_then, step_now: seconds per batch in the step.
        seconds: seconds the check took.
    """

    then: float
    now: float
    band: float
    load_then: float
    load_now: float
    step_then: float
    step_now: float
    seconds: float

    @property
    def holds(self) -> bool:
        """Whether the rate is within the band, a factor either way: the setting is
        reused."""
        return self.then / (1 + self.band) <= self.now <= self.then * (1 + self.band)

    def moved(self) -> str:
        """What moved, in words: loading or the step, whichever added or saved more
        time a batch, by how much."""
        loading = abs(self.load_now - self.load_then) >= abs(self.step_now - self.step_then)
        what, then, now = (
            ("loading", self.load_then, self.load_now)
            if loading
            else ("the step", self.step_then, self.step_now)
        )
        if then <= 0:
            return f"{what} takes {format_seconds(now)} a batch, no time when tuned"
        if now <= 0:
            return f"{what} takes no time, {format_seconds(then)} a batch when tuned"
        ratio = now / then
        faster = ratio < 1
        factor = 1 / ratio if faster else ratio
        amount = f"{factor:.0f}x" if factor >= 2 else f"{factor:.1f}x"
        return f"{what} {amount} {'faster' if faster else 'slower'} than when tuned"

    def note(self) -> str:
        """The check, for the result's notes."""
        return (
            f"checked before reuse: {self.now:,.0f} samples/s in "
            f"{format_seconds(self.seconds)}, {self.then:,.0f} when tuned (within "
            f"{self.band:.0%}): reused"
        )


def compared(saved: TrialRecord, measured: Measurement, *, seconds: float) -> ReuseCheck:
    """``measured``, the check of ``saved``'s setting, against ``saved``."""
    assert saved.samples_per_second is not None
    if measured.too_short:
        band = _TOO_SHORT_BAND
    else:
        errors = (saved.relative_error or 0.0) + measured.relative_error
        band = min(_MOST_BAND, max(_LEAST_BAND, errors))
    return ReuseCheck(
        then=saved.samples_per_second,
        now=measured.samples_per_second,
        band=band,
        load_then=saved.load_seconds or 0.0,
        load_now=measured.load_seconds,
        step_then=saved.step_seconds or 0.0,
        step_now=measured.step_seconds,
        seconds=seconds,
    )


def saved_trial(result: TuneResult) -> TrialRecord | None:
    """The saved trial of ``result``'s setting that a check compares with: the latest
    complete one with a rate, or ``None`` (nothing to compare with)."""
    chosen = result.chosen_trial
    if chosen is None or not chosen.samples_per_second:
        return None
    return chosen


def decided(saved: TrialRecord, window: int, measured: Measurement) -> bool:
    """Whether the check can stop at this timing window: its rate known well enough
    to be inside its band, or far enough to be outside it."""
    if window < 2 or not math.isfinite(measured.relative_error):
        return False
    check = compared(saved, measured, seconds=0.0)
    low, high = check.now * (1 - measured.relative_error), check.now * (1 + measured.relative_error)
    least, most = check.then / (1 + check.band), check.then * (1 + check.band)
    return (least <= low and high <= most) or high < least or low > most


def check_seconds(budget: float) -> float:
    """Seconds ``tune()``'s check of a reused setting may take (``NOTE [ A reused setting
    checked ]``)."""
    return max(_SHARE * budget, _LEAST_SECONDS)


def checked(result: TuneResult, runner: Runner, *, budget: float, path: Path) -> TuneResult | None:
    """``result``, reused from ``path``, once one short trial of its setting measured a
    rate within its band, its notes saying so; ``None`` where it did not, or failed:
    then the run tunes again, and a warning says why (``NOTE [ A reused setting
    checked ]``)."""
    saved = saved_trial(result)
    if saved is None:
        _logger.info("reusing %s unchecked: it keeps no measurement of its setting", path)
        return result
    seconds = check_seconds(budget)
    per_batch = (saved.load_seconds or 0.0) + (saved.step_seconds or 0.0)
    workers = int(result.params.get("num_workers") or 0)
    deadlines = Deadlines.per_batch(max(seconds, _HUNG * per_batch), workers=workers)
    try:
        measured = runner.measure(
            result.params,
            max_seconds=seconds,
            on_window=lambda window, estimate: decided(saved, window, estimate),
            deadlines=deadlines,
        )
    except (TrialError, MemoryBudgetExceeded) as error:
        _logger.warning(
            "not reusing %s: its setting failed when checked (%s). Tuning again; the file "
            "will be replaced.",
            path,
            error,
        )
        return None
    check = compared(saved, measured, seconds=measured.duration)
    if not check.holds:
        _logger.warning(
            "not reusing %s: %s (%.0f samples/s now, %.0f when tuned): re-tuning; the "
            "file will be replaced.",
            path,
            check.moved(),
            check.now,
            check.then,
        )
        return None
    _logger.info("%s: %s", path, check.note())
    return dataclasses.replace(result, notes=(*result.notes, check.note()))


# AutoLoader: epochs whose first trial may end too soon for a rate (fewer batches than
# the warm-up) before the reused setting is left unchecked.
_EPOCHS = 3


class FirstBatchesCheck:
    """``AutoLoader``'s check of a setting reused from ``path``: the first batches the
    training loads with it, timed (``NOTE [ A reused setting checked ]``). Its
    :meth:`on_window` is their trial's: it ends the trial once the rate is clearly
    outside its band; :meth:`verdict` says, as the trial ends, whether the setting holds.
    """

    def __init__(self, result: TuneResult, saved: TrialRecord, path: Path) -> None:
        self.result = result
        self.saved = saved
        self.path = path
        self.check: ReuseCheck | None = None
        self.epochs = 0

    def on_window(self, window: int, measured: Measurement) -> bool:
        """At each timing window of the first batches: whether to end their trial, the
        setting to be tuned again."""
        if self.check is None and decided(self.saved, window, measured):
            self.check = compared(self.saved, measured, seconds=measured.duration)
        return self.check is not None and not self.check.holds

    def verdict(self, measured: Measurement) -> bool | None:
        """As the trial of the first batches ends: whether the setting holds (``None``:
        not known yet, the next epoch's first batches are timed too), said in the log."""
        if self.check is None:
            self.epochs += 1
            if measured.batches == 0 or not measured.samples_per_second > 0:
                if self.epochs < _EPOCHS:
                    return None
                _logger.info(
                    "AutoLoader: reusing %s unchecked: its epochs were too short to time",
                    self.path,
                )
                return True
            self.check = compared(self.saved, measured, seconds=measured.duration)
        check = self.check
        if check.holds:
            _logger.info("AutoLoader: %s: %s", self.path, check.note())
            return True
        _logger.warning(
            "AutoLoader: not reusing %s: %s (%.0f samples/s now, %.0f when tuned): "
            "re-tuning; the file will be replaced.",
            self.path,
            check.moved(),
            check.now,
            check.then,
        )
        return False

    def noted(self) -> TuneResult:
        """The result reused, its notes saying what the check measured."""
        if self.check is None:
            return self.result
        return dataclasses.replace(self.result, notes=(*self.result.notes, self.check.note()))


def first_batches_check(result: TuneResult, path: Path) -> FirstBatchesCheck | None:
    """The check of ``result``'s setting, reused from ``path`` by an ``AutoLoader``;
    ``None`` where the result keeps no measurement of it to compare with."""
    saved = saved_trial(result)
    if saved is None:
        _logger.info(
            "AutoLoader: reusing %s unchecked: it keeps no measurement of its setting", path
        )
        return None
    return FirstBatchesCheck(result, saved, path)
