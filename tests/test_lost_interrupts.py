"""A Ctrl-C that Python cannot raise (in a ``__del__``, in a fork's at-fork hook) stops
the run by its note, and is not printed as "Exception ignored" (``remember_ctrl_c``)."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from autoloader.search import Interruption, Terminated, remember_ctrl_c

ROOT = Path(__file__).resolve().parents[1]


class _RaisesWhenCollected:
    def __init__(self, error: BaseException) -> None:
        self.error = error

    def __del__(self) -> None:
        raise self.error


@pytest.fixture
def printed() -> Iterator[list[Any]]:
    """What reaches the unraisable hook found when the run starts."""
    seen: list[Any] = []
    found = sys.unraisablehook
    sys.unraisablehook = lambda unraisable: seen.append(unraisable.exc_value)
    try:
        yield seen
    finally:
        sys.unraisablehook = found


def test_an_interrupt_lost_once_noted_is_not_printed(printed: list[Any]) -> None:
    hook = sys.unraisablehook
    interrupted = Interruption()
    with remember_ctrl_c(interrupted):
        interrupted.note("Ctrl-C")
        _RaisesWhenCollected(KeyboardInterrupt())  # collected at once
        _RaisesWhenCollected(Terminated())
    assert printed == []
    assert sys.unraisablehook is hook  # put back


def test_every_other_lost_exception_is_printed_as_before(printed: list[Any]) -> None:
    interrupted = Interruption()
    with remember_ctrl_c(interrupted):
        not_noted = KeyboardInterrupt()  # no Ctrl-C noted: not the run's
        _RaisesWhenCollected(not_noted)
        interrupted.note("Ctrl-C")
        other = ValueError("a finalizer's own error")
        _RaisesWhenCollected(other)
    assert printed == [not_noted, other]


def test_a_hook_installed_meanwhile_stays(printed: list[Any]) -> None:
    interrupted = Interruption()

    def theirs(unraisable: Any) -> None:
        pass

    with remember_ctrl_c(interrupted):
        sys.unraisablehook = theirs
    assert sys.unraisablehook is theirs


_CTRL_C_AS_A_WORKER_FORKS = """
import os, sys
sys.path.insert(0, {root!r})
from autoloader.search import Interruption, remember_ctrl_c

interrupted = Interruption()

def ctrl_c_now():  # as the signal's handler runs in logging's after-fork hook
    interrupted.note("Ctrl-C")
    raise KeyboardInterrupt

with remember_ctrl_c(interrupted):
    os.register_at_fork(after_in_parent=ctrl_c_now)
    child = os.fork()
    if child == 0:
        os._exit(0)
    os.waitpid(child, 0)
print("noted", interrupted.is_set())
"""


@pytest.mark.slow  # over 2.5 s here: the full suite's (docs/development/checks.md)
def test_ctrl_c_as_a_worker_forks_stops_the_run_without_a_traceback() -> None:
    done = subprocess.run(
        [sys.executable, "-c", _CTRL_C_AS_A_WORKER_FORKS.format(root=str(ROOT))],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "noted True"
    assert done.stderr == ""
