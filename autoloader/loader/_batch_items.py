"""A per-item sampler over a batch sampler's batches: :class:`BatchItems`."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from torch.utils.data import Sampler

from autoloader._exceptions import InvalidInputError


class BatchItems(Sampler[int]):
    """The items of a batch sampler's batches, one after another.

    A DataLoader with this sampler and ``batch_size`` (``drop_last=False``) gives the
    batch sampler's own batches: those of a ``BatchSampler``, and of accelerate's
    ``BatchSamplerShard``, all have that size but maybe the last. It lets ``tune()``,
    which takes a per-item sampler and a batch size, load the Trainer's batches.
    """

    def __init__(self, batch_sampler: Any, batch_size: int) -> None:
        self.batch_sampler = batch_sampler
        self.batch_size = batch_size

    @classmethod
    def of(cls, batch_sampler: Any) -> BatchItems:
        """The sampler over ``batch_sampler``'s items, or :class:`InvalidInputError`
        for one whose batches have no one size."""
        size = getattr(batch_sampler, "batch_size", None)
        if getattr(batch_sampler, "split_batches", False) and isinstance(size, int):
            size //= batch_sampler.num_processes  # each process takes its slice
        if not isinstance(size, int) or size < 1:
            inner = getattr(batch_sampler, "batch_sampler", batch_sampler)
            raise InvalidInputError(
                "autoloader tunes loaders whose batches have one size, but these batches "
                f"come from a {type(inner).__qualname__}, which has none (e.g. a Trainer's "
                'train_sampling_strategy="batch_rebalance"). Use a batch sampler with a '
                "batch_size, or call autoloader.tune() with a sampler of your own."
            )
        return cls(batch_sampler, size)

    def __iter__(self) -> Iterator[int]:
        for batch in self.batch_sampler:
            yield from batch

    def __len__(self) -> int:
        # At most one batch is short, the last: DataLoader divides this by the batch
        # size, rounding up, and gets the batch sampler's length.
        return len(self.batch_sampler) * self.batch_size
