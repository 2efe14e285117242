"""The ``autoloader`` command: end to end as a real subprocess (``python -m
autoloader``), and its usage errors and help in this process (``main([...])``), which
spares starting an interpreter and importing torch for each."""

from __future__ import annotations

import functools
import json
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

import autoloader
from autoloader._cli import main
from autoloader.loader._params import TUNED_KEYS


def _run(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "autoloader", *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        timeout=120,
    )


def _main(
    *args: str, cwd: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> subprocess.CompletedProcess[str]:
    """``autoloader ARGS`` run in this process from ``cwd``, as :func:`_run` runs it."""
    monkeypatch.chdir(cwd)
    monkeypatch.syspath_prepend(str(cwd))  # as python -m puts the working directory first
    monkeypatch.delitem(sys.modules, "pipe", raising=False)  # another test's pipe.py
    monkeypatch.setattr(warnings, "formatwarning", warnings.formatwarning)  # main() sets it
    capsys.readouterr()
    try:
        code = main(list(args))
    except SystemExit as exit:  # argparse's usage errors and --help
        code = exit.code if isinstance(exit.code, int) else 1
    said = capsys.readouterr()
    monkeypatch.delitem(sys.modules, "pipe", raising=False)
    return subprocess.CompletedProcess(args, code, said.out, said.err)


PIPELINE = """
import time
import torch
from torch.utils.data import Dataset


class Slow(Dataset):
    def __len__(self):
        return 256

    def __getitem__(self, index):
        time.sleep(0.002)
        return torch.full((4,), float(index))


def make_dataset():
    return Slow()


def step(batch):
    time.sleep(0.005)


def broken():
    raise RuntimeError("no data directory")
"""


def test_demo_tunes_prints_the_report_and_saves(tmp_path: Path) -> None:
    out = tmp_path / "demo.json"
    done = _run(
        "demo", "--time-budget", "4", "--items", "512", "--out", str(out), "-q", cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr
    for text in ("num_workers", "with the defaults", "bottleneck", "trials", str(out)):
        assert text in done.stdout
    assert json.loads(out.read_text())["schema_version"] == 7
    # What it printed is the report of what it saved, and the search measured workers.
    result = autoloader.load(out)
    assert autoloader.report(result) in done.stdout
    assert set(result.params) == set(TUNED_KEYS)
    assert result.trials[0].phase == "baseline"
    assert any(t.params["num_workers"] > 0 for t in result.trials if t.phase == "search")


def test_tune_show_and_plot_a_user_pipeline(tmp_path: Path) -> None:
    (tmp_path / "pipe.py").write_text(PIPELINE)
    out = tmp_path / "runs" / "best.json"
    journal = tmp_path / "study.log"
    done = _run(
        "tune", "pipe:make_dataset", "pipe.py:step", "--batch-size", "8",
        "--time-budget", "5", "--out", str(out), "--storage", str(journal), "-q",
        cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "with the defaults" in done.stdout and str(out) in done.stdout
    assert journal.stat().st_size > 0  # the study went to the storage
    result = autoloader.load(out)
    assert result.batch_size == 8

    shown = _run("show", str(out), cwd=tmp_path)
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout.strip() == autoloader.report(result)

    image = tmp_path / "tuning.png"
    drawn = _run("plot", str(out), "-o", str(image), cwd=tmp_path)
    assert drawn.returncode == 0, drawn.stderr
    assert image.read_bytes().startswith(b"\x89PNG")


def test_a_factory_that_raises_is_one_line_and_exit_1(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "pipe.py").write_text(PIPELINE)
    done = _main(
        "tune", "pipe:broken", "pipe:step", "--batch-size", "8", "-q",
        cwd=tmp_path, monkeypatch=monkeypatch, capsys=capsys,
    )  # fmt: skip
    assert done.returncode == 1
    assert done.stderr.strip() == (
        "autoloader: error: broken() raised RuntimeError: no data directory"
    )


def test_names_that_do_not_import_are_usage_errors(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "pipe.py").write_text(PIPELINE)
    run = functools.partial(_main, cwd=tmp_path, monkeypatch=monkeypatch, capsys=capsys)
    for spec, message in (
        ("pipe", "is not MODULE:NAME"),
        ("pipe:nothing", "'pipe' has no 'nothing'"),
        ("missing_module:make", "cannot import 'missing_module'"),
        ("missing.py:make", "missing.py: no such file"),
    ):
        done = run("tune", spec, "pipe:step", "--batch-size", "8")
        assert done.returncode == 2 and message in done.stderr, (spec, done.stderr)
    # --batch-size is required
    assert run("tune", "pipe:make_dataset", "pipe:step").returncode == 2


def test_show_of_a_missing_or_broken_file_is_one_line_and_exit_1(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    run = functools.partial(_main, cwd=tmp_path, monkeypatch=monkeypatch, capsys=capsys)
    missing = run("show", "nothere.json")
    assert missing.returncode == 1
    assert missing.stderr.strip() == (
        "autoloader: error: cannot read nothere.json: No such file or directory"
    )
    (tmp_path / "bad.json").write_text("{}")
    for command in ("show", "plot"):
        bad = run(command, "bad.json")
        assert bad.returncode == 1 and len(bad.stderr.strip().splitlines()) == 1


def test_library_errors_are_one_line_and_exit_1(tmp_path: Path) -> None:
    done = _run("demo", "--batch-size", "0", cwd=tmp_path)
    assert done.returncode == 1
    assert done.stderr.strip() == "autoloader: error: batch_size must be positive but got 0."
    assert not (tmp_path / "autoloader-demo.json").exists()


def test_usage_errors_exit_2(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    run = functools.partial(_main, cwd=tmp_path, monkeypatch=monkeypatch, capsys=capsys)
    assert run("frobnicate").returncode == 2
    assert run("demo", "--time-budget", "soon").returncode == 2


def test_help_lists_every_command_and_each_has_its_own(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    run = functools.partial(_main, cwd=tmp_path, monkeypatch=monkeypatch, capsys=capsys)
    done = run("--help")
    assert done.returncode == 0
    for command in ("tune", "show", "plot", "demo"):
        assert command in done.stdout
        helped = run(command, "--help")
        assert helped.returncode == 0 and helped.stdout.startswith(f"usage: autoloader {command}")


def test_tune_saves_the_result_before_it_prints_the_report(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A report that cannot be printed (a closed pipe, a bug in a presenter) loses
    nothing measured: the file is written first."""
    from tests.test_result import _result

    monkeypatch.setattr("autoloader._tune.tune", lambda *args, **kwargs: _result())

    def broken_report(result: object) -> str:
        raise BrokenPipeError

    monkeypatch.setattr("autoloader.results._report.report", broken_report)
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "pipeline_for_save.py").write_text(PIPELINE)
    out = tmp_path / "best.json"
    monkeypatch.setattr(warnings, "formatwarning", warnings.formatwarning)  # main() sets it
    with pytest.raises(BrokenPipeError):
        main(["tune", "pipeline_for_save:make_dataset", "pipeline_for_save:step",
              "--batch-size", "4", "--out", str(out)])  # fmt: skip
    assert autoloader.load(out).params == _result().params
