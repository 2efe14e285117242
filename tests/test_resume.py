"""A tuning run SIGKILLed mid-trial resumes from its storage: a real kill of a real run;
and a run elsewhere holds the study while it beats."""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import optuna
import pytest
from optuna.trial import FrozenTrial, TrialState

import autoloader
from autoloader import SearchSpace

from .workloads import SleepDataset, sleep_step

pytestmark = pytest.mark.slow  # a killed run resumed

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


_FRESH = 0.3


def _wait_for_a_running_trial(url: str, child: subprocess.Popen[str], after: int) -> None:
    """Until the storage holds a trial numbered past ``after`` that has started and not
    finished, its setting written (``owner``, the last of its attributes the driver
    sets after ``params``): a run killed between Optuna's ``ask()`` and that
    leaves a trial of no setting, which the next run fails and does not report (a full
    run beside a busy loop killed one there). Started within the last _FRESH seconds, so
    that it is still running at the kill: a trial seen running as it neared its end
    ended before the kill once, in a quiet full run (2026-11-29), and none was left
    running (a trial measures for a second at least)."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        assert child.poll() is None, "the tuning run ended before it could be killed"
        with contextlib.suppress(KeyError, ValueError):  # no study yet
            (summary,) = optuna.get_all_study_summaries(url)
            study = optuna.load_study(study_name=summary.study_name, storage=url)
            running = study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))
            fresh = datetime.datetime.now() - datetime.timedelta(seconds=_FRESH)
            if any(
                t.number > after
                and "owner" in t.user_attrs
                and t.datetime_start is not None
                and t.datetime_start > fresh
                for t in running
            ):
                return
        time.sleep(0.02)
    raise AssertionError("no trial started within 60 s")


# Not alone: it kills the run once a trial of it is running, which a busy machine makes
# no rarer (3 of 3 beside two busy loops, 16.8-17.0 s each).
def test_a_killed_run_resumes_from_its_storage(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
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
    killed = optuna.load_study(study_name=summary.study_name, storage=url)
    before = killed.trials
    assert any(t.state == TrialState.RUNNING for t in before), "killed between trials"
    # It held the study's lease, and its running trial beat (Optuna's own heartbeat).
    lease = killed.user_attrs["autoloader:run"]
    assert lease["pid"] == child.pid and lease["ended"] is None
    with contextlib.closing(sqlite3.connect(tmp_path / "study.db")) as db:
        beaten = {row[0] for row in db.execute("SELECT trial_id FROM trial_heartbeats")}
    assert {t._trial_id for t in before if t.state == TrialState.RUNNING} <= beaten

    with caplog.at_level(logging.WARNING, logger="autoloader"):
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
    # The next run took the dead run's lease over, and gave it back at its end.
    assert any(
        f"pid {child.pid} on host" in r.getMessage() and "takes it over" in r.getMessage()
        for r in caplog.records
    )
    resumed = optuna.load_study(study_name=summary.study_name, storage=url)
    assert resumed.user_attrs["autoloader:run"]["ended"] is not None
    assert "autoloader-heartbeat" not in {t.name for t in threading.enumerate()}
    after = resumed.trials
    assert not [t for t in after if t.state == TrialState.RUNNING]
    orphans = [
        t for t in after if t.number < len(before) and before[t.number].state == TrialState.RUNNING
    ]
    records = {r.number: r for r in result.trials}
    assert orphans
    for trial in orphans:
        if "outcome" in before[trial.number].user_attrs:  # killed as its trial was told
            assert (
                records[trial.number].state == before[trial.number].user_attrs["outcome"]["state"]
            )
            continue
        assert trial.state == TrialState.FAIL
        assert (records[trial.number].reason or "").startswith("interrupted: the tuning process")
        assert records[trial.number].kind == "interrupted"
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


def _tune_small(url: str) -> autoloader.TuneResult:
    return autoloader.tune(
        SleepDataset(512), sleep_step, batch_size=4, time_budget=10, n_trials=1,
        search_space=SearchSpace(num_workers=(0, 0)), storage=url, show_progress=False,
    )  # fmt: skip


def _left_running_elsewhere(
    url: str, *, heartbeat_age: float, copied: tuple[str, ...]
) -> tuple[optuna.Study, FrozenTrial, int, dict[str, Any]]:
    """What a tuning run on another machine leaves in the study of ``_tune_small``'s run
    there: its lease, its heartbeat ``heartbeat_age`` s old, and a trial running with
    the ``copied`` attributes of the study's last trial. The study, that last trial, the
    running trial's number and the lease."""
    (summary,) = optuna.get_all_study_summaries(url)
    study = optuna.load_study(study_name=summary.study_name, storage=url)
    finished = study.trials[-1]
    trial = study.ask()
    for name in copied:
        trial.set_user_attr(name, finished.user_attrs[name])
    trial.set_user_attr("owner", {"host": "elsewhere", "pid": 1, "started": 0.0})
    now = time.time()
    lease = {
        "host": "elsewhere", "pid": 1, "started": 0.0, "since": now - 600,
        "heartbeat": now - heartbeat_age, "token": "theirs", "ended": None,
    }  # fmt: skip
    study.set_user_attr("autoloader:run", lease)
    return study, finished, trial.number, lease


@pytest.mark.light  # mostly waits
def test_a_run_of_another_machine_holds_the_study_until_its_heartbeat_lapses(
    tmp_path: Path,
) -> None:
    """A run elsewhere cannot be looked up: its lease is live while it beats. Once its
    heartbeat is older than the grace period, the next run takes the study over and fails
    the trial it left running."""
    url = f"sqlite:///{tmp_path / 'study.db'}"
    _tune_small(url)
    study, _, number, lease = _left_running_elsewhere(
        url, heartbeat_age=5, copied=("phase", "params")
    )

    with pytest.raises(autoloader.StudyInUseError, match="pid 1 on host elsewhere") as refused:
        _tune_small(url)
    assert "its lease lapses 60 s after its last heartbeat" in str(refused.value)
    assert study.trials[number].state == TrialState.RUNNING

    study.set_user_attr("autoloader:run", {**lease, "heartbeat": time.time() - 120})
    result = _tune_small(url)
    assert study.trials[number].state == TrialState.FAIL
    (record,) = [r for r in result.trials if r.number == number]
    assert record.reason == "interrupted: the tuning process (pid 1 on elsewhere) died"
    assert TrialState.RUNNING not in {t.state for t in study.trials}


@pytest.mark.light  # mostly waits
def test_a_trial_its_dead_run_had_measured_is_kept_as_measured(tmp_path: Path) -> None:
    """A run killed between storing a trial's outcome and telling Optuna left the trial
    running with its measurement: the next run tells it as measured, not failed."""
    url = f"sqlite:///{tmp_path / 'study.db'}"
    first = _tune_small(url)
    study, finished, number, _ = _left_running_elsewhere(
        url, heartbeat_age=120, copied=("phase", "params", "measurement", "outcome")
    )
    assert finished.state == TrialState.COMPLETE

    result = _tune_small(url)
    kept = study.trials[number]
    assert kept.state == TrialState.COMPLETE
    assert kept.value == finished.value
    (record,) = [r for r in result.trials if r.number == number]
    assert record.state == "complete" and record.reason is None
    assert record.samples_per_second == first.trials[-1].samples_per_second
    assert record.samples_per_second is not None and record.samples_per_second > 0
    assert TrialState.RUNNING not in {t.state for t in study.trials}
