"""Tune an in-memory TensorDataset: where fetching whole batches beats any worker count.

163,840 samples of 128 features sit in one tensor. DataLoader's default reads them one
by one (``dataset[i]`` 256 times, then a collate); autoloader checks that
``dataset[list_of_indices]`` gives the same batches and, if faster, fetches each batch
with one vectorised index (``batched_fetch``). The step is a small MLP on the CPU.

    python examples/tensor_dataset.py [--time-budget 30] [--out tensor.json]
"""

from __future__ import annotations

import argparse

import torch
from torch import nn
from torch.utils.data import TensorDataset

import autoloader


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--time-budget", type=float, default=30.0)
    parser.add_argument("--items", type=int, default=163_840)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--out", default="tensor.json")
    args = parser.parse_args()

    generator = torch.Generator().manual_seed(0)
    features = torch.randn(args.items, 128, generator=generator)
    labels = torch.randint(0, 10, (args.items,), generator=generator)
    dataset = TensorDataset(features, labels)

    model = nn.Sequential(nn.Linear(128, 64), nn.ReLU(), nn.Linear(64, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    def step(batch: list[torch.Tensor]) -> None:
        x, y = batch
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()

    result = autoloader.tune(
        dataset,
        step,
        batch_size=args.batch_size,
        time_budget=args.time_budget,
        loader_kwargs={"shuffle": True},
    )
    print(autoloader.report(result))
    result.save(args.out)
    print(f"\nsaved {args.out}")


if __name__ == "__main__":
    main()
