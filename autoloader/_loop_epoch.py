"""One epoch of a tuning AutoLoader, the iterator the loop holds: each batch from the
trial under way, the next trial started where one ends, and all a trial holds stopped
once the loop drops it (``NOTE [ Nothing outlives the loop ]``).
"""

from __future__ import annotations

import contextlib
import logging
import weakref
from collections.abc import Iterator, Sized
from dataclasses import dataclass
from typing import Any

from autoloader._loader_state import Draws
from autoloader._loop_stages import Stage
from autoloader._loop_tuning import LoopTuning
from autoloader.loader import EpochBatches
from autoloader.loader._torch_compat import exiting
from autoloader.measure import LiveTrial, TrialEnded

_logger = logging.getLogger("autoloader")

# NOTE [ Nothing outlives the loop ]
# A trial holds a thread (the memory watch), the SIGCHLD and SIGALRM handlers, and its
# loader's workers. Left running after the loop stopped using them, the watch would
# kill processes of the user's long after (it acts only on the trial's workers, but a
# stale trial is nobody's to judge). So the loop alone holds the epoch: the loader keeps
# a weak reference to it, and the epoch holds the loader. When the loop drops it (a
# ``break``, an exception, Ctrl-C), its finalizer ends the trial under way where it
# stands and stops all it holds (``LiveTrial.close``), at once in CPython; the study is
# told how the trial went at the loader's next epoch or ``close()``, in the loop's own
# code, not in a finalizer (under torchrun that takes a collective). A trial the epoch
# ended in the middle of (NOTE [ Live trials span epochs ]) is the tuning's until the
# next epoch resumes it: between epochs it stands as between two steps, its watch and
# handlers in place; ``close()`` ends it and tells the study. The search holds the
# loader by a weak reference too, so a loader nobody holds is collected at once, and
# its finalizer stops the chosen setting's persistent workers and a trial waiting for
# the next epoch. Both finalizers run at the interpreter's exit too, where the workers
# are killed: DataLoader's own shutdown does nothing then. A finalizer the garbage
# collector runs in another thread stops the threads and the workers; the handlers,
# which only the main thread can set, are put back by the next trial there
# (``NOTE [ Handlers put back ]``).


@dataclass(slots=True)
class _Current:
    """The trial under way in an epoch: what its finalizer stops."""

    trial: LiveTrial | None = None


class Epoch(Iterator[Any]):
    """One pass over an AutoLoader: each batch from the trial under way, the next trial
    started where one ends."""

    def __init__(
        self,
        owner: Sized,
        tuning: LoopTuning,
        batches: EpochBatches,
        seed: int,
        draws: Draws,
    ) -> None:
        self.owner = owner  # NOTE [ Nothing outlives the loop ]
        self.tuning = tuning
        self.batches = batches
        self.seed = seed
        self.draws = draws  # the generators' states at its start
        # The trial the last epoch ended in the middle of goes on with this one's batches.
        self.current = _Current(tuning.carry_on(batches))
        self.done = False
        weakref.finalize(self, _abandon, self.tuning, self.current)

    @property
    def trial(self) -> LiveTrial | None:
        return self.current.trial

    def __iter__(self) -> Epoch:
        return self

    def __len__(self) -> int:
        return len(self.owner)

    def __next__(self) -> Any:
        return self._next(asked=True)

    def _next(self, *, asked: bool) -> Any:
        """The next batch; ``asked``: the loop asked for it (past the epoch's end, the
        sampler is asked too, as DataLoader's iterator asks it)."""
        if self.done:
            raise StopIteration
        while True:
            trial = self.current.trial
            if trial is None:
                trial = self.current.trial = self.tuning.start_trial(self.batches, self.seed)
            elif trial.draining:  # NOTE [ Overlapped start-up ]: the next may start now
                self.tuning.drains(trial, self.batches, self.seed)
            try:
                return trial.next()
            except TrialEnded:
                self._end_trial()
            except StopIteration:
                if asked:
                    self.batches.exhaust()
                self.done = True
                if trial.outcome is None:  # NOTE [ Live trials span epochs ]
                    self.current.trial = None
                    self.tuning.carry(trial)
                else:
                    self._end_trial()
                raise

    def _end_trial(self) -> None:
        trial, self.current.trial = self.current.trial, None
        assert trial is not None
        trial.end()
        self.tuning.overlap.ending(trial)  # a successor's batches go back behind its own
        undelivered = trial.feed.in_flight
        if self.tuning.stage is Stage.SEARCHING and self.tuning.overlap.of(trial) is None:
            self.tuning.loaders.park(trial)  # NOTE [ The last trial's workers kept ]
        trial.close()
        self.tuning.trial_ended(trial, undelivered)

    def close(self) -> None:
        """The loop left this epoch: end its trial where it stands, and stop a next
        trial's loader started on its batches (``NOTE [ Overlapped start-up ]``); or,
        where the loop took every batch, end the epoch as at StopIteration (``NOTE [ An
        epoch left at its last batch ]``, in measure/_live.py)."""
        if not self.done and self.batches.all_done:
            if self.current.trial is not None:
                self.current.trial.epoch_left()
            with contextlib.suppress(StopIteration):
                self._next(asked=False)  # as the loop's next() past the end, unasked
                raise AssertionError("a batch past the epoch's last")
            return
        self.done = True
        self.tuning.overlap.drop()
        if self.current.trial is not None:
            self._end_trial()


def _abandon(tuning: LoopTuning, current: _Current) -> None:
    """The loop dropped an epoch: end its trial where it stands and stop all it holds;
    the study is told at the loader's next epoch (``NOTE [ Nothing outlives the loop ]``)."""
    trial, current.trial = current.trial, None
    if trial is None:
        return
    try:
        tuning.overlap.drop(kill=exiting())  # NOTE [ Overlapped start-up ]
        trial.end()
        undelivered = trial.feed.in_flight
        trial.close(kill=exiting())
    except Exception:
        _logger.warning("AutoLoader: stopping an abandoned epoch's trial failed", exc_info=True)
        return
    tuning.abandoned.append((trial, undelivered))
