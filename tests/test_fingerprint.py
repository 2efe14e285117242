"""The fingerprints of a dataset's and a step's code (``NOTE [ Code fingerprints ]``,
``search/_code.py``): the same in every process, changed by a changed body, whatever
the file's layout."""

from __future__ import annotations

import functools
import os
import subprocess
import sys
import textwrap
from typing import Any

import pytest
from torch.utils.data import ConcatDataset, Subset

from autoloader.search import NOT_FINGERPRINTED, dataset_code, step_code

from .workloads import BusyDataset, SleepDataset, noop_step

# A dataset with a set among its constants (whose order follows the process's string
# hashing), a helper of its module and a method reached through self, and a step closure.
_SOURCE = """
import torch
from torch.utils.data import Dataset


def scale(value):
    return value * {factor}


class Items(Dataset):
    def __len__(self):
        return 8

    def __getitem__(self, index):
        if str(index) in {{"1", "2", "3", "4", "5"}}:
            index = self.shifted(index)
        return torch.tensor(scale(index))

    def shifted(self, index):
        return index + {shift}


def make_step(counts):
    def record(batch):
        counts.append(len(batch))

    def step(batch):
        record(batch)

    return step
"""


def _made(*, factor: int = 2, shift: int = 1, blank_lines: int = 0) -> dict[str, Any]:
    """The module ``_SOURCE`` makes, as ``tests.made``, by ``exec``: no source file."""
    namespace: dict[str, Any] = {"__name__": "tests.made"}
    code = "\n" * blank_lines + _SOURCE.format(factor=factor, shift=shift)
    exec(compile(code, "<made>", "exec"), namespace)
    return namespace


def _codes(made: dict[str, Any]) -> tuple[str, str]:
    return dataset_code(made["Items"]()), step_code(made["make_step"]([]))


@pytest.mark.slow  # over 2.5 s here: the full suite's (docs/development/checks.md)
def test_the_fingerprints_are_the_same_in_another_process() -> None:
    here = _codes(_made())
    script = textwrap.dedent(
        """
        from tests.test_fingerprint import _codes, _made
        print("|".join(_codes(_made())))
        """
    )
    for seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": seed, "PYTHONPATH": os.getcwd()}
        out = subprocess.run(
            [sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True
        )
        assert tuple(out.stdout.strip().split("|")) == here
    assert here[0].startswith(f"python {sys.version_info.major}.{sys.version_info.minor}: ")


def test_a_changed_body_changes_the_fingerprint_and_a_moved_one_does_not() -> None:
    dataset, step = _codes(_made())
    assert _codes(_made(blank_lines=5)) == (dataset, step)  # other line numbers: same code
    assert _codes(_made(shift=2))[0] != dataset  # a method reached through self
    assert _codes(_made(factor=3))[0] != dataset  # a helper of its module
    changed = _made()
    exec(
        "def make_step(counts):\n"
        "    def record(batch):\n"
        "        counts.append(len(batch) + 1)\n"
        "    def step(batch):\n"
        "        record(batch)\n"
        "    return step\n",
        changed,
    )
    changed_dataset, changed_step = _codes(changed)
    assert changed_dataset == dataset and changed_step != step


def test_the_datasets_a_dataset_holds_and_the_steps_forms_are_fingerprinted() -> None:
    sleep, busy = SleepDataset(16), BusyDataset(16)
    assert dataset_code(Subset(sleep, [0])) != dataset_code(Subset(busy, [0]))
    assert dataset_code(ConcatDataset([sleep, busy])) != dataset_code(ConcatDataset([sleep]))
    # A subclass that calls super() covers the method it overrides.
    assert dataset_code(busy) != dataset_code(sleep)
    assert step_code(functools.partial(noop_step)) == step_code(noop_step)

    class Step:
        def __call__(self, batch: object) -> None:
            pass

        def train(self, batch: object) -> None:
            pass

    assert step_code(Step()) not in (NOT_FINGERPRINTED, step_code(noop_step))
    assert step_code(Step().train) not in (NOT_FINGERPRINTED, step_code(Step()))
    assert step_code(print) == NOT_FINGERPRINTED  # no Python code to hash
