"""A first guess at the worker count, from what the baseline measured.

NOTE [ Cost model ]
With ``n`` workers the loop's time per batch is about

    max(step, load / n, cpu_load / cores)

where ``step`` is the step's own time per batch, ``load`` the time to load one batch
(the baseline's time blocked in ``next()`` with ``num_workers=0``) and ``cpu_load`` the
CPU part of it. Workers keep up with the step once ``load / n <= step``, so
``n = ceil(load / step)``; more only cost memory and start-up. Loading that is mostly
CPU work cannot go faster than the cores allow: past ``n = cores`` it gains nothing,
while loading that mostly waits (I/O, remote storage) wants ``n`` workers whatever the
cores. One more worker than the estimate absorbs jitter and the main process's cost of
receiving batches. The search measures these first and refines around them.

Loading whose CPU time exceeds its wall time ran on several threads at once: a native
thread pool (BLAS, OpenMP) inside the dataset. Each worker would start one as wide as
the machine, so the first settings measured limit each worker to one thread (see
``NOTE [ Worker threads ]``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

# Share of the baseline's load time spent on CPU above which loading is CPU-bound.
_CPU_BOUND_SHARE = 0.5
# CPU seconds per wall second of loading above which it ran on several threads.
_MULTI_THREADED_SHARE = 1.2


def guess_workers(baseline: Mapping[str, float], *, usable_cpus: int) -> list[int]:
    """Worker counts to measure first, from the baseline's measurement (``as_dict()``).

    Returns an empty list when the baseline does not wait for data at all.
    """
    load = float(baseline.get("load_seconds", 0.0))
    step = float(baseline.get("step_seconds", 0.0))
    if load <= 0:
        return []
    needed = math.ceil(load / step) if step > 0 else usable_cpus
    cpu_share = float(baseline.get("load_cpu_seconds", 0.0)) / load
    if cpu_share > _CPU_BOUND_SHARE:
        needed = min(needed, usable_cpus)
    return list(dict.fromkeys([max(1, needed), needed + 1]))


def loads_on_several_threads(baseline: Mapping[str, float]) -> bool:
    """Whether the baseline's loading kept more than one CPU busy at once."""
    load = float(baseline.get("load_seconds", 0.0))
    return load > 0 and float(baseline.get("load_cpu_seconds", 0.0)) > _MULTI_THREADED_SHARE * load
