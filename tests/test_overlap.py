"""The next setting's workers start while the trial before it drains
(``NOTE [ Overlapped start-up ]``, ``_loop_overlap.py``): they load while the loop
still takes the drained batches, every batch stays DataLoader's, and a drain that fails
or an epoch the loop leaves mid-drain loses and repeats nothing, and leaves no worker
(conftest.py fails a test that leaves a child process).
"""

from __future__ import annotations

import itertools
import os
import signal
import time
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch
from torch.utils.data import DataLoader, Dataset, get_worker_info

from autoloader import AutoLoader

pytestmark = pytest.mark.slow  # AutoLoaders tuning in real loops, 10-20 s each

LENGTH, BATCH = 480, 8
# Worker processes only, each asking 4 batches ahead: a trial that measured enough
# drains 8-16 batches, one 5 ms step each.
# The step sleeps, but a full run beside a busy loop once searched its threads and chose
# 1 (its baseline's figures are lost): not these tests' matter.
SPACE = {
    "num_workers": (2, 4), "prefetch_factor": 4, "worker_kind": "processes", "step_threads": None
}  # fmt: skip
STEP = 0.005


class Stamped(Dataset[torch.Tensor]):
    """Item ``i`` is ``[i, loader]`` after 2 ms, ``loader`` naming the iterator whose
    worker loaded it (its workers' base seed; -1 in the main process); each load is
    written to ``log`` as ``loader time`` (monotonic, the same clock in every process)."""

    def __init__(self, log: Path, length: int = LENGTH) -> None:
        self.log = str(log)
        self.length = length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> torch.Tensor:
        time.sleep(0.002)
        info = get_worker_info()
        loader = -1 if info is None else (info.seed - info.id) % 2**31
        with open(self.log, "a") as log:
            log.write(f"{loader} {time.monotonic()}\n")
        return torch.tensor([index, loader], dtype=torch.float64)


def _autoloader(
    dataset: Dataset[Any], space: dict[str, Any] = SPACE, *, time_budget: float = 6
) -> AutoLoader[Any]:
    return AutoLoader(
        dataset,
        batch_size=BATCH,
        shuffle=True,
        generator=torch.Generator().manual_seed(7),
        time_budget=time_budget,
        search_space=space,
        verbose=False,
    )


def _reference(epochs: int | list[int], length: int = LENGTH) -> list[list[int]]:
    """DataLoader's batches of indices of a dataset of ``length`` items over ``epochs``
    epochs, or as many as the list has, the loop leaving each after its count of batches
    (a loop that leaves an epoch early draws less from the generator: the sampler is not
    asked past its end). The order is the sampler's: a dataset of indices gives it."""
    loader = DataLoader(
        range(length), batch_size=BATCH, shuffle=True, generator=torch.Generator().manual_seed(7)
    )
    counts = [length // BATCH] * epochs if isinstance(epochs, int) else epochs
    batches = []
    for count in counts:
        for number, batch in enumerate(loader):
            batches.append([int(i) for i in batch])
            if number + 1 == count and count < length // BATCH:
                break
    return batches


# Beside a busy loop and two other tests, no switch between settings with workers came
# within an epoch: the drains the assertion looks for need their workers to keep up.
@pytest.mark.calm
def test_the_next_settings_workers_load_while_the_loop_takes_the_drained_batches(
    tmp_path: Path,
) -> None:
    """Each batch says which loader's workers loaded it; the log says when each loader's
    workers first loaded. Some loader's workers loaded before the loop received the last
    batch of the loader before it: switched one after the other, they could not have,
    its workers starting only once the loader before had delivered its last batch."""
    # Epochs of 180 batches: a loader without persistent workers starts new ones at each
    # epoch's start, where no drain precedes them; with 60-batch epochs, a full run saw
    # 3 worker loaders, the second and third each an epoch's first: no switch to look at.
    length = 3 * LENGTH
    dataset = Stamped(tmp_path / "loads", length=length)
    # Each worker 8 batches ahead: drains of 16-32 steps, 80-160 ms, longer than workers
    # take to start on a busy machine (with 4 ahead, 40-80 ms, the next loader's first
    # load came 49 ms after the last drained batch in one full run).
    # 9 s: at 6, beside three or four busy loops, the search's time was spent after one
    # setting with workers in 3 of 19 runs (no switch to look at); at 9, 0 of 8.
    loader = _autoloader(dataset, {**SPACE, "prefetch_factor": 8}, time_budget=9)
    seen: list[list[int]] = []
    received: list[tuple[int, float]] = []  # each batch's loader, and when the loop got it
    epochs = 0
    try:
        while not loader.tuned and epochs < 200:
            for batch in loader:
                received.append((int(batch[0, 1]), time.monotonic()))
                seen.append([int(i) for i in batch[:, 0]])
                time.sleep(STEP)
            epochs += 1
    finally:
        loader.close()
    assert loader.tuned, loader.report()
    assert seen == _reference(epochs, length=length)

    first_load: dict[int, float] = {}
    for line in (tmp_path / "loads").read_text().splitlines():
        key, at = line.split()
        first_load.setdefault(int(key), float(at))
    # The worker loaders in the loop's order, each with its last batch's receipt, and
    # whether its first batch was an epoch's first: a loader without persistent workers
    # starts new workers (a new key) at each epoch, after the last epoch's end, where
    # there is no drain to overlap (on a slow machine, the only switches but one were
    # epochs' starts).
    order: list[int] = []
    last_received: dict[int, float] = {}
    starts_an_epoch: dict[int, bool] = {}
    for number, (key, at) in enumerate(received):
        if key == -1:
            continue
        if key not in last_received:
            order.append(key)
            starts_an_epoch[key] = number % (length // BATCH) == 0
        last_received[key] = at
    switches = [
        (before, after) for before, after in itertools.pairwise(order) if not starts_an_epoch[after]
    ]
    assert switches, (
        "no switch between settings with workers within an epoch",
        order,
        loader.report(),
    )
    overlapped = [
        (before, after) for before, after in switches if first_load[after] < last_received[before]
    ]
    assert overlapped, (switches, first_load, last_received)


def _draining(loader: AutoLoader[Any]) -> Any:
    """The trial under way in the loader's epoch, if it drains (internal: the test
    acts at the drain's first batch)."""
    epoch = loader._current_epoch()
    trial = None if epoch is None else epoch.trial
    return trial if trial is not None and trial.draining else None


# Beside a busy loop and three other tests, no drain with a successor came (a full run,
# 2026-11-29): as for the test above, the drains need their workers to keep up, and the
# search the time for a second setting with workers.
@pytest.mark.calm
def test_a_drain_that_fails_gives_back_its_batches_before_the_next_settings(
    tmp_path: Path,
) -> None:
    """At the first drain with a successor started, the draining trial's workers are
    killed: the successor stops first, both give their batches back in the epoch's
    order, the setting is a failure, and every epoch is still DataLoader's. The loop
    takes no step: loading is the bottleneck, so batches the killed workers had not
    loaded yet are still in flight (with a step, they may all be queued already, and
    a drain whose workers die after loading everything it holds loses nothing)."""
    dataset = Stamped(tmp_path / "loads")
    loader = _autoloader(dataset, time_budget=9)
    seen: list[list[int]] = []
    killed: list[int] = []
    workers = 0
    epochs = 0
    try:
        # Until the epoch in which the setting killed failed ends (or the tuning does).
        while not loader.tuned and not (killed and loader.failures) and epochs < 200:
            for batch in loader:
                seen.append([int(i) for i in batch[:, 0]])
                trial = _draining(loader)
                successor = loader.tuning.overlap.successor if loader.tuning else None
                if (
                    not killed
                    and trial is not None
                    and successor is not None
                    and trial.feed.in_flight >= 2
                ):
                    workers = trial.params["num_workers"]
                    killed = trial.guard.worker_pids()
                    for pid in killed:
                        os.kill(pid, signal.SIGKILL)
            epochs += 1
    finally:
        loader.close()
    assert killed, "a drain with a successor"
    assert seen == _reference(epochs)
    # The setting failed (its workers' death read as a death, or as a pipe reset by it).
    (failure,) = loader.failures
    assert failure.startswith(f"{workers} workers"), failure


def _gone(pids: list[int]) -> bool:
    """Whether none of ``pids`` runs any more (exited, or a zombie not yet reaped)."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        alive = [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != "zombie"]
        if not alive:
            return True
        time.sleep(0.05)
    return False


def test_an_epoch_left_during_a_drain_stops_the_next_settings_workers(tmp_path: Path) -> None:
    """The loop breaks out of the epoch once a successor's workers started: they stop
    with the epoch, its plan starts the next epoch's trial, the epoch left is a prefix
    of DataLoader's and the others are DataLoader's, whole."""
    dataset = Stamped(tmp_path / "loads")
    loader = _autoloader(dataset)
    per_epoch: list[list[list[int]]] = []
    left: list[int] = []
    epoch_left = -1
    stopped = False
    try:
        while not loader.tuned and len(per_epoch) < 200:
            seen: list[list[int]] = []
            per_epoch.append(seen)
            for batch in loader:
                seen.append([int(i) for i in batch[:, 0]])
                time.sleep(STEP)
                successor = loader.tuning.overlap.successor if loader.tuning else None
                if not left and successor is not None and successor.trial is not None:
                    left = successor.trial.guard.worker_pids()
                    epoch_left = len(per_epoch) - 1
                    break
            if left and not stopped:
                stopped = _gone(left)  # before the next epoch starts
    finally:
        loader.close()
    assert left and stopped, left
    assert loader.tuned, loader.report()
    counts = [len(seen) for seen in per_epoch]
    # The epoch left is the first with a successor: a prefix (whole where the successor
    # started at the epoch's last batch, as it did once in CI); every other is whole.
    assert counts[:epoch_left] + counts[epoch_left + 1 :] == [LENGTH // BATCH] * (
        len(counts) - 1
    ), counts
    seen = [batch for epoch in per_epoch for batch in epoch]
    assert seen == _reference(counts)


class Pids(Dataset[torch.Tensor]):
    """Item ``i`` is ``[i, pid]`` after 2 ms: the process that loaded it."""

    def __len__(self) -> int:
        return LENGTH

    def __getitem__(self, index: int) -> torch.Tensor:
        time.sleep(0.002)
        return torch.tensor([index, os.getpid()], dtype=torch.float64)


def test_the_chosen_setting_goes_on_with_the_workers_that_measured_it_last(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With no drain to start the chosen setting's loader early (here no trial's memory
    peak is small enough for two loaders at once), the last trial, of the setting then
    chosen, keeps its workers, and they load the training's batches from there: no
    new worker starts (``NOTE [ The last trial's workers kept ]``). The batches are
    DataLoader's."""
    monkeypatch.setattr("autoloader._loop_overlap._MEMORY_SHARE", 0.0)
    loader = AutoLoader(
        Pids(),
        batch_size=BATCH,
        shuffle=True,
        generator=torch.Generator().manual_seed(7),
        time_budget=6,
        search_space={
            "num_workers": 2,
            "prefetch_factor": 2,
            "persistent_workers": True,
            "worker_kind": "processes",
            "worker_threads": None,
            "step_threads": None,  # as SPACE's
        },
        verbose=False,
    )
    pids: list[int] = []  # the process that loaded each batch
    seen: list[list[int]] = []
    tuned_at = None  # the first batch of the chosen setting's loader
    epochs = 0
    try:
        while epochs < 200 and (tuned_at is None or len(pids) < tuned_at + LENGTH // BATCH):
            for batch in loader:
                pids.append(int(batch[0, 1]))
                seen.append([int(i) for i in batch[:, 0]])
                if tuned_at is None and loader.tuned:
                    tuned_at = len(pids) - 1
                time.sleep(STEP)
            epochs += 1
        history, report = loader.history, loader.report()
    finally:
        loader.close()
    assert tuned_at is not None, report
    # The one setting with workers; measured to its end, or pruned once measured (a full
    # run's last trial was, quiet): its workers delivered either way, and are kept.
    assert history[-1].params["num_workers"] == 2, report
    assert history[-1].state in ("complete", "pruned") and history[-1].kind != "memory", report
    last_trial = set(pids[tuned_at - 4 : tuned_at])
    assert os.getpid() not in last_trial  # the last trial's batches came from workers
    assert set(pids[tuned_at:]) <= last_trial, (last_trial, set(pids[tuned_at:]), report)
    assert seen == _reference(epochs)
