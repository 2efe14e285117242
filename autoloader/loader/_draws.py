"""A loader with persistent workers that draws from the random number generator as a
new DataLoader iterator does.

NOTE [ Persistent workers and the RNG stream ]
Every new DataLoader iterator draws one number, its workers' base seed, from the
loader's generator (torch's global one when it has none): ``_BaseDataLoaderIter``
draws it in ``__init__``. With ``persistent_workers`` the loader makes its iterator
once and resets it for each later epoch, drawing nothing then. So a training run whose
loader is made persistent by tuning draws one number fewer per epoch from epoch 2 on
than the same run with ``num_workers=0``: its shuffling (a ``RandomSampler`` without a
generator seeds itself from the global RNG) and its dropout differ from then on, while
the user asked for nothing but a faster loader. :class:`SameDraws` makes the draw the
reset skipped, in the same place (before the sampler's own: a ``RandomSampler`` draws
its seed at its first item, which a new iterator asks for after drawing the base seed
and a reset asks for as it primes the workers), so that the stream
is the one a non-persistent loader leaves. The workers are seeded as before: the
number is drawn, not used.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.data import DataLoader


class SameDraws(DataLoader[Any]):
    """A ``DataLoader`` that draws the base seed it would draw with a new iterator
    each epoch, persistent workers or not (``NOTE [ Persistent workers and the RNG
    stream ]``)."""

    def __iter__(self) -> Any:
        if self.persistent_workers and self.num_workers > 0 and self._iterator is not None:
            # Before the reset, which primes the workers and so draws the sampler's seed.
            torch.empty((), dtype=torch.int64).random_(generator=self.generator)
        return super().__iter__()


def same_draws(loader: DataLoader[Any]) -> DataLoader[Any]:
    """``loader``, drawing from its generator each epoch as a non-persistent loader
    does. Only a plain ``DataLoader`` with persistent workers needs it (a
    :class:`~autoloader.ThreadLoader` makes a new iterator each epoch); it becomes a
    :class:`SameDraws`, which adds no state."""
    if type(loader) is DataLoader and loader.persistent_workers and loader.num_workers > 0:
        loader.__class__ = SameDraws
    return loader
