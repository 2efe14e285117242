"""Whether a dataset can be fetched a whole batch at a time (``NOTE [ Batched fetch ]``)."""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch.utils.data import Dataset, IterableDataset, default_collate, default_convert

from autoloader.loader import PER_ITEM_OPTIONS
from autoloader.measure import TrialTimeout


def batched_fetch_problem(
    dataset: Dataset[Any], batch_size: int, fixed: Mapping[str, Any]
) -> str | None:
    """Why ``dataset`` cannot be fetched a batch at a time, or ``None`` if it can.

    Loads two batches both ways in this process (see ``NOTE [ Batched fetch ]``). A
    :class:`~autoloader.measure._deadlines.TrialTimeout` (the check's deadline) goes through.
    """
    if isinstance(dataset, IterableDataset):
        return "an IterableDataset yields items, it is not indexed"
    for option in PER_ITEM_OPTIONS:
        if fixed.get(option) is not None:
            return f"loader_kwargs sets {option}, which works on items one by one"
    try:
        length = len(dataset)  # type: ignore[arg-type]
    except TypeError:
        return "the dataset has no __len__"
    size = min(batch_size, length)
    if size < 1:
        return "the dataset is empty"
    probes = (list(range(size)), random.Random(0).sample(range(length), size))
    for indices in probes:
        try:
            batched = default_convert(dataset[indices])  # type: ignore[no-untyped-call]
        except TrialTimeout:  # the check's deadline, not an answer from the dataset
            raise
        except Exception as error:  # any failure means: not indexable by a list
            return (
                f"dataset[list of indices] raised {type(error).__name__}: "
                f"{str(error).splitlines()[0] if str(error) else ''}".rstrip(": ")
            )
        try:
            items = [dataset[i] for i in indices]
        except TrialTimeout:
            raise
        except Exception:  # a fault of the dataset itself: the baseline reports it
            return "loading its items one by one failed"
        per_item = default_collate(items)
        if not same_batch(batched, per_item):
            return (
                "dataset[list of indices] gives a different batch from loading the items "
                "one by one and collating them"
            )
    return None


def same_batch(a: Any, b: Any, *, values: bool = True) -> bool:
    """Whether two (nested) batches hold equal tensors of the same dtype, in the same
    structure; with ``values=False``, whether they have the same structure and tensors of
    the same dtypes and shapes, their values aside (batches of random items)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return False
        if a.dtype != b.dtype or a.shape != b.shape:
            return False
        if not values:
            return True
        if a.is_floating_point():  # NaN is data here: equal where both are NaN
            return bool(((a == b) | (a.isnan() & b.isnan())).all())
        return torch.equal(a, b)
    if type(a) is not type(b):
        return False
    if isinstance(a, Mapping):
        return a.keys() == b.keys() and all(same_batch(a[k], b[k], values=values) for k in a)
    if isinstance(a, Sequence) and not isinstance(a, str | bytes):
        return len(a) == len(b) and all(
            same_batch(x, y, values=values) for x, y in zip(a, b, strict=True)
        )
    return bool(a == b) if values else True
