"""Loading watched once tuned, and searched again where it drifted.

NOTE [ Drift ]
A setting is tuned once, and training meets changes it did not: storage slows (a cold
cache, a noisy neighbour, a remote filesystem), a curriculum or an augmentation
schedule changes an item's cost, another job starts on the node. So once tuned, an
``AutoLoader`` watches the loop's wait for data (:class:`DriftWatch`), and where
loading has become the bottleneck for a sustained stretch it searches again.

- The watch: the chosen setting's trial, which serves training unmeasured, reads the
  clock before and after each fetch (two ``perf_counter()`` calls a batch, nothing
  else: no CPU reads, no window estimates) and tells the watch the batch's wait and
  the step before it. The first batch of each epoch counts nothing (its wait is the
  epoch's start: workers starting, the loop's own work between epochs).
- Windows: the watch sums them in windows of at least ``_WINDOW_SECONDS`` and
  ``_WINDOW_BATCHES``. A window has drifted where the loop waited for data at least
  ``_SHARE`` of its time *and* its wait a batch grew, from the chosen setting's trial
  when tuned, by more than ``_GROWTH`` of a batch's time then (the band of a reuse
  check too short for an error of its own, ``NOTE [ A reused setting checked ]``). A
  step that slowed leaves the setting alone; a wait that was already the loop's whole
  cost when tuned has to grow by that much again.
- Hysteresis: ``_WINDOWS`` drifted windows in a row start a search; any other window
  starts the count again, so a blip (a checkpoint's disk write, a burst of the
  neighbour's) never does.
- Never worse: the search, of one budget, may not find a setting as good as the one
  chosen; the drifted windows measured that in the new world: where the best found is
  no faster than those windows' rate, the chosen setting is kept (its result saved
  back at ``path``), and the watch takes those windows as its reference.
- Bounds: nothing is counted until ``_GAP`` times the re-search's budget has passed
  since the last search ended (the first included); a re-search has
  ``_BUDGET_SHARE`` of ``time_budget`` and the same ``search_space``; a run searches
  again at most ``_MOST`` times. The new result's chosen trial is the watch's new
  reference, so a world that stays slow does not start another: no oscillation.
- The search is the one a reused setting that failed its check starts: SEARCHING, its
  batches exactly DataLoader's, faults absorbed (``NOTE [ AutoLoader's tuning ]``);
  a WARNING says why, and the result is saved at ``path`` as the first search's.
- Around the setting in use: after its baseline, the search measures first the setting
  in use with the workers the drifted windows say keep up with the step
  (:meth:`DriftWatch.keeping_up`, held to the space), then the cost model's guesses
  and the ladder. Its short budget reaches few settings, and the ladder's first rungs
  (1, 2 workers) are the ones a slowed loading needs least: on benchmarks/drift.py's
  images pipeline, whose reads went from 1 to 6 ms, the search from the baseline chose
  3 workers (0.47 of the best hand setting at the new speed), and the search that
  measures the 2 workers in use scaled first (to 11), 12 (1.00). It has the whole
  ``time_budget``, its trials their time after their first batch (``NOTE [ A live
  trial's time starts at its first batch ]``, in ``measure/_live.py``).
- A checkpoint taken while such a search runs resumes it as a search of the whole
  budget (``NOTE [ An AutoLoader's state ]`` keeps no drift), its count starting again.
- ``retune=False`` turns it off. Under torchrun it is off (an INFO line says so): a
  search there is every rank's at once, and a rank's own wait is not the job's.
"""

from __future__ import annotations

import math
from time import perf_counter

from autoloader.loader import Params
from autoloader.results import TuneResult

# A window: at least this many seconds of the loop, and this many batches.
_WINDOW_SECONDS = 2.0
_WINDOW_BATCHES = 8
# A window drifted: the loop waited this share of its time or more for data, its wait a
# batch grown by more than this share of a batch's time when tuned.
_SHARE = 0.3
_GROWTH = 0.5
# Drifted windows in a row that start a search.
_WINDOWS = 3
# A re-search's share of time_budget; the gap before the watch counts, in re-search
# budgets; the re-searches a run may start. With half the budget (10 s of 20), its
# trials of 1 s could not drain the start-up burst of the workers slowed loading needs:
# on benchmarks/drift.py's images pipeline, whose reads went from 1 to 6 ms, 12 workers
# were pruned too short and the search chose 3 (0.47 of the best hand setting, 8).
_BUDGET_SHARE = 1.0
_GAP = 5.0
_MOST = 3


def research_budget(time_budget: float) -> float:
    """Seconds a search started by drift may take (``NOTE [ Drift ]``)."""
    return _BUDGET_SHARE * time_budget


def watch(result: TuneResult, *, time_budget: float, researches: int) -> DriftWatch | None:
    """The watch of ``result``'s chosen setting, just chosen in a run of ``time_budget``
    that searched again ``researches`` times so far; ``None`` where it may search no
    more, or the chosen trial keeps no wait and step to compare with."""
    if researches >= _MOST:
        return None
    return DriftWatch.of(result, gap=_GAP * research_budget(time_budget))


class DriftWatch:
    """The loop's wait for data with the chosen setting of ``result``, against its
    trial's when tuned (``NOTE [ Drift ]``); :meth:`batch` says when to search again.

    Args:
        load_then, step_then: seconds a batch the loop waited for data, and stepped,
            in the chosen setting's trial.
        gap: seconds from now before windows count.

    Attributes:
        most: searches drift may start in a run.
    """

    most = _MOST

    def __init__(self, load_then: float, step_then: float, *, gap: float) -> None:
        self.load_then = load_then
        self.step_then = step_then
        self.counts_from = perf_counter() + gap
        self.drifted = 0  # drifted windows in a row
        self.wait = self.step = 0.0
        self.batches = 0
        self.share = 0.0  # the last window's share of time waiting for data
        self.load_now = self.step_now = 0.0  # and its seconds a batch

    @classmethod
    def of(cls, result: TuneResult, *, gap: float) -> DriftWatch | None:
        """The watch of ``result``'s chosen setting; ``None`` where its trial keeps no
        wait and step to compare with."""
        chosen = result.chosen_trial
        if chosen is None or chosen.load_seconds is None or not chosen.step_seconds:
            return None
        return cls(chosen.load_seconds, chosen.step_seconds, gap=gap)

    @property
    def share_then(self) -> float:
        """The loop's share of time waiting for data when tuned."""
        return self.load_then / (self.load_then + self.step_then)

    def batch(self, wait: float, step: float) -> bool:
        """A batch the loop waited ``wait`` seconds for, after a step of ``step``:
        whether loading drifted for long enough to search again."""
        self.wait += wait
        self.step += step
        self.batches += 1
        seconds = self.wait + self.step
        if seconds < _WINDOW_SECONDS or self.batches < _WINDOW_BATCHES:
            return False
        wait_per_batch = self.load_now = self.wait / self.batches
        self.step_now = self.step / self.batches
        self.share = self.wait / seconds
        self.wait = self.step = 0.0
        self.batches = 0
        if perf_counter() < self.counts_from:
            return False
        grown = wait_per_batch - self.load_then > _GROWTH * (self.load_then + self.step_then)
        self.drifted = self.drifted + 1 if grown and self.share >= _SHARE else 0
        return self.drifted >= _WINDOWS

    def rate(self, batch_size: int) -> float:
        """Samples per second of the loop in the last window, of ``batch_size``."""
        return batch_size / (self.load_now + self.step_now)

    def now(self, *, time_budget: float) -> DriftWatch:
        """A watch of the setting as it loads now, in the last window (the search it
        started found none faster): drift from here on, after the gap."""
        return DriftWatch(self.load_now, self.step_now, gap=_GAP * research_budget(time_budget))

    def keeping_up(self, params: Params) -> Params | None:
        """``params``, the setting watched, with the workers that would keep up with the
        step at the last window's pace: where ``w`` workers hand the loop a batch every
        ``wait + step`` seconds, ``w * (wait + step) / step`` hand it one a step. The
        search drift starts measures it first (``Policy.first``), its count held to the
        space there. ``None`` without workers (their count tells nothing), or where it
        is no more than ``params``'s."""
        workers = params["num_workers"]
        if workers == 0 or self.step_now <= 0:
            return None
        needed = math.ceil(workers * (self.load_now + self.step_now) / self.step_now)
        if needed <= workers:
            return None
        return {**params, "num_workers": needed}

    def why(self) -> str:
        """What drifted, in words."""
        return (
            f"the loop now waits {self.share:.0%} of its time for data, "
            f"{self.share_then:.0%} when tuned"
        )
