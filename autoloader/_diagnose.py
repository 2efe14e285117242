"""``autoloader.diagnose``: is data loading the bottleneck of this loop, and of what kind?

The user's own DataLoader is measured, without changing it (the loop, the loader alone,
the step alone where needed), and the figures are judged by ``_verdict.py`` (``NOTE [
Verdict ]``, ``NOTE [ Oversubscription ]``).
"""

from __future__ import annotations

import os
import textwrap
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset

from autoloader._exceptions import InvalidInputError, LoopError
from autoloader._problem import check_main_thread
from autoloader._verdict import (
    OVERSUBSCRIBED,
    Figures,
    oversubscription,
    step_asks,
    workers_named,
)
from autoloader._verdict import step_cpus as measured_step_cpus
from autoloader._verdict import verdict as judge
from autoloader.checks import (
    Checks,
    Environment,
    check_seconds,
    check_step_fn,
    copied_per_worker,
    start_method,
)
from autoloader.measure import (
    ChildrenRunDelay,
    Deadlines,
    Measurement,
    MemoryBudgetExceeded,
    TrialError,
    TrialRunner,
    TrialTimeout,
    format_bytes,
    resolve_device,
    resolve_memory_budget,
    time_limit,
)
from autoloader.measure import format_seconds as _ms
from autoloader.search import (
    STEP_ON_CPU,
)

# Share of the measuring time given to the loop; the rest times the loader alone.
_LOOP_SHARE = 0.6
# The checks (the copy-on-read probe, workers repeating samples) get this share of the
# measuring time on top of it, and at least _MIN_CHECKS_SECONDS.
_CHECKS_SHARE = 0.2
_MIN_CHECKS_SECONDS = 1.0
# A batch that takes this many times the whole measuring time is hung.
_HANG_FACTOR = 2.0
# NOTE [ Spinning threads ]
# After each parallel op, torch's OpenMP threads spin for a while before they sleep
# (here a 10 ms sleep right after one is charged 0.9 CPUs). With num_workers=0 the
# loading's ops run in this process, just before each step, so a step that only waits
# looks busy. Where the loop's step seemed to use a tenth of a CPU or more, the step is
# timed alone, on one batch handed back again and again (no loading op before it), for
# _STEP_ALONE_SHARE of the measuring time. With workers, loading runs elsewhere and the
# loop's own figure is clean.
_STEP_ALONE_SHARE = 0.15
_SPINNING_CPUS = 0.1


@dataclass(frozen=True)
class Diagnosis:
    """What :func:`diagnose` measured of a training loop, and its verdict.

    Attributes:
        verdict: ``"step-bound"``, ``"CPU-bound (step and loader)"``,
            ``"loader-bound (CPU)"``, ``"loader-bound (latency)"`` or ``"memory-bound"``
            (see ``NOTE [ Verdict ]``).
        reason: the figures behind the verdict and what to do, in a sentence or two.
        num_workers: the loader's worker count.
        batch_size: samples per batch, as measured.
        samples_per_second: the loop's steady rate; ``None`` if it passed the budget.
        data_wait_fraction: share of the loop's time blocked waiting for a batch.
        step_seconds: the step's own time per batch (data transfer included).
        loop_load_seconds: seconds per batch the loop waited for data.
        loader_seconds: the loader's own time per batch, measured with no step.
        time_to_first_batch: seconds from ``iter(loader)`` to the first batch.
        peak_memory: bytes, the highest PSS of the process tree (workers included).
        memory_budget: bytes the tree was allowed.
        copied_per_worker: with forked workers, bytes of the dataset each can end up
            copying over an epoch (copy-on-read of Python objects, see
            ``NOTE [ Copy-on-read probe ]``); ``None`` where the probe found none or
            did not run.
        missing: for each check that could not be made, why (it ran out of its time,
            or the dataset raised in it).
        loading_cpu_share: share of the loading processes' time spent on the CPU.
        usable_cpus: CPUs this process may run on.
        step_cpus: CPUs the step kept busy while it ran (its CPU seconds per second):
            about 0 for a step on an accelerator, up to ``usable_cpus`` for training on
            the CPU.
        step_threads: ``torch.get_num_threads()`` of this process when measured: the
            threads of torch's intra-op pool the step's ops run on.
        workers_cpus: CPUs the worker processes asked for during the loop (their CPU
            seconds, and seconds waiting for a CPU, per second of it: ``NOTE [ CPU
            demand ]``); ``None`` without worker processes (``num_workers=0``, or thread
            workers).
    """

    verdict: str
    reason: str
    num_workers: int
    batch_size: int
    samples_per_second: float | None
    data_wait_fraction: float | None
    step_seconds: float | None
    loop_load_seconds: float | None
    loader_seconds: float | None
    time_to_first_batch: float | None
    peak_memory: int
    memory_budget: int
    loading_cpu_share: float | None
    usable_cpus: int
    copied_per_worker: float | None = None
    missing: dict[str, str] = field(default_factory=dict)
    step_cpus: float | None = None
    step_threads: int | None = None
    workers_cpus: float | None = None

    @property
    def ceiling(self) -> float | None:
        """Samples/s if the loop never waited for data: ``batch_size / step_seconds``."""
        if not self.step_seconds:
            return None
        return self.batch_size / self.step_seconds

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def __str__(self) -> str:
        rows = [("verdict", self.verdict)]
        if self.samples_per_second is not None and self.data_wait_fraction is not None:
            rows.append(
                (
                    "loop",
                    f"{self.samples_per_second:,.0f} samples/s, waits for data "
                    f"{self.data_wait_fraction:.0%} of the time",
                )
            )
        if self.step_seconds is not None:
            ceiling = f" (ceiling {self.ceiling:,.0f} samples/s)" if self.ceiling else ""
            on_cpu = ""
            if self.step_cpus is not None and self.step_cpus >= 0.05:
                on_cpu = f", keeping {self.step_cpus:.1f} CPUs busy"
            rows.append(("step", f"{_ms(self.step_seconds)} per batch{ceiling}{on_cpu}"))
        if self.loader_seconds is not None:
            rows.append(
                (
                    "loader alone",
                    f"{_ms(self.loader_seconds)} per batch "
                    f"({self.batch_size / self.loader_seconds:,.0f} samples/s), "
                    f"num_workers={self.num_workers}",
                )
            )
        if self.time_to_first_batch is not None:
            rows.append(("first batch", f"{self.time_to_first_batch:.2f} s after iter()"))
        memory = f"{format_bytes(self.peak_memory)} peak of a {format_bytes(self.memory_budget)}"
        rows.append(("memory (process tree)", memory + " budget"))
        if self.copied_per_worker is not None:
            rows.append(
                (
                    "copy-on-read",
                    f"each worker copies up to {format_bytes(self.copied_per_worker)} of "
                    "the dataset over an epoch",
                )
            )
        if self.loading_cpu_share is not None:
            who = "the workers" if self.num_workers else "the main process"
            rows.append(
                (
                    "loading on CPU",
                    f"{self.loading_cpu_share:.0%} of {who}' time"
                    if self.num_workers
                    else f"{self.loading_cpu_share:.0%} of {who}'s loading time",
                )
            )
        if (
            self.step_cpus is not None
            and self.step_threads is not None
            and self.workers_cpus is not None
        ):
            rows.append(("CPUs asked", self._cpus_asked(self.step_cpus, self.step_threads)))
        rows += [(f"not checked: {name}", why) for name, why in self.missing.items()]
        width = max(len(name) for name, _ in rows)
        lines = [f"{name:<{width}}  {value}" for name, value in rows]
        lines.append(textwrap.fill(self.reason, width=88))
        return "\n".join(lines)

    def _cpus_asked(self, step_cpus: float, step_threads: int) -> str:
        """The CPUs row: what the step and the workers ask for, against the usable CPUs."""
        workers_cpus = self.workers_cpus or 0.0
        step = step_asks(step_cpus, step_threads, self.usable_cpus)
        if step_cpus >= STEP_ON_CPU:
            threads = "thread" if step_threads == 1 else "threads"
            step_part = f"step {step_threads} torch {threads} ({step_cpus:.1f} busy)"
        else:
            step_part = f"step {step_cpus:.1f}"
        total = step + workers_cpus
        verdict = ": oversubscribed" if total > OVERSUBSCRIBED * self.usable_cpus else ""
        return (
            f"{step_part} + {workers_named(self.num_workers)} {workers_cpus:.1f} = "
            f"{total:.1f} of {self.usable_cpus}{verdict}"
        )


def diagnose(
    loader: DataLoader[Any],
    step_fn: Callable[[Any], object],
    *,
    device: str | torch.device | None = None,
    seconds: float = 10.0,
    memory_budget: int | str | None = None,
) -> Diagnosis:
    """Measure the training loop over ``loader`` as it is, and say what bounds it.

    Nothing is tuned: the loop (``next(loader)``, then ``step_fn(batch)``) runs for
    at most ``0.6 * seconds``, then the loader alone for at most the rest (each stops
    earlier once its rate is known within 5%), under the same memory
    watchdog as :func:`autoloader.tune`. The loader is left as it was; workers it
    started are stopped, and it starts new ones the next time it is iterated.

    Args:
        loader (DataLoader): the loader to diagnose, as used in training.
        step_fn (callable): one training step; receives a batch.
        device (str or torch.device, optional): if set, each batch is moved there before
            ``step_fn``. (default: ``None``)
        seconds (float, optional): the longest the measurements may take, worker
            start-up excluded; the checks (the copy-on-read probe with forked workers,
            repeated samples with an ``IterableDataset``) add a fifth of it, at least a
            second. With ``num_workers=0`` and a step that seems to use the CPU, the
            step is also timed alone, on one batch again and again (see
            ``NOTE [ Spinning threads ]``), for a further 15%. A batch that takes twice
            this long is taken as hung. (default: ``10``)
        memory_budget (int or str, optional): bytes the process tree may use, e.g.
            ``"6GiB"``; ``None`` means what it uses now plus 80% of the memory
            available. (default: ``None``)

    Returns:
        Diagnosis: the figures and the verdict; ``print()`` it.

    Raises:
        InvalidInputError: an argument is wrong, or this is not the main thread (see
            ``NOTE [ Main thread only ]``); raised before anything runs. Or the
            loader's workers repeat each other's samples (an ``IterableDataset`` that
            does not split its items between workers).
        LoopError: the dataset, collate_fn or step_fn raised or hung, or a worker died.

    Example::

        print(autoloader.diagnose(train_loader, train_step))
    """
    check_main_thread("diagnose()")
    if not isinstance(loader, DataLoader):
        raise InvalidInputError(
            f"loader must be a torch.utils.data.DataLoader, but got {type(loader).__name__}. "
            "To tune settings for a dataset, use autoloader.tune(dataset, step_fn)."
        )
    step_fn = check_step_fn(step_fn)
    seconds = check_seconds(
        "seconds", seconds, hint=" It is about how long the diagnosis measures."
    )
    resolved_device = resolve_device(device)
    budget = resolve_memory_budget(memory_budget)
    batch_size = loader.batch_size or 1
    usable_cpus = Environment.current().usable_cpus
    workers = loader.num_workers
    # Thread workers (a ThreadLoader) run in this process: nothing is forked or received.
    threads = getattr(loader, "worker_kind", "processes") == "threads"
    checks, copied = _checks(loader, seconds=seconds, memory_budget=budget, threads=threads)
    step_threads = torch.get_num_threads()
    try:
        loops = _measure(loader, step_fn, device=resolved_device, seconds=seconds, budget=budget)
    except MemoryBudgetExceeded as error:
        return _memory_bound(error, workers, batch_size, budget, usable_cpus)
    loop, alone = loops.loop, loops.alone
    cpu_share, load_cpu = loops.loading_cpu(workers, threads=threads, usable_cpus=usable_cpus)
    verdict, reason = judge(
        Figures(
            loop=loop,
            alone=alone,
            step_alone=loops.step_alone,
            cpu_share=cpu_share,
            load_cpu=load_cpu,
            workers=workers,
            budget=budget,
            usable_cpus=usable_cpus,
            copied=copied,
            receiving=workers > 0 and not threads,
        )
    )
    step_cpus = measured_step_cpus(loops.step_alone)
    workers_cpus = None
    if workers and not threads and loop.duration > 0:
        workers_cpus = loops.children_cpu / loop.duration
        if verdict != "memory-bound":
            crowded = oversubscription(
                step_cpus=step_cpus,
                workers_cpus=workers_cpus,
                workers=workers,
                usable_cpus=usable_cpus,
                step_threads=step_threads,
            )
            reason = f"{reason} {crowded}" if crowded else reason
    return Diagnosis(
        verdict=verdict,
        reason=reason,
        num_workers=workers,
        batch_size=batch_size,
        samples_per_second=loop.samples_per_second,
        data_wait_fraction=loop.data_wait_fraction,
        step_seconds=loop.step_seconds,
        loop_load_seconds=loop.load_seconds,
        loader_seconds=alone.load_seconds + alone.step_seconds,
        time_to_first_batch=loop.time_to_first_batch,
        peak_memory=max(loop.peak_memory, alone.peak_memory),
        memory_budget=budget,
        loading_cpu_share=cpu_share,
        usable_cpus=usable_cpus,
        copied_per_worker=copied,
        missing=dict(checks.missing),
        step_cpus=step_cpus,
        step_threads=step_threads,
        workers_cpus=workers_cpus,
    )


def _measure(
    loader: DataLoader[Any],
    step_fn: Callable[[Any], object],
    *,
    device: torch.device | None,
    seconds: float,
    budget: int,
) -> _Loops:
    """The loop, the loader alone and the step alone, measured; a fault of the user's
    code as a :class:`LoopError` that says what to do.

    Raises:
        MemoryBudgetExceeded: the process tree passed ``budget`` (a verdict, not an error).
    """
    try:
        return _Loops.measure(loader, step_fn, device=device, seconds=seconds, memory_budget=budget)
    except TrialTimeout as timeout:
        raise _hung(timeout) from timeout
    except TrialError as error:
        if isinstance(error.error, TrialTimeout):
            raise _hung(error.error) from error.error
        raise LoopError(
            f"The loop over the loader failed: {error}"
            + (f" at {error.where}" if error.where else "")
            + ". Fix it and run the loop once by hand before diagnosing it."
        ) from error.error


def _checks(
    loader: DataLoader[Any], *, seconds: float, memory_budget: int, threads: bool
) -> tuple[Checks, float | None]:
    """The checks diagnose() makes before measuring: repeated samples (several workers)
    and copy-on-read (forked workers); the bytes each worker copies, if measured."""
    options = {
        "collate_fn": loader.collate_fn,
        "worker_init_fn": loader.worker_init_fn,
        "multiprocessing_context": loader.multiprocessing_context,
    }
    workers = loader.num_workers
    method = start_method(options, Environment.current().start_method)
    checks = Checks(
        loader.dataset,
        {name: value for name, value in options.items() if value is not None},
        batch_size=loader.batch_size or 1,
        seconds=max(_MIN_CHECKS_SECONDS, _CHECKS_SHARE * seconds),
        memory_budget=memory_budget,
    )
    if workers > 1:
        checks.repeated_samples()
    facts = checks.copy_on_read(
        _length(loader.dataset), start_method=method if workers and not threads else "none"
    )
    return checks, copied_per_worker(facts)


@dataclass(frozen=True, slots=True)
class _Loops:
    """What diagnose() measured: the loop, the loader alone, the step alone (the loop
    itself unless the step was timed on one batch again), and the CPU seconds the
    workers' processes asked for during the loop (NOTE [ CPU demand ])."""

    loop: Measurement
    alone: Measurement
    step_alone: Measurement
    children_cpu: float

    @classmethod
    def measure(
        cls,
        loader: DataLoader[Any],
        step_fn: Callable[[Any], object],
        *,
        device: torch.device | None,
        seconds: float,
        memory_budget: int,
    ) -> _Loops:
        def runner(step: Callable[[Any], object], on: torch.device | None) -> TrialRunner:
            return TrialRunner(
                loader.dataset,
                step,
                batch_size=loader.batch_size or 1,
                memory_budget=memory_budget,
                device=on,
            )

        deadlines = Deadlines.per_batch(_HANG_FACTOR * seconds, workers=loader.num_workers)
        children_before = _children_cpu()
        # What the workers asked of the CPUs: their CPU time once reaped, and what they
        # waited for one (NOTE [ CPU demand ]).
        with ChildrenRunDelay() as waited:
            loop = runner(step_fn, device).measure_loader(
                loader, max_seconds=_LOOP_SHARE * seconds, deadlines=deadlines
            )
        children_cpu = _children_cpu() - children_before + waited.seconds
        alone = runner(_no_step, None).measure_loader(
            loader, max_seconds=(1 - _LOOP_SHARE) * seconds, deadlines=deadlines
        )
        step_alone = loop
        if not loader.num_workers and measured_step_cpus(loop) >= _SPINNING_CPUS:
            again = runner(step_fn, device).measure_loader(
                _one_batch_again(loader, deadlines.first),
                max_seconds=_STEP_ALONE_SHARE * seconds,
                deadlines=deadlines,
            )
            # A step too slow to time a window in that share keeps the loop's figures.
            if again.step_seconds > 0:
                step_alone = again
        return cls(loop, alone, step_alone, children_cpu)

    def loading_cpu(self, workers: int, *, threads: bool, usable_cpus: int) -> tuple[float, float]:
        """The share of the loading workers' CPUs busy loading, and loading's CPU seconds
        per batch."""
        loop, alone = self.loop, self.alone
        if workers and threads:
            # This process's CPU time while it waited on the loader alone is the threads'.
            rate = alone.load_cpu_seconds / alone.load_seconds if alone.load_seconds else 0.0
            cpu_share = rate / min(workers, usable_cpus)
            load_cpu = alone.load_cpu_seconds
        elif workers:
            cpu_share = self.children_cpu / (loop.duration * min(workers, usable_cpus))
            # The workers' CPU seconds per second, over the loop's seconds per batch.
            load_cpu = self.children_cpu / loop.duration * (loop.load_seconds + loop.step_seconds)
        else:
            cpu_share = loop.load_cpu_seconds / loop.load_seconds if loop.load_seconds else 0.0
            load_cpu = loop.load_cpu_seconds
        return min(1.0, cpu_share), load_cpu


def _memory_bound(
    error: MemoryBudgetExceeded, workers: int, batch_size: int, budget: int, usable_cpus: int
) -> Diagnosis:
    return Diagnosis(
        verdict="memory-bound",
        reason=(
            f"The loop was stopped: {error}. The workers were killed. Use fewer workers or "
            "a smaller prefetch_factor, or make items smaller in memory (numpy arrays "
            "rather than Python objects, which forked workers copy as they read them)."
        ),
        num_workers=workers,
        batch_size=batch_size,
        samples_per_second=None,
        data_wait_fraction=None,
        step_seconds=None,
        loop_load_seconds=None,
        loader_seconds=None,
        time_to_first_batch=None,
        peak_memory=error.peak,
        memory_budget=budget,
        loading_cpu_share=None,
        usable_cpus=usable_cpus,
    )


def _length(dataset: object) -> int | None:
    try:
        return len(dataset)  # type: ignore[arg-type]
    except TypeError:
        return None


def _hung(timeout: TrialTimeout) -> LoopError:
    return LoopError(
        f"The loop over the loader made {timeout}: a worker, the dataset or step_fn "
        "hangs. If a batch really takes that long, give diagnose() more seconds: a batch "
        f"may take {_HANG_FACTOR:.0f} times as many."
    )


class _Again(Dataset[Any]):
    """One batch, as many times as asked for."""

    def __init__(self, batch: Any) -> None:
        self.batch = batch

    def __len__(self) -> int:
        return 1 << 30

    def __getitem__(self, index: int) -> Any:
        return self.batch


def _one_batch_again(loader: DataLoader[Any], seconds: float) -> DataLoader[Any]:
    """A loader handing back one batch of ``loader`` (read in this process, within
    ``seconds``) again and again: the step alone (see ``NOTE [ Spinning threads ]``)."""
    with time_limit(seconds, "loading a batch"):
        batch = next(iter(loader))
    return DataLoader(_Again(batch), batch_size=None)


def _children_cpu() -> float:
    """CPU seconds of this process's children that have exited and been waited for."""
    times = os.times()
    return times.children_user + times.children_system


def _no_step(batch: object) -> None:
    """The step of the loader-alone measurement."""
