"""The training process's own threads: torch's intra-op pool, where the step runs.

NOTE [ Step threads ]
A step that trains on the CPU runs its ops on torch's intra-op thread pool, as wide as
the machine by default (``torch.get_num_threads()``; torchrun sets one thread per rank
unless ``OMP_NUM_THREADS`` says otherwise). DataLoader's worker processes load on the
same cores. With the pool as wide as the cores, every worker's turn on a core stalls a
thread the step's next parallel op waits for, and the step slows by far more than the
core the worker takes: on the 2-core development VM, JPEG decoding in 1 worker and a
narrow CNN trained on 2 threads ran 625 samples/s, and 853 with the step on 1 thread
(``cpu-train-small`` in ``benchmarks/README.md``); with no workers, 722 on 2 threads.

``step_threads`` is that pool's width, tuned against the workers where the step does
CPU work. It is a setting of the process, not of a loader: each trial sets it and puts
back what was there (:func:`step_threads`), ``tune()`` returns with the user's own, and
the tuned loader cannot carry it: ``TuneResult.apply_threads()`` sets it for training.
``None`` leaves the pool as it is.

torch's inter-op pool is not tuned: eager training does not use it (only TorchScript's
``fork`` and a few ops do), and torch allows setting it once per process, before any
inter-op work.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch


@contextmanager
def step_threads(threads: int | None) -> Iterator[None]:
    """Run the block with ``torch.set_num_threads(threads)`` in this process, and put the
    width it had back afterwards, whatever happens; ``None`` changes nothing."""
    before = torch.get_num_threads()
    if threads is not None and threads != before:
        torch.set_num_threads(threads)
    try:
        yield
    finally:
        if torch.get_num_threads() != before:
            torch.set_num_threads(before)


def set_step_threads(threads: int | None) -> int | None:
    """``torch.set_num_threads(threads)`` for good, where ``threads`` is not ``None``;
    the count the process had before, or ``None`` if nothing was set."""
    if threads is None:
        return None
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    return before


@contextmanager
def kept_threads() -> Iterator[None]:
    """Put this process's intra-op width back as it was on entry, whatever the block
    set (the user's step included)."""
    with step_threads(None):
        yield
