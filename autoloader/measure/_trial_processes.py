"""How each trial's process starts under ``isolation="subprocess"``: forked from a helper
spawned once a run, or spawned afresh where a helper cannot be watched.

NOTE [ A helper forks the trials ]
A spawned process pays for importing torch before it can load a dataset: 2-2.5 s of a
CPU on the development machine, each trial. So the runner spawns one helper for the
run (``ForkingHelper``): it imports torch and autoloader, and the script's main module
as spawn does, then forks each trial's process on request (tens of milliseconds). The
trial's process then does what a spawned one would: loads the dataset, step_fn and
loader options from their pickles, measures, and talks to the tuning process through a
pipe of its own. What isolation promises stays:

- the helper runs no user code: it is single-threaded (Python's threads; torch's
  import leaves one native thread, as in any process that forks DataLoader workers)
  and unpickles nothing of the user's, whose parts reach it as bytes;
- each trial starts from the helper's state, not the last trial's;
- the tuning process's end of the trial's pipe is made here and the trial's end passed
  to the helper with ``SCM_RIGHTS`` (``socket.send_fds``), so the trial's messages go
  straight to the tuning process;
- the trial's process is not the tuning process's child: it is watched through a pidfd
  (``os.pidfd_open``: readable once the process has exited, Linux 5.3 on) and its
  process group is made by the helper (``setpgid`` in both, as a shell does), before
  its pid is known here, so the group the tuning process kills is there;
- the helper reaps a trial only when asked, after the tuning process saw it exit or
  killed its group, and gives back its exit code (its SIGCHLD is the default whatever
  the tuning process's: an ignored one would have the kernel reap the trials);
- the helper ignores Ctrl-C and SIGTERM (in the run's process group, it gets what a
  terminal or a process manager sends the group: the tuning process acts on them, and
  stops the trial under way in order), and ends when its pipe closes, at the run's end
  or when the tuning process dies, killing the groups of any trials it still holds.

Where ``os.pidfd_open`` is missing or refused (macOS, older kernels), each trial's
process is spawned (``Spawner``), as before.
"""

from __future__ import annotations

import contextlib
import importlib
import multiprocessing
import os
import signal
import socket
import sys
import time
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection, wait
from typing import Any, Protocol

import psutil

from autoloader._exceptions import IsolationError
from autoloader.measure._errors import TrialProcessDied
from autoloader.measure._process_memory import process_memory

# Seconds a helper may take to import torch (about 2.5 s on a 2-core machine) and a
# spawned trial's process to start.
START_TIMEOUT = 120.0
# Seconds the helper gets to answer a request to fork or reap: forking takes tens of
# milliseconds, and reaping waits for a process whose group was killed.
_REPLY_TIMEOUT = 60.0
# Seconds the helper gets to end its trials and exit once its pipe closes.
_EXIT_GRACE = 5.0
_GONE_WITHIN = 1.0  # an exiting process's pid, gone once it is reaped
# What the helper imports before it forks a trial: everything a trial's process runs.
_PRELOAD = ("autoloader.measure._isolation",)

GUARD_ADVICE = (
    "Under isolation='subprocess' the script that calls tune() must guard it with "
    "`if __name__ == '__main__':`, and every class and function it sends must be "
    "importable from a module; see the process's own output above."
)


class HelperGone(IsolationError):
    """The helper that forks the trials' processes died or stopped answering while a
    trial was under way: that trial's outcome is lost, not the run's."""


class TrialProcess(Protocol):
    """A trial's process, as ``multiprocessing.Process`` shows one: its pid, a handle
    that is ready once it has exited, and its exit code once it has been reaped."""

    @property
    def pid(self) -> int | None: ...

    @property
    def sentinel(self) -> int: ...

    @property
    def exitcode(self) -> int | None: ...

    def join(self, timeout: float | None = None) -> None: ...

    def close(self) -> None: ...


class TrialStarter(Protocol):
    """Starts trials' processes for one runner, one at a time."""

    def ready(self) -> int:
        """Make ready what trials start from; its memory (PSS, bytes), part of the tree
        the memory budget is for."""
        ...

    def start(
        self, target: Callable[..., None], theirs: Connection, args: Sequence[Any]
    ) -> TrialProcess:
        """A process running ``target(theirs, *args)``; ``theirs`` is closed here."""
        ...

    def close(self) -> None:
        """Stop what :meth:`ready` started, and wait for it."""
        ...


def trial_starter() -> TrialStarter:
    """A helper that forks each trial where its trials can be watched (pidfds), else a
    spawner (``NOTE [ A helper forks the trials ]``)."""
    return ForkingHelper() if pidfds_work() else Spawner()


def pidfds_work() -> bool:
    """Whether this platform hands out pidfds (Linux 5.3 on, Python 3.9 on)."""
    if not hasattr(os, "pidfd_open"):
        return False
    try:
        os.close(os.pidfd_open(os.getpid()))
    except OSError:  # ENOSYS on an older kernel, EPERM under some sandboxes
        return False
    return True


class Spawner:
    """Spawns a fresh process for each trial."""

    def __init__(self) -> None:
        self._context = multiprocessing.get_context("spawn")

    def ready(self) -> int:
        return 0

    def start(
        self, target: Callable[..., None], theirs: Connection, args: Sequence[Any]
    ) -> TrialProcess:
        process = self._context.Process(
            target=target, args=(theirs, *args), name="autoloader-trial"
        )
        process.start()
        theirs.close()
        return process

    def close(self) -> None:
        pass


class ForkingHelper:
    """One spawned process a run that forks each trial's process
    (``NOTE [ A helper forks the trials ]``). Started by :meth:`ready`, stopped by
    :meth:`close`; a helper that died between trials is started again."""

    def __init__(self) -> None:
        self._context = multiprocessing.get_context("spawn")
        self._process: multiprocessing.process.BaseProcess | None = None
        self._connection: Connection | None = None

    @property
    def pid(self) -> int | None:
        """The helper's pid while it runs."""
        return self._process.pid if self._process is not None else None

    def ready(self) -> int:
        if self._process is not None and not self._process.is_alive():
            self.close()  # died between trials (the OOM killer): start another
        if self._process is None:
            self._spawn()
        assert self._process is not None and self._process.pid is not None
        try:
            return process_memory(psutil.Process(self._process.pid))
        except psutil.Error:
            return 0

    def _spawn(self) -> None:
        ours, theirs = self._context.Pipe(duplex=True)
        process = self._context.Process(
            target=serve, args=(theirs, _PRELOAD), name="autoloader-trial-helper"
        )
        process.start()
        theirs.close()
        self._process, self._connection = process, ours
        ready = wait([ours, process.sentinel], timeout=START_TIMEOUT)
        if ours in ready:
            with contextlib.suppress(EOFError, OSError):
                if ours.recv() == ("ready",):
                    return
        how = self._lost(process, ending=bool(ready))
        raise IsolationError(
            f"The process that starts each trial's process {how} before it was ready. "
            + GUARD_ADVICE
        )

    def start(
        self, target: Callable[..., None], theirs: Connection, args: Sequence[Any]
    ) -> TrialProcess:
        pid = self._ask(("fork", target, tuple(args)), handing=theirs)
        theirs.close()
        return ForkedTrial(self, pid)

    def reap(self, pid: int) -> int:
        """Reap the trial ``pid``, which has exited or whose group was killed; its exit
        code as ``multiprocessing`` gives it (minus the signal that killed it)."""
        code: int = self._ask(("reap", pid))
        return code

    def _ask(self, request: tuple[Any, ...], handing: Connection | None = None) -> Any:
        process, connection = self._process, self._connection
        if process is None or connection is None:
            raise HelperGone(
                "The process that starts each trial's process had already stopped when "
                f"asked to {request[0]} a trial's process."
            )
        closed = False
        try:
            connection.send(request)
            if handing is not None:
                with socket.socket(fileno=os.dup(connection.fileno())) as carrier:
                    socket.send_fds(carrier, [b"\0"], [handing.fileno()])
            if connection.poll(_REPLY_TIMEOUT):
                return connection.recv()
        except (EOFError, OSError):
            closed = True
        except BaseException:
            self.close()  # Ctrl-C mid-request: a reply left unread would answer the next
            raise
        how = self._lost(process, ending=closed)  # the next trial starts another
        raise HelperGone(
            f"The process that starts each trial's process {how} while asked to "
            f"{request[0]} a trial's process (the OOM killer, or autoloader's bug)."
        )

    def _lost(self, process: multiprocessing.process.BaseProcess, *, ending: bool) -> str:
        """How a helper that stopped answering ended (:func:`death`), once stopped:
        waited for where its pipe closed (``ending``: the pipe closes a moment before
        it ends)."""
        process.join(_EXIT_GRACE if ending else 0)
        code = process.exitcode
        lost = ending and code is None and reaped_elsewhere(process.pid)
        self.close()
        return death(code, lost=lost)

    def close(self) -> None:
        process, connection = self._process, self._connection
        self._process = self._connection = None
        if connection is not None:
            connection.close()  # the helper ends its trials and exits
        if process is not None:
            process.join(_EXIT_GRACE)
            # Its sentinel says it ended where its exit code is lost (SIGCHLD ignored
            # here): its pid may be another process's by now, not to be killed.
            if process.exitcode is None and not wait([process.sentinel], 0):
                process.kill()
                process.join()
            release(process)


class ForkedTrial:
    """A trial's process forked by a :class:`ForkingHelper`: watched by a pidfd,
    reaped by the helper."""

    def __init__(self, helper: ForkingHelper, pid: int) -> None:
        self._helper = helper
        self._pid = pid
        self._exitcode: int | None = None
        # Its parent, the helper, reaps it only when asked: until then it is there.
        self._pidfd: int | None = os.pidfd_open(pid)

    @property
    def pid(self) -> int | None:
        return self._pid

    @property
    def sentinel(self) -> int:
        if self._pidfd is None:
            raise ValueError("the trial's process handle is closed")
        return self._pidfd

    @property
    def exitcode(self) -> int | None:
        return self._exitcode

    def join(self, timeout: float | None = None) -> None:
        """Wait up to ``timeout`` seconds for the process to exit, and reap it if it did.

        Raises:
            HelperGone: the helper died, and with it the exit code.
        """
        if self._exitcode is None and wait([self.sentinel], timeout):
            self._exitcode = self._helper.reap(self._pid)

    def close(self) -> None:
        if self._pidfd is not None:
            os.close(self._pidfd)
            self._pidfd = None


def release(process: TrialProcess | multiprocessing.process.BaseProcess) -> None:
    """Close ``process``'s handles once it has ended. Where this process ignores
    SIGCHLD the kernel reaps its children, their exit codes are lost, and
    ``multiprocessing`` takes one that ended for one still running: nothing to close."""
    with contextlib.suppress(ValueError):
        process.close()


def death(code: int | None, *, lost: bool = False) -> str:
    """How a process with exit code ``code`` ended, to follow "the process ...":
    "was killed by SIGKILL", "exited with code 1", "ended, its exit code lost: ..."
    where it ended and another reaped it (``lost``, :func:`reaped_elsewhere`);
    "stopped answering" if it runs on."""
    if code is None and not lost:
        return "stopped answering"
    return str(TrialProcessDied(code)).removeprefix("the trial's process ")


def reaped_elsewhere(pid: int | None, within: float = _GONE_WITHIN) -> bool:
    """Whether the process ``pid``, a child of this one whose exit code
    ``multiprocessing`` does not have, has ended all the same: another reaped it (the
    kernel, where this process ignores SIGCHLD; a handler that waits for any child),
    and its pid is gone. Asked once its pipe closed: a process that is exiting keeps
    its pid a moment after it closed its files, so the pid is looked for ``within``
    seconds."""
    if pid is None:
        return False
    give_up = time.monotonic() + within
    while True:
        try:
            os.kill(pid, 0)
        except (ProcessLookupError, PermissionError):  # gone, or another user's by now
            return True
        if time.monotonic() >= give_up:
            return False
        time.sleep(0.01)


# The helper's side.


def serve(connection: Connection, preload: Sequence[str]) -> None:
    """The helper's entry point: import ``preload``, then fork each trial asked for and
    reap each when asked, until ``connection`` closes."""
    # Ctrl-C, and a SIGTERM to the run's process group, are the tuning process's to act
    # on: it stops the trial under way and then closes the pipe, which ends the helper.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    # The helper reaps its trials for their exit codes: an ignored SIGCHLD, inherited
    # through exec from a tuning process that ignores it, would have the kernel reap them.
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    for name in preload:
        importlib.import_module(name)
    context = multiprocessing.get_context("fork")
    trials: dict[int, multiprocessing.process.BaseProcess] = {}
    connection.send(("ready",))
    try:
        while True:
            try:
                request = connection.recv()
            except EOFError:
                return  # the run ended, or the tuning process died
            if request[0] == "fork":
                _, target, args = request
                with socket.socket(fileno=os.dup(connection.fileno())) as carrier:
                    _, fds, _, _ = socket.recv_fds(carrier, 1, 1)
                trial = context.Process(
                    target=_forked, args=(connection, target, fds[0], args), name="autoloader-trial"
                )
                trial.start()
                os.close(fds[0])
                assert trial.pid is not None
                with contextlib.suppress(OSError):  # it may have made its group, or exited
                    os.setpgid(trial.pid, trial.pid)
                trials[trial.pid] = trial
                connection.send(trial.pid)
            elif request[0] == "reap":
                ended = trials.pop(request[1])
                ended.join()
                connection.send(ended.exitcode)
    finally:
        for pid, left in trials.items():
            with contextlib.suppress(OSError):
                os.killpg(pid, signal.SIGKILL)
            left.join()
        # Nothing to clean up: skip the interpreter's teardown of torch (half a second).
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def _forked(helper: Connection, target: Callable[..., None], fd: int, args: Sequence[Any]) -> None:
    """A trial's process, forked: its own group first, then ``target`` as a spawned
    process would run it."""
    os.setpgid(0, 0)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # as a spawned process has it
    helper.close()  # the helper's pipe is the helper's
    target(Connection(fd), *args)
