"""AutoLoader as a drop-in DataLoader (issue 38, item 0): what DataLoader takes it takes,
passing through untuned what it cannot tune; a batch that raises is consumed and the
loop goes on; workers' pickling is asked only where a worker would need it; DataLoader's
own errors in its words; nothing printed with ``verbose=False``."""

from __future__ import annotations

import logging
import multiprocessing
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import BatchSampler, DataLoader, RandomSampler

from autoloader import AutoLoader
from autoloader.checks import unpicklable
from tests.workloads import FailingDataset, ShardedStream, SleepDataset

_ROOT = Path(__file__).resolve().parents[1]


def _batches(loader: Any, epochs: int = 2) -> list[torch.Tensor]:
    return [batch for _ in range(epochs) for batch in loader]


def _same(got: list[Any], expected: list[Any]) -> None:
    assert len(got) == len(expected)
    for a, b in zip(got, expected, strict=True):
        assert torch.equal(a, b)


# Passed through untuned: DataLoader's batches, the truth said ------------------------------


@pytest.mark.parametrize(
    ("dataset", "kwargs", "because"),
    [
        (ShardedStream(length=40), {"batch_size": 4}, "IterableDataset"),
        (ShardedStream(length=40), {"batch_size": 4, "num_workers": 2}, "IterableDataset"),
        (SleepDataset(length=30, latency=0.0), {"batch_size": None}, "batch_size=None"),
        (
            SleepDataset(length=30, latency=0.0),
            {"batch_size": None, "shuffle": True},
            "batch_size=None",
        ),
        (
            SleepDataset(length=30, latency=0.0),
            {"batch_sampler": BatchSampler(range(30), 4, drop_last=False)},
            "batch_sampler",
        ),
        (
            SleepDataset(length=30, latency=0.0),
            {"batch_size": 4, "shuffle": True, "in_order": False},
            "in_order=False",
        ),
    ],
)
def test_what_it_cannot_tune_is_dataloaders_batch_for_batch_and_says_so(
    dataset: Any, kwargs: dict[str, Any], because: str, caplog: pytest.LogCaptureFixture
) -> None:
    if "batch_sampler" in kwargs:  # one per loader: a sampler is not shared
        kwargs_auto = {**kwargs, "batch_sampler": BatchSampler(range(30), 4, drop_last=False)}
    else:
        kwargs_auto = kwargs
    expected = _batches(DataLoader(dataset, generator=torch.Generator().manual_seed(3), **kwargs))
    caplog.set_level(logging.INFO, logger="autoloader")
    loader = AutoLoader(
        dataset, generator=torch.Generator().manual_seed(3), verbose=False, **kwargs_auto
    )
    try:
        got = _batches(loader)
    finally:
        loader.close()
    _same(got, expected)
    assert loader.untuned is not None and because in loader.untuned
    assert not loader.tuned and loader.result is None and loader.history == []
    assert loader.failures == [] and loader.setting is None
    assert "not tuned" in loader.report() and because in loader.report()
    notes = [r for r in caplog.records if "not tuning" in r.getMessage()]
    assert len(notes) == 1 and notes[0].levelno == logging.WARNING


def test_a_tunable_loader_says_it_is_not_passed_through() -> None:
    loader = AutoLoader(SleepDataset(length=16), batch_size=4, verbose=False)
    assert loader.untuned is None
    loader.close()


def test_dataloaders_own_errors_are_raised_in_its_words() -> None:
    dataset = SleepDataset(length=16)
    with pytest.raises(ValueError, match="timeout option should be non-negative"):
        AutoLoader(dataset, batch_size=4, timeout=-1)
    with pytest.raises(ValueError, match="mutually exclusive"):
        AutoLoader(dataset, batch_size=None, drop_last=True)
    with pytest.raises(ValueError, match="sampler option is mutually exclusive with shuffle"):
        AutoLoader(dataset, batch_size=4, shuffle=True, sampler=RandomSampler(dataset))
    # DataLoader refuses a start method without workers, where nothing would use it, and
    # so does AutoLoader where it may choose a setting without; with worker processes
    # only, it takes it for them (NOTE [ A rebuilt AutoLoader ]; test_autoloader_lightning).
    workers = {"num_workers": (1, 4)}
    for context in ("spawn", multiprocessing.get_context("spawn")):
        with pytest.raises(ValueError, match=r"multi-process loading \(num_workers > 0\)"):
            DataLoader(dataset, batch_size=4, multiprocessing_context=context)
        with pytest.raises(ValueError, match=r"multi-process loading \(num_workers > 0\)"):
            AutoLoader(dataset, batch_size=4, multiprocessing_context=context)
        loader = AutoLoader(
            dataset, batch_size=4, multiprocessing_context=context, search_space=workers
        )
        assert loader.multiprocessing_context.get_start_method() == "spawn"
    with pytest.raises(ValueError, match="should specify a valid start method"):
        AutoLoader(dataset, batch_size=4, multiprocessing_context="bad")


# A batch that raises is consumed, as DataLoader consumes it ---------------------------------


def _skipping_bad(loader: Any, epochs: int) -> tuple[list[list[int]], int]:
    """Every batch's ids over ``epochs``, a loop that skips a batch that raises."""
    seen: list[list[int]] = []
    errors = 0
    for _ in range(epochs):
        iterator = iter(loader)
        while True:
            try:
                batch = next(iterator)
            except StopIteration:
                break
            except ValueError as error:
                assert "corrupt record" in str(error)
                errors += 1
                continue
            time.sleep(0.002)
            seen.append(batch[:, 0].long().tolist())
    return seen, errors


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.slow  # over 2.5 s here: the full suite's (docs/development/checks.md)
def test_a_loop_that_skips_a_bad_batch_gets_every_other_one_while_tuning_and_after(
    workers: int,
) -> None:
    dataset = FailingDataset(length=96, latency=0.0005, bad=21)
    epochs = 6
    reference = DataLoader(
        dataset,
        batch_size=4,
        shuffle=True,
        num_workers=workers,
        generator=torch.Generator().manual_seed(5),
    )
    expected, expected_errors = _skipping_bad(reference, epochs)
    assert expected_errors == epochs
    search = None if workers == 0 else {"num_workers": (0, workers)}
    loader = AutoLoader(
        dataset,
        batch_size=4,
        shuffle=True,
        generator=torch.Generator().manual_seed(5),
        time_budget=2,
        search_space=search,
        verbose=False,
    )
    try:
        seen, errors = _skipping_bad(loader, epochs)
        while not loader.tuned:  # then an epoch after tuning
            _skipping_bad(loader, 1)
        after, after_errors = _skipping_bad(loader, 1)
    finally:
        loader.close()
    assert errors == epochs and seen == expected
    ids = [i for batch in after for i in batch]
    assert after_errors == 1 and len(after) == 96 // 4 - 1
    assert 21 not in ids and len(set(ids)) == len(ids) == 96 - 4


def test_every_batch_raising_raises_once_each_as_dataloader() -> None:
    """PyTorch's own ``_test_error``: a dataset without ``__getitem__``."""

    class NoItems(torch.utils.data.Dataset[Any]):
        def __len__(self) -> int:
            return 20

    def errors(loader: Any) -> int:
        count, iterator = 0, iter(loader)
        while True:
            try:
                next(iterator)
            except NotImplementedError:
                count += 1
            except StopIteration:
                return count

    loader = AutoLoader(NoItems(), batch_size=2, shuffle=True, time_budget=2, verbose=False)
    try:
        assert errors(loader) == errors(DataLoader(NoItems(), batch_size=2, shuffle=True)) == 10
    finally:
        loader.close()


# Pickling: asked where a worker would need it, as the workers pickle -------------------------


class _SharedCounter(torch.utils.data.Dataset[torch.Tensor]):
    """Holds a ``multiprocessing.Value``, as PyTorch's own SynchronizedDataset does."""

    def __init__(self) -> None:
        self.count = multiprocessing.get_context("spawn").Value("i", 0, lock=True)

    def __len__(self) -> int:
        return 8

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.tensor([index])


@pytest.mark.slow  # over 2.5 s here: the full suite's (docs/development/checks.md)
def test_a_dataset_holding_a_multiprocessing_value_pickles_as_into_a_worker() -> None:
    dataset = _SharedCounter()
    assert unpicklable({"dataset": dataset}, "spawn") is None
    expected = list(
        DataLoader(dataset, batch_size=2, num_workers=1, multiprocessing_context="spawn")
    )
    assert [b.tolist() for b in expected] == [[[0], [1]], [[2], [3]], [[4], [5]], [[6], [7]]]
    local = lambda index: index  # noqa: E731
    problem = unpicklable({"dataset": dataset, "collate_fn": local}, "spawn")
    assert problem is not None and "collate_fn" in problem
    assert unpicklable({"collate_fn": local}, "fork") is None


@pytest.mark.slow  # over 2.5 s here: the full suite's (docs/development/checks.md)
def test_an_unpicklable_dataset_under_spawn_is_loaded_without_workers() -> None:
    """DataLoader with num_workers=0 pickles nothing: AutoLoader neither refuses it nor
    fails a setting on it; it tunes without workers, and says why."""
    script = textwrap.dedent(
        """
        import logging, sys, time
        import torch
        import torch.multiprocessing as mp
        from torch.utils.data import DataLoader
        from autoloader import AutoLoader
        from tests.workloads import SleepDataset

        logging.basicConfig(level=logging.WARNING, stream=sys.stdout, format="%(message)s")
        mp.set_start_method("spawn", force=True)

        def main():
            class Local(SleepDataset):  # a local class: spawn cannot pickle it
                pass

            dataset = Local(length=64, latency=0.0)
            loader = AutoLoader(dataset, batch_size=8, time_budget=2, verbose=False)
            seen = []
            while not loader.tuned:
                for batch in loader:
                    time.sleep(0.002)
                    seen.append(batch)
            loader.close()
            expected = list(DataLoader(dataset, batch_size=8))
            assert all(torch.equal(a, b) for a, b in zip(seen, expected * 100))
            print("chosen", loader.result.params["num_workers"], loader.failures)

        main()
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=_ROOT, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert "tuning without workers" in done.stdout and "cannot be pickled" in done.stdout
    assert "chosen 0 []" in done.stdout


# Quiet where the application configured no logging -------------------------------------------


@pytest.mark.slow  # over 2.5 s here: the full suite's (docs/development/checks.md)
def test_nothing_reaches_stderr_with_verbose_false_and_no_logging_configured() -> None:
    script = textwrap.dedent(
        """
        import time
        from autoloader import AutoLoader
        from tests.workloads import FailsInWorkersDataset, ShardedStream

        AutoLoader(ShardedStream(length=8), batch_size=4, verbose=False)  # passed through
        loader = AutoLoader(
            FailsInWorkersDataset(length=64, latency=0.0), batch_size=4, time_budget=2,
            verbose=False,
        )
        while not loader.tuned:  # a setting with workers fails: warned, to the logger
            for batch in loader:
                time.sleep(0.002)
        loader.close()
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=_ROOT, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""
