"""The ``autoloader tune`` options, each checked for what it does to a real run (the
saved result, where the step ran, the batches it got, what was printed), not only
that the command exits 0; Ctrl-C as a real SIGINT to the command; ``plot`` where
matplotlib cannot be imported. ``tests/test_cli.py`` covers the commands themselves."""

from __future__ import annotations

import ast
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import optuna
import pytest

import autoloader
from tests.test_cli import _main, _run

pytestmark = pytest.mark.slow  # real CLI runs, each option's effect

# A pipeline that leaves traces: the factory writes the pid of the process that called
# it (the command's own), each step call appends its batch's item ids to a file named
# after the process it runs in.
PIPELINE = """
import os
import time
from pathlib import Path

import torch
from torch.utils.data import Dataset


class Slow(Dataset):
    def __len__(self):
        return 256

    def __getitem__(self, index):
        time.sleep(0.002)
        return torch.full((4,), float(index))


def make_dataset():
    Path("factory.pid").write_text(str(os.getpid()))
    return Slow()


DATASET = Slow()


def step(batch):
    with open(f"steps.{os.getpid()}", "a") as seen:
        seen.write(" ".join(str(int(i)) for i in batch[:, 0]) + "\\n")
    time.sleep(0.005)


def slow_step(batch):
    Path("stepping").touch()
    time.sleep(0.2)
"""


def _steps(folder: Path) -> dict[int, list[list[int]]]:
    """The batches each process's step calls got, by pid."""
    return {
        int(path.suffix[1:]): [
            [int(i) for i in line.split()] for line in path.read_text().split("\n") if line
        ]
        for path in folder.glob("steps.*")
    }


def _in_order(batch: list[int]) -> bool:
    return batch == list(range(batch[0], batch[0] + len(batch)))


def test_tune_options_take_effect_in_the_run_and_the_saved_result(tmp_path: Path) -> None:
    """--n-trials caps the search, --memory-budget and --device are the problem's,
    --shuffle shuffles the step's batches, -v logs each trial."""
    (tmp_path / "pipe.py").write_text(PIPELINE)
    out = tmp_path / "best.json"
    done = _run(
        "-v", "tune", "pipe:make_dataset", "pipe:step", "--batch-size", "8",
        "--time-budget", "12", "--n-trials", "1", "--memory-budget", "2GiB",
        "--device", "cpu", "--shuffle", "-q", "--out", str(out), cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    result = autoloader.load(out)
    # Uncapped, this search runs 3 trials or more before the step bounds it.
    assert len([t for t in result.trials if t.phase == "search"]) <= 1, result.trials
    assert result.memory_budget == 2 << 30
    assert result.problem["memory budget"] == str(2 << 30)
    assert result.problem["device"] == "cpu"
    assert ast.literal_eval(result.problem["fixed loader options"]) == [("shuffle", "True")]
    logged = [line for line in done.stderr.splitlines() if line.startswith("trial ")]
    assert len(logged) >= len(result.trials), done.stderr
    batches = [batch for seen in _steps(tmp_path).values() for batch in seen]
    assert sum(not _in_order(batch) for batch in batches) > len(batches) / 2


def test_without_the_options_the_run_is_tunes_defaults_and_a_dataset_object_is_taken(
    tmp_path: Path,
) -> None:
    """The other side of the test above, with a Dataset object named in place of a
    factory: it is used as it is (nothing calls it), the step runs in the command's
    process on batches in order, no trial is logged, and the problem has no device,
    memory budget or fixed options."""
    (tmp_path / "pipe.py").write_text(PIPELINE)
    out = tmp_path / "best.json"
    done = _run(
        "tune", "pipe:DATASET", "pipe:step", "--batch-size", "8", "--time-budget", "6",
        "--n-trials", "1", "-q", "--out", str(out), cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert not (tmp_path / "factory.pid").exists()
    result = autoloader.load(out)
    assert result.problem["dataset"].endswith("Slow") and result.problem["dataset length"] == "256"
    assert result.problem["device"] == "None"
    assert result.problem["memory budget"] == "None"
    assert result.problem["fixed loader options"] == "[]"
    assert [line for line in done.stderr.splitlines() if line.startswith("trial ")] == []
    steps = _steps(tmp_path)
    (pid,) = steps  # one process: the command's, the only one that imports pipe and steps
    assert all(_in_order(batch) for batch in steps[pid])


def test_seed_seeds_the_sampler_and_isolation_runs_the_step_in_trial_processes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """--seed seeds the study's sampler (its proposals after the cost model's guesses
    and the ladder), and --isolation subprocess runs each trial, its steps included, in
    a process of its own; without them, tune()'s seed 0 and the steps in this process."""
    seeds: list[int | None] = []

    class Seeded(optuna.samplers.TPESampler):
        def __init__(self, *, seed: int | None = None, **kwargs: object) -> None:
            seeds.append(seed)
            super().__init__(seed=seed, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(optuna.samplers, "TPESampler", Seeded)
    (tmp_path / "pipe.py").write_text(PIPELINE)
    for given, seed, isolated in (
        (["--seed", "5", "--isolation", "subprocess"], 5, True),
        ([], 0, False),
    ):
        for old in tmp_path.glob("steps.*"):
            old.unlink()
        done = _main(
            "tune", "pipe:DATASET", "pipe:step", "--batch-size", "8", "--time-budget", "4",
            "--n-trials", "1", "-q", "--out", str(tmp_path / "best.json"), *given,
            cwd=tmp_path, monkeypatch=monkeypatch, capsys=capsys,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        assert seeds == [seed], given
        seeds.clear()
        steps = _steps(tmp_path)
        assert steps, given
        assert (os.getpid() not in steps) == isolated, (os.getpid(), list(steps))


def _ctrl_c_default() -> None:
    """In the child before it runs Python: SIGINT as a terminal leaves it, so that
    Python turns it into KeyboardInterrupt (a test run in the background, ``cmd &``,
    has it ignored, and its children inherit that)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _start(*args: str, cwd: Path) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "autoloader", *args],
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own process group, as a job in a terminal
        preexec_fn=_ctrl_c_default,
    )


def _finish(child: subprocess.Popen[str]) -> tuple[str, str]:
    try:
        return child.communicate(timeout=60)
    finally:
        if child.poll() is None:
            os.killpg(child.pid, signal.SIGKILL)
            child.wait()


def test_ctrl_c_before_the_baseline_ended_exits_130_with_nothing_saved(tmp_path: Path) -> None:
    (tmp_path / "pipe.py").write_text(PIPELINE)
    out = tmp_path / "best.json"
    child = _start("tune", "pipe:make_dataset", "pipe:slow_step", "--batch-size", "8",
                   "--time-budget", "60", "-q", "--out", str(out), cwd=tmp_path)  # fmt: skip
    try:
        give_up = time.monotonic() + 60
        while not (tmp_path / "stepping").exists() and child.poll() is None:
            assert time.monotonic() < give_up, "the baseline never stepped"
            time.sleep(0.05)
        os.killpg(child.pid, signal.SIGINT)  # Ctrl-C in the baseline's first step
    finally:
        _, err = _finish(child)
    assert child.returncode == 130, err
    assert err.strip().splitlines() == ["autoloader: interrupted"]
    assert not out.exists()


def test_ctrl_c_in_the_search_saves_the_best_so_far_and_the_report_says_interrupted(
    tmp_path: Path,
) -> None:
    (tmp_path / "pipe.py").write_text(PIPELINE)
    out = tmp_path / "best.json"
    child = _start("-v", "tune", "pipe:make_dataset", "pipe:step", "--batch-size", "8",
                   "--time-budget", "60", "-q", "--out", str(out), cwd=tmp_path)  # fmt: skip
    assert child.stderr is not None
    said = []
    try:
        for line in child.stderr:
            said.append(line)
            if line.startswith("trial 1 "):
                break
        os.killpg(child.pid, signal.SIGINT)
    finally:
        stdout, err = _finish(child)
    err = "".join(said) + err
    assert child.returncode == 0, err
    assert "Traceback" not in err
    result = autoloader.load(out)
    assert result.partial and result.trials[0].state == "complete"
    first = stdout.splitlines()[0]
    assert first.startswith("autoloader report: ")
    assert first.endswith(" (interrupted: best of the finished trials)")
    assert autoloader.report(result) in stdout


def test_plot_without_matplotlib_is_one_line_saying_how_to_install_it(tmp_path: Path) -> None:
    from tests.test_result import _result

    saved = _result().save(tmp_path / "best.json")
    image = tmp_path / "tuning.png"
    # The command as `python -m autoloader` runs it, where matplotlib cannot be imported.
    without = (
        "import sys; sys.modules['matplotlib'] = None; "
        "from autoloader._cli import main; sys.exit(main())"
    )
    done = subprocess.run(
        [sys.executable, "-c", without, "plot", str(saved), "-o", str(image)],
        capture_output=True, text=True, cwd=tmp_path, timeout=120,
    )  # fmt: skip
    assert done.returncode == 1
    assert done.stderr.strip().splitlines() == [
        "autoloader: error: autoloader.plot() needs matplotlib: pip install "
        "'torch-autoloader[plot]' (or pip install matplotlib)."
    ]
    assert not image.exists()
