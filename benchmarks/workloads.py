"""The benchmark's workloads: a dataset and a step that stands in for an accelerator.

Each step sleeps, leaving the CPU to the loader, as a GPU step would. Classes live at
module level so that spawned processes can import them.
"""

from __future__ import annotations

import math
import os
import random
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset, TensorDataset, get_worker_info


class SleepStep:
    """The accelerator stand-in: waits ``seconds`` per batch, using no CPU."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def __call__(self, batch: object) -> None:
        time.sleep(self.seconds)


class Latency(Dataset[torch.Tensor]):
    """Every item waits ``latency`` seconds, like a read from remote storage."""

    def __init__(self, length: int, latency: float = 0.005) -> None:
        self.length = length
        self.latency = latency

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> torch.Tensor:
        time.sleep(self.latency)
        return torch.full((64,), float(index))


class JitteryLatency(Latency):
    """Waits a log-normal time per item: mostly ``median``, with a long tail."""

    def __init__(self, length: int, median: float = 0.003, sigma: float = 1.0) -> None:
        super().__init__(length, median)
        self.sigma = sigma

    def __getitem__(self, index: int) -> torch.Tensor:
        # Seeded per item: every setting meets the same delays.
        delay = random.Random(index).lognormvariate(math.log(self.latency), self.sigma)
        time.sleep(delay)
        return torch.full((64,), float(index))


class PythonTransform(Dataset[torch.Tensor]):
    """A CPU-bound pure-Python transform per item, holding the GIL (``rounds`` steps)."""

    def __init__(self, length: int, rounds: int = 20_000) -> None:
        self.length = length
        self.rounds = rounds

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> torch.Tensor:
        acc = index
        for i in range(self.rounds):
            acc = (acc * 31 + i) % 1_000_003
        return torch.full((64,), float(acc))


class BlasTransform(Dataset[torch.Tensor]):
    """A CPU-bound transform through numpy's BLAS, which starts a thread per core."""

    def __init__(self, length: int, size: int = 192, repeats: int = 4) -> None:
        self.length = length
        self.size = size
        self.repeats = repeats

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> torch.Tensor:
        rng = np.random.default_rng(index)
        a = rng.standard_normal((self.size, self.size))
        for _ in range(self.repeats):
            a = a @ a.T
            a /= np.abs(a).max()
        return torch.from_numpy(a[0, :64].astype(np.float32))


class MemoryHeavy(Latency):
    """Latency-bound, and each worker holds ``hold_bytes`` once it starts reading."""

    def __init__(self, length: int, hold_bytes: int, latency: float = 0.005) -> None:
        super().__init__(length, latency)
        self.hold_bytes = hold_bytes
        self._held: torch.Tensor | None = None

    def __getitem__(self, index: int) -> torch.Tensor:
        if get_worker_info() is not None and self._held is None:
            self._held = torch.ones(self.hold_bytes // 4, dtype=torch.float32)
        return super().__getitem__(index)


class WorkerFault(Latency):
    """Latency-bound; workers with an id of ``from_worker`` or more meet ``fault`` on
    their first item: ``"crash"`` (SIGSEGV) or ``"hang"``. A dataset of ``from_worker``
    shards, or a per-worker resource that runs out, fails this way."""

    def __init__(self, length: int, fault: str, from_worker: int, latency: float = 0.005) -> None:
        super().__init__(length, latency)
        self.fault = fault
        self.from_worker = from_worker

    def __getitem__(self, index: int) -> torch.Tensor:
        info = get_worker_info()
        if info is not None and info.id >= self.from_worker:
            if self.fault == "crash":
                os.kill(os.getpid(), signal.SIGSEGV)
            time.sleep(3600)
        return super().__getitem__(index)


def tensor_dataset(length: int) -> TensorDataset:
    generator = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(length, 128, generator=generator), torch.arange(length))


@dataclass(frozen=True)
class Workload:
    """A dataset factory, a step, and what tuning it is measured against.

    Attributes:
        ceiling: ``batch_size / step_seconds``: no setting can beat the step.
        memory_budget: bytes above what the tree uses at start, or ``None``.
        fails_from: the worker count from which every setting fails (crashes or
            hangs), or ``None``: the grid does not measure those, they are worth 0.
    """

    name: str
    describe: str
    make_dataset: Callable[[int], Dataset[Any]]
    length: int
    batch_size: int
    step_seconds: float
    memory_budget: int | None = None
    search_space: dict[str, Any] = field(default_factory=dict)
    fails_from: int | None = None

    @property
    def ceiling(self) -> float:
        return self.batch_size / self.step_seconds

    def step(self) -> SleepStep:
        return SleepStep(self.step_seconds)


WORKLOADS = {
    w.name: w
    for w in (
        Workload("latency", "5 ms wait per item", Latency, 4096, 8, 0.010),
        Workload(
            "jitter",
            "log-normal wait per item, median 3 ms; batches may come out of order",
            JitteryLatency,
            4096,
            8,
            0.010,
            search_space={"in_order": (True, False)},
        ),
        Workload("cpu-python", "pure-Python transform per item", PythonTransform, 4096, 8, 0.005),
        Workload("cpu-blas", "numpy BLAS transform per item", BlasTransform, 4096, 8, 0.005),
        Workload(
            "tensor", "in-memory TensorDataset, 128 floats", tensor_dataset, 163_840, 256, 0.002
        ),
        Workload(
            "memory",
            "5 ms wait per item, 300 MiB per worker, budget +1 GiB",
            lambda n: MemoryHeavy(n, 300 * 1024**2),
            4096,
            8,
            0.010,
            memory_budget=1024**3,
        ),
        Workload(
            "crash-at-4",
            "5 ms wait per item; workers 3 and up crash (SIGSEGV): at most 3 work",
            lambda n: WorkerFault(n, "crash", from_worker=3),
            4096,
            8,
            0.010,
            fails_from=4,
        ),
        Workload(
            "hang-at-4",
            "5 ms wait per item; workers 3 and up hang: at most 3 work",
            lambda n: WorkerFault(n, "hang", from_worker=3),
            4096,
            8,
            0.010,
            fails_from=4,
        ),
    )
}
