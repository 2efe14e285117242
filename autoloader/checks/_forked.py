"""A check run in a forked process: one that blocks forever is abandoned at its deadline
(the process killed), and nothing of it is left behind in this process.

NOTE [ Checks that can be abandoned ]
A check that runs the user's code in threads of this process (the threads check) cannot
be stopped when that code blocks forever: a thread cannot be killed, nor interrupted by
the trial's alarm, which reaches the main thread only. Its threads would stay blocked
for the rest of the process. Run in a forked process instead, the check is a copy of
this process's state, with the same dataset object in the same memory, read by its own
threads, and the parent waits for it no longer than its time: then it kills it. Where
this platform cannot fork, the check runs here, and a thread that does not return is
left as a daemon (see ``ThreadLoader``).
"""

from __future__ import annotations

import multiprocessing
import signal
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any, TypeVar

import torch

from autoloader.measure import TrialTimeout, describe_error

_T = TypeVar("_T")


class ForkedCheckFailed(Exception):
    """A check in a forked process could not say: its message says why (the exception
    the check raised, or how its process ended)."""


def can_fork() -> bool:
    """Whether this platform starts processes by fork."""
    try:
        multiprocessing.get_context("fork")
    except ValueError:
        return False
    return True


def run_forked(
    target: Callable[..., _T], args: tuple[Any, ...], *, seconds: float, stage: str, name: str
) -> _T:
    """``target(*args)`` in a process forked from this one, which is killed once
    ``seconds`` have passed (see ``NOTE [ Checks that can be abandoned ]``).

    Args:
        target: the check; what it returns must pickle.
        args: its arguments, shared with the fork (never pickled).
        seconds: the time it has, forking included.
        stage: what it does, for the :class:`TrialTimeout`.
        name: the process's name.

    Raises:
        TrialTimeout: it did not answer within ``seconds``.
        ForkedCheckFailed: it raised, or its process died.
    """
    context = multiprocessing.get_context("fork")
    receiver, sender = context.Pipe(duplex=False)
    process = context.Process(target=_child, args=(target, args, sender), name=name)
    ends = time.monotonic() + seconds
    process.start()
    sender.close()
    try:
        if not receiver.poll(max(0.0, ends - time.monotonic())):
            raise TrialTimeout(stage, seconds)
        ok, outcome = receiver.recv()
    except EOFError:
        raise ForkedCheckFailed(f"its process {_ending(process)}") from None
    finally:
        receiver.close()
        if process.is_alive():
            process.kill()
        process.join()
        process.close()  # its sentinel is a file descriptor too
    if not ok:
        raise ForkedCheckFailed(outcome)
    result: _T = outcome
    return result


def _child(target: Callable[..., Any], args: tuple[Any, ...], out: Connection) -> None:
    """In the forked process: the check's outcome, or what it raised, sent back."""
    # NOTE [ Forked processes ]: as a DataLoader worker does, before reading anything.
    torch.set_num_threads(1)
    try:
        out.send((True, target(*args)))
    except Exception as error:
        out.send((False, describe_error(error)[0]))
    finally:
        out.close()


def _ending(process: multiprocessing.process.BaseProcess) -> str:
    """How a forked check that stopped answering ended."""
    process.join(1.0)
    code = process.exitcode
    if code is None:
        return "closed its pipe"
    return f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"
