"""The next trial's loader started while the trial before it drains, so that its
workers' start-up overlaps the loop's last steps of that trial
(``NOTE [ Overlapped start-up ]``): when it may, and what stands meanwhile.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from autoloader._loop_loaders import Loaders
from autoloader._loop_search import Plan, SoloSearch, Tuning
from autoloader.loader import Params
from autoloader.measure import LiveTrial, Measurement
from autoloader.results import TuneResult

# NOTE [ Overlapped start-up ]
# Each switch of setting stalls the loop for the new loader's start-up: its workers
# start and each loads a first batch before the loop gets one. On the 2-core VM an
# AutoLoader's first run of the images pipeline (budget 20 s) stalled 0.1-1.2 s at each
# of its 8 switches, 4.5 s of a 37 s run. A trial alone that has measured enough
# drains (NOTE [ Draining a trial ], in measure/_live.py): the loop takes, one step
# each, the batches its loader had asked for. Its outcome is known from the drain's
# first batch on, and nothing in the drain is measured. So there the study is told how
# it went and asked for the next trial, whose loader starts at once
# (LiveTrial.prestart): its workers load the batches after the drained ones while the
# loop steps through those, and the loop goes on to them with the start-up hidden, up
# to the drain's length. The successor's own time (deadline, warm-up, windows) starts
# at the loop's first next() of it, as any trial's does; its start-up (time to first
# batch, which the search charges settings whose workers restart every epoch) counts
# from its workers' start, so it is the start-up itself where the loop had to wait for
# it, and at most the drain's length more where the drain hid it: never less.
# Not overlapped: a trial under torchrun (its segment ends at a set batch, without a
# drain), the making up of a failed setting's batches, and a trial whose process tree
# peaked above _MEMORY_SHARE of its memory budget (the two loaders' workers live at
# once during the drain). The drained trial's memory watch stops at the drain: its
# measurement is over and its batches are loaded; the successor's watch counts both.
# A drain that fails (a worker dies before delivering what it had loaded) is the
# setting's failure, told to the study as measured before: the successor stops first
# and gives back its batches, then the drained trial gives back its own ahead of them
# (the epoch's order), they are made up by the setting that was last good before it,
# and the successor's plan starts afresh after. Where the loop leaves the epoch during
# the drain, the successor stops likewise and its plan starts the next trial; where
# the loader closes first, its plan is told to the study as not run.
_MEMORY_SHARE = 0.4


@dataclass(slots=True)
class Successor:
    """The trial planned while ``drained`` drains (``NOTE [ Overlapped start-up ]``).

    Attributes:
        drained: the trial told to the study at its drain's first batch.
        plan: what comes next: a search trial, or the search's result.
        last_good: the last good setting before ``drained`` was told, which makes up
            its batches if its drain fails.
        trial: the next trial, its loader started, until the loop takes it or it is
            dropped (its plan is then started afresh).
    """

    drained: LiveTrial
    plan: Plan | TuneResult
    last_good: Params
    trial: LiveTrial | None = None


class Overlap:
    """The successor of the search's trial that drains, from the drain's first batch
    until the loop takes it (``NOTE [ Overlapped start-up ]``).

    Args:
        loaders: the tuning's loaders, the chosen setting's kept among them.
    """

    def __init__(self, loaders: Loaders) -> None:
        self.loaders = loaders
        self.successor: Successor | None = None

    def start(
        self,
        tuning: Tuning,
        search: SoloSearch,
        trial: LiveTrial,
        loader_of: Callable[[Plan | TuneResult], LiveTrial],
    ) -> None:
        """``trial`` drains: where it may, tell the study how it went, plan the next
        trial and start its loader (``loader_of`` the plan) at once."""
        if self.successor is not None or not overlappable(trial):
            return
        assert isinstance(trial.outcome, Measurement)
        last_good = tuning.last_good
        trial.watch.stop()  # its measurement is over; the successor's watch counts both
        search.ended(tuning, trial, trial.outcome, 0)
        plan = search.plan(tuning)
        self.successor = successor = Successor(trial, plan, last_good)
        successor.trial = loader_of(plan)
        successor.trial.prestart()

    def take(self) -> Successor | None:
        """The successor, for the next trial to start from."""
        successor, self.successor = self.successor, None
        return successor

    def of(self, trial: LiveTrial) -> Successor | None:
        """The successor planned while ``trial`` drained, if any."""
        successor = self.successor
        return successor if successor is not None and successor.drained is trial else None

    def ending(self, trial: LiveTrial) -> None:
        """``trial`` ends: where its drain failed, its successor stops first, giving back
        its batches behind ``trial``'s."""
        if self.of(trial) is not None and not isinstance(trial.outcome, Measurement):
            self.drop()

    def drop(self, *, kill: bool = False) -> None:
        """Stop the successor's loader, its batches given back (the loop left the epoch
        it loads, or the drain before it failed): its plan starts the next trial
        (``kill``: the interpreter is exiting)."""
        successor = self.successor
        if successor is None or successor.trial is None:
            return
        trial, successor.trial = successor.trial, None
        trial.close(kill=kill)
        if isinstance(successor.plan, TuneResult):
            self.loaders.release_kept()  # the chosen setting's, kept: NOTE [ Drift ]


def overlappable(trial: LiveTrial) -> bool:
    """Whether the next trial's loader may start while ``trial`` drains: it measured
    well, and its process tree peaked within ``_MEMORY_SHARE`` of its memory budget."""
    return (
        trial.draining
        and isinstance(trial.outcome, Measurement)
        and trial.watch.peak <= _MEMORY_SHARE * trial.watch.budget
    )
