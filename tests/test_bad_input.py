"""Bad input that used to crash or hang, refused promptly with an error that names it
(issue 36, item 7): times that overflow, result paths that are not regular files, and
the environment variables a torchrun job or Lightning sets.

Whatever could hang runs in a subprocess with a timeout, so that a regression fails the
test rather than hangs the suite.
"""

from __future__ import annotations

import json
import math
import os
import resource
import socket
import subprocess
import sys
import textwrap
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from torch.utils.data import DataLoader

import autoloader
from autoloader import AutoLoader, InvalidInputError, ResultFileError
from autoloader._cli import main
from autoloader.checks._validation import MAX_SECONDS
from autoloader.results._files import MAX_RESULT_BYTES
from tests.test_result import _result
from tests.workloads import CountingDataset, SleepDataset, noop_step

# Seconds a command that should answer at once may take on a busy 2-core machine before
# the test calls it a hang.
_PROMPTLY = 60


def _saved(tmp_path: Path, name: str = "best.json", **changes: Any) -> Path:
    path = _result().save(tmp_path / name)
    assert path is not None
    if changes:
        data = json.loads(path.read_text())
        data.update(changes)
        path.write_text(json.dumps(data))
    return path


def _cli(
    *args: str, cwd: Path, env: dict[str, str] | None = None, limit_memory: bool = False
) -> subprocess.CompletedProcess[str]:
    """``autoloader ARGS`` in a process of its own, with ``env`` added to this one's."""

    def at_most_4_gib() -> None:  # a read without end fails in the child, not the machine
        resource.setrlimit(resource.RLIMIT_AS, (4 * 1024**3, 4 * 1024**3))

    return subprocess.run(
        [sys.executable, "-m", "autoloader", *args],
        cwd=cwd,
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=_PROMPTLY,
        preexec_fn=at_most_4_gib if limit_memory else None,
    )


def _one_error_line(done: subprocess.CompletedProcess[str], *parts: str) -> None:
    """The command failed with one line on stderr, no traceback, saying ``parts``."""
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("autoloader: error: "), done.stderr
    for part in parts:
        assert part in lines[0]


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


# Times ----------------------------------------------------------------------------------


@pytest.mark.parametrize("seconds", [math.inf, 1e10])
@pytest.mark.parametrize("entry", ["tune", "AutoLoader", "diagnose"])
def test_a_time_that_would_overflow_is_refused_before_any_work(entry: str, seconds: float) -> None:
    """inf and 1e10 s raised OverflowError from a deadline or an alarm deep in the run
    (AutoLoader only at its first batch); a week is the most any of them takes."""
    dataset = CountingDataset(length=64)
    with pytest.raises(InvalidInputError) as caught:
        if entry == "tune":
            autoloader.tune(dataset, noop_step, batch_size=8, time_budget=seconds)
        elif entry == "AutoLoader":
            AutoLoader(dataset, batch_size=8, time_budget=seconds, verbose=False)
        else:
            autoloader.diagnose(DataLoader(dataset, batch_size=8), noop_step, seconds=seconds)
    message = str(caught.value)
    assert ("time_budget" if entry != "diagnose" else "seconds") in message
    assert repr(seconds) in message and "at most 604800 s (a week)" in message
    assert dataset.reads == 0
    if entry == "AutoLoader":  # a week is taken
        assert MAX_SECONDS == 7 * 24 * 3600
        AutoLoader(dataset, batch_size=8, time_budget=MAX_SECONDS, verbose=False).close()


@pytest.mark.parametrize("timeout", [math.inf, 1e10, math.nan, -1.0])
def test_a_dataloader_timeout_that_would_overflow_is_refused(timeout: float) -> None:
    """DataLoader's own timeout (a queue's wait) raised OverflowError at the first batch
    with workers."""
    # DataLoader refuses a negative one itself, in its words, before AutoLoader's checks.
    refused = "timeout option" if timeout < 0 else r"loader_kwargs\['timeout'\]"
    with pytest.raises(ValueError, match=refused):
        AutoLoader(SleepDataset(length=64), batch_size=8, timeout=timeout, verbose=False)
    with pytest.raises(InvalidInputError, match=r"loader_kwargs\['timeout'\]"):
        autoloader.tune(
            SleepDataset(length=64),
            noop_step,
            batch_size=8,
            time_budget=2,
            loader_kwargs={"timeout": timeout},
            show_progress=False,
        )


@pytest.mark.parametrize("budget", ["inf", "1e10", "nan", "0"])
def test_the_cli_refuses_a_time_budget_that_would_overflow(
    budget: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A usage error (exit 2, one line), before the dataset is built."""
    (tmp_path / "overflow_budget.py").write_text(
        textwrap.dedent(
            """
            from tests.workloads import SleepDataset
            built = []
            def make_dataset():
                built.append(1)
                return SleepDataset(length=64)
            def step(batch):
                pass
            """
        )
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1]))
    monkeypatch.setattr(warnings, "formatwarning", warnings.formatwarning)  # main() sets it
    with pytest.raises(SystemExit) as caught:
        main(
            ["tune", "overflow_budget:make_dataset", "overflow_budget:step", "--batch-size",
             "8", "--time-budget", budget, "-q", "--out", str(tmp_path / "out.json")]
        )  # fmt: skip
    assert caught.value.code == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert error.startswith("autoloader tune: error: argument --time-budget: ")
    if budget in ("inf", "1e10"):
        assert "at most 604800 s (a week)" in error
    assert sys.modules["overflow_budget"].built == []
    assert not (tmp_path / "out.json").exists()


# Result files that are not regular files ------------------------------------------------

_TRY_EVERY_READER = textwrap.dedent(
    """
    import sys, time, warnings
    import autoloader
    from tests.workloads import SleepDataset, noop_step
    path = sys.argv[1]
    calls = {
        "load": lambda: autoloader.load(path),
        "tune": lambda: autoloader.tune(
            SleepDataset(length=64), noop_step, batch_size=8, time_budget=2, path=path,
            show_progress=False,
        ),
        "AutoLoader": lambda: autoloader.AutoLoader(
            SleepDataset(length=64), batch_size=8, time_budget=2, path=path, verbose=False
        ),
    }
    for name, call in calls.items():
        started = time.monotonic()
        try:
            call()
            outcome = "no error"
        except Exception as error:
            outcome = f"{type(error).__name__}: {error}"
        print(f"{name}\\t{time.monotonic() - started:.2f}\\t{outcome}", flush=True)
    """
)


def _special_file(tmp_path: Path, kind: str) -> Path:
    path = tmp_path / f"{kind}.json"
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "dev-zero":
        path.symlink_to("/dev/zero")
    elif kind == "directory":
        path.mkdir()
    else:
        path.write_text("[" * 100_000 + "]" * 100_000)
    return path


@pytest.mark.parametrize(
    ("kind", "said"),
    [
        ("fifo", "is a FIFO (named pipe), not a result file"),
        ("dev-zero", "is a character device, not a result file"),
        ("directory", "is a directory, not a result file"),
        ("nested", "is not a result: its JSON is nested deeper than any result's"),
    ],
)
@pytest.mark.slow  # over 2.5 s here: the full suite's (docs/development/checks.md)
def test_a_result_path_that_is_not_a_regular_file_is_refused_promptly(
    tmp_path: Path, kind: str, said: str
) -> None:
    """A FIFO hung every reader, a symlink to /dev/zero read without end, and deeply
    nested JSON raised RecursionError. load() refuses them with ResultFileError; tune()
    and AutoLoader refuse to replace them (InvalidInputError), before any trial."""
    path = _special_file(tmp_path, kind)
    root = Path(__file__).resolve().parents[1]
    done = subprocess.run(
        [sys.executable, "-c", _TRY_EVERY_READER, str(path)],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=_PROMPTLY,
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_AS, (4 * 1024**3,) * 2),
    )
    assert done.returncode == 0, done.stderr
    lines = dict(line.split("\t", 1) for line in done.stdout.strip().splitlines())
    expected = {
        "load": f"ResultFileError: {path} {said}",
        "tune": "InvalidInputError: ",
        "AutoLoader": "InvalidInputError: ",
    }
    if kind == "directory":  # refused as a path to write, before it is read
        expected["tune"] = expected["AutoLoader"] = "InvalidInputError: path "
    for name, start in expected.items():
        seconds, outcome = lines[name].split("\t", 1)
        assert outcome.startswith(start), outcome
        assert float(seconds) < 10  # at once; before, never (FIFO, /dev/zero)


@pytest.mark.parametrize("kind", ["fifo", "dev-zero", "nested"])
@pytest.mark.slow  # over 2.5 s here: the full suite's (docs/development/checks.md)
def test_autoloader_show_refuses_a_file_that_is_not_a_result_promptly(
    tmp_path: Path, kind: str
) -> None:
    path = _special_file(tmp_path, kind)
    _one_error_line(_cli("show", str(path), cwd=tmp_path, limit_memory=True), str(path))


def test_a_result_file_larger_than_any_result_is_refused_unread(tmp_path: Path) -> None:
    """Read whole before (gigabytes, for a file of gigabytes); a result of 10,000 trials
    is about 7 MiB."""
    path = tmp_path / "huge.json"
    with path.open("wb") as file:  # sparse: nothing is written, nothing need be read
        file.truncate(MAX_RESULT_BYTES + 1)
    with pytest.raises(ResultFileError, match=r"larger than any result file \(at most 64\.0 MiB\)"):
        autoloader.load(path)
    with pytest.raises(InvalidInputError, match="not an autoloader result"):
        AutoLoader(SleepDataset(length=64), batch_size=8, path=path, verbose=False)


# Result files with figures out of range: see test_result.py's tests of tampered files.


# What autoloader show prints ------------------------------------------------------------


@pytest.mark.slow  # over 2.5 s here: the full suite's (docs/development/checks.md)
def test_show_prints_a_lone_surrogate_escaped(tmp_path: Path) -> None:
    """A string of the file that stdout cannot encode (a lone surrogate, from a "\\ud800"
    escape) raised UnicodeEncodeError while printing."""
    path = _saved(tmp_path, notes=["read \ud800 then stopped"])
    done = _cli("show", str(path), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "read \\ud800 then stopped" in done.stdout


@pytest.mark.slow  # over 2.5 s here: the full suite's (docs/development/checks.md)
def test_show_refuses_facts_of_the_wrong_type_naming_them(tmp_path: Path) -> None:
    """The report's arithmetic on a fact that is a string raised TypeError."""
    facts = {"dataset_length": 100_000, "copy_on_read": 50_000.0, "copy_on_read_items": "lots"}
    path = _saved(tmp_path, facts=facts)
    _one_error_line(
        _cli("show", str(path), cwd=tmp_path), "field 'facts.copy_on_read_items' is \"lots\""
    )


# Environment variables ------------------------------------------------------------------


@pytest.fixture
def torchrun_rank_0() -> Iterator[dict[str, str]]:
    """The variables torchrun leaves for rank 0 of 2, with nobody at its port."""
    yield {
        "RANK": "0",
        "WORLD_SIZE": "2",
        "LOCAL_RANK": "0",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(_free_port()),
    }


@pytest.mark.parametrize("command", ["show", "plot"])
@pytest.mark.slow  # over 2.5 s here: the full suite's (docs/development/checks.md)
def test_a_command_that_reads_a_file_never_waits_for_other_ranks(
    tmp_path: Path, torchrun_rank_0: dict[str, str], command: str
) -> None:
    """With RANK and WORLD_SIZE left in the environment, show waited for a rendezvous
    with rank 1 (still waiting at 25 s)."""
    path = _saved(tmp_path)
    extra = ["-o", str(tmp_path / "tuning.png")] if command == "plot" else []
    started = time.monotonic()
    done = _cli(command, str(path), *extra, cwd=tmp_path, env=torchrun_rank_0)
    assert done.returncode == 0, done.stderr
    assert time.monotonic() - started < _PROMPTLY
    if command == "show":
        assert "num_workers" in done.stdout and "tuned" in done.stdout
    else:
        assert (tmp_path / "tuning.png").stat().st_size > 0


@pytest.mark.parametrize(
    ("variable", "value", "rule"),
    [
        ("WORLD_SIZE", "two", "must be an int >= 1"),
        ("RANK", "x", "must be an int from 0 to 1"),
        ("RANK", "5", "must be an int from 0 to 1"),
        ("MASTER_PORT", "http", "must be an int from 1 to 65535"),
    ],
)
@pytest.mark.slow  # over 2.5 s here: the full suite's (docs/development/checks.md)
def test_a_bad_torchrun_variable_is_named_in_one_line(
    tmp_path: Path, torchrun_rank_0: dict[str, str], variable: str, value: str, rule: str
) -> None:
    """They were bare ValueError tracebacks from int(), or (RANK=5 of 2) a wait without
    end for the rendezvous."""
    (tmp_path / "bad_env_job.py").write_text(
        "from tests.workloads import SleepDataset, noop_step\n"
        "def make_dataset():\n    return SleepDataset(length=64)\n"
    )
    env = {
        **torchrun_rank_0,
        variable: value,
        "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[1]), str(tmp_path)]),
    }
    done = _cli(
        "tune", "bad_env_job:make_dataset", "bad_env_job:noop_step", "--batch-size", "8",
        "--time-budget", "2", "-q", "--out", str(tmp_path / "out.json"), cwd=tmp_path, env=env,
    )  # fmt: skip
    _one_error_line(done, f"environment variable {variable} is {value!r}", rule)
    assert not (tmp_path / "out.json").exists()


def test_a_bad_rank_does_not_fail_an_autoloader_at_the_end_of_its_tuning(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Its last words were printed on rank 0 as RANK said: int("x") raised ValueError
    in the training loop once tuning ended. Without a process group the process tunes
    alone, as rank 0."""
    monkeypatch.setenv("RANK", "x")
    loader = AutoLoader(SleepDataset(length=64, latency=0.0), batch_size=8, time_budget=2)
    try:
        for _ in range(200):
            for _batch in loader:
                time.sleep(0.002)
            if loader.tuned:
                break
    finally:
        loader.close()
    assert loader.tuned
    assert "AutoLoader: tuned in" in capsys.readouterr().err


@pytest.mark.late  # imports Lightning (tests/seats.py)
@pytest.mark.slow  # over 2.5 s here (importing Lightning): the full suite's
def test_a_bad_pl_seed_workers_is_named_before_tuning(monkeypatch: pytest.MonkeyPatch) -> None:
    """Read after the tuning run, to seed the tuned loader's workers: int("yes") raised
    ValueError once the tuning was spent."""
    pl = pytest.importorskip("lightning.pytorch")
    from autoloader.lightning import LoaderTuner
    from tests.lightning_models import Regression

    monkeypatch.setenv("PL_SEED_WORKERS", "yes")
    tuner = LoaderTuner(time_budget=3)
    trainer = pl.Trainer(
        accelerator="cpu", max_epochs=1, callbacks=[tuner], logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    with pytest.raises(InvalidInputError, match="environment variable PL_SEED_WORKERS is 'yes'"):
        trainer.fit(Regression())
    assert tuner.result is None  # nothing was tuned
