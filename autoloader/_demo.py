"""The built-in workload of ``autoloader demo``: latency-bound reads plus a CPU transform.

It stands in for a real image pipeline: each item waits on storage (a sleep, as on a
network filesystem or object store), then is decoded and augmented on the CPU (numpy).
The step sleeps like an accelerator would, leaving the CPU to the workers.
"""

from __future__ import annotations

import time

import numpy as np
import torch
from torch.utils.data import Dataset


class SyntheticImageDataset(Dataset[tuple[torch.Tensor, int]]):
    """Images that take ``read_latency`` seconds to fetch and a little CPU to transform.

    Args:
        length (int, optional): items. (default: ``4096``)
        read_latency (float, optional): seconds each read waits. (default: ``0.004``)
        size (int, optional): images are ``3 x size x size``. (default: ``48``)
    """

    def __init__(self, length: int = 4096, *, read_latency: float = 0.004, size: int = 48) -> None:
        self.length = length
        self.read_latency = read_latency
        self.size = size

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        if not 0 <= index < self.length:
            raise IndexError(f"index {index} out of range for {self.length} items")
        time.sleep(self.read_latency)
        rng = np.random.default_rng(index)
        image = rng.integers(0, 256, size=(self.size, self.size, 3), dtype=np.uint8)
        pixels = image.astype(np.float32) / 255.0
        if rng.random() < 0.5:
            pixels = pixels[:, ::-1]
        pixels = (pixels - pixels.mean(axis=(0, 1))) / (pixels.std(axis=(0, 1)) + 1e-6)
        return torch.from_numpy(np.ascontiguousarray(pixels.transpose(2, 0, 1))), index % 10


class SleepStep:
    """A training step that takes ``seconds`` of accelerator time and no CPU.

    Args:
        seconds (float, optional): time per step. (default: ``0.01``)
    """

    def __init__(self, seconds: float = 0.01) -> None:
        self.seconds = seconds

    def __call__(self, batch: object) -> None:
        time.sleep(self.seconds)
