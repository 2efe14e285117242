"""Every wait on user code ends within the bounds the docs state (docs/guides/safety.md),
and says where the user's code was stuck (NOTE [ Hang deadlines ],
NOTE [ Main thread only ], NOTE [ Checks that can be abandoned ],
NOTE [ Where user code was stuck ])."""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, Dataset, TensorDataset

import autoloader
from autoloader.loader._params import normalize_params
from autoloader.measure._deadlines import Deadlines, TrialTimeout, time_limit
from autoloader.measure._errors import TrialError
from autoloader.measure._process_memory import tree_memory
from autoloader.measure._runner import TrialRunner

# Seconds tune(time_budget=5) may take to fail on a dataset that blocks forever: the
# checks' second, the baseline's 3 s deadline, and room for a loaded machine.
_BOUND = 20.0
# Where Blocks.__getitem__ blocks, as the error must name it.
_BLOCKS_AT = 0


class Blocks(Dataset[torch.Tensor]):
    """Every read blocks until the test releases it: forever, as far as tune() knows."""

    def __init__(self, release: threading.Event) -> None:
        self.release = release
        self.reads = 0

    def __len__(self) -> int:
        return 256

    def __getitem__(self, index: int) -> torch.Tensor:
        global _BLOCKS_AT
        self.reads += 1
        _BLOCKS_AT = sys._getframe().f_lineno + 1
        self.release.wait()
        return torch.zeros(4)


@pytest.fixture
def release() -> Iterator[threading.Event]:
    """Set at the end: whatever still blocks in a read (on the code before the fix: the
    threads check's threads, a tune() in another thread) returns and ends."""
    event = threading.Event()
    yield event
    event.set()


def _blocked_in(dataset_type: type) -> list[str]:
    """The threads of this process whose stack is in a read of ``dataset_type``."""
    frames = sys._current_frames()
    names = {thread.ident: thread.name for thread in threading.enumerate()}
    blocked = []
    for ident, frame in frames.items():
        current: Any = frame
        while current is not None:
            if current.f_code is dataset_type.__getitem__.__code__:
                blocked.append(names.get(ident, str(ident)))
                break
            current = current.f_back
    return blocked


@pytest.mark.light  # mostly waits
@pytest.mark.slow  # over 2.5 s here: the full suite's (docs/development/checks.md)
def test_a_dataset_that_blocks_forever_fails_the_baseline_in_seconds_naming_its_line(
    release: threading.Event,
) -> None:
    started = time.monotonic()
    with pytest.raises(autoloader.BaselineError) as raised:
        autoloader.tune(
            Blocks(release), lambda batch: None, batch_size=4, time_budget=5, show_progress=False
        )
    took = time.monotonic() - started
    assert took < _BOUND, f"BaselineError after {took:.1f} s"
    message = str(raised.value)
    assert "no progress for 3 s while loading a batch" in message, message
    # The user's frame where it blocked, not the alarm's handler in autoloader.
    assert f"at {__file__}:{_BLOCKS_AT} in __getitem__" in message, message
    # The threads check ran in a forked process: no thread of this one is left blocked.
    assert _blocked_in(Blocks) == []


@pytest.mark.light  # mostly waits
def test_a_step_that_blocks_on_its_first_call_fails_the_baseline_and_says_what_to_do(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """NOTE [ The first step ]: the run's first step may take the budget, at least
    FIRST_STEP_TIMEOUT (1 s here: the budget's 2 s decide). A step blocked there fails
    the baseline then, and the error tells a set-up longer than the budget allows from
    a fault, where a later step's hang is a fault."""
    monkeypatch.setattr("autoloader.search._hang_deadlines.FIRST_STEP_TIMEOUT", 1.0)
    calls: list[object] = []

    def _blocks_on_its_first_call(batch: object) -> None:
        calls.append(batch)
        if len(calls) == 1:
            time.sleep(3600)

    started = time.monotonic()
    with pytest.raises(autoloader.BaselineError) as raised:
        autoloader.tune(
            TensorDataset(torch.zeros(64, 4)), _blocks_on_its_first_call, batch_size=4,
            time_budget=2, show_progress=False,
        )  # fmt: skip
    took = time.monotonic() - started
    assert took < _BOUND, f"BaselineError after {took:.1f} s"
    message = str(raised.value)
    assert "no progress for 2 s while running step_fn's first call at " in message, message
    assert "raise time_budget; if it blocks, fix it" in message, message
    assert "This is a fault" not in message, message
    assert len(calls) == 1


def test_tune_from_another_thread_is_refused_before_any_read(release: threading.Event) -> None:
    dataset = Blocks(release)
    raised: list[BaseException] = []

    def run() -> None:
        try:
            autoloader.tune(
                dataset, lambda batch: None, batch_size=4, time_budget=5, show_progress=False
            )
        except BaseException as error:
            raised.append(error)

    thread = threading.Thread(target=run, name="training-thread", daemon=True)
    thread.start()
    thread.join(_BOUND)
    assert not thread.is_alive(), "tune() in another thread still runs"
    assert len(raised) == 1 and isinstance(raised[0], autoloader.InvalidInputError), raised
    message = str(raised[0])
    assert message.startswith("tune() must be called from the main thread because"), message
    assert "'training-thread'" in message and "SIGALRM" in message
    assert dataset.reads == 0


def test_diagnose_from_another_thread_is_refused_before_any_read(
    release: threading.Event,
) -> None:
    dataset = Blocks(release)
    raised: list[BaseException] = []

    def run() -> None:
        try:
            autoloader.diagnose(DataLoader(dataset, batch_size=4), lambda batch: None, seconds=1)
        except BaseException as error:
            raised.append(error)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(_BOUND)
    assert not thread.is_alive(), "diagnose() in another thread still runs"
    assert len(raised) == 1 and isinstance(raised[0], autoloader.InvalidInputError), raised
    assert str(raised[0]).startswith("diagnose() must be called from the main thread because")
    assert dataset.reads == 0


@pytest.mark.light  # mostly waits
@pytest.mark.slow  # over 2.5 s here: the full suite's (docs/development/checks.md)
def test_a_trial_whose_thread_workers_block_names_the_thread_and_its_line(
    release: threading.Event,
) -> None:
    runner = TrialRunner(
        Blocks(release), lambda batch: None, batch_size=4, memory_budget=tree_memory() + 2**31
    )
    params = normalize_params({"num_workers": 2, "worker_kind": "threads"})
    started = time.monotonic()
    with pytest.raises(TrialError) as raised:
        runner.measure(params, max_seconds=5, deadlines=Deadlines(first=1.0, each=1.0))
    assert time.monotonic() - started < _BOUND
    assert isinstance(raised.value.error, TrialTimeout)
    message = str(raised.value.error)
    where = f"{__file__}:{_BLOCKS_AT} in __getitem__"
    assert message.startswith("no progress for 1 s while loading a batch: thread worker "), message
    assert f"is stuck at {where}; a thread cannot be stopped" in message, message
    assert raised.value.where == where


@pytest.mark.light  # mostly waits
@pytest.mark.slow  # over 2.5 s here: the full suite's (docs/development/checks.md)
def test_a_timeout_that_user_code_swallows_fires_again(release: threading.Event) -> None:
    # On the code before the fix this blocks until the timer releases it.
    timer = threading.Timer(_BOUND, release.set)
    timer.start()
    started = time.monotonic()
    try:
        with pytest.raises(TrialTimeout), time_limit(0.2, "reading an item"):
            # A retry loop, or a library that logs and goes on.
            with contextlib.suppress(Exception):
                release.wait()
            release.wait()
    finally:
        timer.cancel()
        timer.join()
    assert time.monotonic() - started < 0.2 + 3.0 + 2.0


def test_a_timeouts_message_says_its_stage_once() -> None:
    timeout = TrialTimeout("loading a batch", 3.0)
    assert str(TrialError("loading a batch", timeout, 0)) == (
        "TrialTimeout: no progress for 3 s while loading a batch"
    )
    assert str(TrialError("running step_fn", ValueError("bad"), 0)) == (
        "ValueError: bad while running step_fn"
    )
