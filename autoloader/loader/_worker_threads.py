"""Native thread pools (BLAS, OpenMP) inside DataLoader workers.

NOTE [ Worker threads ]
Native libraries start a thread pool as wide as the machine in every process that
loads them: with ``n`` workers each running a BLAS transform, ``n * cores`` threads
compete for ``cores`` CPUs, and two workers on two cores can run several times slower
than one. DataLoader limits torch's own pool to one thread in each worker, but not
those of numpy, SciPy, OpenCV or other OpenMP code. ``worker_threads`` limits them all,
in each worker as it starts: threadpoolctl for the pools already loaded, the usual
environment variables for those loaded later, and torch's own pool.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import threadpoolctl
import torch

# Read by OpenMP, OpenBLAS, MKL and numexpr when they start their pools.
_THREAD_VARIABLES = (
    "OMP_NUM_THREADS",
    "OPENBLAS_NUM_THREADS",
    "MKL_NUM_THREADS",
    "NUMEXPR_NUM_THREADS",
)


class LimitThreads:
    """A ``worker_init_fn`` that limits native thread pools, then calls the user's.

    Args:
        threads (int): threads each native thread pool of the worker may run.
        then (callable, optional): the user's ``worker_init_fn``, called afterwards
            with the worker's id. (default: ``None``)

    It is a module-level class, not a closure, so that it pickles into workers started
    by spawn or forkserver.
    """

    def __init__(self, threads: int, then: Callable[[int], object] | None = None) -> None:
        self.threads = threads
        self.then = then

    def __call__(self, worker_id: int) -> None:
        for variable in _THREAD_VARIABLES:
            os.environ[variable] = str(self.threads)
        threadpoolctl.threadpool_limits(limits=self.threads)
        torch.set_num_threads(self.threads)
        if self.then is not None:
            self.then(worker_id)

    def __repr__(self) -> str:
        return f"LimitThreads({self.threads}, then={self.then!r})"
