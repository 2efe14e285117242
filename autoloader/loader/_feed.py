"""One epoch's batches handed out once each, to the loaders that take turns loading it.

NOTE [ Every batch once ]
``AutoLoader`` loads one epoch with several loaders in turn (a setting per trial,
``NOTE [ Tuning in the training loop ]``), and each must load exactly the batches the
one before it did not deliver. The epoch's batches of indices come from the sampler
once, in its order, as DataLoader's would (:class:`EpochBatches`); each loader's sampler
is a :class:`Feed` that takes them from there as the loader asks, and remembers those
handed out and not yet delivered: a loader asks ``num_workers x prefetch_factor``
batches ahead. When a loader stops, by a switch or a fault, the batches still in its
queues are given back, ahead of the rest, and the next loader loads them first. The
loaders deliver in order (``in_order=True``), so what is delivered is always the oldest
batch handed out, and the user's loop sees DataLoader's batches, in DataLoader's order.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Iterable, Iterator
from typing import Any

# NOTE [ A batch handed out whole ]
# A worker's death is raised in the main thread by a signal handler, at whatever line
# it runs, and a fetch runs the feed: DataLoader asks its sampler, this feed, for the
# next batch while it waits for one. Raised between the batch's leaving the epoch
# (``EpochBatches.take``: the batches given back, or the sampler, whose generator an
# exception inside it ends) and its place among the batches handed out, the batch was
# neither: never given back, never loaded, lost to the loop (a full run beside a busy
# loop lost one after a worker's SIGKILL, not reproduced since: this is the one window
# found where it could).
# So while a batch is handed out, the trial's handler holds the death back
# (:func:`handing_out`); the dead worker's batch never comes, and DataLoader's own
# check of its workers, or the trial's deadline, fails the fetch after it.
_handing = threading.local()


def handing_out() -> bool:
    """Whether this thread is handing a batch out of an epoch to a loader (``NOTE [ A
    batch handed out whole ]``)."""
    return bool(getattr(_handing, "now", False))


class EpochBatches:
    """One epoch's batches of indices in the sampler's order, each handed out once; a
    batch given back is handed out again, before any other.

    Args:
        indices: the epoch's iterator over the index sampler (a ``BatchSampler``'s
            lists of indices), drawn lazily, as DataLoader draws it.
        length: the epoch's batches, where the sampler has a length: no loader asks
            the sampler for one more (a ``RandomSampler`` draws from its generator
            there) unless the loop does (:meth:`exhaust`), as with DataLoader's own
            iterator, which asks only for the batch the loop asks for.
    """

    def __init__(self, indices: Iterator[Any], *, length: int | None = None) -> None:
        self._indices = indices
        self.length = length
        self._ended = False
        self._given_back: deque[Any] = deque()
        self.taken = 0  # handed out and not given back
        # Delivered to the loop, or consumed by raising in it: always the epoch's first
        # batches, in order (NOTE [ An AutoLoader's state ], in _loader_state.py).
        self.done = 0

    @property
    def all_done(self) -> bool:
        """Whether the loop got every batch of the epoch (a sampler with a length)."""
        return self.length is not None and self.done >= self.length

    def fast_forward(self, count: int) -> None:
        """The epoch's first ``count`` batches were delivered before a checkpoint: drawn
        from the sampler as DataLoader draws them, and not loaded."""
        if self.length is not None:
            count = min(count, self.length)
        for _ in range(count):
            try:
                self._next()
            except StopIteration:
                return
            self.taken += 1
            self.done += 1

    def take(self) -> Any:
        """The next batch of indices.

        Raises:
            StopIteration: the epoch has no batch left.
        """
        if self._given_back:
            batch = self._given_back.popleft()
        elif self.length is not None and self.taken >= self.length:
            raise StopIteration
        else:
            batch = self._next()
        self.taken += 1
        return batch

    def _next(self) -> Any:
        try:
            return next(self._indices)
        except StopIteration:
            self._ended = True
            raise

    def exhaust(self) -> None:
        """The loop asked for a batch past the epoch's last: the sampler is asked too,
        as DataLoader's iterator asks it then (its generator's draws come out the same)."""
        if not self._ended:
            next(self._indices, None)
            self._ended = True

    def drop_failed(self) -> None:
        """The oldest batch given back raised in the loop, the dataset's error reaching
        it as DataLoader's would: consumed, as DataLoader consumes a batch that raised,
        so that a loop that goes on gets the next one."""
        if self._given_back:
            self._given_back.popleft()
            self.taken += 1
            self.done += 1

    def give_back(self, batches: Iterable[Any]) -> None:
        """``batches`` (in their order) were not delivered: they come next."""
        returned = list(batches)
        self._given_back.extendleft(reversed(returned))
        self.taken -= len(returned)


class Feed:
    """The sampler of one loader over :class:`EpochBatches`: it hands the loader batches
    until it is closed (or ``limit`` of them), and remembers those not yet delivered.

    A persistent loader keeps its feed across epochs: :meth:`point_at` gives it the next
    epoch's batches before the loader is iterated again.
    """

    def __init__(self, epoch: EpochBatches, *, limit: int | None = None) -> None:
        self.epoch = epoch
        self.limit = limit
        self._handed: deque[Any] = deque()
        self._open = True
        self.delivered_count = 0

    def __iter__(self) -> Iterator[Any]:
        while self._open and (self.limit is None or self.handed_count < self.limit):
            _handing.now = True  # NOTE [ A batch handed out whole ]
            try:
                batch = self.epoch.take()
                self._handed.append(batch)
            except StopIteration:
                return
            finally:
                _handing.now = False
            yield batch

    @property
    def handed_count(self) -> int:
        return self.delivered_count + len(self._handed)

    @property
    def in_flight(self) -> int:
        """Batches handed to the loader and not delivered yet."""
        return len(self._handed)

    def delivered(self) -> None:
        """The loader delivered its oldest batch handed out."""
        self._handed.popleft()
        self.delivered_count += 1
        self.epoch.done += 1

    def stop(self) -> None:
        """Hand out no more; the loader delivers those it has (NOTE [ Draining a trial ])."""
        self._open = False

    def requeue(self) -> None:
        """The iterator the batches in flight were handed to is gone without delivering
        them (its start failed): they go back to the epoch, ahead of the rest, for the
        loader's next iterator, which the feed goes on handing batches to."""
        self.epoch.give_back(self._handed)
        self._handed.clear()

    def close(self) -> None:
        """Hand out no more, and give the undelivered batches back to the epoch."""
        self._open = False
        self.requeue()

    def point_at(self, epoch: EpochBatches) -> None:
        """Feed the next epoch's batches (a persistent loader's next epoch)."""
        self.carry_to(epoch)
        self.delivered_count = 0

    def carry_to(self, epoch: EpochBatches) -> None:
        """Feed the next epoch's batches to the same trial (``NOTE [ Trials span epochs ]``):
        its counts, and its ``limit``, go on from where the last epoch left them."""
        self.epoch, self._open = epoch, True
        self._handed.clear()
