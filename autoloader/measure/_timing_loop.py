"""The timing loop's parts: sums over batches, whole epochs, the pace deadline."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils.data import (
    DataLoader,
)

# The most of a trial's time its warm-up may take (NOTE [ Warm-up ]). Each rank of a
# torchrun job has a share of the cores and drains its burst slower: with 2 ranks on 2
# cores, 8 workers x prefetch 2 took about 1 s of a 3 s trial, and at 0.3 every setting
# of 8 workers or more was pruned as too short (the joint choice fell to 4 workers).
WARMUP_SHARE = 0.5


@dataclass(slots=True)
class Totals:
    """Sums over measured batches."""

    samples: int = 0
    batches: int = 0
    seconds: float = 0.0
    wait: float = 0.0
    wait_cpu: float = 0.0
    step: float = 0.0
    step_cpu: float = 0.0


# NOTE [ Whole epochs ]
# The steady rate leaves out what an epoch's edges cost: when the sampler runs out, the
# workers idle while the main process drains the batches already queued (which, timed,
# look faster than steady), and the next epoch waits while every worker loads its first
# batch at once. With many workers on few CPUs and short epochs, this is a fifth of the
# epoch: on the development VM an HF dataset of 63 batches per epoch with 16 workers
# measured 10,900 samples/s steady and ran 8,200 over whole epochs, against 9,200 for 3
# workers (steady 9,750). So where the trial can, it times whole epochs as training gets
# them: from the first batch after warm-up to the same batch of the next epoch, the
# restart, the refill and the drain included; the objective then uses that rate (NOTE
# [ Epoch model ]). Where the batches in flight (num_workers x prefetch_factor) are more
# than a twentieth of an epoch, the edges matter, and the trial keeps going for one
# such epoch if it fits in the trial's time; below that they cost a few percent at most.
_EDGES_MATTER = 20


@dataclass(slots=True)
class Epochs:
    """Times whole epochs of a trial, from a batch to the same batch one epoch later."""

    length: int | None
    in_flight: int = 0  # batches queued at once: num_workers x prefetch_factor
    epoch: int = 0
    index: int = 1  # batches of the current epoch stepped; the first comes before this
    mark: tuple[int, int] | None = None  # (epoch, index) where the clock started
    mark_time: float = 0.0
    samples: int = 0
    measured: list[tuple[int, float]] = field(default_factory=list)

    def restarted(self) -> None:
        """A new epoch began (its first batch not yet stepped)."""
        self.epoch, self.index = self.epoch + 1, 0

    def add(self, samples: int, now: float) -> None:
        """A batch of ``samples`` was stepped; ``now`` is when."""
        self.index += 1
        if self.mark is None:
            return
        self.samples += samples
        mark_epoch, mark_index = self.mark
        if self.epoch > mark_epoch and self.index == mark_index:
            self.measured.append((self.samples, now - self.mark_time))
            self.start(now)

    def start(self, now: float) -> None:
        """Start the clock at the batch just stepped (again, once an epoch is timed)."""
        self.mark, self.mark_time, self.samples = (self.epoch, self.index), now, 0

    def rate(self) -> float | None:
        """Samples per second over the whole epochs timed, ``None`` if none were."""
        seconds = sum(s for _, s in self.measured)
        return sum(n for n, _ in self.measured) / seconds if seconds > 0 else None

    def due(self, now: float, seconds_per_batch: float, deadline: float) -> bool:
        """Whether to keep measuring for a first whole epoch: one is under way and
        expected (with room to spare) before ``deadline``."""
        if self.length is None or self.mark is None or self.measured:
            return False
        if self.length > _EDGES_MATTER * self.in_flight:
            return False
        mark_epoch, mark_index = self.mark
        to_go = mark_index - self.index
        if self.epoch == mark_epoch:
            to_go += self.length
        return now + 1.5 * to_go * seconds_per_batch < deadline


# NOTE [ Pace deadline ]
# A hang in one worker while the others deliver (a fault at worker index k and above)
# stalls the loop at that worker's batch. The trial's deadlines come from the
# baseline, with a floor of seconds; once a timing window has shown this trial's own
# pace, a batch may take no more than _PACE_FACTOR times what each worker takes per
# batch at that pace (workers x seconds per batch: batches come in turn), and at least
# _MIN_PACE_SECONDS. A log-normal latency with sigma 1 stays an order of magnitude
# under it; a hung worker is found in seconds instead of the baseline's floor. Without
# workers (the baseline) there is no worker to hang, and a false timeout there would
# stop the run: the baseline keeps its own deadline.
_PACE_FACTOR = 20.0
_MIN_PACE_SECONDS = 2.0


def pace_limit(total: Totals, workers: int) -> float:
    per_batch = total.seconds / total.batches if total.batches else math.inf
    return max(_MIN_PACE_SECONDS, _PACE_FACTOR * max(1, workers) * per_batch)


def loader_length(loader: DataLoader[Any]) -> int | None:
    """Batches in one epoch of ``loader``, ``None`` where it has no length."""
    try:
        return len(loader)
    except TypeError:
        return None


def tensor_bytes(batch: Any) -> int:
    """Bytes of every tensor in a (nested) batch."""
    if isinstance(batch, torch.Tensor):
        return batch.element_size() * batch.nelement()
    if isinstance(batch, Mapping):
        batch = list(batch.values())
    if isinstance(batch, list | tuple):
        return sum(tensor_bytes(item) for item in batch)
    return 0


def batch_length(batch: Any, default: int) -> int:
    """Samples in a collated batch: the leading dimension of its first tensor."""
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0]) if batch.dim() > 0 else default
    if isinstance(batch, Mapping):
        batch = list(batch.values())
    if isinstance(batch, list | tuple):
        for item in batch:
            if isinstance(item, torch.Tensor | Mapping | list | tuple):
                return batch_length(item, default)
    return default
