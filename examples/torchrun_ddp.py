"""Tune every rank of a DDP job together under torchrun, then train with the result.

Each rank reads its share of a latency-bound dataset (2 ms per item, as from remote
storage) through a DistributedSampler, and trains a small model with DDP on the CPU
(gloo): its backward all-reduces the gradients across the ranks. Every rank calls
``autoloader.tune()`` with the same arguments; the ranks measure each setting at the
same time, competing for the node's cores as they will in training, and every rank
gets the same result. Rank 0 writes it.

    torchrun --standalone --nproc_per_node=2 examples/torchrun_ddp.py [--time-budget 30]

The same job through the command line:

    torchrun --standalone --nproc_per_node=2 -m autoloader tune \\
        examples/torchrun_ddp.py:make_dataset examples/torchrun_ddp.py:step --batch-size 32

Run without torchrun, it tunes one process alone.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist
from torch.utils.data import Dataset, DistributedSampler

import autoloader

ITEM_LATENCY = 0.002
BATCH_SIZE = 32


class RemoteDataset(Dataset[torch.Tensor]):
    """Each item waits ``ITEM_LATENCY`` seconds, like a read from object storage."""

    def __init__(self, length: int = 8192) -> None:
        self.length = length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> torch.Tensor:
        time.sleep(ITEM_LATENCY)
        return torch.full((64,), float(index % 7))


def make_dataset() -> RemoteDataset:
    return RemoteDataset()


class Step:
    """One DDP training step; the model is made on first use, once the process group
    exists (the command line starts it before it imports this module)."""

    def __init__(self) -> None:
        self.model: torch.nn.Module | None = None
        self.optimizer: torch.optim.Optimizer | None = None

    def __call__(self, batch: torch.Tensor) -> None:
        if self.model is None:
            model = torch.nn.Sequential(
                torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 1)
            )
            if dist.is_initialized():
                model = torch.nn.parallel.DistributedDataParallel(model)
            self.model = model
            self.optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
        assert self.optimizer is not None
        self.optimizer.zero_grad()
        self.model(batch).pow(2).mean().backward()
        self.optimizer.step()


step = Step()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--time-budget", type=float, default=30.0)
    parser.add_argument("--out", default="torchrun_ddp.json")
    parser.add_argument("--epochs", type=int, default=1)
    args = parser.parse_args()
    if "RANK" in os.environ:  # launched by torchrun
        dist.init_process_group("gloo")
    rank = dist.get_rank() if dist.is_initialized() else 0
    dataset = make_dataset()
    sampler = DistributedSampler(dataset) if dist.is_initialized() else None
    result = autoloader.tune(
        dataset,
        step,
        batch_size=BATCH_SIZE,
        time_budget=args.time_budget,
        loader_kwargs={"sampler": sampler} if sampler is not None else None,
        show_progress=rank == 0,
    )
    result.save(args.out)  # written by rank 0 only
    if rank == 0:
        print(autoloader.report(result))
    loader = result.make_loader(dataset)  # this rank's sampler, the tuned settings
    result.apply_threads()  # this rank's torch threads, where they were tuned
    for epoch in range(args.epochs):
        if sampler is not None:
            sampler.set_epoch(epoch)
        started, batches = time.perf_counter(), 0
        for batch in loader:
            step(batch)
            batches += 1
        seconds = time.perf_counter() - started
        if rank == 0:
            print(f"epoch {epoch}: {batches} batches per rank in {seconds:.1f} s")
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
