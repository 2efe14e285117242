"""The checks made before the search, with real forked processes and real workers: the
facts they find, the deadlines that bound them, and the datasets they refuse."""

from __future__ import annotations

import multiprocessing
import re
import time
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import Dataset, TensorDataset

from autoloader import InvalidInputError
from autoloader.checks._copy_on_read import _probe, copied_per_worker
from autoloader.checks._facts import Checks, same_samples
from autoloader.checks._forked import run_forked
from benchmarks.copy_on_read import Memo, Records, RewrittenCache

from .workloads import AugmentedDataset, HangsIn, SleepDataset, Stream, TorchOpsDataset


def _checks(dataset: Any, *, seconds: float = 10.0, batch_size: int = 1) -> Checks:
    return Checks(dataset, {}, batch_size=batch_size, seconds=seconds)


def dataset_facts(dataset: Any, length: int, *, start_method: str = "fork") -> dict[str, Any]:
    """The facts tune() measures before its search, given time enough for every check."""
    return _checks(dataset).facts(length, start_method=start_method)


class OwnGeneratorDataset(Dataset[torch.Tensor]):
    """Augments with a generator it holds: forked workers each get the same copy."""

    def __init__(self) -> None:
        self.rng = np.random.default_rng(0)

    def __len__(self) -> int:
        return 8

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.tensor(self.rng.random(3) + index)


def test_facts_tell_workers_that_repeat_randomness_from_those_that_do_not() -> None:
    repeating = dataset_facts(OwnGeneratorDataset(), 8)
    assert repeating["random_items"] is True and repeating["workers_repeat_randomness"] is True
    # numpy's global generator, which DataLoader seeds per worker
    seeded = dataset_facts(AugmentedDataset(8), 8)
    assert seeded["random_items"] is True and seeded["workers_repeat_randomness"] is False
    plain = dataset_facts(TensorDataset(torch.arange(8)), 8)
    assert plain["random_items"] is False and plain["workers_repeat_randomness"] is None
    assert plain["dataset_length"] == 8 and plain["shm_bytes"] and plain["shm_bytes"] > 0
    assert dataset_facts(SleepDataset(4), 4)["random_items"] is False
    assert plain["missing"] == {}


def test_a_workers_start_up_is_measured_for_map_and_iterable_datasets() -> None:
    """The first item of one worker, started as the loader starts its workers: of item 0
    for a map-style dataset, of whatever comes first from an IterableDataset (which
    takes no sampler)."""
    for dataset, length in ((SleepDataset(64), 64), (Stream(shard=True), None)):
        facts = dataset_facts(dataset, length)  # type: ignore[arg-type]
        assert facts["missing"] == {}, facts["missing"]
        assert facts["worker_start_seconds"] is not None
        assert facts["worker_start_seconds"] >= 0 and not facts["worker_start_at_least"]
        assert facts["start_method"] == "fork"
    checks = Checks(SleepDataset(64), {}, batch_size=1, seconds=10.0, processes=False)
    no_workers = checks.facts(64, start_method="fork")
    assert no_workers["worker_start_seconds"] is None and no_workers["missing"] == {}


# Copy-on-read ---------------------------------------------------------------------


def test_the_probe_finds_copy_on_read_in_python_objects_and_not_in_tensors() -> None:
    records = dataset_facts(Records(100_000), 100_000)
    tensors = dataset_facts(TensorDataset(torch.randn(100_000, 16)), 100_000)
    assert records["copy_on_read_items"] and tensors["copy_on_read_items"]
    assert records["copy_on_read"] > 10 * max(tensors["copy_on_read"], 100.0)
    assert copied_per_worker(records) is not None and copied_per_worker(tensors) is None
    assert dataset_facts(Records(2_000), 2_000, start_method="spawn")["copy_on_read"] is None


def test_the_probe_ends_after_its_first_run_where_that_copied_too_little_to_advise() -> None:
    """Its other runs can only lower the figure, which would not become advice: the
    probe's time is saved (NOTE [ Copy-on-read probe ])."""

    def probe(dataset: Dataset[Any]) -> tuple[list[int | None], int, int]:
        fresh = list(range(32, 100_000, 11))
        runs = ([i for i in fresh if i < 50_000], [i for i in fresh if i >= 50_000])
        arguments = (dataset, list(range(32)), runs, 0.8)
        return run_forked(_probe, arguments, seconds=60, stage="the probe", name="probe")

    (first, again, second), items, second_items = probe(TensorDataset(torch.randn(100_000, 16)))
    assert first is not None and items > 0
    assert (again, second, second_items) == (None, None, 0)
    (first, again, second), items, second_items = probe(Records(100_000))
    assert None not in (first, again, second) and items and second_items


@pytest.mark.parametrize(
    "dataset", [Memo(20_000), RewrittenCache(20_000)], ids=["memo", "shared-cache"]
)
def test_the_probe_takes_neither_a_cache_nor_a_one_off_copy_for_copy_on_read(
    dataset: Dataset[Any],
) -> None:
    dataset[0]  # the parent has read, as tune() has before the probe
    facts = dataset_facts(dataset, len(dataset))  # type: ignore[arg-type]
    assert facts["copy_on_read_items"], facts["missing"]
    assert copied_per_worker(facts) is None, facts["copy_on_read"]


# Its probe reads 20,000 items within its share: beside a Lightning DDP fit's ranks and two
# other tests, a quiet full run (2026-11-29) saw it cut short at 6.4 s (7.1 s of the
# test's wall, 3.8 s of its CPU).
@pytest.mark.calm
def test_the_probe_takes_no_reuse_of_the_parents_freed_heap_for_copy_on_read() -> None:
    """A cache filling the free blocks of a fragmented heap the child inherited writes pages
    it shares with its parent: that is the allocator's, not the dataset's copy (19 KB per
    item before the probe took those blocks first; an HDF5 pipeline in a CI run, 2 KiB)."""
    blocks = [bytes(65_536 - 64) + bytes([i % 256]) for i in range(3_000)]
    del blocks[::2]  # about 100 MiB of free, dirty holes in this process's C heap
    dataset = Memo(20_000)
    dataset[0]
    facts = dataset_facts(dataset, len(dataset))
    assert facts["copy_on_read_items"], facts["missing"]
    assert copied_per_worker(facts) is None, facts["copy_on_read"]
    assert blocks


def test_the_probe_reads_safely_after_this_process_ran_torchs_thread_pool() -> None:
    """A process forked after torch's intra-op pool ran deadlocks at its first large op,
    unless it limits itself to one thread first, as DataLoader's workers do."""
    dataset = TorchOpsDataset()
    dataset[0]  # runs the pool here, as loading in the main process does
    facts = dataset_facts(dataset, len(dataset))
    assert "copy_on_read" not in facts["missing"], facts["missing"]
    assert facts["copy_on_read_items"]


# Every check is held to its time ---------------------------------------------------------


# The checks that do not hang must finish in their shares of 2 s: beside a Lightning DDP
# fit's ranks and two other tests, a quiet full run (2026-11-29) found the probe after
# the hung workers' checks cut short too.
@pytest.mark.calm
@pytest.mark.parametrize(
    ("where", "hung"),
    [
        ("probe", ["copy_on_read"]),
        ("workers", ["workers_repeat_randomness", "worker_start"]),
        ("list", ["batched_fetch"]),
        ("item 0 here", ["batched_fetch", "random_items"]),
    ],
)
def test_a_check_that_hangs_costs_its_share_of_the_time_and_no_more(
    where: str, hung: list[str]
) -> None:
    checks = _checks(HangsIn(where, random=True), seconds=2.0, batch_size=4)
    problem = checks.batched_fetch_problem()
    facts = checks.facts(2048, start_method="fork")
    assert list(facts["missing"]) == hung
    for check in hung:
        assert facts["missing"][check].startswith("the check did not finish within ")
        assert "s the checks before the search may take" in facts["missing"][check]
    if "batched_fetch" in hung:
        assert problem is not None and problem.startswith("its check was cut short")


class SlowToGiveUp(HangsIn):
    """Hangs in the copy-on-read probe; its read of a list (the batched-fetch check's)
    blocks, and once its check's time is out takes 1.2 s more to give up."""

    def __getitem__(self, index: Any) -> torch.Tensor:
        if isinstance(index, list):
            try:
                time.sleep(3600)
            finally:
                time.sleep(1.2)
        return super().__getitem__(index)


@pytest.mark.light  # mostly waits
@pytest.mark.slow  # over 2.5 s here: the full suite's (docs/development/checks.md)
def test_a_checks_clean_up_past_its_time_is_not_charged_to_the_checks_after_it() -> None:
    checks = _checks(SlowToGiveUp("probe"), seconds=2.0, batch_size=4)
    problem = checks.batched_fetch_problem()
    assert problem is not None and problem.startswith("its check was cut short")
    assert problem.endswith("; a longer time_budget gives it more)"), problem  # what to do
    facts = checks.facts(2048, start_method="fork")
    # The batched fetch took 1.5 s of the 2.0 s, its 0.3 s share and 1.2 s more: the
    # probe still gets its 0.9 s share, and what the checks before it left of theirs.
    found = re.match(
        r"the check did not finish within (\d\.\d) s", facts["missing"]["copy_on_read"]
    )
    assert found is not None, facts["missing"]
    assert 0.9 <= float(found[1]) <= 1.3


class HangsInTheThreadsCheck(SleepDataset):
    """Reads at once, but hangs in the threads check's forked process."""

    def __getitem__(self, index: int) -> torch.Tensor:
        if multiprocessing.current_process().name == "autoloader-threads-check":
            time.sleep(3600)
        return super().__getitem__(index)


@pytest.mark.light  # mostly waits
def test_without_worker_processes_the_probe_is_not_run_and_its_share_goes_before_it() -> None:
    """The copy-on-read probe's fact is worker processes': searching threads alone, the
    threads check gets its 0.2 of the checks' time, and the probe's 0.45."""
    for processes, (least, most) in ((True, (0.2, 0.4)), (False, (0.6, 0.85))):
        checks = Checks(
            HangsInTheThreadsCheck(2048, latency=0), {}, batch_size=4, seconds=1.0,
            processes=processes,
        )  # fmt: skip
        checks.batched_fetch_problem()
        problem = checks.threads_problem()
        found = re.search(r"did not finish within (\d\.\d) s", problem or "")
        assert found is not None, problem
        assert least <= float(found[1]) <= most, (processes, problem)
    facts = checks.facts(2048, start_method="fork")
    assert facts["copy_on_read"] is None and "copy_on_read" not in facts["missing"]


def test_the_repeated_samples_check_is_held_to_its_time() -> None:
    checks = _checks(Stream(hang_in_workers=True), seconds=2.0, batch_size=4)
    checks.repeated_samples()
    assert checks.missing["repeated_samples"].startswith("the check did not finish within 1.0 s")


def test_a_check_that_raises_says_so() -> None:
    class Broken(SleepDataset):
        def __getitem__(self, index: int) -> torch.Tensor:
            raise KeyError("no such record")

    facts = dataset_facts(Broken(8), 8)
    assert facts["missing"]["random_items"] == "the check failed: KeyError: 'no such record'"


# Workers that repeat each other's samples -------------------------------------------------


@pytest.mark.parametrize(
    ("stream", "refused"),
    [
        (Stream(shard=True), False),
        (Stream(shard=False), True),
        (Stream(shard=False, augment=True), True),  # random tensors, but the same ids
        (Stream(shard=True, augment=True), False),
        (Stream(shard=False, augment=True, ids=False), False),  # nothing tells them apart
    ],
    ids=["sharded", "unsharded", "unsharded-augmented", "sharded-augmented", "no-ids"],
)
def test_workers_that_repeat_each_others_samples_are_refused(stream: Stream, refused: bool) -> None:
    checks = _checks(stream, batch_size=8)
    if not refused:
        checks.repeated_samples()
        assert checks.missing == {}
        return
    with pytest.raises(InvalidInputError, match="repeat each other's samples") as info:
        checks.repeated_samples()
    assert "get_worker_info()" in str(info.value) and "workersplitter" in str(info.value)


def test_same_samples_compares_what_identifies_samples() -> None:
    ids = torch.arange(4)
    first = {"x": torch.rand(4, 2), "id": ids, "key": ["a", "b", "c", "d"]}
    assert same_samples(first, {**first, "x": torch.rand(4, 2)})
    assert not same_samples(first, {**first, "id": ids + 4, "key": ["e", "f", "g", "h"]})
    labels = {"x": torch.rand(4, 2), "label": torch.tensor([0, 1, 0, 1])}
    assert not same_samples(labels, {**labels, "x": torch.rand(4, 2)})  # labels repeat
    assert same_samples((torch.ones(2), ids), (torch.ones(2), ids))
    # WebDataset's keys collate to a tuple of strings; labels repeat within the batch.
    keyed = (torch.rand(4, 2), torch.tensor([0, 1, 0, 1]), ("a", "b", "c", "d"))
    assert same_samples(keyed, (torch.rand(4, 2), *keyed[1:]))
    assert not same_samples(keyed, (torch.rand(4, 2), keyed[1], ("e", "f", "g", "h")))
