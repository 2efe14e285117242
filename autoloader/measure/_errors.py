"""What went wrong in a trial, as exceptions that survive being sent between processes."""

from __future__ import annotations

import itertools
import os
import pickle
import re
import signal
import sys
import sysconfig
import threading
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from types import TracebackType
from typing import Any

import torch

from autoloader.measure._deadlines import TrialTimeout


class TrialError(Exception):
    """User code raised during a trial.

    Attributes:
        stage: what the loop was doing: "loading a batch" or "running step_fn".
        error: the exception user code raised (re-raised by DataLoader for workers).
        summary: one line, ``"ValueError: corrupt record 3"``, with the worker's
            traceback that DataLoader folds into the message left out.
        where: ``"file:line in function"`` where it was raised, or ``""``.
        peak_memory: bytes, the tree's peak before the error.
        worker_signals: signals that killed the trial's workers, if any.
        worker_exit_codes: non-zero exit codes of the trial's workers, if any.
        rank: under torchrun, the rank it happened on (set by the rank that gathered it).
    """

    def __init__(self, stage: str, error: BaseException, peak_memory: int) -> None:
        self.stage = stage
        self.error = error
        self.summary, self.where = describe_error(error)
        self.peak_memory = peak_memory
        self.worker_signals: tuple[int, ...] = ()
        self.worker_exit_codes: tuple[int, ...] = ()
        self.rank: int | None = None
        # A timeout already says what it was doing (TrialTimeout: "... while loading a batch").
        said = isinstance(error, TrialTimeout) and error.stage == stage
        super().__init__(self.summary if said else f"{self.summary} while {stage}")

    def __reduce__(self) -> tuple[Callable[..., TrialError], tuple[Any, ...]]:
        # Sent from a trial's own process (isolation="subprocess"): pickling keeps
        # neither tracebacks nor causes, so the summary and the chain of causes, which
        # the fault classifier reads, are sent as they are.
        return _restore_trial_error, (
            self.stage,
            portable_chain(self.error),
            self.peak_memory,
            self.summary,
            self.where,
            self.worker_signals,
            self.worker_exit_codes,
        )


class RemoteError(Exception):
    """Stands for an exception from a trial's process that could not be sent as itself."""


def portable_chain(error: BaseException) -> list[BaseException]:
    """``error`` and its causes, each as itself if it survives pickling, else a stand-in."""
    links: list[BaseException] = []
    for link in exception_chain(error):
        try:
            links.append(pickle.loads(pickle.dumps(link)))
        except Exception:  # an exception whose __init__ does not take its own args
            links.append(RemoteError(f"{type(link).__qualname__}: {link}"))
    return links


def restore_chain(links: list[BaseException]) -> BaseException:
    """The first of ``links``, with each one the ``__cause__`` of the one before."""
    for link, cause in itertools.pairwise(links):
        link.__cause__ = cause
    return links[0]


def _restore_trial_error(
    stage: str,
    chain: list[BaseException],
    peak_memory: int,
    summary: str,
    where: str,
    worker_signals: tuple[int, ...],
    worker_exit_codes: tuple[int, ...],
) -> TrialError:
    error = TrialError(stage, restore_chain(chain), peak_memory)
    error.summary, error.where = summary, where
    error.worker_signals, error.worker_exit_codes = worker_signals, worker_exit_codes
    return error


class TrialProcessDied(Exception):
    """The process running the trial died (``isolation="subprocess"``).

    Attributes:
        exit_code: its exit code; negative for the signal that killed it; ``None``
            where another reaped the process before ``multiprocessing`` could, and its
            exit code is lost (``lost_to`` says who).
        lost_to: who reaped the process where its exit code is lost: the kernel, where
            this process ignores SIGCHLD, or another part of this process; else ``""``.
    """

    def __init__(self, exit_code: int | None, lost_to: str | None = None) -> None:
        if exit_code is None:
            lost_to = lost_to or _reaper()
            how = f"ended, its exit code lost: {lost_to}"
        elif exit_code < 0:
            how = f"was killed by {signal.Signals(-exit_code).name}"
        else:
            how = f"exited with code {exit_code}"
        super().__init__(f"the trial's process {how}")
        self.exit_code, self.lost_to = exit_code, lost_to or ""

    def __reduce__(self) -> tuple[type[TrialProcessDied], tuple[int | None, str]]:
        return type(self), (self.exit_code, self.lost_to)


def _reaper() -> str:
    """Who reaped a child of this process before ``multiprocessing`` could."""
    if signal.getsignal(signal.SIGCHLD) == signal.SIG_IGN:
        return "this process ignores SIGCHLD, and the kernel reaped it"
    return "another part of this process reaped it (a SIGCHLD handler that waits for any child?)"


_WORKER_FRAME = re.compile(r'^\s*File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<name>.+)$')


def describe_error(error: BaseException) -> tuple[str, str]:
    """One line naming the exception, and where it was raised: the exception's type and
    the first line of its message (``"ValueError: No samples found ..."``).

    DataLoader re-raises a worker's exception with a message that embeds the worker's
    traceback ("Caught ValueError in DataLoader worker process 0. Original Traceback
    ..."). Its last frame is the origin; the exception's own line is the first line
    after that frame that is not indented (source lines and ``^^^`` markers are). The
    message's later lines are often advice on silencing a check, not what went wrong.
    """
    message = str(error)
    lines = [line for line in message.splitlines() if line.strip()]
    if message.startswith("Caught ") and "Original Traceback" in message and lines:
        worker = lines[0].removeprefix("Caught ").split(" in ", 1)[-1].rstrip(".")
        frames = [(n, m) for n, m in enumerate(map(_WORKER_FRAME.match, lines)) if m]
        if not frames:
            return f"{lines[-1].strip()} (in {worker})", ""
        last, frame = frames[-1]
        after = [line for line in lines[last + 1 :] if not line[0].isspace()]
        raised = after[0].strip() if after else lines[-1].strip()
        return f"{raised} (in {worker})", f"{frame['file']}:{frame['line']} in {frame['name']}"
    if isinstance(error, TrialTimeout):
        stuck = user_frame(error.__traceback__)
        where = f"{stuck.filename}:{stuck.lineno} in {stuck.name}" if stuck else ""
    else:
        stack = traceback.extract_tb(error.__traceback__)
        where = f"{stack[-1].filename}:{stack[-1].lineno} in {stack[-1].name}" if stack else ""
    first = lines[0].strip() if lines else ""
    return f"{type(error).__name__}: {first}".rstrip(": "), where


# NOTE [ Where user code was stuck ]
# A deadline's TrialTimeout is raised by the alarm's handler, in whatever frame the main
# thread was: its innermost frames are the handler's (autoloader's) and those of what
# the user's code was waiting in (threading, a socket, torch). The frame that says
# where to look is the innermost one of the user's own code: not autoloader's, torch's
# or the standard library's. Where there is none (the main thread waited for a worker
# process), the error names no place. A ThreadLoader's worker thread stuck in a read is
# found by its name, and the innermost user frame of its stack is named instead: the
# thread cannot be stopped, and stays until its read returns.
def _folders(*paths: str | Path) -> tuple[str, ...]:
    return tuple(str(Path(path).resolve()) + os.sep for path in paths)


_LIBRARIES = _folders(Path(__file__).parents[1], Path(torch.__file__).parent)  # autoloader, torch
_STANDARD = _folders(sysconfig.get_paths()["stdlib"], sysconfig.get_paths()["platstdlib"])
# Installed packages, which may lie under the standard library's folder: the user's own.
_INSTALLED = _folders(sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"])


def user_frame(tb: TracebackType | None) -> traceback.FrameSummary | None:
    """The innermost frame of ``tb`` in the user's code (see ``NOTE [ Where user code
    was stuck ]``), or ``None``."""
    for frame in reversed(traceback.extract_tb(tb)):
        if is_users(frame.filename):
            return frame
    return None


def stuck_threads(prefix: str) -> list[tuple[str, str]]:
    """The live threads whose names begin with ``prefix``, each with where its stack is
    in the user's code (``"file:line in function"``, or ``""``)."""
    frames = sys._current_frames()
    stuck = []
    for thread in threading.enumerate():
        frame = frames.get(thread.ident) if thread.ident is not None else None
        if not thread.name.startswith(prefix) or frame is None:
            continue
        users = [f for f in traceback.extract_stack(frame) if is_users(f.filename)]
        where = f"{users[-1].filename}:{users[-1].lineno} in {users[-1].name}" if users else ""
        stuck.append((thread.name, where))
    return stuck


def is_users(filename: str) -> bool:
    """Whether ``filename`` is the user's code (see ``NOTE [ Where user code was stuck ]``)."""
    if filename.startswith("<"):  # <frozen ...>, <string>
        return False
    path = str(Path(filename).resolve())
    standard = path.startswith(_STANDARD) and not path.startswith(_INSTALLED)
    return not (path.startswith(_LIBRARIES) or standard)


def exception_chain(error: BaseException) -> Iterator[BaseException]:
    """``error``, then what caused it (``__cause__``, else ``__context__``), and so on."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        yield current
        current = current.__cause__ or current.__context__
