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
receiving batches. The search measures these first and refines around them; where
loading is CPU work, the doubling ladder after them stops at twice the cores
(``_RUNGS_PER_CPU`` in ``_policy.py``), and only the sampler may go past.

Loading whose CPU time exceeds its wall time ran on several threads at once: a native
thread pool (BLAS, OpenMP) inside the dataset. Each worker would start one as wide as
the machine, so the first settings measured limit each worker to one thread (see
``NOTE [ Worker threads ]``).

A step that trains on the CPU adds a term: the step's threads and the workers share the
cores, so a batch takes at least ``(step_cpu + cpu_load) / cores``. When loading is
CPU work, that term (not the step's own time) bounds the loop, and the step does a real
share of the CPU work (a quarter or more), workers overlap loading with the step only by
taking cores from it; a step on several threads also loses more than the core a worker
takes. A step on an accelerator, or one that does no work, leaves the cores to the
workers; loading that mostly waits is overlapped by workers with little CPU.

Where the step's own threads are searched (``NOTE [ Step threads ]``), the first
settings split the cores between them and the workers: with loading that is CPU work,
``n`` workers leave the step ``cores - n`` threads (at least one), and the guessed worker
counts leave the step at least one core; with loading that mostly waits, or none in
workers (``num_workers=0``, thread workers sharing the step's pool), the step keeps every
core. The sampler then measures other splits, with no more workers than cores: with
both works on the CPU, more only take turns with the step. Whether loading is CPU work
is then read from the loading thread's own CPU time: after a step's parallel ops, torch's
pool spins for a while, and the process's CPU time would charge that to the loading.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Mapping

# What a measurement says of the loop, read alike by autoloader.diagnose() (its verdict,
# NOTE [ Verdict ]) and the search (its policy): defined here, the one module below both.
#
# Share of its time the loading is on the CPU (the loading processes', or the loading
# thread's) above which loading is CPU work, not waits: more of it than of anything else.
CPU_BOUND_SHARE = 0.5
# CPU seconds per second of the step from which the step trains on the CPU, and asks for
# its torch threads: half a CPU. diagnose() reads the CPUs the step alone kept busy, the
# search the step's own thread (its process's figure is blurred by torch's spinning
# pool, NOTE [ Spinning threads ] in _diagnose.py): one bar, two readings of it.
STEP_ON_CPU = 0.5
# Two bars on the loop's share of time waiting for data, for two decisions. Under
# STEP_BOUND_WAIT diagnose() tells the user the loop is step-bound: loading can make it
# at most about 5% faster, not worth changing their loader by hand for. Under
# GIVE_BACK_WAIT (a stricter bar) the search stops and gives the rest of its budget back
# (NOTE [ Enough searching ] in _patience.py): that ends the search for good, and the
# budget was given to it already, so it stops only where what is left (about 3%) is
# near a tie (TIE_TOLERANCE in _choice.py, 2%). A loop waiting 4% is step-bound to the reader and
# still searched by tune(). (Receiving a batch from a worker costs the main process
# about 1.3 ms on the development VM, so with a 20 ms step even the best setting with
# workers waits some 6% of the time.)
STEP_BOUND_WAIT = 0.05
GIVE_BACK_WAIT = 0.03
# CPU seconds per wall second of loading above which it ran on several threads.
_MULTI_THREADED_SHARE = 1.2
# Share of the CPU work per batch from which a step that trains on the CPU counts.
STEP_SHARE_OF_WORK = 0.25


def guess_workers(
    baseline: Mapping[str, float], *, usable_cpus: int, step_on_cpu: bool = False
) -> list[int]:
    """Worker counts to measure first, from the baseline's measurement (``as_dict()``).
    With ``step_on_cpu`` (the step's threads are searched) and loading that is CPU work,
    they leave the step a core.

    Returns an empty list when the baseline does not wait for data at all.
    """
    load = float(baseline.get("load_seconds", 0.0))
    step = float(baseline.get("step_seconds", 0.0))
    if load <= 0:
        return []
    needed = math.ceil(load / step) if step > 0 else usable_cpus
    if loading_on_cpu(baseline, step_on_cpu=step_on_cpu):
        needed = min(needed, usable_cpus)
        if step_on_cpu:
            cores = max(1, usable_cpus - 1)
            return list(dict.fromkeys([min(max(1, needed), cores), min(needed + 1, cores)]))
    return list(dict.fromkeys([max(1, needed), needed + 1]))


def batch_seconds(
    baseline: Mapping[str, float],
    workers: int,
    *,
    usable_cpus: int,
    batches_per_epoch: int | None,
    step_on_cpu: bool = False,
) -> float | None:
    """Seconds a batch is expected to take the loop with ``workers`` workers, from the
    baseline's measurement (``as_dict()``): the step, or the load shared by the workers
    that run at once (the CPUs, where loading is CPU work) where that is longer; over an
    epoch, an empty pipeline refills once (a batch's load, as the epoch model charges
    persistent workers, ``NOTE [ Epoch model ]``). ``None`` without a measurement."""
    load = float(baseline.get("load_seconds", 0.0))
    step = float(baseline.get("step_seconds", 0.0))
    if load + step <= 0:
        return None
    if workers <= 0:
        return load + step
    on_cpu = loading_on_cpu(baseline, step_on_cpu=step_on_cpu)
    at_once = min(workers, usable_cpus) if on_cpu else workers
    steady = max(step, load / at_once)
    if not batches_per_epoch:
        return steady
    return (load + (batches_per_epoch - 1) * steady) / batches_per_epoch


def split_step_threads(
    baseline: Mapping[str, float], *, usable_cpus: int
) -> Callable[[str, int], int]:
    """The training process's threads for a first setting of ``num_workers`` workers of
    a kind (``"processes"`` or ``"threads"``): the cores the workers leave the step (see
    ``NOTE [ Cost model ]``)."""
    cpu_bound = loading_on_cpu(baseline, step_on_cpu=True)

    def threads(kind: str, workers: int) -> int:
        if not cpu_bound or kind != "processes":
            return usable_cpus
        return max(1, usable_cpus - workers)

    return threads


def loading_on_cpu(baseline: Mapping[str, float], *, step_on_cpu: bool) -> bool:
    """Whether the baseline's loading was CPU work: on the CPU more than half its time,
    counting the loading thread alone where the step works on the CPU (see
    ``NOTE [ Cost model ]``)."""
    load = float(baseline.get("load_seconds", 0.0))
    key = "load_thread_cpu_seconds" if step_on_cpu else "load_cpu_seconds"
    return load > 0 and float(baseline.get(key, 0.0)) > CPU_BOUND_SHARE * load


def guess_threads(baseline: Mapping[str, float]) -> list[int]:
    """Thread worker counts to measure first (see ``NOTE [ Thread workers ]``): where
    loading mostly waits (I/O, sleeps in native code that release the GIL), or where
    this Python runs without a GIL, threads overlap loading as processes do, without
    their per-batch hand-over. A thread costs little, so the guesses reach twice the
    count that keeps up with the step. Loading that is Python work under the GIL gets
    none: the sampler may still try threads.
    """
    load = float(baseline.get("load_seconds", 0.0))
    step = float(baseline.get("step_seconds", 0.0))
    if load <= 0 or step <= 0:
        return []
    cpu_share = float(baseline.get("load_cpu_seconds", 0.0)) / load
    if cpu_share > CPU_BOUND_SHARE and gil_enabled():
        return []
    needed = max(1, math.ceil(load / step))
    return list(dict.fromkeys([needed + 1, 2 * needed]))


def gil_enabled() -> bool:
    """Whether this Python runs with a GIL (free-threaded CPython 3.13t and later may not)."""
    check = getattr(sys, "_is_gil_enabled", None)
    return bool(check()) if check is not None else True


def loads_on_several_threads(baseline: Mapping[str, float]) -> bool:
    """Whether the baseline's loading kept more than one CPU busy at once."""
    load = float(baseline.get("load_seconds", 0.0))
    return load > 0 and float(baseline.get("load_cpu_seconds", 0.0)) > _MULTI_THREADED_SHARE * load


def cpu_bound_seconds(*, step: float, step_cpu: float, load_cpu: float, usable_cpus: int) -> float:
    """Seconds per batch no setting can beat when the step and loading share the CPUs: the
    step's own time, or both CPU works spread over the CPUs (see ``NOTE [ Cost model ]``)."""
    return max(step, (step_cpu + load_cpu) / usable_cpus)


def step_competes_with_workers(
    *,
    step: float,
    step_cpu: float,
    load_cpu: float,
    loading_cpu_share: float,
    usable_cpus: int,
) -> bool:
    """Whether a step that takes ``step`` seconds and ``step_cpu`` CPU seconds per batch
    competes with workers for the cores, loading taking ``load_cpu`` CPU seconds per
    batch, on the CPU ``loading_cpu_share`` of its time (see ``NOTE [ Cost model ]``)."""
    work = step_cpu + load_cpu
    return (
        loading_cpu_share > CPU_BOUND_SHARE
        and step_cpu >= STEP_SHARE_OF_WORK * work
        and work / usable_cpus > step
    )
