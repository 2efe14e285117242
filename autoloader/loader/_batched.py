"""Fetching a whole batch with one indexing of the dataset.

NOTE [ Batched fetch ]
DataLoader loads a batch item by item, ``collate_fn([dataset[i] for i in indices])``.
A dataset backed by tensors or arrays (``TensorDataset``, a dataset over a numpy array)
answers ``dataset[indices]`` with the whole batch in one vectorised indexing, 10x or
more faster than per-item calls and a collate. DataLoader does that when it is given
``batch_size=None`` and a ``BatchSampler`` as its sampler: each "index" it fetches is
then a list of indices, and the result is only converted (numpy arrays to tensors),
not collated.

The batch must be the same either way. A dataset may accept a list where it expects an
int and still do something else (a pandas frame returns rows in another type; a list
of items raises), so batched fetch is offered only after one sequential and one
scattered batch came out equal, tensor for tensor, to the per-item path. A dataset
whose items are random (augmentations) cannot be compared this way; its batches
differ between two loads either way, and batched fetch is not offered.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch.utils.data import (
    BatchSampler,
    Dataset,
    RandomSampler,
    SequentialSampler,
)

from autoloader._exceptions import InvalidInputError

# Options that take part in forming batches item by item; batched fetch replaces them.
PER_ITEM_OPTIONS = ("collate_fn", "batch_sampler")


def batched_loader_kwargs(dataset: Dataset[Any], kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """DataLoader options that fetch the same batches as ``kwargs``, a batch at a time.

    The batch size, ``shuffle``, ``sampler`` and ``drop_last`` move into a
    ``BatchSampler``; ``generator`` stays, as it also seeds the workers.

    Raises:
        InvalidInputError: ``kwargs`` has a ``collate_fn`` or ``batch_sampler``, which work on
            items one by one.
    """
    options = dict(kwargs)
    for option in PER_ITEM_OPTIONS:
        if options.get(option) is not None:
            raise InvalidInputError(
                f"batched_fetch=True fetches whole batches, without a {option}; pass "
                "batched_fetch=False to use one."
            )
    batch_size = options.pop("batch_size")
    drop_last = bool(options.pop("drop_last", False))
    shuffle = bool(options.pop("shuffle", False))
    sampler = options.pop("sampler", None)
    if sampler is None:
        sampler = (
            RandomSampler(dataset, generator=options.get("generator"))  # type: ignore[arg-type]
            if shuffle
            else SequentialSampler(dataset)  # type: ignore[arg-type]
        )
    options["batch_size"] = None
    options["sampler"] = BatchSampler(sampler, batch_size, drop_last)
    return options
