"""A tuned loader that draws from the random number generators as the user's own
loader would.

NOTE [ A tuned loader's draws ]
Training with a tuned loader must draw the same random numbers as training with the
user's own loader, so that dropout masks (and a sampler without a generator of its
own) come out the same: with a fixed seed, on the CPU and batches in order, the
weights are then equal bit for bit. A DataLoader draws one number from its
``generator`` (torch's global one when it has none) for each new iterator: its
workers' base seed (``_BaseDataLoaderIter.__init__``). A loader with persistent
workers makes a new iterator once and resets it for later epochs, drawing once in all;
a non-persistent one draws every epoch; a :class:`~autoloader.ThreadLoader` is never
persistent. So a tuned loader whose persistence differs from the user's loader's would
shift the random stream of every epoch after the first.

The loaders here draw their workers' seeds from a generator of their own and, before
each epoch, make the user's loader's draw in its place: every epoch if that one was
not persistent, the first only if it was (:class:`RandomDraws`); the number drawn seeds
their own generator. The draw comes before the sampler's, as in DataLoader: a
``RandomSampler`` draws its seed at its first item, which a new iterator asks for
after drawing the base seed (torch 2.6 to 2.13).
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset

from autoloader.loader._thread_loader import ThreadLoader
from autoloader.loader._torch_compat import BaseDataLoaderIter


def persistent(loader: DataLoader[Any]) -> bool:
    """Whether ``loader`` keeps its workers from one epoch to the next."""
    return bool(loader.persistent_workers) and loader.num_workers > 0


class RandomDraws:
    """The draws the user's own loader would make, made by the tuned one in its place
    (``NOTE [ A tuned loader's draws ]``).

    Args:
        original: the user's loader, which draws from its ``generator`` (the global
            generator when ``None``) for each new iterator: every epoch, or the first
            only with persistent workers.
    """

    def __init__(self, original: DataLoader[Any]) -> None:
        self.source: torch.Generator | None = original.generator
        self.each_epoch = not persistent(original)
        self.drawn = False
        # The tuned loader's own: it seeds its workers from this one.
        self.generator = torch.Generator()

    def draw(self) -> None:
        """Before an epoch: the original's draw, if it makes one; it seeds the tuned
        loader's own generator."""
        if self.drawn and not self.each_epoch:
            return
        seed = torch.empty((), dtype=torch.int64).random_(generator=self.source)
        self.generator.manual_seed(int(seed.item()))
        self.drawn = True


class DrawingLoader(DataLoader[Any]):
    """A DataLoader that makes the user's loader's random draws (:class:`RandomDraws`)."""

    def __init__(self, dataset: Dataset[Any], *, draws: RandomDraws, **kwargs: Any) -> None:
        super().__init__(dataset, generator=draws.generator, **kwargs)
        self.draws = draws

    def __iter__(self) -> BaseDataLoaderIter:
        self.draws.draw()
        return super().__iter__()


class DrawingThreadLoader(DrawingLoader, ThreadLoader[Any]):
    """A :class:`ThreadLoader` that makes the user's loader's random draws
    (:class:`RandomDraws`): :class:`DrawingLoader`'s, over the thread workers'."""


def drawing_as(
    original: DataLoader[Any],
    dataset: Dataset[Any],
    kwargs: Mapping[str, Any],
    *,
    threads: bool,
) -> DataLoader[Any]:
    """``DataLoader(dataset, **kwargs)`` (a ``ThreadLoader`` with ``threads``) that
    draws from the random number generators as ``original`` would. ``kwargs`` must
    name a sampler or batch sampler (the loader's generator is its own) and no
    ``generator``: ``original``'s is the one drawn from."""
    if "generator" in kwargs:
        raise ValueError("drawing_as() takes the generator from the original loader")
    draws = RandomDraws(original)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="This DataLoader will create")
        if threads:
            return DrawingThreadLoader(dataset, draws=draws, **kwargs)
        return DrawingLoader(dataset, draws=draws, **kwargs)
