"""One trial: build a DataLoader with given settings and time the training loop.

The runner knows nothing of Optuna or of other trials: everything it needs is passed
in, so the same measurement can run in another process or on every rank of a job.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from time import perf_counter
from typing import Any, Protocol, TypeVar

import torch
from torch.utils.data import DataLoader, Dataset

from autoloader.loader import build_loader, merge_loader_kwargs, step_threads
from autoloader.measure._deadlines import Alarm, Deadlines
from autoloader.measure._errors import TrialError
from autoloader.measure._lockstep import Alone, Lockstep
from autoloader.measure._measurement import Measurement, WindowCallback
from autoloader.measure._memory import MemoryBudgetExceeded, MemoryWatch
from autoloader.measure._supervision import (
    Guard,
    WorkerDeaths,
    stop_workers,
    worker_died,
    worker_exits,
)
from autoloader.measure._timing_loop import TimingLoop

_T = TypeVar("_T")


class Runner(Protocol):
    """Measures one setting at a time: in this process, or each in a process of its own."""

    batch_size: int

    def measure(
        self,
        params: Mapping[str, Any],
        *,
        max_seconds: float,
        on_window: WindowCallback | None = None,
        deadlines: Deadlines | None = None,
        max_batches: int | None = None,
    ) -> Measurement: ...


class TrialRunner:
    """Times the training loop for one DataLoader setting at a time.

    Args:
        dataset (Dataset): the user's dataset.
        step_fn (callable): the user's training step; receives one batch.
        batch_size (int): samples per batch.
        fixed_kwargs (dict, optional): the user's DataLoader options kept in every trial.
        device (torch.device, optional): batches are moved here before ``step_fn``
            and the device is synchronised at the edges of each timing window.
        memory_budget (int): bytes the process tree may use; passing it stops the trial.
        target_relative_error (float, optional): stop measuring once the rate is known
            this well. (default: ``0.05``)
        min_windows (int, optional): timing windows needed before stopping. (default: ``4``)
        min_window_seconds (float, optional): shortest timing window. (default: ``0.1``)
        memory_peers (sequence of int, optional): other processes whose trees count
            in ``memory_budget``: the other ranks of a torchrun job on this node, whose
            workers the watch stops too. (default: ``()``)
    """

    def __init__(
        self,
        dataset: Dataset[Any],
        step_fn: Callable[[Any], object],
        *,
        batch_size: int,
        memory_budget: int,
        fixed_kwargs: Mapping[str, Any] | None = None,
        device: torch.device | None = None,
        target_relative_error: float = 0.05,
        min_windows: int = 4,
        min_window_seconds: float = 0.1,
        memory_peers: Sequence[int] = (),
    ) -> None:
        self.dataset = dataset
        self.step_fn = step_fn
        self.batch_size = batch_size
        self.memory_budget = memory_budget
        self.fixed_kwargs = dict(fixed_kwargs or {})
        self.device = device
        self.target_relative_error = target_relative_error
        self.min_windows = min_windows
        self.min_window_seconds = min_window_seconds
        self.memory_peers = tuple(memory_peers)

    def measure(
        self,
        params: Mapping[str, Any],
        *,
        max_seconds: float,
        on_window: WindowCallback | None = None,
        deadlines: Deadlines | None = None,
        max_batches: int | None = None,
        lockstep: Lockstep | None = None,
    ) -> Measurement:
        """Measure the loop with ``params`` for at most about ``max_seconds``, this
        process's torch threads set to ``params["step_threads"]`` for the trial and put
        back after it (``NOTE [ Step threads ]``).

        Args:
            params: tuned DataLoader settings (see ``SearchSpace``).
            max_seconds: time cap; the trial stops earlier once the rate is stable.
            on_window: called after each timing window with the estimate so far; the
                trial stops there, with that estimate, when it returns True.
            deadlines: how long one batch may take before the trial is failed as hung;
                ``None`` waits as long as it takes. Once a window has set the trial's
                pace, a batch may also take no more than ``NOTE [ Pace deadline ]``
                allows.
            max_batches: stop once this many batches are timed, if set.
            lockstep: how this process keeps in step with the others measuring the
                same setting (every rank of a torchrun job); ``None`` measures alone.

        Raises:
            MemoryBudgetExceeded: the process tree passed the memory budget.
            TrialError: the dataset, collate_fn or step_fn raised or hung
                (``TrialTimeout``), or a worker died.
        """

        def build() -> DataLoader[Any]:
            kwargs = merge_loader_kwargs(
                params, batch_size=self.batch_size, fixed=self.fixed_kwargs
            )
            return build_loader(self.dataset, kwargs)

        with step_threads(params.get("step_threads")):
            return self._measure(
                build,
                params,
                max_seconds,
                on_window,
                deadlines,
                max_batches,
                lockstep or Alone(),
                first_within_trial=True,
            )

    def measure_loader(
        self,
        loader: DataLoader[Any],
        *,
        max_seconds: float,
        deadlines: Deadlines | None = None,
    ) -> Measurement:
        """Measure the loop over a DataLoader built elsewhere (the user's own, for
        :func:`autoloader.diagnose`). Its workers are stopped at the end; the loader
        starts new ones the next time it is iterated.

        Raises:
            The same as :meth:`measure`.
        """
        workers = loader.num_workers
        params = {
            "num_workers": workers,
            "prefetch_factor": loader.prefetch_factor if workers else None,
            "pin_memory": loader.pin_memory,
            "worker_kind": getattr(loader, "worker_kind", "processes"),
        }
        return self._measure(lambda: loader, params, max_seconds, None, deadlines, None, Alone())

    def first_batches(
        self,
        build: Callable[[], DataLoader[Any]],
        count: int,
        *,
        seconds: float,
        times: list[float] | None = None,
    ) -> list[Any]:
        """The first ``count`` batches of the loader ``build`` makes (fewer if it ends
        first), all within ``seconds``, under the same watchdog as a trial: the checks
        made before the search read through it. Its workers are stopped at the end.
        ``times``, if given, gets the seconds from the start to each batch, as they come.

        Raises:
            MemoryBudgetExceeded: the process tree passed the memory budget.
            TrialError: user code raised, a worker died, or ``seconds`` ran out
                (its ``error`` a :class:`TrialTimeout`).
        """

        def read(loader: DataLoader[Any], guard: Guard) -> list[Any]:
            ends = perf_counter() + seconds
            iterator = guard.start()
            batches: list[Any] = []
            while len(batches) < count:
                guard.alarm.arm("loading a batch", max(1e-3, ends - perf_counter()))
                try:
                    batches.append(next(iterator))
                    if times is not None:
                        times.append(perf_counter() - guard.started)
                except StopIteration:
                    break
                except Exception as error:
                    raise TrialError("loading a batch", error, guard.watch.peak) from error
                finally:
                    guard.alarm.disarm()
            return batches

        return self._guarded(build, seconds, read)

    def _measure(
        self,
        build: Callable[[], DataLoader[Any]],
        params: Mapping[str, Any],
        max_seconds: float,
        on_window: WindowCallback | None,
        deadlines: Deadlines | None,
        max_batches: int | None,
        lockstep: Lockstep,
        *,
        first_within_trial: bool = False,
    ) -> Measurement:
        return self._guarded(
            build,
            max_seconds,
            lambda loader, guard: self._time_loop(
                loader,
                guard,
                params,
                deadlines,
                max_seconds,
                on_window,
                max_batches,
                lockstep,
                first_within_trial,
            ),
            joint=lockstep.joint,
        )

    def _guarded(
        self,
        build: Callable[[], DataLoader[Any]],
        max_seconds: float,
        run: Callable[[DataLoader[Any], Guard], _T],
        *,
        joint: bool = False,
    ) -> _T:
        """``run`` over the loader ``build`` makes, under the memory watch, the workers'
        death handler and the alarm; its workers stopped afterwards, killed if it failed."""
        started = perf_counter()
        watch = MemoryWatch(
            self.memory_budget, ends_at=time.monotonic() + max_seconds, others=self.memory_peers
        )
        with (
            WorkerDeaths(watch, defer=joint).handled() as deaths,
            Alarm().installed() as alarm,
            warnings.catch_warnings(),
        ):
            # Trials run more workers than cores on purpose; torch warns against it.
            warnings.filterwarnings("ignore", message="This DataLoader will create")
            guard = Guard(watch=watch, deaths=deaths, alarm=alarm, started=started)
            failed = True
            try:
                # Started behind the trial's handler: a budget passed at once sends
                # SIGCHLD to the main thread, for this handler, not the one found.
                watch.start()
                guard.loader = loader = build()
                outcome = run(loader, guard)
                failed = False
                return outcome
            except MemoryBudgetExceeded:
                raise
            except Exception as error:
                deaths.expected = True  # from here on, a death is part of this failure
                if watch.exceeded:  # a worker the watch killed surfaced as an error
                    raise (watch.claim() or watch.error()) from error
                if not isinstance(error, TrialError) and not worker_died(error):
                    raise
                # DataLoader's report of a dead worker can surface at any bytecode of the
                # loop, not only in next(): it is still the worker's failure.
                failure = (
                    error
                    if isinstance(error, TrialError)
                    else TrialError("loading a batch", error, watch.peak)
                )
                failure.worker_signals, failure.worker_exit_codes = worker_exits(
                    guard.iterator, failure.error
                )
                if failure is error:
                    raise
                raise failure from error
            finally:
                # First: a worker that an interrupt (Ctrl-C reaches the whole process
                # group) killed must not turn the KeyboardInterrupt into a worker's
                # failure while the watch's thread is joined.
                deaths.expected = True
                alarm.disarm()
                watch.stop()
                discard = failed or guard.discard
                if discard:
                    # Discarded anyway, and possibly hung: do not wait for them.
                    guard.kill_workers()
                stop_workers(guard, abandon=discard)

    def _time_loop(
        self,
        loader: DataLoader[Any],
        guard: Guard,
        params: Mapping[str, Any],
        deadlines: Deadlines | None,
        max_seconds: float,
        on_window: WindowCallback | None,
        max_batches: int | None,
        lockstep: Lockstep,
        first_within_trial: bool,
    ) -> Measurement:
        loop = TimingLoop(
            loader,
            guard,
            params,
            step_fn=self.step_fn,
            device=self.device,
            batch_size=self.batch_size,
            max_seconds=max_seconds,
            deadlines=deadlines,
            max_batches=max_batches,
            min_windows=self.min_windows,
            min_window_seconds=self.min_window_seconds,
            target_relative_error=self.target_relative_error,
            on_window=on_window,
            lockstep=lockstep,
            first_within_trial=first_within_trial,
        )
        return loop.run()
