"""tune(path=...): a result kept in a file is reused for the same problem on the same
machine, and tuned again (saying why) for anything else."""

from __future__ import annotations

import copy
import dataclasses
import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import autoloader
from autoloader import InvalidInputError, SearchSpace
from autoloader._problem import (
    RANK_OWN_PARTS,
    Problem,
    TuneArguments,
    check_arguments,
    shared_arguments,
)
from autoloader._reuse import reused
from autoloader.search._study import ProblemIdentity, name_of

from .workloads import BusyDataset, SleepDataset, noop_step

SPACE = SearchSpace(num_workers=(0, 2), prefetch_factor=2, persistent_workers=True)


class CountingStep:
    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, batch: object) -> None:
        self.calls += 1


def _tune(path: Path, step: CountingStep, *, batch_size: int = 8) -> autoloader.TuneResult:
    return autoloader.tune(
        SleepDataset(256, latency=0.001),
        step,
        batch_size=batch_size,
        time_budget=4,
        search_space=SPACE,
        show_progress=False,
        path=path,
    )


# Its check compares the pace of a tune seconds before: beside a busy loop and three other
# tests, a full run (2026-11-29) read the reused setting at 246 samples/s, 799 when tuned,
# and tuned again (load that came between the two; steady load beside it, 6 of 6 held).
@pytest.mark.calm
@pytest.mark.slow  # over 2.5 s here: the full suite's (docs/development/checks.md)
def test_the_same_problem_reuses_the_file_and_another_tunes_again_saying_why(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "loader.json"
    tuning = CountingStep()
    first = _tune(path, tuning)
    saved = json.loads(path.read_text())
    assert saved["problem"]["batch size"] == "8"
    assert saved["problem"]["dataset"].endswith("SleepDataset")

    step = CountingStep()
    with caplog.at_level(logging.INFO, logger="autoloader"):
        again = _tune(path, step)
    # NOTE [ A reused setting checked ]: one short trial of it or of the defaults (NOTE [
    # The defaults' loop first ]), nothing searched; its check, where other processes
    # held the CPUs (the suite's, beside it), no confirmation, but no tuning either.
    assert 0 < step.calls < tuning.calls
    assert again.params == first.params
    assert again.notes[-1].startswith(("checked before reuse", "reused unconfirmed: "))
    assert again.tuning_seconds == first.tuning_seconds  # the file's run, not a new one
    assert f"reusing the settings in {path}" in caplog.text

    caplog.clear()
    step = CountingStep()
    with caplog.at_level(logging.INFO, logger="autoloader"):
        other = _tune(path, step, batch_size=16)
    assert step.calls > 0, "another batch size is another problem: it tunes"
    assert "batch size: 8 then, 16 now" in caplog.text
    assert json.loads(path.read_text())["batch_size"] == 16  # the file now holds it
    assert other.batch_size == 16


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    """A result file's content, of a real run of ``_tune``'s problem."""
    path = tmp_path_factory.mktemp("saved") / "loader.json"
    _tune(path, CountingStep())
    return json.loads(path.read_text())  # type: ignore[no-any-return]


def _problem(path: Path, *, dataset: Any = None, step: Any = None) -> Problem:
    """``_tune``'s problem, as tune() checks it (or of another ``dataset`` or ``step``)."""
    return check_arguments(
        None,
        SleepDataset(256, latency=0.001) if dataset is None else dataset,
        CountingStep() if step is None else step,
        TuneArguments(
            batch_size=8, time_budget=4, search_space=SPACE, show_progress=False, path=path
        ),
    )


def test_the_file_of_the_same_problem_is_reused(tmp_path: Path, saved: dict[str, object]) -> None:
    path = tmp_path / "loader.json"
    path.write_text(json.dumps(saved))
    found = reused(_problem(path), None)
    assert found is not None
    assert found.params == saved["params"]


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        (lambda data: data.update(schema_version=5, problem={}), "earlier autoloader"),
        (lambda data: data.update(partial=True), "interrupted"),
        (lambda data: data["environment"].update(cpu_count=999), "CPUs"),
        (lambda data: data["problem"].update(device="cuda"), "device: cuda then, None now"),
        (lambda data: data.update(params={"num_workers": "many"}), "not reusing"),
        (lambda data: data["problem"].update({"dataset code": "x"}), "the dataset's code changed"),
        (lambda data: data["problem"].update({"step code": "x"}), "the step's code changed"),
        (
            lambda data: data["problem"].update({"step code": "python 3.1: 0"}),
            "the step's code cannot be compared (python 3.1 then, python 3.",
        ),
    ],
    ids=[
        "older-file",
        "interrupted",
        "other-machine",
        "other-device",
        "malformed",
        "dataset-code",
        "step-code",
        "other-python",
    ],
)
def test_a_file_that_does_not_fit_is_not_reused_and_says_why(
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    saved: dict[str, object],
    change: Callable[[dict[str, Any]], None],
    reason: str,
) -> None:
    data = copy.deepcopy(saved)
    change(data)
    path = tmp_path / "loader.json"
    path.write_text(json.dumps(data))
    with caplog.at_level(logging.INFO, logger="autoloader"):
        assert reused(_problem(path), None) is None
    assert reason in caplog.text
    assert "Tuning again; the file will be replaced" in caplog.text


def test_a_file_saved_before_code_was_fingerprinted_is_reused(
    tmp_path: Path, saved: dict[str, Any]
) -> None:
    """Its code is not compared: the check by measurement tells whether it still holds."""
    data = copy.deepcopy(saved)
    del data["problem"]["dataset code"], data["problem"]["step code"]
    path = tmp_path / "loader.json"
    path.write_text(json.dumps(data))
    assert reused(_problem(path), None) is not None


# The same names as SleepDataset's and CountingStep's, and other bodies: their code changed.
_CHANGED = """
import time
import torch
from torch.utils.data import Dataset


class SleepDataset(Dataset):
    def __init__(self, length=512, latency=0.002, width=8):
        self.length, self.latency, self.width = length, latency, width

    def __len__(self):
        return self.length

    def __getitem__(self, index):
        time.sleep(self.latency)
        return torch.full((self.width,), float(index) * 2)


class CountingStep:
    def __init__(self):
        self.calls = 0

    def __call__(self, batch):
        self.calls += 2
"""


@pytest.mark.parametrize("part", ["dataset", "step"])
def test_a_changed_body_of_the_same_class_is_named_as_its_code_changed(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, saved: dict[str, Any], part: str
) -> None:
    made: dict[str, Any] = {"__name__": __name__}
    exec(_CHANGED, made)
    made["SleepDataset"].__module__ = SleepDataset.__module__
    path = tmp_path / "loader.json"
    path.write_text(json.dumps(saved))
    dataset = made["SleepDataset"](256, latency=0.001) if part == "dataset" else None
    problem = _problem(
        path, dataset=dataset, step=made["CountingStep"]() if part == "step" else None
    )
    assert problem.key()["dataset"] == saved["problem"]["dataset"]  # type: ignore[index]
    assert problem.key()["step_fn"] == saved["problem"]["step_fn"]  # type: ignore[index]
    with caplog.at_level(logging.INFO, logger="autoloader"):
        assert reused(problem, None) is None
    whose = "the dataset's" if part == "dataset" else "the step's"
    assert f"for another problem or machine ({whose} code changed)" in caplog.text


def test_a_path_that_is_not_a_file_path_fails_before_any_step(tmp_path: Path) -> None:
    step = CountingStep()
    with pytest.raises(InvalidInputError, match="is a directory"):
        _tune(tmp_path, step)
    with pytest.raises(InvalidInputError, match="path must be a file path"):
        _tune(42, step)  # type: ignore[arg-type]
    assert step.calls == 0


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ('{"lr": 0.1}', "not an autoloader result"),
        ("epochs: 3\n", "not an autoloader result"),
        ('{"schema_version": 99}', "schema version 99, written by a newer autoloader"),
    ],
    ids=["other-json", "not-json", "newer-schema"],
)
def test_a_file_that_is_not_a_result_to_replace_is_refused_and_kept(
    tmp_path: Path, content: str, message: str
) -> None:
    path = tmp_path / "config.json"
    path.write_text(content)
    step = CountingStep()
    with pytest.raises(InvalidInputError, match=message):
        _tune(path, step)
    assert step.calls == 0 and path.read_text() == content


def test_ranks_agree_on_the_device_by_its_kind(tmp_path: Path) -> None:
    problem = _problem(tmp_path / "loader.json")
    on = {
        name: shared_arguments(dataclasses.replace(problem, device=torch.device(name)))
        for name in ("cuda:0", "cuda:1", "cpu")
    }
    assert on["cuda:0"] == on["cuda:1"] != on["cpu"]
    assert dataclasses.replace(problem, device=torch.device("cuda:1")).key()["device"] == "cuda"


def test_a_problem_that_differs_in_any_part_of_its_identity_is_another_problem_everywhere(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ProblemIdentity is the one list of what identifies a problem: one that differs in
    any of its fields has another study, another record in a result file, and other
    arguments for the ranks of a job to agree on. The fields are read from the list, so
    one added to it is checked here too (the other problem must then differ in it)."""
    problem = _problem(tmp_path / "loader.json")
    other = check_arguments(
        None,
        BusyDataset(128),
        noop_step,
        TuneArguments(
            batch_size=4, time_budget=4, memory_budget="4GB", search_space=SearchSpace(),
            loader_kwargs={"shuffle": True}, device="cpu", show_progress=False,
        ),
    )  # fmt: skip
    mine, theirs = problem.identity(), other.identity()
    shared = shared_arguments(problem)
    for field in dataclasses.fields(ProblemIdentity):
        changed = dataclasses.replace(mine, **{field.name: getattr(theirs, field.name)})
        assert changed.parts() != mine.parts(), f"{field.name}: not in a result file's problem"
        assert name_of(changed, problem.environment) != name_of(mine, problem.environment), (
            f"{field.name}: not in the study's name"
        )
        (part,) = {k for k, v in changed.parts().items() if mine.parts()[k] != v}
        with monkeypatch.context() as patched:
            patched.setattr(Problem, "identity", lambda self, changed=changed, **_: changed)
            agreed = shared_arguments(problem) != shared
        # Each rank may give its own dataset object, step and loader objects (RANK_OWN_PARTS).
        assert agreed == (part not in RANK_OWN_PARTS), f"{field.name}: agreed {agreed}"


class BlockingStep(CountingStep):
    """A step that, at its first call, puts a file where the result's folder was: the
    path could be written when the run began (it is checked then) and not at its end."""

    def __init__(self, folder: Path) -> None:
        super().__init__()
        self.folder = folder

    def __call__(self, batch: object) -> None:
        if self.calls == 0:
            self.folder.rmdir()
            self.folder.write_text("")
        super().__call__(batch)


@pytest.mark.slow  # over 2.5 s here: the full suite's (docs/development/checks.md)
def test_a_result_that_cannot_be_saved_is_returned_with_a_warning(tmp_path: Path) -> None:
    folder = tmp_path / "results"
    folder.mkdir()
    step = BlockingStep(folder)
    with pytest.warns(UserWarning, match="could not save the result") as warned:
        result = _tune(folder / "loader.json", step)
    (warning,) = [w for w in warned if "could not save the result" in str(w.message)]
    assert warning.filename == __file__  # the caller of tune() is told, not autoloader
    assert folder.read_text() == ""  # nothing written where the folder was
    # The run's own result, whole: its trials, a setting measured among them, and a file
    # elsewhere that holds it, as the warning advises.
    assert step.calls > 0 and result.trials[0].phase == "baseline" and not result.partial
    assert any(t.state == "complete" and t.params == result.params for t in result.trials)
    result.save(tmp_path / "elsewhere.json")
    again = autoloader.load(tmp_path / "elsewhere.json")
    assert again.params == result.params and again.trials == result.trials
