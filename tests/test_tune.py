"""tune() end to end, with real DataLoaders and real worker processes."""

from __future__ import annotations

import dataclasses
import math
import re
import statistics
from pathlib import Path
from typing import Any
from unittest import mock

import optuna
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import autoloader
from autoloader import BaselineError, InvalidInputError, SearchSpace, UnpicklableError
from autoloader.loader._params import BASELINE_PARAMS
from autoloader.measure._process_memory import tree_memory
from autoloader.search._choice import TIE_TOLERANCE

from .workloads import (
    CountingDataset,
    FailingDataset,
    FailsInWorkersDataset,
    HangsIn,
    MemoryHogDataset,
    NoLenDataset,
    OutOfMemoryInWorkersDataset,
    ShardedStream,
    SharedBufferDataset,
    SleepDataset,
    Stream,
    failing_step,
    noop_step,
    sleep_10ms_step,
    sleep_step,
    slow_step,
)

QUICK = {"time_budget": 5.0, "show_progress": False}


def _tune(dataset: Any = None, step: Any = sleep_step, **kwargs: Any) -> autoloader.TuneResult:
    kwargs = {"batch_size": 4, **QUICK, **kwargs}
    return autoloader.tune(SleepDataset(1024) if dataset is None else dataset, step, **kwargs)


# Bad input: a clear exception before any work starts ------------------------------


class Local:
    def __init__(self) -> None:
        self.transform = lambda x: x


class LambdaDataset(SleepDataset):
    def __init__(self) -> None:
        super().__init__(64)
        self.pipeline = Local()


@pytest.mark.parametrize(
    ("dataset", "kwargs", "error", "message"),
    [
        (42, {}, InvalidInputError, "dataset must be a torch.utils.data.Dataset .* got int"),
        (
            DataLoader(SleepDataset(8)),
            {},
            InvalidInputError,
            r"dataset is a DataLoader; pass its dataset",
        ),
        (NoLenDataset(), {}, InvalidInputError, "map-style dataset without __len__"),
        (SleepDataset(0), {}, InvalidInputError, "is empty"),
        (None, {"batch_size": 0}, InvalidInputError, "batch_size must be positive but got 0"),
        (None, {"batch_size": -3}, InvalidInputError, "batch_size must be positive but got -3"),
        (None, {"batch_size": 2.5}, InvalidInputError, "batch_size must be a positive int"),
        (None, {"batch_size": True}, InvalidInputError, "batch_size must be a positive int"),
        (
            SleepDataset(10),
            {"batch_size": 11},
            InvalidInputError,
            r"batch_size 11 is larger than the dataset \(10 items\)",
        ),
        (None, {"step": "train"}, InvalidInputError, "step_fn must be callable"),
        (None, {"time_budget": 0}, InvalidInputError, "time_budget must be positive but got 0"),
        (None, {"time_budget": -1.0}, InvalidInputError, "time_budget must be positive"),
        (None, {"time_budget": float("nan")}, InvalidInputError, "time_budget must be a number"),
        (None, {"n_trials": 0}, InvalidInputError, "n_trials must be a positive int or None"),
        (
            None,
            {"search_space": {"num_worker": 4}},
            InvalidInputError,
            "Did you mean 'num_workers'",
        ),
        (
            None,
            {"search_space": "fast"},
            InvalidInputError,
            "search_space must be an autoloader.SearchSpace",
        ),
        (
            None,
            {"loader_kwargs": {"num_workers": 4}},
            InvalidInputError,
            r"sets 'num_workers', which autoloader tunes.*SearchSpace\(num_workers=4\)",
        ),
        (
            None,
            {"loader_kwargs": {"pin_memory": True}},
            InvalidInputError,
            "sets 'pin_memory', which autoloader tunes",
        ),
        (
            None,
            {"loader_kwargs": {"batch_size": 8}},
            InvalidInputError,
            "pass it as tune\\(\\)'s own argument",
        ),
        (None, {"loader_kwargs": {"batch_sampler": [[0]]}}, InvalidInputError, "batch_sampler"),
        (
            None,
            {"loader_kwargs": {"shuffle": True, "sampler": [0, 1]}},
            InvalidInputError,
            "DataLoader rejected loader_kwargs: sampler option is mutually exclusive",
        ),
        (
            None,
            {"loader_kwargs": {"shufle": True}},
            InvalidInputError,
            "DataLoader rejected loader_kwargs: .*shufle",
        ),
        (None, {"loader_kwargs": ["shuffle"]}, InvalidInputError, "loader_kwargs must be a dict"),
        (
            ShardedStream(),
            {"loader_kwargs": {"shuffle": True}},
            InvalidInputError,
            "DataLoader rejected loader_kwargs",
        ),
        (None, {"memory_budget": "lots"}, InvalidInputError, "memory_budget 'lots' is not a size"),
        (
            None,
            {"memory_budget": "1MiB"},
            InvalidInputError,
            "below what this process tree already uses",
        ),
        (
            None,
            {"device": "cuda"},
            InvalidInputError,
            "device 'cuda' was requested but this machine's accelerator is absent",
        ),
        (None, {"device": "warp-drive"}, InvalidInputError, "not a valid torch device"),
        (None, {"storage": 5}, InvalidInputError, "storage must be None"),
        (
            None,
            {"storage": "/nonexistent/folder/tuning.log"},
            InvalidInputError,
            "the folder '/nonexistent/folder' does not exist",
        ),
        (
            None,
            {"storage": "sqlite:////nonexistent/folder/study.db"},
            InvalidInputError,
            r"storage 'sqlite:////nonexistent/folder/study\.db' cannot be opened \(",
        ),
        (
            None,
            {"storage": "nosuchdb://host/study"},
            InvalidInputError,
            r"storage 'nosuchdb://host/study' cannot be opened .*check the URL",
        ),
        (None, {"seed": "1"}, InvalidInputError, "seed must be an int"),
        (
            LambdaDataset(),
            {"loader_kwargs": {"multiprocessing_context": "spawn"}},
            UnpicklableError,
            r"dataset\.pipeline\.transform \(function\) cannot be pickled",
        ),
        (
            None,
            {"loader_kwargs": {"multiprocessing_context": "spawn", "collate_fn": lambda b: b}},
            UnpicklableError,
            r"collate_fn \(function\) cannot be pickled",
        ),
        # A path the result cannot be written at is refused before the first trial, not
        # found after the whole budget (/proc refuses root too; a folder that is a file).
        (None, {"path": "/proc/loader.json"}, InvalidInputError, "cannot write the result"),
        (None, {"path": __file__ + "/loader.json"}, InvalidInputError, "is not a folder"),
    ],
)
def test_bad_input_is_rejected_before_any_work(
    dataset: Any, kwargs: dict[str, Any], error: type[Exception], message: str
) -> None:
    dataset = CountingDataset() if dataset is None else dataset
    step = kwargs.pop("step", noop_step)
    with pytest.raises(error, match=message):
        _tune(dataset, step, **kwargs)
    if isinstance(dataset, CountingDataset):
        assert dataset.reads == 0


@pytest.mark.light  # mostly waits
@pytest.mark.slow  # over 2.5 s here: the full suite's (docs/development/checks.md)
def test_unpicklable_objects_are_fine_under_fork() -> None:
    result = _tune(
        LambdaDataset(),
        noop_step,
        time_budget=15.0,  # room for a trial with a worker on a busy machine
        n_trials=1,  # which the one trial the space leaves to search is
        search_space={"num_workers": (0, 1)},
    )
    # The lambda reached the forked worker, which loaded with it.
    worker_trials = [t for t in result.trials if t.params["num_workers"] == 1]
    assert worker_trials and all(t.state != "failed" for t in worker_trials), worker_trials


# The main path -----------------------------------------------------------------------


def _epoch_rates(result: autoloader.TuneResult, params: dict[str, Any]) -> list[float]:
    """The epoch rates (the objective) of ``params``'s complete trials in ``result``."""
    return [
        t.epoch_samples_per_second
        for t in result.trials
        if t.state == "complete" and t.params == params and t.epoch_samples_per_second
    ]


def test_tune_returns_measured_settings(tmp_path: Path) -> None:
    result = _tune(SleepDataset(1024), sleep_step, time_budget=6.0)
    assert result.trials[0].phase == "baseline"
    assert result.trials[0].params["num_workers"] == 0
    assert {t.phase for t in result.trials} >= {"baseline", "search"}
    assert result.params == autoloader.loader._params.normalize_params(result.params)
    assert result.params["pin_memory"] is False
    # The settings and their figures are the trials': the medians of the epoch rates of
    # the chosen setting's and of the defaults' complete trials; the defaults, always a
    # candidate, beat the choice by no more than the tie tolerance it allows.
    tuned, defaults = _epoch_rates(result, result.params), _epoch_rates(result, BASELINE_PARAMS)
    assert tuned and defaults
    assert result.throughput == pytest.approx(statistics.median(tuned))
    assert result.baseline == pytest.approx(statistics.median(defaults))
    assert result.speedup == pytest.approx(statistics.median(tuned) / statistics.median(defaults))
    assert result.speedup >= 1 - TIE_TOLERANCE
    assert any("no accelerator" in n for n in result.notes)
    # The step waits: its threads are left as they are, and there is nothing to apply.
    assert any(n.startswith("step_threads left as they are") for n in result.notes)
    assert {t.params["step_threads"] for t in result.trials} == {None}
    assert result.apply_threads() is None
    for record in result.trials:
        assert record.state in {"complete", "pruned", "failed"}
        if record.state == "complete":
            assert record.samples_per_second and record.samples_per_second > 0
            assert record.data_wait_fraction is not None
            assert 0 <= record.data_wait_fraction <= 1
            assert record.time_to_first_batch and record.time_to_first_batch > 0
            assert record.peak_memory and record.peak_memory > 0
    assert result.environment == autoloader.Environment.current()

    loader = result.make_loader(SleepDataset(40, latency=0.0))
    assert loader.num_workers == result.params["num_workers"]
    assert sum(batch.shape[0] for batch in loader) == 40
    del loader

    again = autoloader.load(result.save(tmp_path / "best.json"))
    assert again.params == result.params
    assert again.trials == result.trials
    assert again.throughput == result.throughput


@pytest.mark.alone  # batched fetch must measure faster than per-item loading
@pytest.mark.slow  # over 2.5 s here: the full suite's (docs/development/checks.md)
def test_a_tensor_dataset_is_tuned_with_batched_fetch(tmp_path: Path) -> None:
    dataset = TensorDataset(torch.randn(4096, 16), torch.arange(4096))
    result = _tune(dataset, noop_step, batch_size=64, time_budget=6.0)
    assert any("batched_fetch searched" in note for note in result.notes)
    batched = [t for t in result.trials if t.params.get("batched_fetch")]
    assert batched and not [t for t in batched if t.state == "failed"]
    again = autoloader.load(result.save(tmp_path / "best.json"))
    loader = again.make_loader(dataset)
    assert sum(len(y) for _, y in loader) == 4096
    del loader


def test_batched_fetch_asked_of_a_dataset_that_cannot_fails_before_any_trial() -> None:
    with pytest.raises(
        InvalidInputError,
        match="batched_fetch=True was asked for, but dataset\\[list of indices\\] raised TypeError",
    ):
        _tune(SleepDataset(64, latency=0.0), noop_step, search_space={"batched_fetch": True})


@pytest.mark.light  # mostly waits
@pytest.mark.paced  # its verdict rests on a pace it measures
def test_a_loop_bound_by_its_step_is_not_searched() -> None:
    result = _tune(SleepDataset(1024, latency=0.0), slow_step, time_budget=30.0)
    (note,) = [n for n in result.notes if "bound by its step" in n]
    assert "already with num_workers=0" in note and "nothing was searched" in note
    assert [t.phase for t in result.trials] == ["baseline"]
    # Nothing beats the step: workers would only cost memory and start-up.
    assert result.params == BASELINE_PARAMS
    (given_back,) = [n for n in result.notes if n.startswith("done in ")]
    assert "of the 30 s budget, the rest given back: no setting can beat the step" in given_back


@pytest.mark.light  # mostly waits
@pytest.mark.paced  # its verdict rests on a pace it measures
@pytest.mark.slow
def test_the_search_stops_at_the_first_setting_that_leaves_the_loop_bound_by_its_step() -> None:
    # Items of 5 ms, batches of 4, a 200 ms step: loading (20 ms) shows at num_workers=0,
    # and vanishes with one worker, the first setting tried (a busy machine can make
    # that trial wait more than the threshold; then the next one stops the search).
    result = _tune(SleepDataset(1024, latency=0.005), slow_step, time_budget=30.0)
    (note,) = [n for n in result.notes if "bound by its step" in n]
    searched = [t.phase for t in result.trials].count("search")
    assert searched <= 3 and f"the search stopped after {searched} trials" in note
    # One runoff round, not as many as the time left allows: each searched setting (up
    # to three) and the baseline measured again once; two where one setting was searched.
    runoff = [sorted(t.params.items()) for t in result.trials if t.phase == "runoff"]
    assert runoff and all(runoff.count(params) == 1 for params in runoff), runoff
    assert len(runoff) <= min(searched, 3) + 1 and sorted(BASELINE_PARAMS.items()) in runoff


@pytest.mark.slow
def test_n_trials_caps_the_search() -> None:
    result = _tune(time_budget=12.0, n_trials=2)
    assert sum(t.phase == "search" for t in result.trials) == 2


@pytest.mark.light  # mostly waits
def test_fixed_options_are_kept_in_every_trial_and_in_the_loader() -> None:
    calls = {"n": 0}

    def collate(items: list[torch.Tensor]) -> torch.Tensor:
        calls["n"] += 1
        return torch.stack(items)

    result = _tune(
        loader_kwargs={"collate_fn": collate, "drop_last": True},
        time_budget=3.0,
        search_space={"num_workers": 0},
    )
    assert calls["n"] > 0
    assert result.fixed_loader_kwargs == {"drop_last": True}
    assert result.unsaved_loader_kwargs == ("collate_fn",)
    loader = result.make_loader(SleepDataset(10, latency=0.0))
    assert loader.collate_fn is collate
    assert loader.drop_last is True
    assert len(list(loader)) == 2


@pytest.mark.slow
def test_memory_hungry_settings_are_pruned_and_earlier_results_kept() -> None:
    # Each worker holds 300 MiB: one fits the budget, two or more do not.
    budget = tree_memory() + 450 * 1024**2
    result = _tune(
        MemoryHogDataset(300 * 1024**2),
        noop_step,
        memory_budget=budget,
        time_budget=12.0,
        # Each worker process holds the memory: threads hold none (get_worker_info()).
        search_space=SearchSpace(
            num_workers=(0, 4), persistent_workers=True, worker_kind="processes"
        ),
    )
    trials = [(t.params["num_workers"], t.state, t.reason) for t in result.trials]
    pruned = [t for t in result.trials if t.state == "pruned"]
    # Every setting of two workers or more is stopped for memory, and only those: one
    # worker fits. (One worker may still be pruned as slower or too short to measure,
    # as any setting may: that is timing, not memory.)
    hungry = [t for t in result.trials if t.params["num_workers"] >= 2]
    assert hungry, trials
    memory = [t for t in pruned if (t.reason or "").startswith("memory")]
    assert all(t in memory for t in hungry), trials
    assert all(t in hungry for t in memory), trials
    assert result.params["num_workers"] <= 1
    # A setting of as many workers as one that passed the budget, or more, is known to
    # pass it: not run. (Which one depends on the order the search met them in: beside a
    # busy loop a full run skipped another than the ladder's 4 workers after 2.)
    named = re.compile(r"\(not run: asks at least as much memory as trial (\d+)\)$")
    matches = [(t, named.search(t.reason or "")) for t in pruned]
    skipped = [(t, int(match.group(1))) for t, match in matches if match is not None]
    assert skipped, [(t.params["num_workers"], t.reason) for t in pruned]
    by_number = {t.number: t for t in result.trials}
    for trial, number in skipped:
        passed = by_number[number]
        assert passed in memory, (trial.reason, trials)
        assert trial.params["num_workers"] >= passed.params["num_workers"], (trial.reason, trials)
    assert all(t.duration is None for t, _ in skipped)
    assert result.memory_budget == budget


@pytest.mark.light  # mostly waits
@pytest.mark.slow  # over 2.5 s here: the full suite's (docs/development/checks.md)
def test_out_of_memory_errors_prune_the_setting() -> None:
    result = _tune(
        OutOfMemoryInWorkersDataset(256),
        noop_step,
        time_budget=4.0,
        # The error is raised in worker processes only (get_worker_info()).
        search_space={"num_workers": (0, 2), "worker_kind": "processes"},
    )
    # Pruned for memory, and only where workers ran (a busy machine may prune another
    # trial as slower or too short: not this test's matter).
    memory = [t for t in result.trials if t.kind == "memory"]
    assert memory, [(t.params["num_workers"], t.state, t.reason) for t in result.trials]
    assert all(t.state == "pruned" and t.params["num_workers"] > 0 for t in memory)
    for trial in memory:
        assert re.match(r"memory: (MemoryError|OutOfMemoryError)\b", trial.reason or ""), trial
    assert not [t for t in result.trials if t.params["num_workers"] > 0 and t.state == "complete"]
    assert result.params["num_workers"] == 0


@pytest.mark.slow  # over 2.5 s here: the full suite's (docs/development/checks.md)
def test_a_setting_that_breaks_user_code_fails_and_the_run_goes_on() -> None:
    result = _tune(
        FailsInWorkersDataset(256),
        noop_step,
        time_budget=4.0,
        # It fails in worker processes only (get_worker_info()).
        search_space={"num_workers": (0, 2), "worker_kind": "processes"},
    )
    failed = [t for t in result.trials if t.state == "failed"]
    assert failed
    reason = "OSError: cannot open the second shard from this worker (in DataLoader worker"
    assert all((t.reason or "").startswith(reason) for t in failed)
    assert all(t.params["num_workers"] >= 2 for t in failed)
    assert result.params["num_workers"] <= 1


@pytest.mark.light  # mostly waits
@pytest.mark.slow
def test_a_setting_that_failed_is_not_run_again() -> None:
    # Two settings only, six trials: the sampler has to propose the failing one again.
    space = SearchSpace(num_workers=(1, 2), prefetch_factor=2, persistent_workers=True)
    result = _tune(
        FailsInWorkersDataset(256), noop_step, time_budget=15.0, n_trials=6, search_space=space
    )
    failed = [t for t in result.trials if t.state == "failed"]
    assert len(failed) >= 2, [(t.params, t.state) for t in result.trials]
    first, *again = failed
    assert all(t.reason == first.reason and t.duration is None for t in again)


def test_a_broken_dataset_stops_at_the_baseline_with_its_origin() -> None:
    with pytest.raises(
        BaselineError,
        match=r"while loading a batch: ValueError: corrupt record 3 at .*workloads\.py:\d+ in "
        r"__getitem__",
    ) as info:
        _tune(FailingDataset(64))
    assert isinstance(info.value.__cause__, ValueError)


def test_a_broken_step_stops_at_the_baseline() -> None:
    with pytest.raises(
        BaselineError, match="while running step_fn: RuntimeError: shape mismatch in step"
    ):
        _tune(step=failing_step)


@pytest.mark.slow  # over 2.5 s here: the full suite's (docs/development/checks.md)
def test_iterable_datasets_are_tuned() -> None:
    result = _tune(
        ShardedStream(512), noop_step, time_budget=4.0, search_space={"num_workers": (0, 2)}
    )
    # Worker processes only, each reading its own share (get_worker_info()); threads have
    # no worker info and would each read the whole stream, so they are not offered.
    assert any(
        n.startswith("worker_kind fixed to processes: an IterableDataset") for n in result.notes
    )
    assert {t.params["worker_kind"] for t in result.trials} == {"processes"}
    assert any(t.params["num_workers"] > 0 and t.state == "complete" for t in result.trials)
    # The tuned loader yields the stream as it is: every item once.
    items = [int(x) for batch in result.make_loader(ShardedStream(512)) for x in batch[:, 0]]
    assert sorted(items) == list(range(512))


def test_an_iterable_dataset_whose_workers_repeat_samples_is_refused() -> None:
    with pytest.raises(InvalidInputError, match="repeat each other's samples"):
        _tune(Stream(shard=False))


@pytest.mark.slow  # over 2.5 s here: the full suite's (docs/development/checks.md)
def test_a_probe_that_hangs_costs_its_share_and_the_run_still_searches() -> None:
    """The checks before the search get a tenth of the budget; the probe its share of
    that, and what the checks before it left of theirs."""
    result = _tune(HangsIn("probe", length=4096), noop_step, time_budget=6.0)
    assert sum(t.phase == "search" for t in result.trials) >= 2
    assert list(result.facts["missing"]) == ["copy_on_read"]
    text = " ".join(autoloader.report(result).split())
    found = re.search(
        r"not checked, copy-on-read in forked workers: the check did not finish within "
        r"(\d\.\d) s, its share of the 1\.0 s the checks before the search may take",
        text,
    )
    assert found is not None, text
    assert 0.45 <= float(found[1]) <= 1.0


@pytest.mark.light  # mostly waits
@pytest.mark.slow
def test_a_journal_file_keeps_the_study_and_a_stale_lock_does_not_hang(tmp_path: Path) -> None:
    path = tmp_path / "tuning.log"
    space = SearchSpace(num_workers=(0, 2), prefetch_factor=2, persistent_workers=True)
    _tune(storage=str(path), n_trials=1, search_space=space, time_budget=12.0)
    # A run killed while writing leaves the journal's lock file behind.
    (tmp_path / "tuning.log.lock").touch()
    _tune(storage=path, n_trials=1, search_space=space, time_budget=12.0)
    storage = optuna.storages.JournalStorage(optuna.storages.journal.JournalFileBackend(str(path)))
    (summary,) = optuna.get_all_study_summaries(storage)
    phases = [
        t.user_attrs["phase"]
        for t in optuna.load_study(study_name=summary.study_name, storage=storage).trials
    ]
    assert phases.count("baseline") == 1  # the second run read the first's
    assert phases.count("search") == 2


def test_device_batches_reach_the_step_on_that_device() -> None:
    devices: set[torch.device] = set()

    def step(batch: torch.Tensor) -> None:
        devices.add(batch.device)

    _tune(step=step, device="meta", time_budget=2.0, search_space={"num_workers": (0, 1)})
    assert devices == {torch.device("meta")}


@pytest.mark.slow  # over 2.5 s here: the full suite's (docs/development/checks.md)
def test_with_an_accelerator_pin_memory_is_searched() -> None:
    with (
        mock.patch("autoloader.checks._environment.accelerator", return_value=torch.device("cuda")),
        mock.patch("autoloader.checks._environment.torch.accelerator.device_count", return_value=1),
        mock.patch(
            "autoloader.checks._environment.torch.cuda.get_device_name", return_value="Fake GPU"
        ),
    ):
        result = _tune(time_budget=4.0, search_space={"num_workers": (0, 2)})
    assert result.environment.accelerator == "cuda: Fake GPU x1"
    assert not any("no accelerator" in n for n in result.notes)
    # Both values measured: the defaults without pinning, the search's first settings with
    # it, and pinning broke none of them.
    assert {t.params["pin_memory"] for t in result.trials} == {False, True}
    assert not [t for t in result.trials if t.params["pin_memory"] and t.state == "failed"]
    assert math.isfinite(result.speedup)


def test_a_stored_study_is_shared_only_by_the_same_problem() -> None:
    """A setting pruned under a 4 GiB budget may fit in 64 GiB; a step, fixed loader
    options, a device or a machine that differ make trials that do not compare."""
    import dataclasses

    from autoloader.checks._environment import Environment
    from autoloader.search._study import study_name

    environment = Environment.current()
    problem: dict[str, Any] = {
        "length": 512,
        "batch_size": 4,
        "space": SearchSpace(),
        "memory_budget": 4 * 1024**3,
        "fixed_loader_kwargs": {"shuffle": True, "collate_fn": None},
        "environment": environment,
        "device": None,
    }
    name = study_name(SleepDataset(512), sleep_step, **problem)
    assert name == study_name(SleepDataset(512), sleep_step, **problem)  # not by address
    changed = [
        study_name(SleepDataset(512), sleep_step, **{**problem, "memory_budget": 64 * 1024**3}),
        study_name(SleepDataset(512), noop_step, **problem),
        study_name(
            SleepDataset(512),
            sleep_step,
            **{**problem, "fixed_loader_kwargs": {"shuffle": False, "collate_fn": None}},
        ),
        study_name(
            SleepDataset(512),
            sleep_step,
            **{**problem, "environment": dataclasses.replace(environment, cpu_count=64)},
        ),
        study_name(SleepDataset(512), sleep_step, **{**problem, "device": torch.device("meta")}),
    ]
    assert name not in changed and len(set(changed)) == len(changed)


def test_a_job_of_several_nodes_names_its_study_by_its_shape_not_its_host(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A scheduler gives each job whichever nodes are free: the next job of the same
    shape resumes the study from other hosts; one of another node count does not."""
    import dataclasses
    import socket

    from autoloader.checks._environment import Environment
    from autoloader.search._study import study_name

    def named(environment: Environment, host: str) -> str:
        monkeypatch.setattr(socket, "gethostname", lambda: host)
        return study_name(
            SleepDataset(512), sleep_step, length=512, batch_size=4, space=SearchSpace(),
            memory_budget=None, fixed_loader_kwargs={}, environment=environment, device=None,
        )  # fmt: skip

    alone = Environment.current()
    two_nodes = dataclasses.replace(alone, world_size=4, local_world_size=2, nodes=2)
    four_nodes = dataclasses.replace(two_nodes, local_world_size=1, nodes=4)
    assert named(two_nodes, "node-a") == named(two_nodes, "node-c")
    assert named(alone, "node-a") != named(alone, "node-c")  # one machine: its own
    shapes = {named(e, "node-a") for e in (alone, two_nodes, four_nodes)}
    assert len(shapes) == 3
    # Another node count alone (the same ranks per node) is another study too.
    assert named(dataclasses.replace(two_nodes, nodes=3), "node-a") != named(two_nodes, "node-a")


# Thread workers ---------------------------------------------------------------------


# Its threads check has 0.2 s of a 10 s budget (24 reads of 5 ms in a forked process):
# beside the suite's tests and a busy loop it was cut short once, and no thread worker
# was measured (ci33).
@pytest.mark.calm
@pytest.mark.slow
def test_thread_workers_are_measured_and_a_tuned_thread_loader_holds_every_sample_once(
    tmp_path: Path,
) -> None:
    """Items that wait 5 ms on "storage" for a 10 ms step: both kinds are measured, and
    whichever is chosen loads one epoch as the dataset holds it."""
    dataset = SleepDataset(512, latency=0.005)
    result = _tune(dataset, sleep_10ms_step, batch_size=8, time_budget=10.0)
    kinds = {t.params["worker_kind"] for t in result.trials if t.params["num_workers"]}
    assert kinds == {"processes", "threads"}, [t.params for t in result.trials]
    assert any("worker_kind searched" in note for note in result.notes)
    loaded = autoloader.load(result.save(tmp_path / "best.json"))
    # The tuned loader, whichever kind won, and the best setting measured with threads,
    # each built from the file as tuned (no override of the settings): every sample once.
    best_threads = max(  # measured to the end or pruned on the way
        (t for t in result.trials if t.params["worker_kind"] == "threads" and t.state != "failed"),
        key=lambda t: t.epoch_samples_per_second or t.samples_per_second or 0.0,
    )
    tuned = loaded.make_loader(dataset, shuffle=True)
    threads = dataclasses.replace(loaded, params=best_threads.params).make_loader(
        dataset, shuffle=True
    )
    assert isinstance(threads, autoloader.ThreadLoader)
    assert threads.num_workers == best_threads.params["num_workers"] > 0
    assert isinstance(tuned, autoloader.ThreadLoader) == (loaded.params["worker_kind"] == "threads")
    for loader in (tuned, threads):
        ids = [int(x) for batch in loader for x in batch[:, 0]]
        assert sorted(ids) == list(range(512)) and ids != sorted(ids)


# Its verdict comes from the threads check, which has 0.2 s of a 4 s budget's checks:
# beside three slow tests the notes lacked it (cut in the report; beside six busy loops
# it held 3 of 3). A check cut short says so in the note ("its check was cut short").
@pytest.mark.calm
@pytest.mark.slow  # over 2.5 s here: the full suite's (docs/development/checks.md)
def test_a_dataset_that_reads_otherwise_from_threads_is_tuned_with_processes_only() -> None:
    result = _tune(SharedBufferDataset(256), noop_step, time_budget=4.0)
    assert all(t.params["worker_kind"] == "processes" for t in result.trials)
    assert any(
        note.startswith("worker_kind fixed to processes: reading it from 2 threads gave other")
        for note in result.notes
    ), "\n".join(result.notes)
    with pytest.raises(InvalidInputError, match='"threads" was asked for, but reading it'):
        _tune(SharedBufferDataset(256), noop_step, search_space={"worker_kind": "threads"})
