"""Each trial in a fresh process of its own (``isolation="subprocess"``).

Each trial runs in a process of its own, forked from a helper the run spawns once, or
spawned where the platform cannot watch a forked one (``NOTE [ A helper forks the
trials ]`` in ``_trial_processes.py``). That process loads the dataset, step_fn and
loader options from their pickles, measures the one setting with a
:class:`~autoloader.measure._runner.TrialRunner` (its own memory watch and deadlines included)
and sends the outcome back through a pipe. Whatever the trial does to its process
(a crash in native code, the OOM killer, a hang that signals cannot break), the tuning
process sees only a pipe that closes or stays silent, records why, and goes on.

The trial's process leads a process group of its own: its DataLoader workers belong to
it, so the whole trial is killed with one signal even after its leader died, and
Ctrl-C in a terminal reaches only the tuning process, which then ends the trial.
"""

from __future__ import annotations

import contextlib
import dataclasses
import multiprocessing
import os
import pickle
import signal
import time
import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from types import TracebackType
from typing import Any

import psutil

from autoloader._exceptions import IsolationError, UnpicklableError
from autoloader.loader import default_start_method
from autoloader.measure._deadlines import Deadlines, TrialTimeout
from autoloader.measure._errors import TrialError, TrialProcessDied, portable_chain, restore_chain
from autoloader.measure._measurement import Measurement, WindowCallback
from autoloader.measure._memory import MemoryBudgetExceeded
from autoloader.measure._pickling import describe_unpicklable
from autoloader.measure._process_memory import process_memory
from autoloader.measure._runner import TrialRunner
from autoloader.measure._trial_processes import (
    GUARD_ADVICE,
    START_TIMEOUT,
    HelperGone,
    TrialProcess,
    TrialStarter,
    death,
    reaped_elsewhere,
    release,
    trial_starter,
)

# Beyond the trial's own deadlines, how long the tuning process waits for news from a
# trial process before killing it as hung: only a hang the trial's own alarm cannot
# break (native code that blocks signals) gets this far.
_SILENCE_MARGIN = 5.0
# Seconds a trial process gets to stop its workers and exit once its trial is over.
_EXIT_GRACE = 5.0


@dataclass(frozen=True, slots=True)
class _Request:
    params: dict[str, Any]
    max_seconds: float
    deadlines: Deadlines | None
    memory_budget: int
    start_method: str
    max_batches: int | None = None


class SubprocessRunner:
    """Measures each setting in a fresh process of its own, like ``runner`` would here.

    The processes are forked from a helper spawned at the first trial, which
    :meth:`close` (or leaving a ``with`` block) stops (``NOTE [ A helper forks the
    trials ]``).

    Args:
        runner (TrialRunner): the in-process runner whose dataset, step_fn, options
            and memory budget each trial process rebuilds.
        starter (TrialStarter, optional): what starts each trial's process; by
            default a helper that forks them where the platform allows, else a spawner.

    Raises:
        UnpicklableError: the dataset, step_fn or a loader option cannot be pickled.
    """

    def __init__(self, runner: TrialRunner, *, starter: TrialStarter | None = None) -> None:
        self.batch_size = runner.batch_size
        self.memory_budget = runner.memory_budget
        self._settings = {
            "batch_size": runner.batch_size,
            "device": runner.device,
            "target_relative_error": runner.target_relative_error,
            "min_windows": runner.min_windows,
            "min_window_seconds": runner.min_window_seconds,
        }
        parts = {
            "dataset": runner.dataset,
            "step_fn": runner.step_fn,
            "loader_kwargs": runner.fixed_kwargs,
        }
        # Plain pickle, by value: multiprocessing's pickler would move tensors to shared
        # memory and pickle a handle that only one process can take, once.
        self._parts: dict[str, bytes] = {}
        for name, obj in parts.items():
            try:
                self._parts[name] = _by_value(obj)
            except Exception:  # pickling can raise almost anything
                what = describe_unpicklable(obj, name, _by_value)
                raise UnpicklableError(
                    f"{what}, but isolation='subprocess' sends {name} to each trial's "
                    "process. Replace lambdas and local functions with module-level ones, "
                    "open files and connections lazily, or keep the default "
                    "isolation='in-process'."
                ) from None
        self._starter = starter if starter is not None else trial_starter()
        self._close = weakref.finalize(self, self._starter.close)

    def close(self) -> None:
        """Stop the helper that forks the trials' processes, if one was started."""
        self._close()

    def __enter__(self) -> SubprocessRunner:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()

    def measure(
        self,
        params: Mapping[str, Any],
        *,
        max_seconds: float,
        on_window: WindowCallback | None = None,
        deadlines: Deadlines | None = None,
        max_batches: int | None = None,
    ) -> Measurement:
        """Measure ``params`` in a new process; see :meth:`TrialRunner.measure`.

        Raises:
            MemoryBudgetExceeded: the tree (this process and the trial's) passed the
                budget.
            TrialError: user code raised or hung, a worker died, or the trial's process
                died (:class:`TrialProcessDied`) or stopped answering.
            UnpicklableError: the trial's process could not load what it was sent.
            IsolationError: the trial's process died before it could run the trial,
                or the helper that forks them before it was ready.
        """
        started = time.perf_counter()
        # The tree the budget is for: this process, the helper, the trial's.
        own = process_memory(psutil.Process()) + self._starter.ready()
        request = _Request(
            params=dict(params),
            max_seconds=max_seconds,
            deadlines=deadlines,
            max_batches=max_batches,
            memory_budget=max(1, self.memory_budget - own),
            start_method=default_start_method(),
        )
        try:
            outcome = self._run(request, on_window, own)
        except HelperGone as error:
            raise TrialError("running the trial", error, own) from None
        measurement = self._result(outcome, own)
        # The whole trial, as the run's time budget pays for it: starting its process too.
        return dataclasses.replace(measurement, duration=time.perf_counter() - started)

    def _run(
        self, request: _Request, on_window: WindowCallback | None, own: int
    ) -> tuple[Any, ...]:
        """Start the trial's process, hear it out, and end it and its workers."""
        ours, theirs = multiprocessing.Pipe(duplex=True)
        try:
            process = self._starter.start(
                _trial_process, theirs, (self._parts, self._settings, request)
            )
        except BaseException:
            ours.close()
            theirs.close()
            raise
        outcome: tuple[Any, ...] = ("interrupted",)
        try:
            outcome = self._converse(ours, process, request, on_window, own)
        except BaseException:
            # on_window raised (Ctrl-C): the trial's process was told to stop, and
            # shuts its workers down in order.
            outcome = ("stopped",)
            raise
        finally:
            try:
                _end(process, graceful=outcome[0] not in ("interrupted", "silent"))
            except HelperGone:
                if outcome[0] != "stopped":
                    raise
                # Stopping already (Ctrl-C): that exception, under way, goes on.
            finally:
                release(process)
                ours.close()
        return outcome

    def _converse(
        self,
        connection: Connection,
        process: TrialProcess,
        request: _Request,
        on_window: WindowCallback | None,
        own: int,
    ) -> tuple[Any, ...]:
        """Relay the trial's windows to ``on_window`` until its outcome arrives."""
        silence = _silence_limit(request)
        give_up = time.monotonic() + START_TIMEOUT
        started = False
        while True:
            message = _receive(connection, process, give_up)
            if message is None:
                code = process.exitcode
                # Ended before its time was up, and reaped by another where its exit
                # code is missing (a spawned one, where this process ignores SIGCHLD).
                lost = code is None and time.monotonic() < give_up and reaped_elsewhere(process.pid)
                if not started:
                    raise IsolationError(
                        f"A trial's process {death(code, lost=lost)} before it could load "
                        f"the dataset. {GUARD_ADVICE}"
                    )
                if code is not None or lost:
                    return ("died", TrialProcessDied(code))
                return ("silent", TrialTimeout("waiting for the trial's process", silence))
            kind = message[0]
            if kind == "ready":
                started = True
                give_up = time.monotonic() + silence
            elif kind == "window":
                _, step, measurement = message
                try:
                    stop = on_window is not None and on_window(step, _with_memory(measurement, own))
                except BaseException:
                    with contextlib.suppress(OSError):
                        connection.send(True)  # stop
                    raise
                connection.send(bool(stop))
                give_up = time.monotonic() + silence
            else:
                return tuple(message)

    def _result(self, outcome: tuple[Any, ...], own: int) -> Measurement:
        kind = outcome[0]
        if kind == "done":
            return _with_memory(outcome[1], own)
        if kind == "memory":
            error: MemoryBudgetExceeded = outcome[1]
            projected = None if error.projected is None else error.projected + own
            raise MemoryBudgetExceeded(error.peak + own, self.memory_budget, projected)
        if kind == "trial_error":
            trial_error: TrialError = outcome[1]
            trial_error.peak_memory += own
            raise trial_error
        if kind == "unloadable":
            _, name, reason = outcome
            raise UnpicklableError(
                f"{name} was pickled but a trial's process cannot load it ({reason}). "
                "Define its classes and functions in an importable module, not in "
                "__main__ of a notebook or an interactive session."
            )
        if kind == "error":
            raise restore_chain(outcome[1])
        # "died" or "silent": the process itself failed, whatever the trial did.
        raise TrialError("running the trial", outcome[1], own)


def _by_value(obj: object) -> bytes:
    return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)


def _silence_limit(request: _Request) -> float:
    """How long a running trial may stay silent: its whole length plus its deadlines
    (the first step's where longer than a batch's: NOTE [ The first step ])."""
    deadlines = request.deadlines or Deadlines(first=START_TIMEOUT, each=START_TIMEOUT)
    step = max(deadlines.each, deadlines.first_step or 0.0)
    return request.max_seconds + deadlines.first + step + _SILENCE_MARGIN


def _receive(
    connection: Connection, process: TrialProcess, give_up: float
) -> tuple[Any, ...] | None:
    """The next message, or ``None`` if the process died or ``give_up`` passed first."""
    ready = wait([connection, process.sentinel], timeout=max(0.0, give_up - time.monotonic()))
    if connection in ready or (ready and connection.poll()):
        try:
            message: tuple[Any, ...] = connection.recv()
            return message
        except (EOFError, OSError):
            # The pipe closes as the process exits, a moment before its exit shows on
            # its sentinel (a pidfd's shows only once every file is closed).
            process.join(_EXIT_GRACE)
            return None
    if process.sentinel in ready or process.exitcode is not None:
        process.join()
    return None


def _with_memory(measurement: Measurement, own: int) -> Measurement:
    """The measurement with this process's memory added: the tree the budget is for."""
    return dataclasses.replace(measurement, peak_memory=measurement.peak_memory + own)


def _end(process: TrialProcess, *, graceful: bool) -> None:
    """Make sure the trial's process and every worker it started are gone.

    Its group is killed before the process is reaped: until then its pid, and so the
    group id, cannot be reused by an unrelated process.
    """
    try:
        if graceful:
            process.join(_EXIT_GRACE)
    finally:
        if process.pid is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(process.pid, signal.SIGKILL)
    process.join()


def _trial_process(
    connection: Connection,
    parts: Mapping[str, bytes],
    settings: Mapping[str, Any],
    request: _Request,
) -> None:
    """The entry point of a trial's process: load, measure, send the outcome."""
    os.setpgid(0, 0)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the tuning process's to act on
    # A spawned process spawns its own children by default: the trial's workers must
    # start the way they would in the tuning process (fork, on Linux), or start-up
    # is measured at the cost of importing torch in each worker.
    multiprocessing.set_start_method(request.start_method, force=True)
    try:
        loaded: dict[str, Any] = {}
        for name, data in parts.items():
            try:
                loaded[name] = pickle.loads(data)
            except Exception as error:
                connection.send(("unloadable", name, f"{type(error).__name__}: {error}"))
                return
        runner = TrialRunner(
            loaded["dataset"],
            loaded["step_fn"],
            fixed_kwargs=loaded["loader_kwargs"],
            memory_budget=request.memory_budget,
            **settings,
        )
        connection.send(("ready",))

        def on_window(step: int, measurement: Measurement) -> bool:
            connection.send(("window", step, measurement))
            return bool(connection.recv())

        try:
            measurement = runner.measure(
                request.params,
                max_seconds=request.max_seconds,
                on_window=on_window,
                deadlines=request.deadlines,
                max_batches=request.max_batches,
            )
        except MemoryBudgetExceeded as error:
            connection.send(("memory", error))
        except TrialError as error:
            connection.send(("trial_error", error))
        except Exception as error:
            connection.send(("error", portable_chain(error)))
        else:
            connection.send(("done", measurement))
    finally:
        connection.close()
