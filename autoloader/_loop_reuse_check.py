"""``AutoLoader``'s check of a setting reused from its file: the first batches the
training loads with it, timed, against the saved trial of the setting (``NOTE [ A
reused setting checked ]``, in ``_reuse_check.py``, which ``tune()``'s check shares).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Iterable
from pathlib import Path

from autoloader._reuse_check import (
    ReuseCheck,
    _beside_others,
    _CpuUse,
    _explains,
    _needed_cpus,
    _told,
    compared,
    decided,
    saved_trial,
)
from autoloader.measure import Measurement
from autoloader.results import TrialRecord, TuneResult

_logger = logging.getLogger("autoloader")

# AutoLoader: epochs whose first trial may end too soon for a rate (fewer batches than
# the warm-up) before the reused setting is left unchecked.
_EPOCHS = 3


class FirstBatchesCheck:
    """``AutoLoader``'s check of a setting reused from ``path``: the first batches the
    training loads with it, timed (``NOTE [ A reused setting checked ]``). Its
    :meth:`on_window` is their trial's: it ends the trial once the wait for data is
    clearly beyond its band; :meth:`verdict` says, as the trial ends, whether the
    setting holds.
    """

    def __init__(self, result: TuneResult, saved: TrialRecord, path: Path) -> None:
        self.result = result
        self.saved = saved
        self.path = path
        self.check: ReuseCheck | None = None
        self.epochs = 0
        self.cpus: _CpuUse | None = None
        self.unconfirmed: str | None = None

    def begin(self, workers: Callable[[], Iterable[int]]) -> None:
        """As a trial of the first batches starts: the CPUs' use is read from here, the
        trial's ``workers`` (pids) counted as the loop's own."""
        self.cpus = _CpuUse(workers)

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
            timed = measured.batches > 0 and measured.samples_per_second > 0
            if not timed or measured.only_queued:
                if self.epochs < _EPOCHS:
                    return None
                _logger.info(
                    "AutoLoader: reusing %s unchecked: its epochs were too short to time",
                    self.path,
                )
                return True
            self.check = compared(self.saved, measured, seconds=measured.duration)
        if not self.check.holds and self.cpus is not None:
            workers = int(self.result.params.get("num_workers") or 0)
            free, needed = self.cpus.free(), _needed_cpus(self.cpus, workers)
            if _explains(free, needed, self.check):  # NOTE [ A reused setting checked ]
                self.unconfirmed = _beside_others(self.check, free, needed, probed=False)
                _logger.warning("AutoLoader: %s: %s", self.path, self.unconfirmed)
                return True
        return _told(self.check, self.path, who="AutoLoader: ")

    def noted(self) -> TuneResult:
        """The result reused, its notes saying what the check measured."""
        if self.check is None:
            return self.result
        note = self.unconfirmed or self.check.note()
        return dataclasses.replace(self.result, notes=(*self.result.notes, note))


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
