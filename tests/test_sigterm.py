"""SIGTERM during ``tune()`` (how SLURM, Kubernetes and torchrun stop a job): a real
SIGTERM to a real tuning process, after its first trials (``NOTE [ SIGTERM while
tuning ]``)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

import autoloader

pytestmark = pytest.mark.slow  # SIGTERM in real runs

ROOT = Path(__file__).resolve().parents[1]

TUNE = """
import json, logging, signal, sys
import autoloader
from tests.workloads import SleepDataset, sleep_step

logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
{before}
result = autoloader.tune(
    SleepDataset(100_000), sleep_step, batch_size=4, time_budget=float(sys.argv[2]),
    show_progress=False, path=sys.argv[1],
)
{after}
"""


def _tune_until_sigterm(
    path: Path,
    *,
    before: str = "",
    after: str = "",
    at: str = "trial 1 ",
    budget: float = 20,
) -> tuple[subprocess.CompletedProcess[str], set[int]]:
    """Run ``tune(path=path)`` in a process of its own; once it logs a line that starts
    with ``at`` (by default: two trials finished) and, after the baseline, a trial's
    workers run, send it SIGTERM (to it alone, as ``kill`` and Kubernetes do). Its exit,
    and the pids of the workers it had then."""
    script = TUNE.format(before=textwrap.dedent(before), after=textwrap.dedent(after))
    child = subprocess.Popen(
        [sys.executable, "-c", script, str(path), str(budget)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    assert child.stderr is not None
    descendants: set[int] = set()
    said = []
    try:
        for line in child.stderr:
            said.append(line)
            if line.startswith(at):
                break
        give_up = time.monotonic() + (30 if at.startswith("trial") else 0)
        while not descendants and time.monotonic() < give_up:
            time.sleep(0.05)
            descendants = {p.pid for p in psutil.Process(child.pid).children(recursive=True)}
        child.send_signal(signal.SIGTERM)
        out, err = child.communicate(timeout=60)
    finally:
        if child.poll() is None:
            os.killpg(child.pid, signal.SIGKILL)
            child.wait()
    return subprocess.CompletedProcess(child.args, child.returncode, out, "".join(said) + err), (
        descendants
    )


def _running(pids: set[int], *, within: float) -> list[int]:
    """Those of ``pids`` still running ``within`` seconds from now (an exited process
    its new parent has not reaped yet counts as ended). Beside a busy loop, a worker
    killed as the process ended was found still alive at the parent's exit, once."""
    give_up = time.monotonic() + within
    while True:
        running = []
        for pid in pids:
            try:
                if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                    running.append(pid)
            except psutil.NoSuchProcess:
                continue
        if not running or time.monotonic() > give_up:
            return running
        time.sleep(0.1)


def test_sigterm_saves_the_finished_trials_then_ends_the_process_by_sigterm(
    tmp_path: Path,
) -> None:
    path = tmp_path / "loader.json"
    done, descendants = _tune_until_sigterm(path)
    # The process ends as SIGTERM ends it without autoloader: by the signal.
    assert done.returncode == -signal.SIGTERM, done.stderr
    result = autoloader.load(path)  # whole and readable
    assert result.partial
    assert len(result.trials) >= 2, done.stderr
    assert result.trials[0].state == "complete"  # the baseline
    assert [t.reason for t in result.trials if t.kind == "interrupted"] in (
        [],  # SIGTERM came between two trials
        ["interrupted (SIGTERM)"],
    )
    assert any(note.startswith("interrupted (SIGTERM)") for note in result.notes)
    # The trial under way was stopped, and its workers with it.
    assert descendants, "the trial had workers when SIGTERM came"
    assert not _running(descendants, within=10)
    assert not [p.name for p in tmp_path.iterdir() if p.name != "loader.json"]  # no temp file
    # Never reused as a complete result: tune(path=) tunes again (tests/test_reuse.py).


def test_sigterm_goes_on_to_the_programs_own_handler_after_saving(tmp_path: Path) -> None:
    """A program with a SIGTERM handler of its own (a checkpoint-and-exit hook) gets the
    signal once the finished trials are saved, and its handler back, the same object;
    its handler returns, so ``tune()`` returns the partial result."""
    path = tmp_path / "loader.json"
    before = """
        got = []
        def mine(signum, frame):
            got.append((signum, autoloader.load(sys.argv[1]).partial))
        signal.signal(signal.SIGTERM, mine)
    """
    after = """
        print(json.dumps({"partial": result.partial, "trials": len(result.trials),
                          "got": got, "mine_back": signal.getsignal(signal.SIGTERM) is mine}))
    """
    done, _ = _tune_until_sigterm(path, before=before, after=after)
    assert done.returncode == 0, done.stderr
    said = json.loads(done.stdout.strip().splitlines()[-1])
    # Called once, after the file was saved (it read it), and only then.
    assert said["got"] == [[signal.SIGTERM, True]]
    assert said["mine_back"] is True
    assert said["partial"] is True
    assert len(autoloader.load(path).trials) == said["trials"] >= 2


def test_sigterm_before_the_baseline_ended_ends_the_process_with_nothing_saved(
    tmp_path: Path,
) -> None:
    path = tmp_path / "loader.json"
    done, _ = _tune_until_sigterm(path, at="tuning SleepDataset")
    assert done.returncode == -signal.SIGTERM, done.stderr
    assert not path.exists()
    assert list(tmp_path.iterdir()) == []


def test_a_sigterm_the_program_ignores_stays_ignored(tmp_path: Path) -> None:
    path = tmp_path / "loader.json"
    before = "signal.signal(signal.SIGTERM, signal.SIG_IGN)"
    after = """
        print(json.dumps({"partial": result.partial,
                          "ignored": signal.getsignal(signal.SIGTERM) is signal.SIG_IGN}))
    """
    done, _ = _tune_until_sigterm(path, before=before, after=after, budget=8)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.strip().splitlines()[-1]) == {"partial": False, "ignored": True}
    assert not autoloader.load(path).partial


SAVING = """
import sys
from tests.test_result import _result

result = _result()
result.save(sys.argv[1])
print("saving", flush=True)
while True:
    result.save(sys.argv[1])
"""


def test_a_process_killed_while_saving_leaves_a_whole_file(tmp_path: Path) -> None:
    """What ``AutoLoader`` (which installs no SIGTERM handler in the training loop) and
    ``tune()`` write at ``path`` stays whole whenever the process is killed: a process
    saving in a loop, SIGKILLed (no handler runs), leaves a file that loads, and
    nothing but hidden temporary files beside it."""
    from tests.test_result import _result

    path = tmp_path / "loader.json"
    child = subprocess.Popen(
        [sys.executable, "-c", SAVING, str(path)], cwd=ROOT, stdout=subprocess.PIPE, text=True
    )
    try:
        assert child.stdout is not None and child.stdout.readline() == "saving\n"
        time.sleep(0.5)  # hundreds of saves: killed in the middle of one
    finally:
        child.kill()
        child.wait()
    assert autoloader.load(path).as_dict() == _result().as_dict()
    assert all(p.name.startswith(".loader.json.") for p in tmp_path.iterdir() if p != path)
