from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.utils.data import Dataset, TensorDataset

from autoloader.checks._batched_fetch import batched_fetch_problem, same_batch
from autoloader.loader._factory import build_loader, merge_loader_kwargs
from autoloader.loader._params import normalize_params

from .workloads import (
    ArrayDataset,
    AugmentedDataset,
    FailingDataset,
    FirstOnlyDataset,
    ShardedStream,
    SleepDataset,
)


def _tensors(length: int = 50) -> TensorDataset:
    return TensorDataset(torch.randn(length, 4), torch.arange(length))


@pytest.mark.parametrize(
    "dataset", [_tensors(), ArrayDataset()], ids=["TensorDataset", "numpy-backed"]
)
def test_datasets_indexable_by_a_list_are_offered_batched_fetch(dataset: Dataset[Any]) -> None:
    assert batched_fetch_problem(dataset, 16, {}) is None


@pytest.mark.parametrize(
    ("dataset", "fixed", "problem"),
    [
        (SleepDataset(32, latency=0.0), {}, "dataset[list of indices] raised TypeError"),
        (FirstOnlyDataset(), {}, "gives a different batch"),
        (AugmentedDataset(), {}, "gives a different batch"),
        (_tensors(), {"collate_fn": list}, "loader_kwargs sets collate_fn"),
        (ShardedStream(32), {}, "an IterableDataset"),
        (FailingDataset(32, latency=0.0), {}, "raised"),
        (TensorDataset(torch.zeros(0, 2)), {}, "the dataset is empty"),
    ],
    ids=["list-raises", "wrong-batch", "random-items", "collate_fn", "iterable", "bad", "empty"],
)
def test_batched_fetch_is_not_offered_where_batches_would_differ(
    dataset: Dataset[Any], fixed: dict[str, Any], problem: str
) -> None:
    found = batched_fetch_problem(dataset, 8, fixed)
    assert found is not None and problem in found


def _epoch(dataset: Dataset[Any], **params: Any) -> list[Any]:
    options = merge_loader_kwargs(
        normalize_params(params),
        batch_size=7,
        fixed={"shuffle": True, "drop_last": False, "generator": torch.Generator().manual_seed(3)},
    )
    loader = build_loader(dataset, options)
    try:
        return list(loader)
    finally:
        del loader


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize(
    "dataset", [_tensors(), ArrayDataset(50)], ids=["TensorDataset", "numpy-backed"]
)
def test_a_batched_epoch_is_the_per_item_epoch(dataset: Dataset[Any], num_workers: int) -> None:
    per_item = _epoch(dataset, num_workers=num_workers)
    batched = _epoch(dataset, num_workers=num_workers, batched_fetch=True)
    assert len(batched) == len(per_item) == 8  # 50 items by 7, the last one short
    assert all(same_batch(a, b) for a, b in zip(batched, per_item, strict=True))


def test_same_batch_compares_structure_dtype_and_values() -> None:
    x = torch.tensor([1.0, float("nan")])
    assert same_batch([x, {"y": 1}], [x.clone(), {"y": 1}])
    assert not same_batch([x], (x,))
    assert not same_batch(x, x.double())
    assert not same_batch(x, torch.tensor([2.0, float("nan")]))
    assert not same_batch({"y": 1}, {"z": 1})
    assert not same_batch(x, [1.0, float("nan")])
