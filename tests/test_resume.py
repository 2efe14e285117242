"""A tuning run SIGKILLed mid-trial resumes from its storage: a real kill of a real run."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import optuna
import pytest
from optuna.trial import TrialState

import autoloader
from autoloader import SearchSpace
from autoloader.search._space import trial_params

from .workloads import SleepDataset, sleep_step

SPACE = SearchSpace(num_workers=(0, 4), prefetch_factor=2, persistent_workers=True)

SCRIPT = textwrap.dedent(
    """
    import logging, sys
    import autoloader
    from tests.test_resume import SPACE
    from tests.workloads import SleepDataset, sleep_step

    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    autoloader.tune(SleepDataset(100_000), sleep_step, batch_size=4, time_budget=120,
                    search_space=SPACE, storage=sys.argv[1], show_progress=False)
    """
)


def _wait_for_a_running_trial(url: str, child: subprocess.Popen[str], after: int) -> None:
    """Until the storage holds a trial numbered past ``after`` that has started and not
    finished."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        assert child.poll() is None, "the tuning run ended before it could be killed"
        with contextlib.suppress(KeyError, ValueError):  # no study yet
            (summary,) = optuna.get_all_study_summaries(url)
            study = optuna.load_study(study_name=summary.study_name, storage=url)
            running = study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))
            if any(t.number > after for t in running):
                return
        time.sleep(0.02)
    raise AssertionError("no trial started within 60 s")


def test_a_killed_run_resumes_from_its_storage(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'study.db'}"
    root = Path(__file__).resolve().parents[1]
    child = subprocess.Popen(
        [sys.executable, "-c", SCRIPT, url],
        cwd=root,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    assert child.stderr is not None
    try:
        for line in child.stderr:  # the ladder's second setting has finished
            if line.startswith("trial 2 "):
                break
        _wait_for_a_running_trial(url, child, after=2)  # into the next trial
        os.kill(child.pid, signal.SIGKILL)  # the tuner alone, as the OOM killer would
        child.wait(timeout=30)
    finally:
        # Its orphaned DataLoader workers, had they not exited: they are in its session's
        # process group. (Not every child of this process: multiprocessing's resource
        # tracker is one, and serves the rest of the test session.)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(child.pid, signal.SIGKILL)
        if child.poll() is None:
            child.kill()
            child.wait()
    (summary,) = optuna.get_all_study_summaries(url)
    before = optuna.load_study(study_name=summary.study_name, storage=url).trials
    assert any(t.state == TrialState.RUNNING for t in before), "killed between trials"

    result = autoloader.tune(
        SleepDataset(100_000),
        sleep_step,
        batch_size=4,
        time_budget=8,
        n_trials=1,
        search_space=SPACE,
        storage=url,
        show_progress=False,
    )
    assert result.throughput > 0
    after = optuna.load_study(study_name=summary.study_name, storage=url).trials
    assert not [t for t in after if t.state == TrialState.RUNNING]
    orphans = [
        t for t in after if t.number < len(before) and before[t.number].state == TrialState.RUNNING
    ]
    assert orphans and all(t.state == TrialState.FAIL for t in orphans)
    records = {r.number: r for r in result.trials}
    assert all(
        (records[t.number].reason or "").startswith("interrupted: the tuning process")
        and records[t.number].kind == "interrupted"
        for t in orphans
    )
    # The choice is made among every trial of the problem, the killed run's included:
    # its records are in the result, and the chosen setting's median is the best of
    # all complete settings (the killed run's baseline was not measured again).
    killed_run = [t for t in before if t.state == TrialState.COMPLETE]
    assert {t.number for t in killed_run} <= set(records)
    assert [r.phase for r in result.trials].count("baseline") == 1
    assert any("resumed from storage" in note for note in result.notes)
    # What the killed run finished is kept; a setting measured under its phase is not
    # re-run by the resumed run's ladder, and no queued setting is left waiting.
    kept = [t for t in before if t.state == TrialState.COMPLETE]
    assert kept and all(after[t.number].state == TrialState.COMPLETE for t in kept)
    assert not [t for t in after if t.state == TrialState.WAITING]
    for trial in after:
        queued = trial.system_attrs.get("fixed_params")
        if queued is not None and trial.state == TrialState.COMPLETE:
            measured = trial_params(trial.user_attrs["params"])
            assert queued == measured


@pytest.mark.filterwarnings("ignore::optuna.exceptions.ExperimentalWarning")
def test_a_trial_of_another_machine_is_failed_once_its_heartbeat_stops(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = f"sqlite:///{tmp_path / 'study.db'}"
    autoloader.tune(
        SleepDataset(512), sleep_step, batch_size=4, time_budget=10, n_trials=1,
        search_space=SPACE, storage=url, show_progress=False,
    )  # fmt: skip
    (summary,) = optuna.get_all_study_summaries(url)
    # A tuning process on another machine starts a trial, beats once, then goes silent.
    elsewhere = optuna.storages.RDBStorage(url, heartbeat_interval=1, grace_period=1)
    study = optuna.load_study(study_name=summary.study_name, storage=elsewhere)
    with pytest.warns(UserWarning, match="Heartbeat"):  # Optuna expects optimize(), not ask()
        trial = study.ask()
    trial.set_user_attr("owner", {"host": "elsewhere", "pid": 1, "started": 0.0})
    elsewhere.record_heartbeat(trial._trial_id)
    monkeypatch.setattr("autoloader.search._study._HEARTBEAT_GRACE", 1)
    time.sleep(2.5)  # older than the grace period

    autoloader.tune(
        SleepDataset(512), sleep_step, batch_size=4, time_budget=10, n_trials=1,
        search_space=SPACE, storage=url, show_progress=False,
    )  # fmt: skip
    states = {
        t.number: t.state
        for t in optuna.load_study(study_name=summary.study_name, storage=url).trials
    }
    assert states[trial.number] == TrialState.FAIL
    assert TrialState.RUNNING not in states.values()
