"""isolation="subprocess": each trial in a process of its own, whatever it does to it."""

from __future__ import annotations

import json
import os
import pickle
import re
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch
from torch.utils.data import TensorDataset

import autoloader
from autoloader import InvalidInputError, IsolationError, UnpicklableError
from autoloader.loader._factory import default_start_method
from autoloader.loader._params import normalize_params
from autoloader.measure._deadlines import Deadlines, TrialTimeout
from autoloader.measure._errors import TrialError, TrialProcessDied, exception_chain
from autoloader.measure._isolation import SubprocessRunner, _Request, _silence_limit
from autoloader.measure._measurement import Measurement
from autoloader.measure._memory import MemoryBudgetExceeded
from autoloader.measure._process_memory import process_memory, tree_memory
from autoloader.measure._runner import TrialRunner
from autoloader.measure._trial_processes import (
    ForkingHelper,
    HelperGone,
    Spawner,
    pidfds_work,
    trial_starter,
)
from autoloader.search._faults import classify
from autoloader.search._outcome import state_of

from .workloads import (
    CountingDataset,
    ExitOnLoadDataset,
    FailsInWorkersDataset,
    MemoryHogDataset,
    ProcessRecordingStep,
    SleepDataset,
    StartMethodCheckingStep,
    StepWithFault,
    UnloadableDataset,
    ended,
    noop_step,
    sleep_step,
)

pytestmark = pytest.mark.slow  # trials in processes of their own, killed and hung

GENEROUS = Deadlines(first=20, each=20)


def _params(workers: int) -> dict[str, Any]:
    return normalize_params({"num_workers": workers, "prefetch_factor": 2})


ROOT = Path(__file__).resolve().parents[1]
forking = pytest.mark.skipif(not pidfds_work(), reason="no pidfds: each trial is spawned")

_RUNNERS: list[SubprocessRunner] = []


@pytest.fixture(autouse=True)
def helpers_stopped() -> Iterator[None]:
    """Each test's runners stop their helpers before conftest looks for processes left
    (a runner an exception's traceback holds would stop its helper only when collected)."""
    yield
    while _RUNNERS:
        _RUNNERS.pop().close()


def _isolated(
    dataset: Any, step: Any = noop_step, *, spawned: bool = False, **kwargs: Any
) -> SubprocessRunner:
    kwargs.setdefault("memory_budget", tree_memory() + 4 * 1024**3)
    starter = Spawner() if spawned else None
    runner = SubprocessRunner(TrialRunner(dataset, step, batch_size=2, **kwargs), starter=starter)
    _RUNNERS.append(runner)
    return runner


def _processes(*pids: int) -> list[psutil.Process]:
    """Those of ``pids`` still running."""
    found = []
    for pid in pids:
        try:
            found.append(psutil.Process(pid))
        except psutil.NoSuchProcess:
            continue
    return found


def _recorded(folder: Path) -> list[dict[str, Any]]:
    """What each trial's ProcessRecordingStep wrote, in the order the trials ran."""
    return [
        json.loads(path.read_text())
        for path in sorted(folder.glob("*.json"), key=lambda path: path.stat().st_mtime_ns)
    ]


def test_a_trial_in_its_own_process_is_measured_and_relayed_window_by_window() -> None:
    windows: list[tuple[int, Measurement]] = []
    m = _isolated(SleepDataset(2048), sleep_step).measure(
        _params(2), max_seconds=1.5, on_window=lambda n, m: windows.append((n, m)) is not None
    )
    assert m.samples_per_second > 0 and m.batches > 0
    assert [n for n, _ in windows] == list(range(1, len(windows) + 1))
    # The tree the budget is for: this process and the trial's.
    assert m.peak_memory > process_memory(psutil.Process())


def test_workers_start_as_they_would_in_the_tuning_process() -> None:
    expected = default_start_method()
    wall = time.perf_counter()
    m = _isolated(SleepDataset(512), StartMethodCheckingStep(expected)).measure(
        _params(2), max_seconds=1, deadlines=GENEROUS
    )
    assert m.batches > 0
    # The trial's duration is what the run paid for it, its process's start-up included.
    assert m.duration <= time.perf_counter() - wall


def test_a_tensor_dataset_is_sent_by_value_to_every_trial() -> None:
    dataset = TensorDataset(torch.randn(4096, 16), torch.arange(4096))
    runner = _isolated(dataset)
    for workers in (1, 2):  # each trial's process loads its own copy
        assert runner.measure(_params(workers), max_seconds=0.5, deadlines=GENEROUS).batches > 0


@pytest.mark.parametrize(
    ("fault", "state", "reason"),
    [
        ("SIGSEGV", "failed", r"^trial process crashed \(SIGSEGV\) with this setting$"),
        ("exit", "failed", r"^trial process exited with code 3$"),
        (
            "SIGKILL",
            "pruned",
            r"^killed: the trial's process was killed \(SIGKILL\), likely by the kernel's "
            r"OOM killer",
        ),
    ],
)
def test_the_death_of_the_trial_process_is_recorded(fault: str, state: str, reason: str) -> None:
    with pytest.raises(TrialError) as info:
        _isolated(SleepDataset(512), StepWithFault(fault)).measure(
            _params(2), max_seconds=5, deadlines=GENEROUS
        )
    assert isinstance(info.value.error, TrialProcessDied)
    fault_ = classify(info.value, params=_params(2))
    assert state_of(fault_) == state
    assert re.search(reason, fault_.reason), fault_.reason


@forking
def test_a_trials_death_is_recorded_where_the_tuning_process_ignores_sigchld() -> None:
    """With SIGCHLD ignored the kernel reaps a process's children: the helper, its own
    reaper, still gives each trial's exit code, and ends unreadable but closed."""
    previous = signal.signal(signal.SIGCHLD, signal.SIG_IGN)
    try:
        runner = _isolated(SleepDataset(512), StepWithFault("SIGSEGV", from_workers=2))
        assert runner.measure(_params(1), max_seconds=0.3, deadlines=GENEROUS).batches > 0
        with pytest.raises(TrialError) as info:
            runner.measure(_params(2), max_seconds=5, deadlines=GENEROUS)
        assert isinstance(info.value.error, TrialProcessDied)
        assert info.value.error.exit_code == -signal.SIGSEGV
        helper = runner._starter.pid  # type: ignore[attr-defined]
        runner.close()
        assert helper is not None and ended(helper, within=1)
    finally:
        signal.signal(signal.SIGCHLD, previous)


def test_a_spawned_trial_process_is_measured_and_its_death_recorded() -> None:
    """Where pidfds are missing, each trial's process is spawned (``Spawner``)."""
    runner = _isolated(SleepDataset(512), StepWithFault("SIGSEGV", from_workers=2), spawned=True)
    assert runner.measure(_params(1), max_seconds=0.3, deadlines=GENEROUS).batches > 0
    with pytest.raises(TrialError) as info:
        runner.measure(_params(2), max_seconds=5, deadlines=GENEROUS)
    assert isinstance(info.value.error, TrialProcessDied)
    assert classify(info.value, params=_params(2)).reason == (
        "trial process crashed (SIGSEGV) with this setting"
    )


def test_a_spawned_trials_death_is_a_death_where_the_tuning_process_ignores_sigchld() -> None:
    """With SIGCHLD ignored the kernel reaps a spawned trial's process at once, and its
    exit code is lost: its end is still a death, said to have lost its code, not a hang."""
    previous = signal.signal(signal.SIGCHLD, signal.SIG_IGN)
    try:
        runner = _isolated(
            SleepDataset(512), StepWithFault("SIGSEGV", from_workers=2), spawned=True
        )
        assert runner.measure(_params(1), max_seconds=0.3, deadlines=GENEROUS).batches > 0
        with pytest.raises(TrialError) as info:
            runner.measure(_params(2), max_seconds=5, deadlines=GENEROUS)
        assert isinstance(info.value.error, TrialProcessDied), repr(info.value.error)
        assert info.value.error.exit_code is None
        copied = pickle.loads(pickle.dumps(info.value.error))  # between processes
        assert str(copied) == str(info.value.error) and copied.lost_to == info.value.error.lost_to
        assert classify(info.value, params=_params(2)).reason == (
            "trial process ended with this setting, its exit code lost: this process "
            "ignores SIGCHLD, and the kernel reaped it"
        )
    finally:
        signal.signal(signal.SIGCHLD, previous)


@pytest.mark.light  # mostly waits
def test_a_hang_the_trial_cannot_break_is_killed_from_outside() -> None:
    with pytest.raises(TrialError) as info:
        _isolated(SleepDataset(512), StepWithFault("blocked-hang")).measure(
            _params(1), max_seconds=0.5, deadlines=Deadlines(first=3, each=0.5)
        )
    assert isinstance(info.value.error, TrialTimeout)
    assert classify(info.value, params=_params(1)).reason.startswith(
        "timeout: no progress for 9 s while waiting for the trial's process"
    )


def test_a_worker_error_crosses_the_process_boundary_with_its_origin() -> None:
    with pytest.raises(TrialError) as info:
        _isolated(FailsInWorkersDataset(512)).measure(_params(2), max_seconds=5, deadlines=GENEROUS)
    assert info.value.summary.startswith("OSError: cannot open the second shard")
    assert re.search(r"tests/workloads\.py:\d+ in __getitem__$", info.value.where)
    # The chain of causes arrives as the same trial gives it in this process: the same
    # exception types, in the same order, with the same messages' first lines.
    with pytest.raises(TrialError) as here:
        TrialRunner(
            FailsInWorkersDataset(512), noop_step, batch_size=2, memory_budget=2**40
        ).measure(_params(2), max_seconds=5, deadlines=GENEROUS)
    sent, local = list(exception_chain(info.value.error)), list(exception_chain(here.value.error))
    assert isinstance(info.value.error, OSError)
    assert [type(e) for e in sent] == [type(e) for e in local]
    assert [str(e).splitlines()[0] for e in sent] == [str(e).splitlines()[0] for e in local]
    assert state_of(classify(info.value, params=_params(2))) == "failed"


def test_a_vote_stops_the_trial_process_at_that_window() -> None:
    seen: list[tuple[int, Measurement]] = []

    def vote(window: int, measurement: Measurement) -> bool:
        seen.append((window, measurement))
        return window == 2

    m = _isolated(SleepDataset(4096), sleep_step).measure(
        _params(2), max_seconds=10, on_window=vote
    )
    # No window after the vote, and the trial's figures are those of the window voted on.
    assert [window for window, _ in seen] == [1, 2]
    assert m.batches == seen[-1][1].batches > 0
    assert m.samples_per_second == seen[-1][1].samples_per_second


def test_an_exception_from_on_window_stops_the_trial_process() -> None:
    def interrupt(window: int, measurement: Measurement) -> bool:
        raise KeyboardInterrupt

    before = {p.pid for p in psutil.Process().children(recursive=True)}
    runner = _isolated(SleepDataset(4096), sleep_step)
    with pytest.raises(KeyboardInterrupt):
        runner.measure(_params(2), max_seconds=10, on_window=interrupt)
    # Only the helper is left, for the next trial, until the runner is closed.
    helper = getattr(runner._starter, "pid", None)
    assert {p.pid for p in psutil.Process().children(recursive=True)} <= before | {helper}


def test_the_memory_budget_covers_both_processes() -> None:
    budget = tree_memory() + 600 * 1024**2
    runner = _isolated(MemoryHogDataset(400 * 1024**2), memory_budget=budget)
    with pytest.raises(MemoryBudgetExceeded) as info:
        runner.measure(_params(4) | {"persistent_workers": True}, max_seconds=20)
    assert info.value.budget == budget
    assert info.value.peak > budget or (info.value.projected or 0) > budget


def test_what_a_trial_process_cannot_load_is_named() -> None:
    with pytest.raises(UnpicklableError, match=r"^dataset was pickled but .*NotebookDataset"):
        _isolated(UnloadableDataset()).measure(_params(0), max_seconds=1)


def test_a_trial_process_that_dies_while_starting_is_an_isolation_error() -> None:
    with pytest.raises(IsolationError, match=r"exited with code 1 before it could load"):
        _isolated(ExitOnLoadDataset()).measure(_params(0), max_seconds=1)


def test_isolation_is_checked_before_any_work() -> None:
    dataset = CountingDataset()
    with pytest.raises(InvalidInputError, match="isolation must be one of 'in-process'"):
        autoloader.tune(dataset, noop_step, batch_size=4, isolation="thread")
    with pytest.raises(
        UnpicklableError,
        match=r"^step_fn \(function\) cannot be pickled.*"
        r"isolation='subprocess' sends step_fn",
    ):
        autoloader.tune(dataset, lambda batch: None, batch_size=4, isolation="subprocess")
    assert dataset.reads == 0


@pytest.mark.calm  # trials against the clock, in a process of their own
def test_a_run_goes_on_when_settings_kill_the_trial_process() -> None:
    # Three workers or more crash the trial's main process in the step.
    result = autoloader.tune(
        SleepDataset(4096, latency=0.002),
        StepWithFault("SIGSEGV", from_workers=3),
        batch_size=4,
        time_budget=20,
        n_trials=3,
        # The fault counts worker processes: thread workers would never meet it. From 2
        # workers, the ladder's second trial (4) crashes: the search meets the fault even
        # when trial processes start slowly on a loaded machine and few trials fit.
        search_space={"worker_kind": "processes", "num_workers": (2, 16)},
        show_progress=False,
        isolation="subprocess",
    )
    crashed = [t for t in result.trials if t.state == "failed"]
    assert crashed, [(t.params, t.state) for t in result.trials]
    assert all(t.params["num_workers"] >= 3 for t in crashed)
    assert all(t.reason == "trial process crashed (SIGSEGV) with this setting" for t in crashed)
    assert 1 <= result.params["num_workers"] <= 2
    assert result.speedup > 1


def test_a_trial_process_may_stay_silent_through_its_first_steps_deadline() -> None:
    """The parent waits for a trial's process as long as the trial and its deadlines
    (the first batch's, then the step's): the first step's where longer than a batch's
    (NOTE [ The first step ]), or a trial whose first step sets up for 8 s would be
    called silent where the trial itself lets it."""

    def silence(deadlines: Deadlines) -> float:
        return _silence_limit(_Request({}, 5.0, deadlines, 2**30, "fork"))

    plain = silence(Deadlines(first=3.0, each=3.0))
    assert silence(Deadlines(first=3.0, each=3.0, first_step=10.0)) == pytest.approx(plain + 7)
    assert silence(Deadlines(first=3.0, each=3.0, first_step=1.0)) == pytest.approx(plain)


def test_without_pidfds_each_trial_is_spawned(monkeypatch: pytest.MonkeyPatch) -> None:
    """A kernel before 5.3 (or a sandbox) refuses pidfd_open: a forked trial could not
    be watched, so each is spawned; where the call is missing, the same."""

    def refused(pid: int, flags: int = 0) -> int:
        raise OSError(38, "Function not implemented")  # ENOSYS

    monkeypatch.setattr(os, "pidfd_open", refused)
    assert not pidfds_work() and isinstance(trial_starter(), Spawner)
    monkeypatch.delattr(os, "pidfd_open")
    assert not pidfds_work() and isinstance(trial_starter(), Spawner)


@forking
def test_each_trial_is_forked_from_one_helper_into_a_group_of_its_own(tmp_path: Path) -> None:
    """NOTE [ A helper forks the trials ]: one helper a runner, this process's child;
    each trial's process its child, leading its own group; close() ends the helper."""
    runner = _isolated(SleepDataset(512), ProcessRecordingStep(str(tmp_path)))
    for workers in (1, 2):
        assert runner.measure(_params(workers), max_seconds=0.3, deadlines=GENEROUS).batches
    first, second = _recorded(tmp_path)
    helper = runner._starter
    assert isinstance(helper, ForkingHelper) and helper.pid is not None
    assert first["pid"] != second["pid"]
    assert first["ppid"] == second["ppid"] == helper.pid
    assert helper.pid in {child.pid for child in psutil.Process().children()}
    assert first["pgid"] == first["pid"] and second["pgid"] == second["pid"]
    # The helper leaves Ctrl-C and SIGTERM to the tuning process; a trial, as spawned.
    ignored = int(Path(f"/proc/{helper.pid}/status").read_text().split("SigIgn:")[1].split()[0], 16)
    assert all(ignored & 1 << (sig - 1) for sig in (signal.SIGINT, signal.SIGTERM))
    assert first["sigterm"] == second["sigterm"] == str(signal.SIG_DFL)
    pid = helper.pid
    runner.close()
    assert helper.pid is None and ended(pid, within=1)


@forking
def test_a_helper_killed_between_trials_is_started_again(tmp_path: Path) -> None:
    runner = _isolated(SleepDataset(512), ProcessRecordingStep(str(tmp_path)))
    runner.measure(_params(1), max_seconds=0.3, deadlines=GENEROUS)
    helper = runner._starter
    assert isinstance(helper, ForkingHelper) and helper.pid is not None
    os.kill(helper.pid, signal.SIGKILL)
    assert ended(helper.pid, within=5)
    assert runner.measure(_params(1), max_seconds=0.3, deadlines=GENEROUS).batches > 0
    parents = {record["ppid"] for record in _recorded(tmp_path)}
    assert len(parents) == 2 and helper.pid in parents


@forking
@pytest.mark.parametrize(
    ("sigchld", "how"),
    [
        (signal.SIG_DFL, "was killed by SIGKILL"),
        # The kernel reaps the helper: it ended, not "stopped answering".
        (
            signal.SIG_IGN,
            "ended, its exit code lost: this process ignores SIGCHLD, and the kernel reaped it",
        ),
    ],
    ids=["sigchld-default", "sigchld-ignored"],
)
def test_a_helper_killed_during_a_trial_fails_that_trial_and_the_next_one_runs(
    tmp_path: Path, sigchld: signal.Handlers, how: str
) -> None:
    previous = signal.signal(signal.SIGCHLD, sigchld)
    try:
        _helper_killed_during_a_trial(tmp_path, how)
    finally:
        signal.signal(signal.SIGCHLD, previous)


def _helper_killed_during_a_trial(tmp_path: Path, how: str) -> None:
    runner = _isolated(SleepDataset(512), ProcessRecordingStep(str(tmp_path), kill_parent=True))
    with pytest.raises(TrialError) as info:
        runner.measure(_params(1), max_seconds=0.3, deadlines=GENEROUS)
    assert isinstance(info.value.error, HelperGone)
    assert f"{how} while asked to reap a trial's process" in str(info.value.error)
    (killed,) = _recorded(tmp_path)
    assert ended(killed["pid"], within=5)  # its group killed
    assert state_of(classify(info.value, params=_params(1))) == "failed"
    # A new helper, whose trial kills it too: the runner starts one each time.
    with pytest.raises(TrialError):
        runner.measure(_params(1), max_seconds=0.3, deadlines=GENEROUS)
    assert len({record["ppid"] for record in _recorded(tmp_path)}) == 2


_KILLED_MID_TRIAL = textwrap.dedent(
    """
    import sys
    from autoloader.measure._isolation import SubprocessRunner
    from autoloader.measure._runner import TrialRunner
    from autoloader.loader._params import normalize_params
    from tests.workloads import ProcessRecordingStep, SleepDataset

    if __name__ == "__main__":
        step = ProcessRecordingStep(sys.argv[1])
        runner = SubprocessRunner(
            TrialRunner(SleepDataset(4096, latency=0.01), step, batch_size=2, memory_budget=2**40)
        )
        runner.measure(normalize_params({"num_workers": 2}), max_seconds=60)
    """
)


@forking
@pytest.mark.light  # mostly waits for its trial
def test_the_helper_ends_its_trials_when_the_tuning_process_is_killed(tmp_path: Path) -> None:
    """SIGKILL of the tuning process mid-trial: its helper sees its pipe close, kills
    the trial's group, workers included, and exits; nothing is left."""
    script = tmp_path / "tuning.py"
    script.write_text(_KILLED_MID_TRIAL)
    tuning = subprocess.Popen(
        [sys.executable, str(script), str(tmp_path)],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    try:
        give_up = time.monotonic() + 60
        while not _recorded(tmp_path) and time.monotonic() < give_up:
            time.sleep(0.1)
        (trial,) = _recorded(tmp_path)
        processes = [psutil.Process(trial["ppid"]), psutil.Process(trial["pid"])]
        processes += processes[1].children(recursive=True)
        assert len(processes) == 4  # the helper, the trial, its two workers
    finally:
        tuning.kill()
        tuning.wait()
    _, alive = psutil.wait_procs(processes, timeout=10)
    assert not alive, [p.cmdline() for p in alive]


_NO_MAIN_GUARD = textwrap.dedent(
    """
    import autoloader
    from tests.workloads import SleepDataset, noop_step

    autoloader.tune(
        SleepDataset(64), noop_step, batch_size=4, time_budget=5, isolation="subprocess",
        show_progress=False,
    )
    """
)


@forking
def test_a_script_without_a_main_guard_is_told_to_add_one(tmp_path: Path) -> None:
    """The helper, spawned, imports the script as spawn does: unguarded, the script
    calls tune() again there, and the helper dies before it is ready."""
    script = tmp_path / "unguarded.py"
    script.write_text(_NO_MAIN_GUARD)
    done = subprocess.run(
        [sys.executable, str(script)],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 1
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith(
        "autoloader._exceptions.IsolationError: The process that starts "
        "each trial's process exited with code 1 before it was ready"
    ), last
    assert "`if __name__ == '__main__':`" in last


_TUNED_UNTIL_SIGTERM = textwrap.dedent(
    """
    import sys
    import autoloader
    from tests.workloads import ProcessRecordingStep, SleepDataset

    if __name__ == "__main__":
        autoloader.tune(
            SleepDataset(100_000, latency=0.002), ProcessRecordingStep(sys.argv[1]),
            batch_size=4, time_budget=60, isolation="subprocess", show_progress=False,
            path=sys.argv[2],
        )
    """
)


@forking
@pytest.mark.light  # mostly waits for its trials
def test_sigterm_to_the_runs_process_group_stops_it_and_no_trial_fails_for_it(
    tmp_path: Path,
) -> None:
    """``kill -TERM -PGID`` (a terminal's job, a process manager) reaches the helper too,
    which is in the run's group: it stays up for the run to stop its trial in order
    (``NOTE [ SIGTERM while tuning ]``), then ends with it."""
    records, saved = tmp_path / "records", tmp_path / "best.json"
    records.mkdir()
    script = tmp_path / "tuning.py"
    script.write_text(_TUNED_UNTIL_SIGTERM)
    tuning = subprocess.Popen(
        [sys.executable, str(script), str(records), str(saved)],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        start_new_session=True,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        give_up = time.monotonic() + 60
        while len(_recorded(records)) < 3 and time.monotonic() < give_up:
            time.sleep(0.05)
        started = _recorded(records)
        assert len(started) >= 3, "three trials' processes started"
        # The helper, and the last trial's process unless it has just ended.
        processes = _processes(started[-1]["ppid"], started[-1]["pid"])
        os.killpg(tuning.pid, signal.SIGTERM)
        _, err = tuning.communicate(timeout=60)
    finally:
        if tuning.poll() is None:
            os.killpg(tuning.pid, signal.SIGKILL)
            tuning.wait()
    assert tuning.returncode == -signal.SIGTERM, err
    trials = json.loads(saved.read_text())["trials"]
    assert len(trials) >= 2, (trials, err)
    assert not [t for t in trials if "HelperGone" in (t.get("reason") or "")], (trials, err)
    _, alive = psutil.wait_procs(processes, timeout=10)
    assert not alive, [p.cmdline() for p in alive]
