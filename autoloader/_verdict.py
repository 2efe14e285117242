"""The verdict of :func:`autoloader.diagnose`: which bottleneck a loop's figures show,
in words, and whether the step and the workers ask for more CPUs than there are.

NOTE [ Verdict ]
The user's own DataLoader is measured twice, without changing it: the training loop
(``next(loader)`` then ``step_fn``), then the loader alone (a step that does nothing),
which gives the loader's own time per batch. The verdict, in this order:

- ``memory-bound``: the process tree passed the memory budget, or came within 10% of
  it, or will pass it within an epoch as forked workers copy the Python objects they
  read (measured by the probe of ``NOTE [ Copy-on-read probe ]``).
- ``step-bound``: the loop waits for data less than 5% of its time, or its workers
  deliver batches faster than the step takes them and the wait left is the main
  process receiving them. More workers cannot make it faster.
- ``CPU-bound (step and loader)``: the step itself runs on the CPU, keeping at least
  half a CPU busy and leaving less than one free, and loading is CPU work too (see
  ``NOTE [ Cost model ]``): workers take cores from the step.
- ``loader-bound (CPU)``: the processes that load (the workers, or the main process with
  ``num_workers=0``) were busy on the CPU for more than half of their time: more
  workers help up to the number of CPUs, not beyond. Or, with workers, the main process
  was on the CPU for more than a third of its wait: receiving batches (unpickling,
  opening shared memory) is the limit, and more workers do not move it.
- ``loader-bound (latency)``: they mostly waited (storage, network, locks): workers
  beyond the number of CPUs overlap the waits.

The loading processes' CPU time comes from the kernel's accounting of reaped children
(``os.times()``): the workers are joined when the measurement stops them, so their
whole CPU time is counted, start-up included.

Whatever the verdict, the reason also says when the step and the worker processes ask
for more CPUs than there are (see ``NOTE [ Oversubscription ]``).

NOTE [ Oversubscription ]
A step that trains on the CPU runs its ops on torch's intra-op pool in this process,
``torch.get_num_threads()`` threads (as many as the cores by default), and every op big
enough to split wakes them all, while worker processes load on the same cores. Measured
on the 2-core development VM, JPEG decode and a narrow CNN trained on the CPU: 1 worker
and 2 threads, 625 samples/s; 1 worker and ``torch.set_num_threads(1)``, 853 (see
``NOTE [ Step threads ]``). What the step was measured
to use is what it got, not what it asked for: on 2 cores, a 2-thread step beside 1 busy
worker kept 1.5 CPUs busy and the worker 0.5, 2.0 in all, though the step wanted both
cores whenever it ran. So the step is taken to ask for its threads (at most the usable
CPUs) once it keeps at least ``STEP_ON_CPU`` (half a CPU, search/_cost_model.py) busy,
and for what it used otherwise (a step on an accelerator, or one that waits); the
workers for the CPUs they kept busy over the loop (their CPU seconds per second of it).
When the two ask for more than ``OVERSUBSCRIBED`` times the usable CPUs, they take
turns on the cores. The advice
leaves the workers the cores they used, rounded half up; ``autoloader.tune()`` measures
the split (its ``step_threads`` setting). Thread workers are not counted: they run in
this process, and its CPU time cannot tell them from the step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from autoloader.measure import Measurement, format_bytes
from autoloader.measure import format_seconds as _ms
from autoloader.search import (
    CPU_BOUND_SHARE,
    STEP_BOUND_WAIT,
    STEP_ON_CPU,
    cpu_bound_seconds,
    step_competes_with_workers,
)

# Share of the main process's wait spent on the CPU, with workers, above which receiving
# batches is the limit. On the 2-core machine: 0.55-0.67 when it was (free items, no
# step), 0.07-0.18 when workers were (sleeping or CPU-bound items); the workers' own
# CPU use keeps it well under 1 even when receiving is all the main process does.
_RECEIVING_SHARE = 0.35
# Share of the memory budget from which the loop is memory-bound.
_MEMORY_NEAR = 0.9
# The step and the workers oversubscribe the cores when they ask for more than this many
# times the usable CPUs. The workers' figure is an average over the loop, start-up
# included, taken on a machine other processes may share: a demand within 15% of the
# cores is a full machine, not a fight. On 2 cores, a step on 2 threads is flagged once
# its workers keep 0.3 CPUs busy; on 16 cores, 2.4.
OVERSUBSCRIBED = 1.15

# What lifts a loop bound by receiving batches from worker processes.
_THREADS_LIFT = (
    " Thread workers (autoloader.ThreadLoader) hand batches over without that cost, "
    "where the dataset may be read from several threads at once; autoloader.tune() "
    "measures both kinds."
)

VERDICTS = (
    "step-bound",
    "CPU-bound (step and loader)",
    "loader-bound (CPU)",
    "loader-bound (latency)",
    "memory-bound",
)


@dataclass(frozen=True)
class Figures:
    """What the verdict rests on.

    Attributes:
        loop: the training loop measured (``next(loader)`` then the step).
        alone: the loader alone (a step that does nothing).
        step_alone: the step alone, on one batch again and again (``NOTE [ Spinning
            threads ]`` in ``_diagnose.py``), or the loop again where that was not needed.
        cpu_share: the share of their time the loading processes were on the CPU.
        load_cpu: CPU seconds of loading per batch.
        workers: the loader's ``num_workers``.
        budget: the memory budget, in bytes.
        usable_cpus: CPUs this process may run on.
        copied: bytes each forked worker can copy over an epoch, or ``None``.
        receiving: batches come from worker processes, whose hand-over costs the main
            process.
    """

    loop: Measurement
    alone: Measurement
    step_alone: Measurement
    cpu_share: float
    load_cpu: float
    workers: int
    budget: int
    usable_cpus: int
    copied: float | None
    receiving: bool

    @property
    def step(self) -> float:
        return self.loop.step_seconds

    @property
    def loader(self) -> float:
        return self.alone.load_seconds + self.alone.step_seconds


def verdict(figures: Figures) -> tuple[str, str]:
    """The verdict of ``NOTE [ Verdict ]`` and the sentence that explains it."""
    # One check a verdict, in the NOTE's order of precedence: the first that holds.
    return (
        _memory_bound(figures)
        or _step_bound(figures)
        or _cpu_bound(figures)
        or _loader_bound(figures)
    )


def _memory_bound(f: Figures) -> tuple[str, str] | None:
    peak, budget, workers, copied = (
        max(f.loop.peak_memory, f.alone.peak_memory), f.budget, f.workers, f.copied,
    )  # fmt: skip
    if peak >= _MEMORY_NEAR * budget:
        return "memory-bound", (
            f"The process tree peaked at {format_bytes(peak)}, {peak / budget:.0%} of the "
            f"{format_bytes(budget)} budget: more workers or prefetch would not fit. Make "
            "items smaller in memory (numpy arrays rather than Python objects), or fewer "
            "workers with batched fetch."
        )
    if copied is not None and peak + workers * copied >= budget:
        return "memory-bound", (
            f"The process tree peaked at {format_bytes(peak)} in this short run, but each "
            f"of the {workers} workers copies the Python objects it reads (up to "
            f"{format_bytes(copied)} each over an epoch): {format_bytes(peak + workers * copied)} "
            f"by the end of one, past the {format_bytes(budget)} budget. Store the dataset "
            "as numpy arrays or tensors, or use fewer workers."
        )
    return None


def _step_bound(f: Figures) -> tuple[str, str] | None:
    wait, step, loader = f.loop.data_wait_fraction, f.step, f.loader
    if wait < STEP_BOUND_WAIT:
        return "step-bound", (
            f"Data loading is not the bottleneck: the loop waits for data {wait:.0%} of the "
            f"time, the step takes {_ms(step)} per batch and the loader alone "
            f"{_ms(loader)}. More workers would only cost memory and start-up."
        )
    if f.receiving and loader <= step:
        return "step-bound", (
            f"The loader alone delivers a batch every {_ms(loader)}, faster than the step's "
            f"{_ms(step)}, yet the loop waits for data {wait:.0%} of the time: that is the "
            "main process receiving each batch from a worker (unpickling, shared-memory "
            "handles), which more workers do not remove. Fewer, larger transfers do: "
            "batched fetch, or a larger batch." + _THREADS_LIFT
        )
    return None


def _figures(f: Figures) -> str:
    return (
        f"The loop waits for data {f.loop.data_wait_fraction:.0%} of the time: the loader "
        f"needs {_ms(f.loader)} per batch with num_workers={f.workers}, the step "
        f"{_ms(f.step)}."
    )


def _who(workers: int) -> str:
    return {0: "the main process", 1: "the worker"}.get(workers, f"the {workers} workers")


def _cpu_bound(f: Figures) -> tuple[str, str] | None:
    # The CPUs the step keeps busy, from the step alone, over the loop's step time: on a
    # busy machine one step can take several times another, and a step alone that
    # happened to run quicker would otherwise look like less CPU work than the loop's.
    step, usable_cpus = f.step, f.usable_cpus
    step_cpu = step_cpus(f.step_alone) * step
    if not step_competes_with_workers(
        step=step,
        step_cpu=step_cpu,
        load_cpu=f.load_cpu,
        loading_cpu_share=f.cpu_share,
        usable_cpus=usable_cpus,
    ):
        return None
    best = cpu_bound_seconds(
        step=step, step_cpu=step_cpu, load_cpu=f.load_cpu, usable_cpus=usable_cpus
    )
    return "CPU-bound (step and loader)", (
        f"{_figures(f)} The step runs on the CPU too, keeping {step_cpus(f.step_alone):.1f} of "
        f"the {usable_cpus} CPUs busy, and loading is CPU work ({_who(f.workers)} on the CPU "
        f"{f.cpu_share:.0%} of the time): workers overlap loading with the step only by "
        f"taking cores from it. Even perfectly overlapped, the two take {_ms(best)} per "
        f"batch of the CPUs, against {_ms(step + f.loop.load_seconds)} now, and a step on "
        "several threads slows down by more than the core a worker takes. A cheaper "
        "transform, or data decoded once ahead of training, makes this loop faster; "
        "autoloader.tune() measures whether workers pay, and the step's threads "
        "against them."
    )


def _loader_bound(f: Figures) -> tuple[str, str]:
    loop, who, cpu_share = f.loop, _who(f.workers), f.cpu_share
    on_cpu = loop.load_cpu_seconds / loop.load_seconds if loop.load_seconds else 0.0
    if f.receiving and on_cpu > _RECEIVING_SHARE:
        return "loader-bound (CPU)", (
            f"{_figures(f)} The main process is the limit: it was on the CPU {on_cpu:.0%} "
            "of the time it waited, receiving batches from the workers (unpickling, "
            "shared-memory handles), which more workers do not speed up. Fewer, larger "
            "transfers do: batched fetch, a larger batch, or num_workers=0 if loading is "
            "cheap." + _THREADS_LIFT
        )
    if cpu_share > CPU_BOUND_SHARE:
        return "loader-bound (CPU)", (
            f"{_figures(f)} Loading is CPU work ({who} on the CPU {cpu_share:.0%} of the "
            f"time): workers help up to the {f.usable_cpus} CPUs, not beyond; then make "
            "the transform cheaper, limit each worker's native threads, or fetch whole "
            "batches. autoloader.tune() finds the best setting."
        )
    return "loader-bound (latency)", (
        f"{_figures(f)} Loading mostly waits ({who} on the CPU only {cpu_share:.0%} of the "
        f"time: storage, network, sleeps): more workers, even beyond the {f.usable_cpus} "
        "CPUs, overlap the waits. autoloader.tune() finds how many."
    )


def oversubscription(
    *,
    step_cpus: float,
    workers_cpus: float,
    workers: int,
    usable_cpus: int,
    step_threads: int,
) -> str | None:
    """The sentence saying that the step and the ``workers`` worker processes ask for
    more CPUs than the ``usable_cpus``, with the figures and what to do; ``None`` where
    they do not (see ``NOTE [ Oversubscription ]``)."""
    step = step_asks(step_cpus, step_threads, usable_cpus)
    total = step + workers_cpus
    if total <= OVERSUBSCRIBED * usable_cpus:
        return None
    who = workers_named(workers)
    if step_cpus >= STEP_ON_CPU:
        threads = "thread" if step_threads == 1 else "threads"
        step_part = f"The step ({step_threads} torch {threads}, {step_cpus:.1f} CPUs busy)"
    else:
        step_part = f"The step ({step_cpus:.1f} CPUs busy)"
    sentence = (
        f"{step_part} and {who} ({workers_cpus:.1f} CPUs) ask for {total:.1f} CPUs of the "
        f"{usable_cpus} here: they take turns on the cores."
    )
    tune = (
        "autoloader.tune() measures the split (its step_threads setting, applied with "
        "result.apply_threads())."
    )
    # The workers keep the cores they used, rounded half up: round() takes 0.5 to 0,
    # and a worker busy half the time would be left no core at all.
    suggested = max(1, usable_cpus - math.floor(workers_cpus + 0.5))
    if suggested >= step_threads:
        # The step's threads already fit in the cores the workers leave.
        return f"{sentence} Fewer workers crowd them less; {tune}"
    left = usable_cpus - suggested
    cores = "core" if left == 1 else "cores"
    return (
        f"{sentence} torch.set_num_threads({suggested}) in the training process leaves "
        f"{who} {left} {cores}; {tune}"
    )


def step_asks(step_cpus: float, step_threads: int, usable_cpus: int) -> float:
    """CPUs the step asks for: all its torch threads (up to the usable CPUs) once it
    trains on the CPU, else what it used (see ``NOTE [ Oversubscription ]``)."""
    if step_cpus >= STEP_ON_CPU:
        return max(step_cpus, float(min(step_threads, usable_cpus)))
    return step_cpus


def workers_named(workers: int) -> str:
    return "the worker" if workers == 1 else f"the {workers} workers"


def step_cpus(loop: Measurement) -> float:
    """CPUs the step kept busy while it ran."""
    return loop.step_cpu_seconds / loop.step_seconds if loop.step_seconds else 0.0
