"""A study in a storage is tuned by one run at a time, and a journal torn by a killed
writer is read again: real processes, real files."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import optuna
import pytest
import torch
from optuna.storages.journal import JournalFileBackend
from optuna.trial import TrialState

import autoloader
from autoloader import SearchSpace
from autoloader.checks import _facts

from .workloads import SleepDataset, sleep_step

pytestmark = pytest.mark.slow  # studies shared by processes

ROOT = Path(__file__).resolve().parents[1]
SPACE = SearchSpace(num_workers=(0, 2), prefetch_factor=2, persistent_workers=True)
FAST = SearchSpace(num_workers=(0, 0))  # two short trials: where only the storage matters

# The first run: long enough to be still tuning when the second one starts.
SCRIPT = textwrap.dedent(
    """
    import sys
    import autoloader
    from tests.test_storage import SPACE
    from tests.workloads import SleepDataset, sleep_step

    autoloader.tune(SleepDataset(100_000), sleep_step, batch_size=4, time_budget=120,
                    search_space=SPACE, storage=sys.argv[1], show_progress=False)
    """
)


def _storage(kind: str, tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'study.db'}" if kind == "sqlite" else str(tmp_path / "study.log")


def _study(storage: str) -> optuna.Study | None:
    """The one study in ``storage`` (a URL or a journal file), read-only; ``None`` before
    it exists."""
    opened: str | optuna.storages.BaseStorage = (
        storage if "://" in storage else optuna.storages.JournalStorage(JournalFileBackend(storage))
    )
    with contextlib.suppress(KeyError, ValueError, OSError):
        (summary,) = optuna.get_all_study_summaries(opened)
        return optuna.load_study(study_name=summary.study_name, storage=opened)
    return None


@contextlib.contextmanager
def _tuning(storage: str) -> Iterator[subprocess.Popen[str]]:
    """A tuning run in another process, on ``storage``, once it measures a trial; killed
    with its workers at the end."""
    child = subprocess.Popen(
        [sys.executable, "-c", SCRIPT, storage],
        cwd=ROOT,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 60
        while True:
            assert child.poll() is None, f"the first run ended: {child.communicate()[1]}"
            assert time.monotonic() < deadline, "the first run measured no trial in 60 s"
            study = _study(storage)
            if study is not None and study.get_trials(states=(TrialState.RUNNING,)):
                break
            time.sleep(0.05)
        yield child
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(child.pid, signal.SIGKILL)  # the run and its DataLoader workers
        child.communicate()


def _tune(
    storage: str | Path, *, step: Callable[[Any], None] = sleep_step, space: SearchSpace = SPACE
) -> autoloader.TuneResult:
    """:data:`SCRIPT`'s problem (with another step or space, another one), one trial."""
    return autoloader.tune(
        SleepDataset(100_000), step, batch_size=4, time_budget=8, n_trials=1,
        search_space=space, storage=storage, show_progress=False,
    )  # fmt: skip


def _heartbeats() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name == "autoloader-heartbeat"]


@pytest.mark.parametrize("kind", ["sqlite", "journal"])
def test_a_second_run_on_a_study_in_use_is_refused_naming_the_first(
    kind: str, tmp_path: Path
) -> None:
    """Two runs at once would each measure under the other's load and mix their trials:
    the second stops before any trial of its own, and names the live run."""
    storage = _storage(kind, tmp_path)
    with _tuning(storage) as first:
        started = time.monotonic()
        with pytest.raises(autoloader.StudyInUseError) as refused:
            _tune(storage)
        seconds = time.monotonic() - started
        study = _study(storage)
        assert study is not None
        mine = [t for t in study.trials if t.user_attrs.get("owner", {}).get("pid") == os.getpid()]
    message = str(refused.value)
    assert f"pid {first.pid} on host " in message and "tuning since " in message
    assert "another storage" in message  # what to do
    assert not mine, "the refused run measured a trial"
    assert seconds < 60  # its checks, then the refusal: not a wait for the first run
    assert not _heartbeats()


def test_a_check_cut_short_goes_on_with_the_study_of_the_run_before(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """NOTE [ A study named by what stays ]: a threads check that did not finish takes
    thread workers away from its run, not the earlier run's study; the run goes on with
    it, and draws no worker_kind (Optuna refuses a categorical whose choices change)."""
    storage = str(tmp_path / "study.log")
    dataset = SleepDataset(100_000)
    # Three search trials a run, the first a starting point (drawn from no distribution),
    # the others drawn: at 8 s and no cap, a full run's first run ended its search at its
    # starting point twice (2026-11-29, once quiet), and drew nothing the second could
    # conflict with. Its budget is room for them; quiet, the run took 6.9 s.
    kwargs: dict[str, Any] = {
        "batch_size": 4, "search_space": SPACE, "storage": storage, "n_trials": 3,
        "time_budget": 15, "show_progress": False,
    }  # fmt: skip
    first = autoloader.tune(dataset, sleep_step, **kwargs)
    assert any(note.startswith("worker_kind searched") for note in first.notes), first.notes
    for check in ("batched_fetch", "threads"):  # not started: no time for them
        monkeypatch.setitem(_facts._SHARES, check, 0.0)
    second = autoloader.tune(dataset, sleep_step, **kwargs)
    assert any(
        "worker_kind fixed to processes: its check was cut short" in note for note in second.notes
    )
    assert any(note.startswith("resumed from storage") for note in second.notes), second.notes
    before = {r.number for r in first.trials}
    assert before < {r.number for r in second.trials}
    new = [r for r in second.trials if r.number not in before]
    # Thread workers only where the first run measured them (its check passed): again in
    # the runoff, not drawn.
    threads = [r for r in new if r.params.get("worker_kind") == "threads"]
    assert all(
        r.phase == "runoff" and r.params in [t.params for t in first.trials] for r in threads
    )
    study = _study(storage)
    assert study is not None
    drawn = [t for t in study.trials if "worker_kind" in t.distributions]
    # The first run's sampler drew worker_kind from two choices; the second's drew a
    # setting with workers and left worker_kind, its one choice, undrawn.
    assert drawn and all(len(t.distributions["worker_kind"].choices) == 2 for t in drawn)
    assert any(
        t.number not in before and "num_workers" in t.distributions and t.params["num_workers"] > 0
        for t in study.trials
    )


TOGETHER = textwrap.dedent(
    """
    import sys
    import autoloader
    from tests.test_storage import FAST
    from tests.workloads import SleepDataset, sleep_step

    try:
        autoloader.tune(SleepDataset(512), sleep_step, batch_size=4, time_budget=6,
                        n_trials=1, search_space=FAST, storage=sys.argv[1],
                        show_progress=False)
    except autoloader.StudyInUseError as error:
        print("refused:", error)
    else:
        print("ran")
    """
)


def test_of_two_runs_started_together_on_a_new_database_one_runs(tmp_path: Path) -> None:
    """Both find the study free and claim it: the one whose claim stands runs, the other
    is refused (``NOTE [ The study's lease ]``); and both open the new database, which
    they race to create."""
    storage = _storage("sqlite", tmp_path)
    runs = [
        subprocess.Popen(
            [sys.executable, "-c", TOGETHER, storage], cwd=ROOT, stdout=subprocess.PIPE, text=True
        )
        for _ in range(2)
    ]
    said = [run.communicate(timeout=120)[0].strip() for run in runs]
    assert [run.returncode for run in runs] == [0, 0]
    assert sorted(text.split(":")[0] for text in said) == ["ran", "refused"], said
    refused = 0 if said[0].startswith("refused") else 1
    assert f"pid {runs[1 - refused].pid} on host " in said[refused]


def test_the_cli_refuses_a_second_run_on_a_study_in_use(tmp_path: Path) -> None:
    storage = str(tmp_path / "study.log")
    command = [
        sys.executable, "-m", "autoloader", "tune", "tests.workloads:SleepDataset",
        "tests.workloads:sleep_step", "--batch-size", "4", "--storage", storage, "-q",
    ]  # fmt: skip
    first = subprocess.Popen(
        [*command, "--time-budget", "120", "--out", str(tmp_path / "first.json")],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 60
        while not ((study := _study(storage)) and study.get_trials(states=(TrialState.RUNNING,))):
            assert first.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        second = subprocess.run(  # the same problem (the budget bounds the space searched)
            [
                *command,
                "--time-budget",
                "120",
                "--n-trials",
                "1",
                "--out",
                str(tmp_path / "second.json"),
            ],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=120,
        )
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(first.pid, signal.SIGKILL)
        first.wait()
    assert second.returncode == 1, second.stderr
    (line,) = second.stderr.strip().splitlines()
    assert "is being tuned by another run" in line and f"pid {first.pid} " in line
    assert not (tmp_path / "second.json").exists()


@pytest.mark.light  # mostly waits
def test_a_run_that_raises_gives_the_study_back(tmp_path: Path) -> None:
    """The lease and its thread end with tune(), however it ends: the next run on the
    study, in the same (live) process, is not refused."""
    storage = str(tmp_path / "study.log")
    _BROKEN.set()
    try:
        with pytest.raises(autoloader.BaselineError):
            _tune(storage, step=_breakable_step, space=FAST)
    finally:
        _BROKEN.clear()
    assert not _heartbeats()
    assert _tune(storage, step=_breakable_step, space=FAST).throughput > 0
    assert not _heartbeats()
    study = _study(storage)
    assert study is not None
    assert study.user_attrs["autoloader:run"]["ended"] is not None


_BROKEN = threading.Event()


def _breakable_step(batch: object) -> None:
    if _BROKEN.is_set():
        raise RuntimeError("the step is broken")
    sleep_step(batch)


# A journal record cut short, as a writer killed mid-write leaves it.
TORN = b'{"op_code":5,"worker_id":"a-1","trial_id":3,"user_attr":{"outc'


@pytest.mark.light  # mostly waits
def test_a_journal_with_a_torn_last_line_is_repaired_by_the_next_run(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    journal = tmp_path / "study.log"
    _tune(journal, space=FAST)
    kept = journal.read_bytes()
    with journal.open("ab") as file:
        file.write(TORN)

    with caplog.at_level(logging.WARNING, logger="autoloader"):
        result = _tune(journal, space=FAST)  # raised JSONDecodeError
    assert any("resumed from storage" in note for note in result.notes)
    assert journal.read_bytes().startswith(kept)
    warned = [r.getMessage() for r in caplog.records if "incomplete record" in r.getMessage()]
    assert warned and str(journal) in warned[0]
    for line in journal.read_bytes().splitlines():
        json.loads(line)
    assert _tune(journal, space=FAST).throughput > 0  # and the next one


@pytest.mark.light  # mostly waits
def test_a_journal_broken_inside_names_its_line_and_is_left_as_it_is(tmp_path: Path) -> None:
    """A torn record another record was glued to, with more after it (what Optuna left
    before the repair): the error says which line, and what to do."""
    journal = tmp_path / "study.log"
    _tune(journal, space=FAST)
    lines = journal.read_bytes().splitlines(keepends=True)
    broken = b"".join([*lines[:3], TORN + lines[3], *lines[4:]])
    journal.write_bytes(broken)

    with pytest.raises(autoloader.StorageError, match="its line 4 is not one whole record"):
        _tune(journal, space=FAST)
    assert journal.read_bytes() == broken


def test_a_file_that_is_not_a_journal_is_refused_and_left_as_it_is(tmp_path: Path) -> None:
    notes = tmp_path / "notes.txt"
    notes.write_text("my notes\n")
    with pytest.raises(autoloader.StorageError, match="not an Optuna journal file"):
        _tune(notes, space=FAST)
    assert notes.read_text() == "my notes\n"


@pytest.mark.light  # mostly waits
@pytest.mark.filterwarnings("ignore::optuna.exceptions.ExperimentalWarning")
def test_the_heartbeat_renews_the_lease_and_keeps_the_running_trial_alive(tmp_path: Path) -> None:
    """Faster than a run's 10 s, the same thread: the lease's heartbeat moves, and the
    running trial's Optuna heartbeat keeps fail_stale_trials off it until it stops."""
    from autoloader.search._lease import Heartbeat, Lease

    storage = optuna.storages.RDBStorage(
        f"sqlite:///{tmp_path / 'study.db'}", heartbeat_interval=1, grace_period=1
    )
    study = optuna.create_study(storage=storage)
    lease = Lease.take(study)
    heartbeat = Heartbeat(lease, storage, interval=0.1)
    heartbeat.start()
    try:
        with pytest.warns(UserWarning, match="Heartbeat"):  # Optuna expects optimize()
            trial = study.ask()
        heartbeat.beating(trial._trial_id)
        time.sleep(2.5)  # past the grace period, beating
        optuna.storages.fail_stale_trials(study)
        assert study.trials[trial.number].state == TrialState.RUNNING
        held = study.user_attrs["autoloader:run"]
        assert held["heartbeat"] > held["since"] + 1
    finally:
        heartbeat.stop()
    assert not _heartbeats()
    time.sleep(2.5)  # silent
    optuna.storages.fail_stale_trials(study)
    assert study.trials[trial.number].state == TrialState.FAIL


@pytest.mark.light  # mostly waits
@pytest.mark.slow  # over 2.5 s here: the full suite's (docs/development/checks.md)
@pytest.mark.filterwarnings("ignore::optuna.exceptions.ExperimentalWarning")
def test_a_trial_beats_once_as_it_is_asked_before_the_thread_runs(tmp_path: Path) -> None:
    """The first beat is the asking thread's: a run killed before its heartbeat thread
    ran (a full test run on a slow machine) left a running trial with no beat, which
    Optuna's fail_stale_trials never fails. Here the thread never runs at all."""
    from autoloader.search._lease import Heartbeat, Lease

    storage = optuna.storages.RDBStorage(
        f"sqlite:///{tmp_path / 'study.db'}", heartbeat_interval=1, grace_period=1
    )
    study = optuna.create_study(storage=storage)
    heartbeat = Heartbeat(Lease.take(study), storage, interval=0.1)  # not started
    with pytest.warns(UserWarning, match="Heartbeat"):  # Optuna expects optimize()
        trial = study.ask()
    heartbeat.beating(trial._trial_id)
    time.sleep(2.5)  # the run "killed": past the grace period (whole seconds), no beat
    optuna.storages.fail_stale_trials(study)
    assert study.trials[trial.number].state == TrialState.FAIL


class _Clock:
    """``time`` as ``_lease`` sees it, its sleeps recorded, not slept."""

    def __init__(self) -> None:
        self.slept: list[float] = []
        self.time, self.monotonic = time.time, time.monotonic
        self.strftime, self.gmtime = time.strftime, time.gmtime

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)


def _claimed_by_another(study: optuna.Study) -> None:
    """Another run's claim written over this one's, as when both read the lease free."""
    held = dict(study.user_attrs["autoloader:run"])
    study.set_user_attr("autoloader:run", {**held, "token": "another run", "pid": 1})


def test_a_claim_is_confirmed_after_the_settling_time_left_and_refused_if_overwritten(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """NOTE [ The study's lease ]: confirm() waits only what is left of the settling time
    since the claim, and the last claim written wins."""
    from autoloader.search import _lease

    clock = _Clock()
    monkeypatch.setattr(_lease, "time", clock)
    storage = optuna.storages.JournalStorage(JournalFileBackend(str(tmp_path / "study.log")))
    study = optuna.create_study(storage=storage)
    lease = _lease.Lease.claim(study)
    _claimed_by_another(study)
    with pytest.raises(autoloader.StudyInUseError, match="pid 1 on host"):
        lease.confirm()
    assert len(clock.slept) == 1 and 0.9 < clock.slept[0] <= 1.0

    other = optuna.create_study(storage=storage)
    lease = _lease.Lease.claim(other)
    monkeypatch.setattr(clock, "monotonic", lambda: time.monotonic() + 5)  # 5 s later
    lease.confirm()
    assert clock.slept[-1] == 0.0
    assert other.user_attrs["autoloader:run"]["token"] == lease.mine.token


def test_an_autoloader_confirms_its_lease_as_its_baseline_ends_and_searches_in_memory_if_lost(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Its first batch does not wait for the lease to settle (NOTE [ The study's lease ]);
    where another run's claim stands when its baseline ends, that trial is told failed
    in the study kept beside its path, and the search goes on in memory."""
    from autoloader._reuse import study_beside
    from autoloader.search import _lease

    clock = _Clock()
    monkeypatch.setattr(_lease, "time", clock)
    path = tmp_path / "loader.json"
    dataset = SleepDataset(length=256, latency=0.001)
    loader = autoloader.AutoLoader(
        dataset, batch_size=8, time_budget=4, search_space=SPACE, path=path
    )
    batches = iter(loader)
    seen = [int(i) for i in next(batches)[:, 0].tolist()]
    assert not clock.slept  # the training went on
    beside = _study(str(study_beside(path)))
    assert beside is not None
    _claimed_by_another(beside)
    states = None  # of the trials in the study beside the path, once the search left it

    def ids(epoch: Iterator[torch.Tensor]) -> list[int]:
        nonlocal states
        found = []
        for batch in epoch:
            found += [int(i) for i in batch[:, 0].tolist()]
            if states is None and "searching in memory" in caplog.text:
                states = [t.state for t in _study(str(study_beside(path))).trials]  # type: ignore[union-attr]
        return found

    with caplog.at_level(logging.WARNING, logger="autoloader"):
        seen += ids(batches)
        epochs = 1
        while not loader.tuned and epochs < 100:
            assert sorted(ids(iter(loader))) == list(range(256))
            epochs += 1
    assert sorted(seen) == list(range(256))
    assert "searching in memory, not in" in caplog.text and "pid 1 on host" in caplog.text
    assert states == [TrialState.FAIL]  # its baseline, told failed, not left running
    assert loader.tuned and loader.result is not None
    assert loader.result.trials[0].phase == "baseline"  # measured again, in memory
    loader.close()
    assert not _heartbeats()
