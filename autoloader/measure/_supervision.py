"""Watching over a trial's worker processes: their deaths, their shutdown, their reaping."""

from __future__ import annotations

import contextlib
import logging
import re
import signal
import threading
import time
import weakref
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass
from multiprocessing.process import BaseProcess
from types import FrameType
from typing import Any

from torch.utils.data import DataLoader

from autoloader.loader import handing_out
from autoloader.loader._torch_compat import (
    loader_iterator,
    raise_if_any_worker_failed,
    shutdown_workers,
    sigchld_handler_held,
    stop_half_built_iterator,
    worker_processes,
)
from autoloader.measure._deadlines import Alarm, TrialTimeout
from autoloader.measure._errors import exception_chain
from autoloader.measure._memory import MemoryWatch, kill

_logger = logging.getLogger(__name__)


# Seconds to wait for the trial's workers to exit before killing them.
_REAP_TIMEOUT = 5.0
# Seconds the shutdown of a trial's loader may take before its workers are killed.
_STOP_TIMEOUT = 60.0


class WorkerDeaths:
    """Decides what the death of a trial's worker means while the trial runs.

    DataLoader's SIGCHLD handler raises "worker killed by signal" in the main thread,
    once per death, wherever the main thread is, even in the middle of handling the
    first such error. Blocking the signal does not help: the kernel hands it to another
    thread, and Python runs the handler in the main thread all the same. So during a
    trial this handler stands in front of DataLoader's:

    - the trial is being torn down, or fails already (``expected``): its workers are
      being killed on purpose, or their deaths are part of that failure, ignore;
    - the memory watch killed the workers: raise MemoryBudgetExceeded once, which wakes
      a main thread blocked in next(), and ignore the other deaths;
    - otherwise a worker really died: DataLoader's handler reports it, once; the
      deaths that follow are part of the same failure.
    - in a joint trial (``defer``), a death while the main thread is not fetching is
      held back until the next fetch begins (:meth:`fetching`): raised in a step, it
      could cut short a step whose collectives are half done (``NOTE [ Joint trials ]``).

    This handler does the work of DataLoader's handler, which is kept from installing
    itself meanwhile (``NOTE [ Handlers put back ]``).
    """

    # NOTE [ Handlers put back ]
    # autoloader is a guest in the user's process: the SIGCHLD handler it finds is the one
    # it puts back, the same object, and DataLoader's flag that says its own handler is
    # installed is put back too, so that the user's next DataLoader with workers
    # installs it as it would have (one that starts workers during a trial finds it as
    # if installed, and this handler does its work meanwhile). Two AutoLoaders can tune
    # at once (a training and a validation loader), their trials not nested: a handler
    # that ends while another stands in front of it stays in the chain, passing every
    # signal to the handler it found, and the handler in front puts back, when it ends,
    # the first handler in the chain that has not ended. A handler that ends outside
    # the main thread (a finalizer run by the garbage collector there) cannot be
    # replaced: it passes every signal on likewise, and the next trial's handler, or the
    # one in front, skips it.

    # NOTE [ Nothing left registered ]
    # DataLoader registers each iterator's workers with its SIGCHLD handler and removes
    # them at the end of the iterator's shutdown; a worker that died while still
    # registered makes that handler, the next time any child of the process exits, raise
    # "DataLoader worker (pid ...) is killed by signal" wherever the main thread is.
    # So every iterator a trial starts is shut down by the trial, and nothing this handler
    # raises may skip that: tune() raised that error between two trials in 3 of 10 full
    # runs of the suite, CI's among them (there, a memory test's trial had left its
    # workers registered). The cause, read from those failures and shown with its timing
    # forced (tests/test_faults.py): a trial that failed with an error of its own (a
    # worker's pipe that broke as the watch killed it, raised before the signal was
    # handled) while the watch had passed the budget; the overrun was still to be
    # raised, and the death signals that followed raised it in the clean-up, in the
    # middle of the watch's join or the loader's shutdown. Once a trial fails or ends
    # (``expected``), this handler raises nothing; the runner raises the overrun itself
    # (``MemoryWatch.claim``). And a new iterator is named to the trial (``start``'s
    # ``named``) before a death can be raised in the main thread: raised in between, the
    # trial would not know to shut it down.

    def __init__(self, watch: MemoryWatch, *, defer: bool = False) -> None:
        self.watch = watch
        self.defer = defer
        self._fetching = False
        self.expected = False
        self._deferring = False
        self._deferred = False
        self._previous: Any = None
        self._ended = False

    def start(
        self, loader: DataLoader[Any], named: Callable[[Iterator[Any]], object] = lambda _: None
    ) -> Iterator[Any]:
        """``iter(loader)``, with a worker's death reported after it, not in the middle.

        Starting an iterator puts work on the workers' queues; an error raised there by
        the handler can leave a queue's lock held, and the next put then waits forever.
        So a death while the iterator starts is held back and reported once ``iter()``
        has returned, by DataLoader's own check, which raises its usual error. The new
        iterator is handed to ``named`` before that: an error raised from here on
        finds it where the trial's clean-up looks (``NOTE [ Nothing left registered ]``).
        """
        self._deferring, self._deferred = True, False
        try:
            iterator = iter(loader)
            named(iterator)
        except BaseException as error:
            # Ctrl-C: its workers are stopped now, not by a noisy __del__ (NOTE [ A
            # half-built iterator ]); what raised goes on as it was.
            if not isinstance(error, Exception):
                with contextlib.suppress(Exception):
                    stop_half_built_iterator(error)
            raise
        finally:
            self._deferring = False
        if self._deferred:
            # The signal may be another child's (the user's, a last trial's worker):
            # the trial's workers are stopped only where one of them died.
            self._deferred = False
            try:
                raise_if_any_worker_failed()
            except BaseException:
                self.expected = True  # the trial fails with this error; later deaths follow
                # Killed first: an abandoned shutdown waits 5 s for each live worker
                # (DataLoader's join timeout), which is never told to stop.
                kill(_unreaped_pids(worker_processes(iterator)))
                shutdown_workers(iterator, loader, abandon=True)
                raise
        return iterator

    @contextlib.contextmanager
    def handled(self) -> Iterator[WorkerDeaths]:
        if threading.current_thread() is not threading.main_thread():
            yield self  # signal handlers can only be set, and only run, in the main thread
            return
        self._previous = _unended(signal.getsignal(signal.SIGCHLD))
        with sigchld_handler_held():
            signal.signal(signal.SIGCHLD, self._handle)
            try:
                yield self
            finally:
                self.end()

    def end(self) -> None:
        """Put back the handler found (``NOTE [ Handlers put back ]``); from here on this
        handler passes every signal to it. Safe to call more than once, from any thread."""
        self._ended = True
        if threading.current_thread() is not threading.main_thread():
            return
        if signal.getsignal(signal.SIGCHLD) == self._handle:
            signal.signal(signal.SIGCHLD, _unended(self._previous))

    @contextlib.contextmanager
    def fetching(self) -> Iterator[None]:
        """A fetch is under way: a death held back outside one (``defer``) is reported
        as it starts, and a death during it at once."""
        self._fetching = True
        try:
            if self._deferred and not self._deferring:
                self._deferred = False
                self.watch.check()
                raise_if_any_worker_failed()
            yield
        finally:
            self._fetching = False

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self._ended:
            if callable(self._previous):
                self._previous(signum, frame)
            return
        if self._deferring or handing_out() or (self.defer and not self._fetching):
            self._deferred = True  # handing out: NOTE [ A batch handed out whole ]
            return
        if self.expected:  # NOTE [ Nothing left registered ]
            return
        if self.watch.exceeded:
            error = self.watch.claim()
            if error is not None:
                raise error
            return
        try:
            raise_if_any_worker_failed()  # DataLoader's handler's work
            if callable(self._previous):
                self._previous(signum, frame)
        except BaseException:
            self.expected = True  # the trial fails with this error; later deaths follow
            raise


def _unended(handler: Any) -> Any:
    """``handler``, or where it is a trial's that has ended, the first handler down its
    chain that has not (``NOTE [ Handlers put back ]``)."""
    while True:
        owner = getattr(handler, "__self__", None)
        if not isinstance(owner, WorkerDeaths) or not owner._ended:
            return handler
        handler = owner._previous


@dataclass(slots=True, weakref_slot=True)
class Guard:
    """What watches over one run of a loader, and what to clean up after it: the
    loader and its current iterator (a new one each epoch)."""

    watch: MemoryWatch
    deaths: WorkerDeaths
    alarm: Alarm
    started: float
    loader: DataLoader[Any] | None = None
    iterator: Iterator[Any] | None = None
    # Its workers are of no more use and may still be starting: killed, not shut down
    # (a worker still in worker_init_fn, or importing torch, holds up a shutdown).
    discard: bool = False

    def __post_init__(self) -> None:
        self.watch.workers = self.weak_worker_pids()

    def weak_worker_pids(self) -> Callable[[], Collection[int]]:
        """:meth:`worker_pids`, read through a weak reference to this guard: it holds the
        trial's iterator, whose workers' pipes and shared memory are freed as soon as the
        trial lets go of it, not at the next collection; after that, no pids."""
        pids = weakref.WeakMethod(self.worker_pids)
        return lambda: (pids() or tuple)()

    def start(self) -> Iterator[Any]:
        """``iter()`` of the trial's loader, named as its iterator before a worker's death
        can be reported (:meth:`WorkerDeaths.start`)."""
        assert self.loader is not None
        return self.deaths.start(self.loader, named=self._name)

    def _name(self, iterator: Iterator[Any]) -> None:
        self.iterator = iterator

    def workers(self) -> list[BaseProcess]:
        """The worker processes the trial's loader started: its iterator's and, for a
        persistent loader, the one it keeps (``NOTE [ Only the trial's own processes ]``)."""
        found: list[BaseProcess] = []
        for iterator in (self.iterator, loader_iterator(self.loader)):
            found += [w for w in worker_processes(iterator) if w not in found]
        return found

    def worker_pids(self) -> list[int]:
        """The pids of :meth:`workers` not reaped yet: a pid that can still be signalled
        without reaching another process. From any thread: nothing is waited for."""
        return _unreaped_pids(self.workers())

    def kill_workers(self) -> None:
        """SIGKILL the trial's workers that are still there, and what they started."""
        kill(self.worker_pids())


def _unreaped_pids(workers: list[BaseProcess]) -> list[int]:
    """The pids of ``workers`` that can still be signalled without reaching another
    process (:func:`_unreaped`)."""
    return [w.pid for w in workers if w.pid is not None and _unreaped(w)]


def _unreaped(worker: BaseProcess) -> bool:
    """Whether multiprocessing has not yet reaped ``worker``, read without reaping it
    (``Popen.returncode``, set when it is): polling from the watch's thread would race
    the main thread's own wait for the worker."""
    popen = getattr(worker, "_popen", None)
    return popen is not None and getattr(popen, "returncode", 0) is None


# Errors that mean the other end of a worker's pipe or socket went away.
_PEER_GONE = (ConnectionError, EOFError)
_WORKER_DIED = ("exited unexpectedly", "is killed by signal")
# How long a worker that is dying gets to finish, so its exit status can be read.
_DEATH_GRACE = 1.0


def worker_died(error: BaseException) -> bool:
    """Whether ``error`` (or what caused it) says a worker died or its pipe went away."""
    return any(
        isinstance(link, _PEER_GONE) or any(text in str(link) for text in _WORKER_DIED)
        for link in exception_chain(error)
    )


def worker_exits(iterator: object, error: BaseException) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Signals that killed the iterator's workers, and their non-zero exit codes.

    A worker that dies while handing over a batch can make the main process fail
    first (a connection reset, an EOF) while the worker is still dying; for such errors
    the workers get a moment to finish, or the signal would be missed.
    """
    workers = worker_processes(iterator)
    if workers and worker_died(error):
        give_up = time.monotonic() + _DEATH_GRACE
        while time.monotonic() < give_up and all(w.exitcode is None for w in workers):
            time.sleep(0.02)
    signals, codes = [], []
    for worker in workers:
        code = worker.exitcode
        if code is not None and code < 0:
            signals.append(-code)
        elif code:
            codes.append(code)
    if not signals and not codes:
        # The worker was already reaped elsewhere (rarely seen in the test suite): torch's
        # own message still names the exit code.
        found = _TORCH_EXIT_CODE.search(str(error))
        if found:
            code = int(found["code"])
            (signals if code < 0 else codes).append(abs(code))
    return tuple(signals), tuple(codes)


# DataLoader's message for a worker that exited: "DataLoader worker (pid 32512) exited
# unexpectedly with exit code 3. Details are lost due to multiprocessing. ..."
_TORCH_EXIT_CODE = re.compile(r"exited unexpectedly with exit code (?P<code>-?\d+)")


def stop_workers(guard: Guard, *, abandon: bool) -> None:
    """Shut the trial's loader down, under a deadline like every other wait.

    A shutdown that overruns it (a lock a dead worker left held, in a way not foreseen
    in :func:`shutdown_workers`, or workers slow to exit) has its workers killed. It changes
    nothing about the trial: a measurement taken to the end is kept, and a trial that
    failed keeps its own error (a memory overrun is not turned into a timeout).
    """
    guard.alarm.arm("stopping the trial's workers", _STOP_TIMEOUT)
    try:
        shutdown_workers(guard.iterator, guard.loader, abandon=abandon)
    except TrialTimeout:
        _logger.warning(
            "the trial's workers did not stop within %.0f s; they were killed", _STOP_TIMEOUT
        )
        guard.kill_workers()
    finally:
        guard.alarm.disarm()
        reap(guard)


def reap(guard: Guard) -> None:
    """Wait for the trial's workers to exit, killing those that do not; nothing else
    is waited for (``NOTE [ Only the trial's own processes ]``)."""
    workers = worker_processes(guard.iterator)
    give_up = time.monotonic() + _REAP_TIMEOUT
    for worker in workers:
        worker.join(max(0.0, give_up - time.monotonic()))
    alive = [w for w in workers if w.exitcode is None]
    if alive:
        kill(w.pid for w in alive if w.pid is not None)
        for worker in alive:
            worker.join(_REAP_TIMEOUT)


# NOTE [ Kept workers stopped ]
# A persistent loader's workers kept after its trial (the last trial's, the chosen
# setting's) are stopped outside any trial, where DataLoader's own SIGCHLD handler
# stands: each worker that exits as told sends a signal, and that handler raises
# "DataLoader worker (pid ...) is killed by signal" in the main thread, wherever it is,
# for any worker of the loader that died before (one the memory watch of a later trial
# killed while the loader was kept; its pid stays registered until the loader's
# shutdown). The training loop got that error from an AutoLoader starting its next
# trial, once in a full run beside a busy loop. (tune() met the same error between two
# trials, where no loader is kept: another cause, NOTE [ Nothing left registered ].) So
# the deaths during the stop are autoloader's own doing, not reported: DataLoader's
# handler is kept from installing itself, SIGCHLD's default action (nothing) stands in
# front of it, and the loader's shutdown, which removes its workers' pids, runs to its
# end.
# A handler of the user's that DataLoader's chains to misses the signals of that
# shutdown (milliseconds; a worker that dies is told by the loader's own check, not by
# the signal): passed on, they would reach DataLoader's check first, which raises.
def release(loader: DataLoader[Any]) -> None:
    """Stop a persistent loader's workers, kept after its last trial (``NOTE [ Kept
    workers stopped ]``)."""
    if threading.current_thread() is not threading.main_thread():
        shutdown_workers(None, loader)  # no handler can be set here
        return
    found = signal.getsignal(signal.SIGCHLD)
    with sigchld_handler_held():
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        try:
            workers = worker_processes(loader_iterator(loader))
            # One died: the shutdown touches nothing it may have left locked, and tells
            # the others nothing, so they are killed (each would be waited for 5 s).
            dead = any(w.exitcode is not None for w in workers)  # reaps the dead
            if dead:
                kill(_unreaped_pids(workers))
            shutdown_workers(None, loader, abandon=dead)
        finally:
            signal.signal(signal.SIGCHLD, found)
