"""ThreadLoader: DataLoader's interface with thread workers, its faults and its shutdown;
and the check that decides whether thread workers are offered."""

from __future__ import annotations

import signal
import threading
import time
from typing import Any

import pytest
import torch
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    DistributedSampler,
    SequentialSampler,
    TensorDataset,
)

import autoloader
from autoloader.checks._facts import Checks
from autoloader.loader._params import normalize_params
from autoloader.measure._deadlines import Deadlines, TrialTimeout
from autoloader.measure._errors import TrialError
from autoloader.measure._memory import MemoryBudgetExceeded
from autoloader.measure._process_memory import tree_memory
from autoloader.measure._runner import TrialRunner
from tests.workloads import (
    AugmentedDataset,
    FailingDataset,
    FailsInThreadsDataset,
    GetItemsDataset,
    SharedBufferDataset,
    SleepDataset,
    Stream,
    mark_worker,
    noop_step,
)

ThreadLoader = autoloader.ThreadLoader


def _ids(loader: DataLoader[Any], epochs: int = 1) -> list[list[int]]:
    batches = []
    for _ in range(epochs):
        for batch in loader:
            first = batch[0] if isinstance(batch, list | tuple) else batch
            batches.append(first.reshape(len(first), -1)[:, 0].long().tolist())
    return batches


def _worker_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("autoloader-thread")]


@pytest.mark.parametrize(
    "options",
    [
        {"batch_size": 7, "shuffle": True},
        {"batch_size": 7, "shuffle": True, "drop_last": True},
        {"batch_size": 5, "collate_fn": lambda items: torch.stack([x for (x,) in items]) * 2},
        {"batch_sampler": BatchSampler(SequentialSampler(range(50)), 6, False)},
        {"batch_size": None, "sampler": BatchSampler(SequentialSampler(range(50)), 8, False)},
    ],
    ids=["shuffle", "drop_last", "collate_fn", "batch_sampler", "batched_fetch"],
)
def test_the_batches_are_dataloaders_batch_for_batch(options: dict[str, Any]) -> None:
    """Same seed, same batches, in the same order, over two epochs: the sampler is drawn
    from the generator exactly as DataLoader draws it."""
    dataset = TensorDataset(torch.arange(50))
    expected = _ids(DataLoader(dataset, generator=torch.Generator().manual_seed(3), **options), 2)
    loader = ThreadLoader(
        dataset, num_workers=4, generator=torch.Generator().manual_seed(3), **options
    )
    assert _ids(loader, 2) == expected
    assert len(loader) == len(expected) // 2
    assert isinstance(loader, DataLoader)
    assert (loader.dataset, loader.num_workers, loader.prefetch_factor) == (dataset, 4, 2)


def test_out_of_order_hands_over_every_sample_once() -> None:
    dataset = SleepDataset(length=97, latency=0.0)
    loader = ThreadLoader(dataset, batch_size=8, num_workers=3, in_order=False, shuffle=True)
    samples = [i for batch in _ids(loader) for i in batch]
    assert sorted(samples) == list(range(97))


def test_a_distributed_samplers_epoch_is_followed() -> None:
    dataset = SleepDataset(length=40, latency=0.0)
    sampler = DistributedSampler(dataset, num_replicas=2, rank=1, shuffle=True, seed=5)
    loader = ThreadLoader(dataset, batch_size=4, sampler=sampler, num_workers=2)
    reference = DataLoader(dataset, batch_size=4, sampler=sampler)
    orders = []
    for epoch in (0, 1):
        sampler.set_epoch(epoch)
        assert _ids(loader) == _ids(reference)
        orders.append(_ids(loader))
    assert orders[0] != orders[1]


def test_getitems_loads_a_batch_in_one_call() -> None:
    dataset = GetItemsDataset(length=32)
    batches = _ids(ThreadLoader(dataset, batch_size=8, num_workers=2))
    assert batches == [list(range(i, i + 8)) for i in range(0, 32, 8)]
    assert dataset.calls == 4


def test_an_error_names_the_thread_and_item_and_keeps_the_original_traceback() -> None:
    loader = ThreadLoader(FailingDataset(length=64, bad=37), batch_size=8, num_workers=3)
    with pytest.raises(ValueError) as caught:
        _ids(loader)
    message = str(caught.value)
    assert "Caught ValueError in thread worker" in message
    assert "loading item 37" in message
    assert "Original Traceback" in message and "workloads.py" in message
    assert isinstance(caught.value.__cause__, ValueError)
    assert caught.value.__cause__ is not caught.value
    # The traceback holds the epoch's iterator, whose threads wait for it as DataLoader's
    # workers do; dropping it stops them.
    del caught
    # Like DataLoader's workers, the other threads go on: the next batch comes.
    iterator = iter(loader)
    batches = []
    while True:
        try:
            batches.append(next(iterator))
        except ValueError:
            continue
        except StopIteration:
            break
    assert len(batches) == 7


@pytest.mark.light  # mostly waits
def test_the_timeout_option_raises_as_dataloaders_does() -> None:
    loader = ThreadLoader(
        SleepDataset(length=8, latency=0.5), batch_size=4, num_workers=1, timeout=0.1
    )
    with pytest.raises(RuntimeError, match=r"timed out after 0\.1 seconds"):
        next(iter(loader))


def test_break_and_del_stop_the_threads() -> None:
    loader = ThreadLoader(SleepDataset(length=400, latency=0.002), batch_size=4, num_workers=6)
    for _ in loader:
        assert len(_worker_threads()) == 6
        break
    assert _worker_threads() == []
    iterator = iter(loader)
    next(iterator)
    del iterator
    assert _worker_threads() == []


@pytest.mark.light  # mostly waits
@pytest.mark.usefixtures("ctrl_c_raises")
def test_ctrl_c_while_waiting_stops_the_threads() -> None:
    """A real SIGINT while the main thread waits for a batch."""
    loader = ThreadLoader(SleepDataset(length=64, latency=0.3), batch_size=8, num_workers=2)
    main = threading.main_thread().ident
    assert main is not None
    timer = threading.Timer(0.3, signal.pthread_kill, (main, signal.SIGINT))
    timer.start()
    with pytest.raises(KeyboardInterrupt):
        for _ in loader:
            pass
    timer.join()
    deadline = time.monotonic() + 5
    while _worker_threads() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _worker_threads() == []


def test_each_thread_pins_the_batch_it_loaded(monkeypatch: pytest.MonkeyPatch) -> None:
    """Pinning needs an accelerator: faked here, the pinning itself recorded."""
    pinned: list[tuple[str, str | None]] = []

    def fake_pin(data: Any, device: str | None = None) -> Any:
        pinned.append((threading.current_thread().name, device))
        return data

    monkeypatch.setattr(torch.accelerator, "is_available", lambda: True)
    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda: torch.device("cuda"))
    monkeypatch.setattr("autoloader.loader._thread_loader._pin", fake_pin)
    loader = ThreadLoader(
        SleepDataset(length=32, latency=0.0), batch_size=8, num_workers=2, pin_memory=True
    )
    assert len(_ids(loader)) == 4
    assert len(pinned) == 4
    assert all(
        name.startswith("autoloader-thread-worker-") and device == "cuda" for name, device in pinned
    )


@pytest.mark.parametrize(
    ("dataset", "options", "match"),
    [
        (Stream(10), {}, "IterableDataset"),
        (
            SleepDataset(),
            {"worker_init_fn": mark_worker},
            "worker_init_fn sets up worker processes",
        ),
        (SleepDataset(), {"multiprocessing_context": "fork"}, "multiprocessing_context"),
        (SleepDataset(), {"num_workers": -1}, "non-negative"),
        (SleepDataset(), {"num_workers": 2, "prefetch_factor": 0}, "at least 1"),
        # DataLoader's own checks, raised as autoloader's error too
        (SleepDataset(), {"batch_size": 4, "batch_sampler": [[0, 1]]}, "batch_sampler"),
    ],
)
def test_options_for_worker_processes_are_refused(
    dataset: Any, options: dict[str, Any], match: str
) -> None:
    # An InvalidInputError, which is also the ValueError DataLoader raises.
    with pytest.raises(autoloader.InvalidInputError, match=match):
        ThreadLoader(dataset, **options)


def test_a_trial_with_thread_workers_is_measured_and_leaves_no_thread() -> None:
    runner = TrialRunner(SleepDataset(length=256), noop_step, batch_size=8, memory_budget=8 << 30)
    params = normalize_params({"num_workers": 4, "worker_kind": "threads"})
    measurement = runner.measure(params, max_seconds=1.0)
    assert measurement.batches > 0 and measurement.samples_per_second > 0
    assert _worker_threads() == []


@pytest.mark.light  # mostly waits
@pytest.mark.slow  # over 2.5 s here: the full suite's (docs/development/checks.md)
def test_a_hung_read_in_a_thread_fails_the_trial_as_a_timeout() -> None:
    """The thread's read cannot be interrupted: the trial fails at its deadline, and the
    thread ends when its read returns (here after 3 s)."""
    runner = TrialRunner(_HangsOnItem(hang_on=20), noop_step, batch_size=4, memory_budget=8 << 30)
    params = normalize_params({"num_workers": 2, "worker_kind": "threads"})
    with pytest.raises(TrialError) as caught:
        runner.measure(params, max_seconds=5.0, deadlines=Deadlines(first=1.0, each=1.0))
    assert isinstance(caught.value.error, TrialTimeout)
    assert caught.value.stage == "loading a batch"


class _HangsOnItem(SleepDataset):
    def __init__(self, hang_on: int) -> None:
        super().__init__(length=256, latency=0.0)
        self.hang_on = hang_on

    def __getitem__(self, index: int) -> torch.Tensor:
        if index == self.hang_on:
            time.sleep(3.0)
        return super().__getitem__(index)


class _KeepsItems(SleepDataset):
    """Keeps 16 MiB of fresh memory per item read: with threads, in this process."""

    def __init__(self) -> None:
        super().__init__(length=4096, latency=0.001)
        self.kept: list[torch.Tensor] = []

    def __getitem__(self, index: int) -> torch.Tensor:
        self.kept.append(torch.ones(4 << 20))
        return super().__getitem__(index)


def test_memory_over_budget_stops_a_trial_with_thread_workers() -> None:
    """No worker process to kill: the watch wakes the main thread itself, and the trial
    is stopped as over memory, not as a timeout."""
    dataset = _KeepsItems()
    budget = tree_memory() + (400 << 20)
    runner = TrialRunner(dataset, noop_step, batch_size=4, memory_budget=budget)
    params = normalize_params({"num_workers": 2, "worker_kind": "threads"})
    with pytest.raises(MemoryBudgetExceeded):
        runner.measure(params, max_seconds=20.0)
    dataset.kept.clear()


def _checks(dataset: Any, **fixed: Any) -> Checks:
    return Checks(dataset, fixed, batch_size=8, seconds=20.0)


def test_threads_are_offered_for_a_dataset_that_reads_the_same_from_threads() -> None:
    assert _checks(SleepDataset(length=64)).threads_problem() is None
    assert _checks(TensorDataset(torch.arange(100))).threads_problem() is None
    # Random augmentations cannot be compared by value, only by layout.
    assert _checks(AugmentedDataset()).threads_problem() is None


@pytest.mark.parametrize(
    ("dataset", "fixed", "problem"),
    [
        (SharedBufferDataset(), {}, "gave other batches than reading it from one"),
        (FailsInThreadsDataset(), {}, "raised RuntimeError: this handle was opened"),
        (Stream(10), {}, "IterableDataset"),
        (SleepDataset(), {"worker_init_fn": mark_worker}, "sets worker_init_fn"),
    ],
    ids=["shared-buffer", "fails-in-threads", "iterable", "worker_init_fn"],
)
def test_threads_are_not_offered_where_they_would_change_or_break_loading(
    dataset: Any, fixed: dict[str, Any], problem: str
) -> None:
    found = _checks(dataset, **fixed).threads_problem()
    assert found is not None and problem in found
