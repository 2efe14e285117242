"""The argument lists written out more than once, each tied to its one source.

``tune()``'s keyword arguments are :class:`TuneArguments` (``_problem.py``), which
``tune()``, ``AutoLoader`` and the CLI build; DataLoader's arguments are DataLoader's own
signature (``DATALOADER_DEFAULTS``), which ``AutoLoader`` and ``ThreadLoader`` repeat
in theirs for users and their IDEs. An argument added to one and not the other, or a
default that drifts, fails here: a torch release that adds one to DataLoader too.
"""

from __future__ import annotations

import dataclasses
import inspect
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import autoloader._tune
from autoloader import AutoLoader, ThreadLoader, tune
from autoloader._cli import _parser
from autoloader._cli import _tune as cli_tune
from autoloader._problem import TuneArguments
from autoloader.loader._dataloader_options import DATALOADER_DEFAULTS, changed_options

# A value for each of tune()'s keyword arguments, none of them its default.
_GIVEN: dict[str, Any] = {
    "batch_size": 3,
    "time_budget": 5.0,
    "n_trials": 7,
    "memory_budget": "1GiB",
    "search_space": {"num_workers": [1, 2]},
    "loader_kwargs": {"shuffle": True},
    "device": "cpu",
    "seed": 11,
    "storage": "tuning.log",
    "show_progress": False,
    "isolation": "subprocess",
    "restore": (),
    "path": "loader.json",
}


class _Stop(Exception):
    """Raised where the arguments were caught, before anything runs."""


def _keyword_only(function: Any) -> list[inspect.Parameter]:
    return [
        parameter
        for parameter in inspect.signature(function).parameters.values()
        if parameter.kind is inspect.Parameter.KEYWORD_ONLY
    ]


def _field_default(field: dataclasses.Field[Any]) -> Any:
    return inspect.Parameter.empty if field.default is dataclasses.MISSING else field.default


def test_tune_arguments_are_tunes_keyword_arguments() -> None:
    """The same names, in the same order, with the same defaults and types."""
    fields = dataclasses.fields(TuneArguments)
    parameters = _keyword_only(tune)
    assert [field.name for field in fields] == [parameter.name for parameter in parameters]
    for field, parameter in zip(fields, parameters, strict=True):
        assert _field_default(field) == parameter.default, field.name
        assert field.type == parameter.annotation, field.name  # as written: both are str
    assert set(_GIVEN) == {field.name for field in fields}


def test_tune_passes_every_argument_on(monkeypatch: pytest.MonkeyPatch) -> None:
    caught: list[TuneArguments] = []

    def check_arguments(ranks: object, dataset: object, step_fn: object, arguments: Any) -> Any:
        caught.append(arguments)
        raise _Stop

    for field in dataclasses.fields(TuneArguments):
        assert _GIVEN[field.name] != _field_default(field), field.name
    monkeypatch.setattr(autoloader._tune, "check_arguments", check_arguments)
    with pytest.raises(_Stop):
        tune(TensorDataset(torch.zeros(8)), lambda batch: None, **_GIVEN)
    assert caught == [TuneArguments(**_GIVEN)]


def _tune_options() -> dict[str, Any]:
    """The ``autoloader tune`` command's options, by dest."""
    commands = next(action for action in _parser()._actions if action.dest == "command")
    parser = commands.choices["tune"]  # type: ignore[index]  # the subparsers' choices
    return {action.dest: action for action in parser._actions}


def test_the_cli_options_named_as_tunes_arguments_have_its_defaults() -> None:
    """NOTE [ The CLI's options ]: those named as an argument of tune() are its
    arguments; the rest of tune()'s are given by the command's own options or not
    offered."""
    options = _tune_options()
    fields = {field.name: field for field in dataclasses.fields(TuneArguments)}
    mirrored = set(options) & set(fields)
    assert mirrored == {
        "batch_size", "time_budget", "n_trials", "memory_budget", "storage", "device",
        "seed", "isolation",
    }  # fmt: skip
    # loader_kwargs from --shuffle, show_progress from --quiet; the others not offered.
    own = {"search_space", "loader_kwargs", "show_progress", "restore", "path"}
    assert set(fields) - mirrored == own
    for name in mirrored:
        default = _field_default(fields[name])
        if default is inspect.Parameter.empty:
            assert options[name].required, name
        else:
            assert options[name].default == default, name


def test_the_cli_passes_its_options_on(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    caught: list[dict[str, Any]] = []

    def fake_tune(dataset: object, step_fn: object, **kwargs: Any) -> Any:
        caught.append(kwargs)
        raise _Stop

    args = _parser().parse_args(
        ["tune", "autoloader._demo:SleepStep", "autoloader._demo:SleepStep",
         "--batch-size", "3", "--time-budget", "5", "--n-trials", "7",
         "--memory-budget", "1GiB", "--storage", "tuning.log", "--device", "cpu",
         "--seed", "11", "--isolation", "subprocess", "--shuffle", "-q",
         "--out", str(tmp_path / "best.json")]
    )  # fmt: skip
    args.dataset = TensorDataset(torch.zeros(8))
    monkeypatch.setattr(autoloader._tune, "tune", fake_tune)
    with pytest.raises(_Stop):
        cli_tune(args)
    given = {**_GIVEN, "search_space": None, "restore": None, "path": None}
    assert caught == [TuneArguments(**given).as_kwargs()]


def _dataloader_parameters() -> list[inspect.Parameter]:
    return list(inspect.signature(DataLoader.__init__).parameters.values())


@pytest.mark.parametrize("loader", [AutoLoader, ThreadLoader])
def test_the_loaders_take_dataloaders_arguments(loader: type[DataLoader[Any]]) -> None:
    """DataLoader's arguments first, with its names, kinds and defaults; a loader's own
    after them, keyword-only."""
    theirs = _dataloader_parameters()
    ours = list(inspect.signature(loader.__init__).parameters.values())
    shared = ours[: len(theirs)]
    assert [(p.name, p.kind, p.default) for p in shared] == [
        (p.name, p.kind, p.default) for p in theirs
    ]
    own = ours[len(theirs) :]
    assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in own)
    if loader is ThreadLoader:
        assert own == []


def test_dataloader_defaults_are_dataloaders() -> None:
    theirs = {p.name: p.default for p in _dataloader_parameters()[2:]}  # after self, dataset
    assert dict(DATALOADER_DEFAULTS) == theirs
    assert list(DATALOADER_DEFAULTS) == list(theirs)


def test_changed_options_are_those_not_at_dataloaders_default() -> None:
    generator = torch.Generator()
    options = {"shuffle": False, "drop_last": False, "timeout": 0.0, "generator": generator}
    assert changed_options(options) == {"shuffle": False, "generator": generator}
    with pytest.raises(KeyError):
        changed_options({"num_worker": 2})
