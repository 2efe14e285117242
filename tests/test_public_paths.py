"""Public paths no other test takes: ``AutoLoader``'s ``n_trials``, ``device``, a
``memory_budget`` in words, ``verbose`` and ``report()`` before its tuning; a saved
result not reused, part by part, for a changed step, search space, memory budget or
fixed loader options (``tune(path=...)``, ``_reuse.py``)."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import pytest

import autoloader
from autoloader import AutoLoader, SearchSpace
from autoloader._problem import Problem, TuneArguments, check_arguments
from autoloader._reuse import differences_from
from tests.workloads import SleepDataset, noop_step

pytestmark = pytest.mark.slow  # real AutoLoader and tune() runs, each option's effect

# Fixed, so that a few trials decide the search.
# The step's threads not searched: a tuned count stays set for the training (conftest.py
# fails a test that leaves them changed; on a busy machine 1 thread was chosen).
SPACE = {
    "num_workers": (0, 2),
    "prefetch_factor": 2,
    "worker_kind": "processes",
    "step_threads": None,
}


def _until_tuned(loader: AutoLoader[Any], *, epochs: int = 200) -> int:
    """Epochs of a loop with a 2 ms step until ``loader`` has tuned; how many."""
    for epoch in range(1, epochs + 1):
        for _batch in loader:
            time.sleep(0.002)
        if loader.tuned:
            return epoch
    raise AssertionError(f"not tuned after {epochs} epochs")


def test_n_trials_caps_the_search_of_an_autoloader() -> None:
    """With a minute's budget the search would go on; n_trials=1 ends it after one
    search trial, and says so."""
    loader = AutoLoader(
        SleepDataset(length=400, latency=0.001),
        batch_size=8,
        n_trials=1,
        time_budget=60,
        search_space={"num_workers": (0, 4), "worker_kind": "processes"},
        verbose=False,
    )
    try:
        _until_tuned(loader)
    finally:
        loader.close()
    assert loader.n_trials == 1
    result = loader.result
    assert result is not None
    assert len([t for t in result.trials if t.phase == "search"]) == 1, result.trials
    assert any("n_trials=1" in note for note in result.notes), result.notes


def test_device_and_a_memory_budget_in_words_are_the_problems() -> None:
    loader = AutoLoader(
        SleepDataset(length=64, latency=0.001),
        batch_size=8,
        n_trials=1,
        time_budget=4,
        search_space=SPACE,
        device="cpu",
        memory_budget="2GiB",
        verbose=False,
    )
    try:
        _until_tuned(loader)
    finally:
        loader.close()
    assert (loader.device, loader.memory_budget) == ("cpu", "2GiB")
    result = loader.result
    assert result is not None
    assert result.memory_budget == 2 << 30  # what the trials were held to
    assert result.problem["memory budget"] == str(2 << 30)
    assert result.problem["device"] == "cpu"


def test_report_before_and_while_tuning_says_where_it_stands() -> None:
    loader = AutoLoader(
        SleepDataset(length=64, latency=0.001),
        batch_size=8,
        time_budget=4,
        search_space=SPACE,
        verbose=False,
    )
    try:
        assert loader.report() == (
            "AutoLoader: tuning, 0 trials so far; the report comes once it ends."
        )
        for _batch in loader:  # one epoch: the first trials
            time.sleep(0.002)
        if not loader.tuned:
            assert loader.report() == (
                f"AutoLoader: tuning, {len(loader.history)} trials so far; the report comes "
                "once it ends."
            )
        _until_tuned(loader)
    finally:
        loader.close()
    assert loader.result is not None
    assert loader.report() == autoloader.report(loader.result)


def test_verbose_prints_one_line_when_tuning_ends_and_when_it_reuses(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "loader.json"
    dataset = SleepDataset(length=64, latency=0.001)
    kwargs: dict[str, Any] = {"batch_size": 8, "time_budget": 4, "search_space": SPACE}
    capfd.readouterr()
    tuned = AutoLoader(dataset, path=path, **kwargs)  # verbose=True is the default
    try:
        _until_tuned(tuned)
    finally:
        tuned.close()
    (line,) = capfd.readouterr().err.splitlines()
    assert line.startswith("AutoLoader: tuned in ") and line.endswith(f"; saved to {path}")
    assert f"{len(tuned.history)} trials: " in line

    reusing = AutoLoader(dataset, path=path, verbose=True, **kwargs)
    try:
        assert _until_tuned(reusing) == 1
    finally:
        reusing.close()
    (line,) = capfd.readouterr().err.splitlines()
    assert line.startswith("AutoLoader: reusing ") and f"from {path}," in line

    quiet = AutoLoader(dataset, path=path, verbose=False, **kwargs)
    try:
        _until_tuned(quiet)
    finally:
        quiet.close()
    # Nothing, whether the reuse holds or, on a machine busier than when it tuned, its
    # check finds loading slower and the loader tunes again (a WARNING, for logging).
    assert capfd.readouterr().err == ""


# A saved result not reused where the problem changed, part by part -----------------------


class CountingStep:
    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, batch: object) -> None:
        self.calls += 1


_SEARCHED = SearchSpace(num_workers=(0, 2), prefetch_factor=2, persistent_workers=True)
_OTHER_SPACE = SearchSpace(num_workers=(0, 3), prefetch_factor=2)
_TUNED: dict[str, Any] = {
    "batch_size": 8,
    "time_budget": 3,
    "search_space": _SEARCHED,
    "show_progress": False,
}


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The file of a real run, for a problem that the tests then change."""
    path = tmp_path_factory.mktemp("saved") / "loader.json"
    autoloader.tune(SleepDataset(128, latency=0.001), CountingStep(), path=path, **_TUNED)
    return path


def _problem(path: Path, step: object = None, **changes: Any) -> Problem:
    return check_arguments(
        None,
        SleepDataset(128, latency=0.001),
        CountingStep() if step is None else step,  # type: ignore[arg-type]
        TuneArguments(**{**_TUNED, **changes, "path": path}),
    )


@pytest.mark.parametrize(
    ("step", "changes", "difference"),
    [
        (
            noop_step,
            {},
            "step_fn: tests.test_public_paths.CountingStep then, tests.workloads.noop_step now",
        ),
        (
            None,
            {"search_space": _OTHER_SPACE},
            f"search space: {_SEARCHED.as_dict()} then, {_OTHER_SPACE.as_dict()} now",
        ),
        (None, {"memory_budget": "2GiB"}, f"memory budget: None then, {2 << 30} now"),
        (
            None,
            {"loader_kwargs": {"drop_last": True}},
            "fixed loader options: [] then, [('drop_last', 'True')] now",
        ),
    ],
    ids=["step", "search-space", "memory-budget", "fixed-loader-options"],
)
def test_a_changed_part_of_the_problem_is_named_as_the_reason_not_to_reuse(
    saved: Path, step: object, changes: dict[str, Any], difference: str
) -> None:
    result = autoloader.load(saved)
    assert differences_from(result, _problem(saved)) == []  # the same problem: reused
    (found,) = differences_from(result, _problem(saved, step, **changes))
    assert found == difference


def test_tune_with_a_changed_memory_budget_tunes_again_and_replaces_the_file(
    saved: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "loader.json"
    path.write_bytes(saved.read_bytes())
    step = CountingStep()
    with caplog.at_level(logging.INFO, logger="autoloader"):
        result = autoloader.tune(
            SleepDataset(128, latency=0.001), step, path=path, memory_budget="2GiB", **_TUNED
        )
    assert step.calls > 0, "another memory budget is another problem: it tunes"
    assert f"not reusing {path}" in caplog.text
    assert f"memory budget: None then, {2 << 30} now" in caplog.text
    assert autoloader.load(path).problem["memory budget"] == str(2 << 30)
    assert result.memory_budget == 2 << 30
