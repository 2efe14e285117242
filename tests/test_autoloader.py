"""AutoLoader: a DataLoader that tunes itself in the training loop, batch for batch
DataLoader's, with every fault kept from the loop (NOTE [ Tuning in the training loop ])."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler

import autoloader
import autoloader._session
import autoloader.measure._supervision
from autoloader import AutoLoader, InvalidInputError
from autoloader._reuse_check import _CpuUse
from autoloader.loader._feed import EpochBatches, Feed
from autoloader.measure import LiveTrial, TrialEnded, TrialError
from autoloader.search._objective import trial_seconds
from tests.workloads import (
    FailingDataset,
    FaultInWorkersDataset,
    MemoryHogDataset,
    ShardedStream,
    SleepDataset,
)


def _ids(batch: torch.Tensor) -> list[int]:
    return batch[:, 0].long().tolist()


def _epochs(loader: Any, epochs: int, step: float = 0.002) -> list[list[int]]:
    """The ids of every batch of ``epochs`` epochs, a sleeping step after each batch."""
    seen = []
    for _ in range(epochs):
        for batch in loader:
            time.sleep(step)
            seen.append(_ids(batch))
    return seen


def _until_tuned(loader: AutoLoader[Any], *, after: int = 2) -> tuple[list[list[int]], int]:
    """Epochs until tuning has ended, and ``after`` more: their batches' ids, and how
    many epochs that was."""
    seen: list[list[int]] = []
    epochs = 0
    while epochs < 200 and not (loader.tuned and after == 0):
        after -= loader.tuned
        seen += _epochs(loader, 1)
        epochs += 1
    return seen, epochs


def _reference(dataset: Any, epochs: int, **kwargs: Any) -> tuple[list[list[int]], torch.Tensor]:
    """DataLoader's batches over ``epochs`` epochs, and its generator's state after."""
    generator = torch.Generator().manual_seed(7)
    loader = DataLoader(dataset, generator=generator, **kwargs)
    return _epochs(loader, epochs, step=0.0), generator.get_state()


def _every_sample_once(seen: list[list[int]], length: int, epochs: int) -> None:
    per_epoch = [i for batch in seen for i in batch]
    assert sorted(per_epoch) == sorted(list(range(length)) * epochs)


# The feed: every batch handed out once, given back when not delivered --------------------


def test_batches_a_loader_did_not_deliver_are_handed_out_again_first() -> None:
    epoch = EpochBatches(iter([[0], [1], [2], [3], [4]]))
    first = Feed(epoch)
    taken = iter(first)
    assert [next(taken), next(taken), next(taken)] == [[0], [1], [2]]
    first.delivered()  # [0] reached the loop; [1] and [2] were in flight
    first.close()
    assert list(taken) == []  # a closed feed hands out nothing more
    second = Feed(epoch, limit=2)
    assert list(second) == [[1], [2]]
    assert list(Feed(epoch)) == [[3], [4]]


def test_a_stopped_feed_keeps_what_its_loader_holds_for_the_loop() -> None:
    """NOTE [ Draining a trial ]: stopped, a feed hands out nothing more and gives
    nothing back: the batches its loader holds reach the loop through it."""
    epoch = EpochBatches(iter([[0], [1], [2], [3]]))
    feed = Feed(epoch)
    taken = iter(feed)
    assert [next(taken), next(taken)] == [[0], [1]]
    feed.stop()
    assert list(taken) == []
    feed.delivered()
    feed.delivered()
    feed.close()
    assert list(Feed(epoch)) == [[2], [3]]


# Batch for batch DataLoader's ----------------------------------------------------------


@pytest.mark.light  # mostly waits
def test_every_epoch_is_dataloaders_batch_for_batch_while_it_tunes_and_after() -> None:
    """Shuffled with a generator and drop_last, over enough epochs for tuning to end
    mid-way: the same batches in the same order as DataLoader's, and the generator
    drawn as DataLoader draws it."""
    dataset = SleepDataset(length=300, latency=0.001)
    kwargs = {"batch_size": 16, "shuffle": True, "drop_last": True}
    generator = torch.Generator().manual_seed(7)
    loader = AutoLoader(dataset, generator=generator, time_budget=4, verbose=False, **kwargs)
    try:
        assert isinstance(loader, DataLoader)
        assert len(loader) == 300 // 16
        seen, epochs = _until_tuned(loader)
    finally:
        loader.close()
    expected, state = _reference(dataset, epochs, **kwargs)
    assert seen == expected
    assert torch.equal(generator.get_state(), state)
    assert loader.tuned and loader.result is not None
    # The baseline and the search, in the loop (trials across epochs: as few as two).
    assert {"baseline", "search"} <= {t.phase for t in loader.history}
    assert loader.num_workers == loader.result.params["num_workers"]
    # Tuned, the report is the tuning run's, as autoloader.report() gives it.
    assert loader.report() == autoloader.report(loader.result)
    assert loader.report().startswith("autoloader report: batch size 16,")


@pytest.mark.light  # mostly waits
@pytest.mark.slow  # over 2.5 s here: the full suite's (docs/development/checks.md)
def test_shuffled_from_the_global_generator_every_epoch_is_dataloaders() -> None:
    """Without a generator, the sampler's permutations and the workers' base seeds come
    from torch's global generator: the checks before the search (which load batches)
    leave it as they found it, so the epochs and the generator are DataLoader's."""
    dataset = SleepDataset(length=120, latency=0.001)
    kwargs = {"batch_size": 8, "shuffle": True}
    torch.manual_seed(5)
    loader = AutoLoader(dataset, time_budget=2, verbose=False, **kwargs)
    try:
        seen, epochs = _until_tuned(loader, after=1)
    finally:
        loader.close()
    state = torch.get_rng_state()
    torch.manual_seed(5)
    assert seen == _epochs(DataLoader(dataset, **kwargs), epochs, step=0.0)
    assert torch.equal(torch.get_rng_state(), state)


def test_an_epoch_left_early_leaves_the_next_one_dataloaders() -> None:
    """A loop that breaks out of an epoch (max steps) and starts the next one: the next
    epoch is DataLoader's next epoch."""
    dataset = SleepDataset(length=200, latency=0.001)

    def run(loader: Any) -> list[list[int]]:
        seen = []
        for epoch in range(4):
            for number, batch in enumerate(loader):
                seen.append(_ids(batch))
                if epoch == 1 and number == 3:
                    break
        return seen

    expected = run(
        DataLoader(dataset, batch_size=8, shuffle=True, generator=torch.Generator().manual_seed(3))
    )
    loader = AutoLoader(
        dataset,
        batch_size=8,
        shuffle=True,
        generator=torch.Generator().manual_seed(3),
        time_budget=3,
        verbose=False,
    )
    try:
        assert run(loader) == expected
    finally:
        loader.close()


class _HeldToTheNextEpoch:
    """As Lightning's fetcher: ``len(loader)`` batches an epoch, none asked past the
    last, the iterator held until the next epoch's ``iter()``."""

    def __init__(self) -> None:
        self.iterator: Any = None

    def __call__(self, loader: Any, epochs: int) -> list[list[int]]:
        seen = []
        for _ in range(epochs):
            self.iterator = iter(loader)
            for _ in range(len(loader)):
                time.sleep(0.002)
                seen.append(_ids(next(self.iterator)))
        return seen


@pytest.mark.light  # mostly waits
@pytest.mark.paced  # its verdict rests on a pace it measures
@pytest.mark.parametrize(
    "loop",
    # The fast tier keeps the loop that asks past the end; the full suite both.
    [
        pytest.param(_epochs, id="asks-past-the-end"),
        pytest.param(_HeldToTheNextEpoch, id="held-to-the-next-epoch", marks=pytest.mark.slow),
    ],
)
def test_trials_span_epochs_shorter_than_their_start_up_burst(loop: Any) -> None:
    """12 batches an epoch, fewer than 2 to 4 workers x prefetch 4 hold at once, and a
    validation after each epoch (NOTE [ Live trials span epochs ]): trials go on across
    epochs and settings with workers are measured, each epoch still DataLoader's, and
    no trial has a rate it did not measure. Ended with their epochs, every trial with
    workers was pruned too short and the defaults were kept. The same where the loop
    never asks past an epoch's last batch, holding the iterator to the next epoch as
    Lightning does (NOTE [ An epoch left at its last batch ])."""
    dataset = SleepDataset(length=48, latency=0.002)
    kwargs = {"batch_size": 4, "shuffle": True}
    loader = AutoLoader(
        dataset,
        generator=torch.Generator().manual_seed(7),
        time_budget=6,
        search_space={"num_workers": (2, 4), "prefetch_factor": 4, "worker_kind": "processes"},
        verbose=False,
        **kwargs,
    )
    seen: list[list[int]] = []
    epochs = 0
    run = loop() if isinstance(loop, type) else loop
    try:
        while epochs < 400 and not loader.tuned:
            seen += run(loader, 1)
            time.sleep(0.05)  # the loop's validation, off the trials' clocks
            epochs += 1
    finally:
        loader.close()
    # DataLoader's batches and draws under the same loop (one that asks past the end
    # makes RandomSampler draw once more).
    generator = torch.Generator().manual_seed(7)
    reference = loop() if isinstance(loop, type) else loop
    assert seen == reference(DataLoader(dataset, generator=generator, **kwargs), epochs)
    assert torch.equal(loader.generator.get_state(), generator.get_state())
    assert loader.result is not None
    trials = loader.result.trials
    assert any(t.state == "complete" and t.params["num_workers"] > 0 for t in trials), trials
    assert all(t.samples_per_second is None or t.samples_per_second < 1e7 for t in trials)


class _SlowFirstItem(Dataset[int]):
    """Item 0 takes ``first`` seconds to read, the rest none: a slow start-up."""

    def __init__(self, length: int, first: float) -> None:
        self.length, self.first = length, first

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> int:
        if index == 0:
            time.sleep(self.first)
        return index


def _trial_of_one_second(dataset: Dataset[Any]) -> tuple[LiveTrial, Feed]:
    """A live trial of 1 s without workers over an epoch of ``dataset``'s 48 items in
    batches of 4, in order, and its feed."""
    feed = Feed(EpochBatches(iter(torch.arange(48).view(12, 4).tolist())))
    loader = DataLoader(dataset, batch_sampler=feed)
    params = {"num_workers": 0}
    trial = LiveTrial(
        loader, feed, params, batch_size=4, memory_budget=None, max_seconds=1.0, deadlines=None
    )
    return trial, feed


class _SignalledAtStart(DataLoader[Any]):
    """A loader whose iterator, once started, gets a SIGCHLD as a worker's death sends
    (the death itself is faked by the test)."""

    def __iter__(self) -> Any:
        iterator = super().__iter__()
        os.kill(os.getpid(), signal.SIGCHLD)
        return iterator


def test_a_prestart_that_fails_hands_its_batches_to_the_next_start(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A worker of the next trial dies as its loader starts ahead of the loop (NOTE [
    Overlapped start-up ]): the start fails, after it was handed its 2 workers x 2
    batches, and its workers are killed, not waited for (an abandoned shutdown waits 5 s
    for each live one). The first next() starts the loader again: those batches come
    first, in order, none lost (left in the feed, the new start asked for the ones after
    them: the loop got batches 4 to 11 alone)."""
    feed = Feed(EpochBatches(iter(torch.arange(48).view(12, 4).tolist()), length=12))
    params = {"num_workers": 2, "prefetch_factor": 2}
    loader = _SignalledAtStart(SleepDataset(48, latency=0.0), batch_sampler=feed, **params)
    trial = LiveTrial(
        loader, feed, params, batch_size=4, memory_budget=None, max_seconds=60.0, deadlines=None
    )
    deaths: list[bool] = []
    killed: list[int] = []

    def a_worker_died() -> None:  # at the first start; none after
        if not deaths:
            deaths.append(True)
            assert feed.in_flight == 4  # the workers were handed their first batches
            raise RuntimeError("DataLoader worker (pid 1) is killed by signal: Killed.")

    def kill(pids: Any) -> None:
        pids = list(pids)
        killed.extend(pids)
        real_kill(pids)

    supervision = autoloader.measure._supervision
    real_kill = supervision.kill
    monkeypatch.setattr(supervision, "raise_if_any_worker_failed", a_worker_died)
    monkeypatch.setattr(supervision, "kill", kill)
    seen = []
    try:
        trial.prestart()
        assert trial.iterator is None and feed.in_flight == 0
        with pytest.raises(StopIteration):
            while True:
                seen.append(_ids(trial.next()))
    finally:
        trial.end()
        trial.close()
    assert len(killed) == 2  # the failed start's two workers
    assert seen == torch.arange(48).view(12, 4).tolist()


class _EndsShort(DataLoader[Any]):
    """A loader whose iterator asks its sampler for every batch and delivers the first
    five alone, as DataLoader's iterator does when it skips a dead worker's tasks."""

    def __iter__(self) -> Any:
        batches = [self.collate_fn([self.dataset[i] for i in ids]) for ids in self.batch_sampler]
        return iter(batches[:5])


def test_a_loader_that_ends_short_fails_and_gives_its_batches_back() -> None:
    """NOTE [ A loader that ends short ]: its end, passed up, ended the loop's epoch at
    batch 5 of 12; it is the setting's failure, and the 7 batches go back to the epoch."""
    epoch = EpochBatches(iter(torch.arange(48).view(12, 4).tolist()), length=12)
    feed = Feed(epoch)
    loader = _EndsShort(SleepDataset(48, latency=0.0), batch_sampler=feed)
    trial = LiveTrial(
        loader,
        feed,
        {"num_workers": 0},
        batch_size=4,
        memory_budget=None,
        max_seconds=60.0,
        deadlines=None,
    )
    seen = []
    try:
        with pytest.raises(TrialEnded):
            while True:
                seen.append(_ids(trial.next()))
    finally:
        trial.end()
        trial.close()
    assert seen == torch.arange(20).view(5, 4).tolist()
    assert isinstance(trial.outcome, TrialError)
    assert "ended with 7 batch(es) it was handed not delivered" in str(trial.outcome)
    assert [epoch.take() for _ in range(7)] == torch.arange(20, 48).view(7, 4).tolist()


@pytest.mark.light  # mostly waits
def test_a_live_trials_time_starts_at_its_first_batch() -> None:
    """A trial of 1 s whose first batch takes 1.5 s still has its 1 s to measure in
    (NOTE [ A live trial's time starts at its first batch ])."""
    trial, _ = _trial_of_one_second(_SlowFirstItem(48, first=1.5))
    try:
        assert trial.next().tolist() == [0, 1, 2, 3]
        assert trial.next().tolist() == [4, 5, 6, 7]
        assert trial.outcome is None  # 1.5 s after its start, not ended
        assert trial.time_to_first_batch is not None and trial.time_to_first_batch >= 1.5
    finally:
        trial.end()
        trial.close()


@pytest.mark.light  # mostly waits
def test_the_loops_work_between_epochs_is_off_a_trials_time() -> None:
    """A trial of 1 s, an epoch of 12 instant batches, then 1.5 s of the loop's own work
    (a validation): the trial waits at the epoch's edge and goes on with the next
    epoch's batches, its time not spent (NOTE [ Live trials span epochs ])."""
    trial, feed = _trial_of_one_second(SleepDataset(length=48, latency=0.0))
    try:
        epoch = []
        with pytest.raises(StopIteration):
            while True:
                epoch.append(_ids(trial.next()))
        assert len(epoch) == 12 and trial.outcome is None  # at the edge, not ended
        time.sleep(1.5)
        trial.resume(EpochBatches(iter(torch.arange(48).view(12, 4).flip(0).tolist())))
        assert _ids(trial.next()) == [44, 45, 46, 47]  # the next epoch's first batch
        assert _ids(trial.next()) == [40, 41, 42, 43]  # its 1 s not up: the edge was off it
        assert trial.outcome is None and feed.delivered_count == 14
    finally:
        trial.end()
        trial.close()
    assert trial.outcome is not None and trial.outcome.batches >= 1


def test_a_trial_the_loop_leaves_at_an_epochs_edge_is_recorded_with_what_it_measured() -> None:
    """The loop ends (``close()``) while a trial waits for the next epoch: the trial is
    ended and recorded there, with no rate where it delivered nothing, and its workers
    stopped (the test fails if any is left)."""
    dataset = SleepDataset(length=48, latency=0.002)
    loader = AutoLoader(
        dataset,
        batch_size=4,
        time_budget=30,
        search_space={"num_workers": (2, 4), "prefetch_factor": 4, "worker_kind": "processes"},
        verbose=False,
    )
    _epochs(loader, 3)
    assert loader.tuning is not None and loader.tuning.carried is not None
    loader.close()
    assert loader.tuning.carried is None
    assert len(loader.history) >= 1
    assert all(t.samples_per_second is None or t.samples_per_second < 1e7 for t in loader.history)


def test_a_distributed_sampler_set_epoch_orders_as_with_dataloader() -> None:
    dataset = SleepDataset(length=96, latency=0.0)
    sampler = DistributedSampler(dataset, num_replicas=2, rank=1, shuffle=True, seed=5)
    reference = DistributedSampler(dataset, num_replicas=2, rank=1, shuffle=True, seed=5)
    loader = AutoLoader(dataset, batch_size=8, sampler=sampler, time_budget=2, verbose=False)
    plain = DataLoader(dataset, batch_size=8, sampler=reference)
    try:
        for epoch in range(3):
            sampler.set_epoch(epoch)
            reference.set_epoch(epoch)
            assert [_ids(b) for b in loader] == [_ids(b) for b in plain]
    finally:
        loader.close()
    assert loader.sampler is sampler and loader.dataset is dataset and loader.batch_size == 8


# Faults stay out of the loop -------------------------------------------------------------


@pytest.mark.light  # mostly waits
@pytest.mark.slow
@pytest.mark.parametrize("fault", ["SIGKILL"])
def test_workers_that_die_above_one_worker_lose_no_batch(fault: str) -> None:
    """Workers with an id of 1 and above die after loading 5 items, mid-trial: the loop
    never sees it, every epoch is DataLoader's, and the failures are recorded."""
    dataset = FaultInWorkersDataset(fault, length=240, from_worker=1, after=5)
    kwargs = {"batch_size": 8, "shuffle": True}
    loader = AutoLoader(
        dataset,
        generator=torch.Generator().manual_seed(7),
        time_budget=6,
        search_space={"num_workers": (1, 4), "worker_kind": ("processes",)},
        verbose=False,
        **kwargs,
    )
    try:
        seen, epochs = _until_tuned(loader)
    finally:
        loader.close()
    assert seen == _reference(dataset, epochs, **kwargs)[0]
    assert loader.failures, "the dying workers were not recorded"
    failed = [
        t
        for t in loader.history
        if t.state != "complete" and t.kind in ("killed", "worker crashed")
    ]
    assert failed, [(t.state, t.kind) for t in loader.history]
    assert loader.result is not None and loader.result.params["num_workers"] <= 1


@pytest.mark.light  # mostly waits
@pytest.mark.slow
def test_a_hanging_worker_is_stopped_and_its_batches_loaded_by_the_last_good_setting() -> None:
    dataset = FaultInWorkersDataset("hang", length=160, from_worker=1, after=3)
    kwargs = {"batch_size": 8}
    loader = AutoLoader(
        dataset,
        time_budget=8,
        search_space={"num_workers": (2, 2), "worker_kind": ("processes",)},
        verbose=False,
        **kwargs,
    )
    seen: list[list[int]] = []
    epochs = 0
    try:
        # Until the setting with workers has run (the baseline's trial may span epochs).
        while epochs < 4 or (epochs < 40 and not loader.failures and not loader.tuned):
            seen += _epochs(loader, 1)
            epochs += 1
    finally:
        loader.close()
    expected, _ = _reference(dataset, epochs, **kwargs)
    assert seen == expected
    # Stopped as hung (at its deadline), not as crashed or raising.
    hung = [t for t in loader.history if t.state == "failed" and t.kind == "timeout"]
    assert hung, loader.history
    assert any("TrialTimeout: no progress for" in f for f in loader.failures), loader.failures


@pytest.mark.slow
def test_a_setting_over_the_memory_budget_is_stopped_without_losing_a_batch() -> None:
    """Each worker holds 400 MiB: two pass a budget of 500 MiB over the tree."""
    import psutil

    used = psutil.Process().memory_info().rss
    dataset = MemoryHogDataset(400 << 20, length=400)
    loader = AutoLoader(
        dataset,
        batch_size=8,
        time_budget=6,
        memory_budget=used + (500 << 20),
        search_space={"num_workers": (2, 3), "worker_kind": ("processes",)},
        verbose=False,
    )
    seen: list[list[int]] = []
    epochs = 0
    try:
        # Until a setting with workers has run (the baseline's trial may span epochs).
        while epochs < 3 or (epochs < 30 and not loader.failures and not loader.tuned):
            seen += _epochs(loader, 1)
            epochs += 1
    finally:
        loader.close()
    assert seen == _reference(dataset, epochs, batch_size=8)[0]
    assert any(t.state == "pruned" and "memory" in (t.reason or "") for t in loader.history)


def test_an_error_of_the_dataset_under_every_setting_reaches_the_loop_as_dataloaders() -> None:
    dataset = FailingDataset(length=64, latency=0.0, bad=20)
    with pytest.raises(ValueError, match="corrupt record 20"):
        for _ in DataLoader(dataset, batch_size=8):
            pass
    loader = AutoLoader(dataset, batch_size=8, time_budget=4, verbose=False)
    seen = []
    with pytest.raises(ValueError, match="corrupt record 20"):
        for batch in loader:
            seen.append(_ids(batch))
    loader.close()
    assert seen == [list(range(8)), list(range(8, 16))]


# Saved and reused ------------------------------------------------------------------------


@pytest.mark.slow  # over 2.5 s here: the full suite's (docs/development/checks.md)
def test_the_next_run_reuses_the_saved_settings_and_a_changed_dataset_tunes_again(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "loader.json"
    dataset = SleepDataset(length=120, latency=0.001)
    first = AutoLoader(dataset, batch_size=8, time_budget=3, path=path, verbose=False)
    try:
        _until_tuned(first, after=0)
    finally:
        first.close()
    assert first.tuned and path.exists()
    saved = json.loads(path.read_text())
    assert saved["params"] == first.result.params  # type: ignore[union-attr]

    caplog.set_level(logging.INFO, logger="autoloader")
    second = AutoLoader(dataset, batch_size=8, time_budget=3, path=path, verbose=False)
    try:
        seen = _epochs(second, 1)
    finally:
        second.close()
    assert second.tuned and second.result.params == first.result.params  # type: ignore[union-attr]
    assert "reusing" in caplog.text
    _every_sample_once(seen, 120, 1)

    caplog.clear()
    changed = AutoLoader(
        SleepDataset(length=130), batch_size=8, time_budget=2, path=path, verbose=False
    )
    try:
        _epochs(changed, 1)
    finally:
        changed.close()
    assert "not reusing" in caplog.text and "dataset length: 120 then, 130 now" in caplog.text


@pytest.mark.slow  # over 2.5 s here: the full suite's (docs/development/checks.md)
def test_a_reused_setting_checked_slower_only_beside_other_processes_is_kept_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """NOTE [ A reused setting checked ]: loading 3.5x slower (a latency the file's
    description does not see), its first batches' check fails; where other processes
    held the CPUs through it (all: a slowdown of up to 4x on 2 CPUs theirs), the setting
    is kept, unconfirmed, with a warning; where they were free, the slowdown is the
    pipeline's and it is tuned again. Two workers: five, chosen beside busy CPUs, kept
    up with the slower reads, and the check held."""
    path = tmp_path / "loader.json"
    space = autoloader.SearchSpace(num_workers=2, prefetch_factor=2, persistent_workers=True)
    kwargs: dict[str, Any] = {"batch_size": 8, "time_budget": 3, "path": path, "verbose": False}
    kwargs["search_space"] = space
    first = AutoLoader(SleepDataset(length=120, latency=0.001), **kwargs)
    try:
        _until_tuned(first, after=0)
    finally:
        first.close()
    assert first.tuned and path.exists()
    caplog.set_level(logging.INFO, logger="autoloader")
    for busy in (True, False):
        caplog.clear()
        monkeypatch.setattr(_CpuUse, "free", lambda self, busy=busy: 0.0 if busy else 99.0)
        slower = AutoLoader(SleepDataset(length=120, latency=0.0035), **kwargs)
        try:
            _every_sample_once(_epochs(slower, 3), 120, 3)
        finally:
            slower.close()
        warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        if busy:
            assert slower.tuned and slower.result.params == first.result.params  # type: ignore[union-attr]
            note = slower.result.notes[-1]  # type: ignore[union-attr]
            assert note.startswith("reused unconfirmed: its check found "), note
            assert "but other processes used the CPUs meanwhile (0.0 of " in note
            assert note.endswith(", a busy machine, not a changed pipeline")
            assert warnings == [f"AutoLoader: {path}: {note}"]
        else:
            assert warnings and warnings[0].startswith(f"AutoLoader: not reusing {path}: ")


@pytest.mark.calm  # reads a busy child's CPU time: beside the suite and a busy loop, short once
def test_the_cpu_time_of_the_loops_own_workers_is_not_others() -> None:
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.3)  # its start-up, before the readings
        theirs, ours = _CpuUse(), _CpuUse(lambda: [busy.pid])
        time.sleep(0.5)
        free, own_free = theirs.free(), ours.free()
    finally:
        busy.kill()
        busy.wait()
    assert own_free > free + 0.3  # its CPU moved from the others' to the loop's


def _next_run(dataset: Dataset[Any], kwargs: dict[str, Any]) -> tuple[AutoLoader[Any], list[Any]]:
    """An AutoLoader of a 4 s budget trained until tuned, closed; and its search's trials."""
    loader = AutoLoader(dataset, time_budget=4, **kwargs)
    try:
        _until_tuned(loader, after=0)
        tuning = loader.tuning
        assert tuning is not None
        return loader, list(tuning.history)
    finally:
        loader.close()


@pytest.mark.slow  # over 2.5 s here: the full suite's (docs/development/checks.md)
def test_a_run_shorter_than_the_budget_leaves_its_search_for_the_next_to_continue(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """NOTE [ An unfinished search kept ]: the first run trains 2 epochs of a 60 s budget;
    the next continues its study (its trials not measured again), tunes, saves the
    result and removes the study; nothing of the search outlives either loader."""
    path = tmp_path / "loader.json"
    study = tmp_path / "loader.json.study"
    dataset = SleepDataset(length=240, latency=0.001)
    kwargs: dict[str, Any] = {"batch_size": 8, "path": path, "verbose": False}
    first = AutoLoader(dataset, time_budget=60, **kwargs)
    try:
        seen = _epochs(first, 2)
    finally:
        first.close()
    finished = first.history  # the trial under way when it closed, told as it stood
    assert not first.tuned and finished, finished
    assert "autoloader-heartbeat" not in [t.name for t in threading.enumerate()]
    assert study.exists() and not path.exists()
    _every_sample_once(seen, 240, 2)

    caplog.set_level(logging.INFO, logger="autoloader")
    second, history = _next_run(dataset, kwargs)
    earlier = [t for t in history if t.earlier]
    assert second.tuned and path.exists() and not study.exists()
    assert [t.params for t in earlier] == [t.params for t in finished]
    baselines = [t for t in second.result.trials if t.phase == "baseline"]  # type: ignore[union-attr]
    assert len(baselines) == 1, "the first run's baseline was measured again"
    assert any("earlier run" in note for note in second.result.notes), second.result.notes  # type: ignore[union-attr]
    assert "autoloader-heartbeat" not in [t.name for t in threading.enumerate()]


@pytest.mark.slow  # over 2.5 s here: the full suite's (docs/development/checks.md)
def test_the_next_run_continues_the_search_though_its_workers_start_slower(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """NOTE [ A study named by what stays ]: the cap that worker start-up puts on
    num_workers moves with the budget and the machine's load; the next run's study is
    the first's all the same. (Beside another test process, the next run of the test
    above measured its baseline again: its start-up check capped the workers.)"""
    path = tmp_path / "loader.json"
    dataset = SleepDataset(length=240, latency=0.001)
    kwargs: dict[str, Any] = {"batch_size": 8, "path": path, "verbose": False}
    first = AutoLoader(dataset, time_budget=60, **kwargs)
    try:
        _epochs(first, 1)
    finally:
        first.close()
    finished = first.history
    assert finished and not first.tuned

    startup = autoloader._session._startup

    def slow(problem: Any, facts: dict[str, Any]) -> Any:
        measured = startup(problem, facts)
        return None if measured is None else dataclasses.replace(measured, seconds=1.0)

    monkeypatch.setattr(autoloader._session, "_startup", slow)
    _, history = _next_run(dataset, kwargs)
    earlier = [t for t in history if t.earlier]
    searched = [t.params["num_workers"] for t in history if not t.earlier]
    assert [t.params for t in earlier] == [t.params for t in finished]
    # The search kept to the cap: the workers that start in two trials' time.
    assert max(searched, default=0) <= 2 * trial_seconds(4) / 1.0


# Bad input ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"num_workers": 4}, "AutoLoader chooses num_workers itself"),
        ({"pin_memory": True}, "AutoLoader chooses pin_memory itself"),
        ({"persistent_workers": True}, "persistent_workers"),
        ({"time_budget": -1}, "time_budget must be positive"),
        ({"path": "."}, "is a directory"),
    ],
)
def test_bad_arguments_are_refused_before_any_work(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(InvalidInputError, match=message):
        AutoLoader(SleepDataset(length=16), **{"batch_size": 4, **kwargs})


def test_an_iterable_dataset_or_a_batch_sampler_is_passed_through_untuned() -> None:
    """Never refused: DataLoader's, untuned (tests/test_dropin.py compares the batches)."""
    stream = AutoLoader(ShardedStream(), batch_size=4, num_workers=2, verbose=False)
    assert stream.untuned is not None and "IterableDataset" in stream.untuned
    assert stream.num_workers == 2 and not stream.tuned
    batches = torch.utils.data.BatchSampler(range(16), 4, False)
    sampled = AutoLoader(SleepDataset(length=16), batch_sampler=batches, verbose=False)
    assert sampled.untuned is not None and "batch_sampler" in sampled.untuned
    assert len(list(sampled)) == 4


def test_autoloader_is_exported() -> None:
    assert autoloader.AutoLoader is AutoLoader


def test_its_search_follows_the_rules_of_a_search_in_training() -> None:
    # NOTE [ Enough searching ] and NOTE [ The baseline in training ]: the policy knows
    # its trials are the training's own.
    loader = AutoLoader(SleepDataset(512, 0.0005), batch_size=16, time_budget=4)
    batches = iter(loader)
    next(batches)
    assert loader.tuning is not None and loader.tuning.search is not None
    session = loader.tuning.search.session
    assert session is not None
    policy = session.driver.policy
    assert policy.in_training and not policy.runoff_baseline
    loader.close()


@pytest.mark.slow  # over 2.5 s here: the full suite's (docs/development/checks.md)
def test_close_puts_back_the_threads_found_and_a_later_epoch_sets_the_chosen_again() -> None:
    """NOTE [ Threads put back ]: the chosen step_threads are the process's while it
    trains; close() puts back those it had when the AutoLoader was made (a full run's
    AutoLoader left 1 of 2 set after close()); an epoch after close() sets them again."""
    found = torch.get_num_threads()
    chosen = 1 if found > 1 else 2
    space = {"num_workers": 2, "worker_kind": "processes", "step_threads": (chosen, chosen)}
    loader = AutoLoader(
        SleepDataset(length=256, latency=0.002),  # two workers load twice as fast
        batch_size=8,
        time_budget=4,
        search_space=space,
        verbose=False,
    )
    try:
        _until_tuned(loader, after=0)
        assert loader.result is not None and loader.result.params["step_threads"] == chosen
        threads = [torch.get_num_threads() for _ in loader]
        assert set(threads) == {chosen}
        loader.close()
        assert torch.get_num_threads() == found
        assert {torch.get_num_threads() for _ in loader} == {chosen}  # a later epoch
    finally:
        loader.close()
    assert torch.get_num_threads() == found
