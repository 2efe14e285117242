"""Configuration-dependent failures: real processes, real signals, real errors."""

from __future__ import annotations

import gc
import multiprocessing.context
import os
import re
import signal
import threading
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

import psutil
import pytest
from torch.utils.data import DataLoader

import autoloader
from autoloader import AllSettingsFailedError, SearchSpace
from autoloader.loader._feed import EpochBatches, Feed
from autoloader.loader._params import normalize_params
from autoloader.loader._torch_compat import loader_iterator, worker_processes
from autoloader.measure._deadlines import Deadlines, TrialTimeout
from autoloader.measure._errors import TrialError
from autoloader.measure._memory import MemoryBudgetExceeded, MemoryWatch
from autoloader.measure._process_memory import tree_memory
from autoloader.measure._runner import TrialRunner
from autoloader.measure._supervision import WorkerDeaths, release
from autoloader.search._faults import classify
from autoloader.search._outcome import state_of

from .workloads import FaultInWorkersDataset, SleepDataset, hanging_step, noop_step

PARAMS = normalize_params({"num_workers": 2, "prefetch_factor": 2})


GENEROUS = Deadlines(first=20, each=20)


def _fail(dataset: Any, step: Any = noop_step, deadlines: Deadlines = GENEROUS) -> TrialError:
    runner = TrialRunner(dataset, step, batch_size=2, memory_budget=tree_memory() + 2**32)
    started = time.monotonic()
    with pytest.raises(TrialError) as info:
        runner.measure(PARAMS, max_seconds=30, deadlines=deadlines)
    assert time.monotonic() - started < 25, "the failure was not noticed promptly"
    return info.value


@pytest.mark.parametrize(
    ("fault", "state", "reason"),
    [
        ("SIGSEGV", "failed", r"^worker crashed \(SIGSEGV\)$"),
        ("SIGABRT", "failed", r"^worker crashed \(SIGABRT\)$"),
        (
            "SIGKILL",
            "pruned",
            r"^killed: .*\(SIGKILL\), likely by the kernel's OOM killer; use fewer workers",
        ),
        (
            "SIGBUS",
            "failed",
            r"^shared memory: a worker crashed \(SIGBUS\)\. /dev/shm has .* free of .*; "
            r"this setting keeps up to 4 batches of .* in flight",
        ),
        (
            "enospc",
            "failed",
            r"^shared memory: OSError: \[Errno 28\] No space left on device.*/dev/shm has .* free",
        ),
        (
            "emfile",
            "failed",
            r"^too many open files: OSError: \[Errno 24\] Too many open files.*"
            r"ulimit -n, now \d+.*set_sharing_strategy\('file_system'\)",
        ),
        ("exit", "failed", r"^worker exited with code 3$"),
        # Killed holding a lock the other workers and DataLoader then wait on: the hang
        # ends at the deadline, the shutdown does not wait on that lock, and the death
        # is named as the cause.
        ("die-holding-lock", "pruned", r"^killed: .*\(SIGKILL\)"),
    ],
)
def test_worker_faults_are_classified(fault: str, state: str, reason: str) -> None:
    deadlines = Deadlines(first=3, each=3) if fault == "die-holding-lock" else GENEROUS
    error = _fail(FaultInWorkersDataset(fault), deadlines=deadlines)
    recorded = classify(error, params=PARAMS, batch_bytes=64)
    assert state_of(recorded) == state
    assert re.search(reason, recorded.reason), recorded.reason


@pytest.mark.light  # mostly waits
def test_a_hung_worker_times_out() -> None:
    error = _fail(FaultInWorkersDataset("hang"), deadlines=Deadlines(first=1, each=1))
    assert isinstance(error.error, TrialTimeout)
    recorded = classify(error, params=PARAMS)
    assert state_of(recorded) == "failed"
    assert recorded.reason.startswith("timeout: no progress for 1 s while loading a batch")


@pytest.mark.light  # mostly waits
def test_a_hung_step_times_out() -> None:
    error = _fail(SleepDataset(64), hanging_step, deadlines=Deadlines(first=10, each=1))
    assert isinstance(error.error, TrialTimeout)
    assert error.stage == "running step_fn"


class _SetsUpOnFirstCall:
    """A step whose first call takes ``first`` seconds (a model built on first use,
    DDP wrapping it, torch.compile), every later one nothing."""

    def __init__(self, first: float) -> None:
        self.first = first
        self.calls = 0

    def __call__(self, batch: object) -> None:
        self.calls += 1
        if self.calls == 1:
            time.sleep(self.first)


@pytest.mark.light  # mostly waits
@pytest.mark.slow  # over 2.5 s here: the full suite's (docs/development/checks.md)
def test_the_first_step_may_take_its_own_deadline_and_later_steps_the_batchs() -> None:
    """NOTE [ The first step ]: a first call of 1.5 s passes where a batch's deadline is
    1 s; a step that blocks on its first call times out at the first step's deadline,
    not the batch's, and one that blocks later at the batch's."""
    deadlines = Deadlines(first=1, each=1, first_step=3)
    step = _SetsUpOnFirstCall(1.5)
    runner = TrialRunner(SleepDataset(64), step, batch_size=2, memory_budget=2**40)
    measured = runner.measure(PARAMS, max_seconds=2.5, deadlines=deadlines)
    assert measured.batches > 1 and step.calls > 2
    error = _fail(
        SleepDataset(64), hanging_step, deadlines=Deadlines(first=1, each=1, first_step=2)
    )
    assert isinstance(error.error, TrialTimeout)
    assert str(error.error) == "no progress for 2 s while running step_fn's first call"

    calls: list[object] = []

    def blocks_on_its_third_call(batch: object) -> None:
        calls.append(batch)
        if len(calls) == 3:
            time.sleep(3600)

    error = _fail(SleepDataset(64), blocks_on_its_third_call, deadlines=deadlines)
    assert str(error.error) == "no progress for 1 s while running step_fn"


def test_the_alarm_gives_back_a_timer_already_set() -> None:
    import signal

    signal.setitimer(signal.ITIMER_REAL, 1000)
    try:
        runner = TrialRunner(SleepDataset(64), noop_step, batch_size=2, memory_budget=2**40)
        runner.measure(PARAMS, max_seconds=0.5, deadlines=Deadlines(first=10, each=5))
        left, _ = signal.getitimer(signal.ITIMER_REAL)
        assert 990 < left <= 1000
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)


def _fd_targets() -> list[str]:
    """What each open descriptor points at ("pipe:[123]", a path...), to name a leak."""
    gc.collect()  # pipes of earlier tests' loaders, not this one's, are closed here
    found = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            found.append(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:  # the listing's own descriptor, closed by now
            continue
    return sorted(found)


def _fd_targets_after_warm_up() -> list[str]:
    """Descriptors open once the process has run workers: what a leak grows from.

    The first workers in a process open a few process-wide descriptors once; counting
    those as a leak would make the test depend on which test ran first.
    """
    runner = TrialRunner(SleepDataset(64), noop_step, batch_size=2, memory_budget=2**40)
    runner.measure(PARAMS, max_seconds=0.3, deadlines=GENEROUS)
    return _fd_targets()


def _tune_where_a_second_worker_meets(
    fault: str, *, max_workers: int, time_budget: float
) -> autoloader.TuneResult:
    """Tune a pipeline that works with one worker while a second meets ``fault``.

    Whatever the trials went through, no descriptor may be left open.
    """
    before = _fd_targets_after_warm_up()
    result = autoloader.tune(
        FaultInWorkersDataset(fault, from_worker=1),
        noop_step,
        batch_size=2,
        time_budget=time_budget,
        # The fault comes with a worker process's index: thread workers do not meet it.
        search_space={"num_workers": (0, max_workers), "worker_kind": "processes"},
        show_progress=False,
    )
    # A leak stays; a descriptor another thread holds for a moment (a /proc file read
    # by a watcher) does not: look again for a second before calling it one. Only what
    # was opened counts: one held for a moment at the first listing, closed by the
    # second, is no leak (ci50: 29 then 27, nothing opened).
    settled = time.monotonic() + 1.0
    while (opened := _opened(before)) and time.monotonic() < settled:
        time.sleep(0.05)
    assert not opened, f"opened: {dict(opened)}, trials: " + str(
        [(t.params["num_workers"], t.state, t.reason) for t in result.trials]
    )
    return result


def _opened(before: list[str]) -> Counter[str]:
    """The descriptors open now and not in ``before``; a second descriptor on a target
    counts."""
    return Counter(_fd_targets()) - Counter(before)


@pytest.mark.slow  # over 2.5 s here: the full suite's (docs/development/checks.md)
def test_crashing_settings_fail_the_run_goes_on_and_nothing_is_left(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr("autoloader.search._hang_deadlines._MIN_BATCH_TIMEOUT", 1.0)
    result = _tune_where_a_second_worker_meets("SIGSEGV", max_workers=3, time_budget=5.0)
    failed = [t for t in result.trials if t.state == "failed"]
    assert failed and all(t.kind == "worker crashed" for t in failed)
    assert all((t.reason or "").startswith("worker crashed (SIGSEGV)") for t in failed)
    assert all(t.params["num_workers"] >= 2 for t in failed)
    assert result.params["num_workers"] <= 1


@pytest.mark.slow
def test_hung_settings_fail_with_a_timeout_derived_from_the_baseline(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr("autoloader.search._hang_deadlines._MIN_BATCH_TIMEOUT", 1.0)
    result = _tune_where_a_second_worker_meets("hang", max_workers=2, time_budget=8.0)
    hung = [t for t in result.trials if t.state == "failed"]
    assert hung
    assert all(t.params["num_workers"] == 2 for t in hung)
    assert all(
        re.match(r"timeout: no progress for \d+ s while loading a batch", t.reason or "")
        for t in hung
    )


def test_when_every_setting_fails_the_run_stops_early() -> None:
    started = time.monotonic()
    with pytest.raises(
        AllSettingsFailedError,
        match=r"All 5 settings with workers failed, while num_workers=0 works: "
        r"worker crashed \(SIGSEGV\)",
    ):
        autoloader.tune(
            FaultInWorkersDataset("SIGSEGV"),
            noop_step,
            batch_size=2,
            time_budget=120.0,
            # The crash comes with a worker process: thread workers would not meet it.
            search_space=SearchSpace(num_workers=(1, 3), worker_kind="processes"),
            show_progress=False,
        )
    assert time.monotonic() - started < 60, "the run went on after every setting failed"


def test_an_exit_code_only_torch_saw_is_read_from_its_message() -> None:
    from autoloader.measure._supervision import worker_exits

    error = RuntimeError(
        "DataLoader worker (pid 32512) exited unexpectedly with exit code 3. Details are "
        "lost due to multiprocessing. Rerunning with num_workers=0 may give better error trace."
    )
    assert worker_exits(None, error) == ((), (3,))
    assert worker_exits(None, RuntimeError("worker exited unexpectedly")) == ((), ())


def test_a_kept_loader_whose_worker_was_killed_is_released_without_reporting_it() -> None:
    """``NOTE [ Kept workers stopped ]``: a persistent loader kept after its trial, one of
    its workers killed meanwhile (by a later trial's memory watch, under that trial's
    own handler), is stopped without DataLoader's handler raising "killed by signal"
    for it when the others exit, and leaves no process."""
    loader = DataLoader(
        SleepDataset(64, latency=0.0), batch_size=4, num_workers=2, persistent_workers=True
    )
    for _ in loader:  # DataLoader's SIGCHLD handler stands from here on, the workers kept
        pass
    dataloaders = signal.getsignal(signal.SIGCHLD)
    assert callable(dataloaders)
    workers = worker_processes(loader_iterator(loader))
    try:
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # the later trial's, standing in
        assert workers[0].pid is not None
        os.kill(workers[0].pid, signal.SIGKILL)
        victim = psutil.Process(workers[0].pid)
        while victim.status() != psutil.STATUS_ZOMBIE:  # dead, not reaped
            time.sleep(0.01)
        signal.signal(signal.SIGCHLD, dataloaders)
        release(loader)
        assert all(w.exitcode is not None for w in workers)
        assert signal.getsignal(signal.SIGCHLD) is dataloaders
    finally:
        signal.signal(signal.SIGCHLD, dataloaders)
        for worker in workers:
            if worker.exitcode is None:
                worker.kill()
                worker.join()


def test_a_death_signalled_while_a_batch_is_handed_out_loses_no_batch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``NOTE [ A batch handed out whole ]``, its timing forced: a worker's death is
    signalled while the sampler makes a batch for the feed (as DataLoader asks it during
    a fetch). The death is held back, and the batch is among those handed out, to be
    given back if the fetch then fails; raised there, it left the epoch and was lost."""

    def dead() -> None:
        raise RuntimeError("DataLoader worker (pid 1) is killed by signal: Killed.")

    monkeypatch.setattr(autoloader.measure._supervision, "raise_if_any_worker_failed", dead)

    def sampler() -> Iterator[list[int]]:
        yield [0, 1]
        os.kill(os.getpid(), signal.SIGCHLD)  # its handler runs at the next line here
        time.sleep(0.05)
        yield [2, 3]

    epoch = EpochBatches(sampler(), length=2)
    feed = Feed(epoch)
    deaths = WorkerDeaths(MemoryWatch(2**40))
    with deaths.handled(), deaths.fetching():
        handed = list(feed)
        assert deaths._deferred  # held back, for the fetch to report
    assert handed == [[0, 1], [2, 3]] and feed.in_flight == 2
    feed.close()  # the fetch failed: both go back to the epoch, none lost
    assert [epoch.take(), epoch.take()] == [[0, 1], [2, 3]]


def test_an_overrun_still_to_raise_is_not_raised_into_the_trials_clean_up() -> None:
    """``NOTE [ Nothing left registered ]``: a trial failed with an error of its own (a
    worker's pipe broke as the watch killed it) while the watch had passed the budget.
    The death signals that follow, in its clean-up, raise nothing there (they used to
    raise the overrun in the middle of the loader's shutdown); the overrun is left for
    the runner to raise, once."""
    watch = MemoryWatch(1)  # any tree passes it
    deaths = WorkerDeaths(watch)
    with deaths.handled():
        deaths.expected = True  # the trial failed; its clean-up runs
        watch.sample()  # passes the budget: SIGCHLD to the main thread, no worker to kill
        time.sleep(0.2)  # the handler runs here, in the main thread
        assert watch.exceeded
    assert isinstance(watch.claim(), MemoryBudgetExceeded)
    assert watch.claim() is None


def test_an_overrun_during_a_trial_is_raised_once_in_the_main_thread() -> None:
    """The same signal in the trial's loop wakes it with the overrun, once."""
    watch = MemoryWatch(1)
    deaths = WorkerDeaths(watch)
    with deaths.handled():
        with pytest.raises(MemoryBudgetExceeded):
            watch.sample()
            time.sleep(5)
        watch.sample()  # passed still: nothing more is raised
        time.sleep(0.2)
    assert watch.claim() is None


def test_a_death_signalled_as_a_failed_trial_over_budget_cleans_up_stops_its_workers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``NOTE [ Nothing left registered ]``, the race CI met, its timing forced: the
    trial fails with an error of its own while the watch has passed the budget, and a
    worker's death is signalled as the trial's clean-up starts. The trial raises the
    overrun, and its workers are stopped: none left running, none left registered with
    DataLoader's handler (it raised "killed by signal" for them in a later test)."""
    main = threading.main_thread().ident
    assert main is not None
    stop = MemoryWatch.stop

    def passed_unsignalled(watch: MemoryWatch, why: str) -> None:
        watch._exceeded.set()  # the budget passed; its signal not handled yet

    def stop_as_a_death_is_signalled(watch: MemoryWatch) -> None:
        signal.pthread_kill(main, signal.SIGCHLD)  # the late signal of a killed worker
        stop(watch)

    monkeypatch.setattr(MemoryWatch, "_stop_trial", passed_unsignalled)
    monkeypatch.setattr("autoloader.measure._memory.kill", lambda pids: None)  # not yet
    monkeypatch.setattr(MemoryWatch, "stop", stop_as_a_death_is_signalled)

    def step(batch: Any) -> None:
        time.sleep(0.3)  # the watch samples meanwhile
        raise RuntimeError("the step's own error")

    before = {p.pid for p in psutil.Process().children(recursive=True)}
    runner = TrialRunner(SleepDataset(256, latency=0.0), step, batch_size=2, memory_budget=1)
    with pytest.raises(MemoryBudgetExceeded) as info:
        runner.measure(PARAMS, max_seconds=10, deadlines=GENEROUS)
    assert isinstance(info.value.__cause__, TrialError)  # raised by the runner, not the handler
    left = [p.pid for p in psutil.Process().children(recursive=True) if p.pid not in before]
    assert not [pid for pid in left if _running(pid)], f"the trial's workers still run: {left}"


def _running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


class _InterruptedAt(multiprocessing.context.ForkContext):
    """A fork context whose ``at``-th worker starts, and then Ctrl-C lands, before
    DataLoader's ``__init__`` has listed it (NOTE [ A half-built iterator ])."""

    def __init__(self, at: int) -> None:
        super().__init__()
        started: list[multiprocessing.process.BaseProcess] = []
        self.started = started

        class Process(multiprocessing.context.ForkProcess):
            def start(self) -> None:
                super().start()
                started.append(self)
                if len(started) == at:
                    raise KeyboardInterrupt

        self.Process = Process  # type: ignore[misc,assignment]


def test_a_ctrl_c_while_iter_starts_the_workers_stops_them_and_prints_nothing(
    capfd: pytest.CaptureFixture[str],
) -> None:
    context = _InterruptedAt(2)
    loader = DataLoader(
        SleepDataset(64), batch_size=2, num_workers=3, multiprocessing_context=context
    )
    deaths = WorkerDeaths(MemoryWatch(2**40))
    try:
        with deaths.handled(), pytest.raises(KeyboardInterrupt):
            deaths.start(loader)
        # Both started workers stopped before the interrupt went on, the one DataLoader
        # had not listed too; the traceback pytest keeps holds the iterator still.
        assert len(context.started) == 2
        assert [p.is_alive() for p in context.started] == [False, False]
        assert [p.exitcode for p in context.started] == [0, 0]  # told to stop, not killed
        gc.collect()
        assert "Exception ignored" not in capfd.readouterr().err
    finally:
        for process in context.started:
            if process.is_alive():
                process.kill()
                process.join()
