"""The ``autoloader`` command: end to end as a real subprocess (``python -m
autoloader``), and its usage errors and help in this process (``main([...])``), which
spares starting an interpreter and importing torch for each."""

from __future__ import annotations

import functools
import json
import os
import signal
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


@pytest.mark.slow
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


@pytest.mark.slow  # over 2.5 s here: the full suite's (docs/development/checks.md)
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

    monkeypatch.setattr("autoloader.results.report", broken_report)  # as the CLI finds it
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "pipeline_for_save.py").write_text(PIPELINE)
    out = tmp_path / "best.json"
    monkeypatch.setattr(warnings, "formatwarning", warnings.formatwarning)  # main() sets it
    with pytest.raises(BrokenPipeError):
        main(["tune", "pipeline_for_save:make_dataset", "pipeline_for_save:step",
              "--batch-size", "4", "--out", str(out)])  # fmt: skip
    assert autoloader.load(out).params == _result().params


@pytest.mark.slow  # over 2.5 s here: the full suite's (docs/development/checks.md)
def test_sigterm_saves_the_finished_trials_to_out_and_exits_143(tmp_path: Path) -> None:
    """SIGTERM (a scheduler stopping the job) after the first trials: they are saved to
    ``--out``, marked partial, and the command exits with 143 (NOTE [ SIGTERM while
    tuning ])."""
    (tmp_path / "pipe.py").write_text(PIPELINE)
    out = tmp_path / "best.json"
    child = subprocess.Popen(
        [sys.executable, "-m", "autoloader", "-v", "tune", "pipe:make_dataset", "pipe:step",
         "--batch-size", "4", "--time-budget", "20", "-q", "--out", str(out)],
        cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert child.stderr is not None
    said = []
    try:
        for line in child.stderr:
            said.append(line)
            if line.startswith("trial 1 "):
                break
        child.send_signal(signal.SIGTERM)
        _, err = child.communicate(timeout=60)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    err = "".join(said) + err
    assert child.returncode == 143, err
    assert "Traceback" not in err
    assert err.strip().splitlines()[-1].startswith("autoloader: stopped by SIGTERM")
    result = autoloader.load(out)
    assert result.partial and len(result.trials) >= 2
    assert result.trials[0].state == "complete"


@pytest.mark.slow  # over 2.5 s here: the full suite's (docs/development/checks.md)
def test_an_out_holding_another_file_is_refused_before_any_trial(tmp_path: Path) -> None:
    """``--out`` naming a file that is not an autoloader result (a mistyped config
    path) is refused at once, as ``tune(path=...)`` refuses it, and the file is left as
    it was."""
    (tmp_path / "pipe.py").write_text(PIPELINE)
    precious = tmp_path / "precious.toml"
    precious.write_text("[training]\nepochs = 90\n")
    precious.chmod(0o640)
    done = _run("-v", "tune", "pipe:make_dataset", "pipe:step", "--batch-size", "4",
                "--time-budget", "600", "--out", str(precious), cwd=tmp_path)  # fmt: skip
    assert done.returncode == 1
    assert done.stderr.strip().splitlines() == [
        f"autoloader: error: --out: path {str(precious)!r} holds a file that is not an "
        "autoloader result; it would be overwritten. Give another path, or delete the file."
    ]
    assert precious.read_text() == "[training]\nepochs = 90\n"
    assert precious.stat().st_mode & 0o777 == 0o640


@pytest.mark.parametrize(
    "out",
    [
        "/proc/autoloader-test/best.json",  # where no file can be created, root or not
        "pipe.py/best.json",  # under a file
    ],
)
@pytest.mark.slow  # over 2.5 s here: the full suite's (docs/development/checks.md)
def test_an_out_that_cannot_be_written_is_refused_before_any_trial(
    tmp_path: Path, out: str
) -> None:
    """Refused at once with one line, not after the whole budget with a traceback and
    the run lost."""
    (tmp_path / "pipe.py").write_text(PIPELINE)
    done = _run("-v", "tune", "pipe:make_dataset", "pipe:step", "--batch-size", "4",
                "--time-budget", "600", "--out", out, cwd=tmp_path)  # fmt: skip
    assert done.returncode == 1
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("autoloader: error: --out: cannot write")
    assert not Path(out).exists()


def test_the_result_file_follows_the_umask(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Written as ``open()`` writes a file (0o666 less the umask), not 0o600: a result
    in a shared project folder is readable by the group. A missing folder is created."""
    from tests.test_result import _result

    monkeypatch.setattr("autoloader._tune.tune", lambda *args, **kwargs: _result())
    (tmp_path / "pipeline_for_umask.py").write_text(PIPELINE)
    umask = os.umask(0o027)
    try:
        done = _main("tune", "pipeline_for_umask:make_dataset", "pipeline_for_umask:step",
                     "--batch-size", "4", "--out", "results/best.json",
                     cwd=tmp_path, monkeypatch=monkeypatch, capsys=capsys)  # fmt: skip
    finally:
        os.umask(umask)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "results" / "best.json").stat().st_mode & 0o777 == 0o640
    assert [p.name for p in (tmp_path / "results").iterdir()] == ["best.json"]
