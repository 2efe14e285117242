"""Who tunes a study now: the live run's lease on it, and the heartbeat that keeps it.

A study kept in a storage (a journal file, a database) can be opened by any number of
processes. Two tuning runs on one study at once would each measure its trials under the
other's load and mix them in one history: both answer, neither right. So a run takes the
study's lease before its first trial (:meth:`Lease.take`), keeps it alive while it runs
(:class:`Heartbeat`) and gives it back at its end; a second run is refused with
:class:`~autoloader.StudyInUseError`, which names the live one.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Mapping
from dataclasses import asdict, dataclass, replace
from typing import Any

import optuna
import psutil
from optuna.storages._heartbeat import BaseHeartbeat

from autoloader._exceptions import StudyInUseError

_logger = logging.getLogger(__name__)

# NOTE [ The study's lease ]
# The lease is a user attribute of the study (_KEY): the live run's host, pid, process
# start time (a pid reused by another process is not the run), when it began and when it
# last beat. Any storage keeps study attributes (journal files, every RDB, a storage
# object given), so one mechanism serves them all. A lease is live while its run is:
#   * on this machine (this host, and this pid namespace: containers may share a host
#     name), while its process runs: a run killed by SIGKILL, the OOM killer or a power
#     cut is known dead at once, and its lease is taken over;
#   * on another machine (whose processes cannot be looked up), while it beats: every
#     HEARTBEAT_SECONDS, from a thread, so a trial may measure as long as it likes; only
#     a dead or frozen process lets it lapse, HEARTBEAT_GRACE seconds after its last
#     beat (the machines' clocks are assumed to agree within seconds, as NTP keeps them).
# Storages offer no compare-and-set on attributes, so taking a lease is: read it; if it
# is free (none, ended or dead), write ours; wait _SETTLE_SECONDS; read it again. Of runs
# that start together, each reads after every other's write, and only the last writer
# finds its own lease: two runs could both go on only if one took longer than
# _SETTLE_SECONDS between its read and its write.
# AutoLoader does not wait there: its training goes on meanwhile. It claims the lease,
# runs its first trial (the baseline, a second or more, in which nothing is told to the
# study) and confirms the lease before that trial is told (Driver.begin(confirm_later=
# True)): before, its first run's training slept a second at its first batch. Where
# another run's claim stands instead, its first trial is told failed, and the run is
# refused then (under torchrun, on every rank: rank 0 says so as the job's next step):
# an AutoLoader whose study is the one kept beside its path searches in memory from
# there.
# While a run holds the lease no other autoloader run is live on the study, so every
# trial still RUNNING when it takes the lease is a dead run's (Driver._fail_orphans).
# Where the storage keeps Optuna's trial heartbeats (an RDB URL), the same thread records
# the running trial's, so Optuna's own tools (fail_stale_trials) see it alive too, and
# stale once its run is dead; its first beat is the asking thread's, as it is asked:
# those tools never find a running trial with no beat stale.
_KEY = "autoloader:run"
HEARTBEAT_SECONDS = 10
HEARTBEAT_GRACE = 60
_SETTLE_SECONDS = 1.0
_STOP_SECONDS = 10


@dataclass(frozen=True, slots=True)
class Holder:
    """A run that holds, or held, a study's lease (wall-clock times, epoch seconds)."""

    host: str
    pid: int
    started: float  # the process's start time: a reused pid is another process
    since: float
    heartbeat: float
    token: str
    ended: float | None = None
    pid_namespace: int | None = None  # containers on one host may share its name

    def here(self) -> bool:
        """Whether the run's process can be looked up from this one: the same host, and
        the same pid namespace."""
        return self.host == socket.gethostname() and self.pid_namespace == _pid_namespace()

    def live(self) -> bool:
        """Whether the run still tunes (``NOTE [ The study's lease ]``)."""
        if self.ended is not None:
            return False
        if self.here():
            return is_alive({"pid": self.pid, "started": self.started})
        return time.time() - self.heartbeat < HEARTBEAT_GRACE

    def describe(self) -> str:
        """The run in words: "pid 1234 on host gpu-3, tuning since ... (last heartbeat 4 s
        ago)"."""
        since = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(self.since))
        return (
            f"pid {self.pid} on host {self.host}, tuning since {since} "
            f"(last heartbeat {max(0.0, time.time() - self.heartbeat):.0f} s ago)"
        )


class Lease:
    """This run's lease on ``study``; take it with :meth:`take`, end it with :meth:`release`."""

    def __init__(self, study: optuna.Study, mine: Holder) -> None:
        self.study = study
        self.mine = mine
        self._lock = threading.Lock()  # renew() runs in the heartbeat thread
        self._claimed = time.monotonic()  # made by claim(), just after its write
        self._before: Holder | None = None  # the holder claim() found, a dead run's

    @classmethod
    def take(cls, study: optuna.Study) -> Lease:
        """This run's lease on ``study``, taken over from a dead run where one held it:
        :meth:`claim`, then :meth:`confirm`.

        Raises:
            StudyInUseError: another live run holds it.
        """
        lease = cls.claim(study)
        lease.confirm()
        return lease

    @classmethod
    def claim(cls, study: optuna.Study) -> Lease:
        """This run's lease written on ``study``, where no live run holds it; it is this
        run's once :meth:`confirm` finds it still there (``NOTE [ The study's lease ]``).

        Raises:
            StudyInUseError: another live run holds it.
        """
        held = _holder(study)
        if held is not None and held.live():
            raise _in_use(study, held)
        now = time.time()
        process = this_process()
        mine = Holder(
            host=process["host"],
            pid=process["pid"],
            started=process["started"],
            since=now,
            heartbeat=now,
            token=uuid.uuid4().hex,
            pid_namespace=_pid_namespace(),
        )
        study.set_user_attr(_KEY, asdict(mine))
        lease = cls(study, mine)
        lease._before = held
        return lease

    def confirm(self) -> None:
        """Wait what is left of _SETTLE_SECONDS since :meth:`claim`, and read the lease
        again: it is this run's where no other run claimed it since (``NOTE [ The
        study's lease ]``).

        Raises:
            StudyInUseError: another run claimed it after this one: it goes on, not us.
        """
        time.sleep(max(0.0, _SETTLE_SECONDS - (time.monotonic() - self._claimed)))
        now_held = _holder(self.study)
        if now_held is None or now_held.token != self.mine.token:
            raise _in_use(self.study, now_held or self.mine)
        held, self._before = self._before, None
        if held is not None and held.ended is None:
            _logger.warning(
                "study %s: the run that held it (%s) is gone; this run takes it over",
                self.study.study_name,
                held.describe(),
            )

    def renew(self) -> bool:
        """Beat: whether the lease is still this run's (another run may have taken it
        over from a run that was frozen past the grace period)."""
        with self._lock:
            held = _holder(self.study)
            if held is None or held.token != self.mine.token:
                return False
            self.mine = replace(self.mine, heartbeat=time.time())
            self.study.set_user_attr(_KEY, asdict(self.mine))
            return True

    def release(self) -> None:
        """Give the lease back, where it is still this run's. Called as a run ends,
        maybe with an error on its way: a storage that fails now is logged, not raised
        (the lease then lapses as a dead run's does)."""
        with self._lock:
            try:
                held = _holder(self.study)
                if held is not None and held.token == self.mine.token:
                    now = time.time()
                    self.mine = replace(self.mine, heartbeat=now, ended=now)
                    self.study.set_user_attr(_KEY, asdict(self.mine))
            except Exception as error:
                _logger.warning(
                    "study %s: its lease could not be given back: %s", self.study.study_name, error
                )


class Heartbeat:
    """The ``autoloader-heartbeat`` thread: renews ``lease`` every ``interval`` seconds
    and, where ``storage`` keeps Optuna's trial heartbeats, records the running trial's
    (set with :meth:`beating`). Started by :meth:`start`, ended by :meth:`stop`, which
    the owner calls in a ``finally``; a daemon, so that not even a lost ``stop()`` can
    keep the interpreter from exiting."""

    def __init__(
        self,
        lease: Lease,
        storage: optuna.storages.BaseStorage,
        *,
        interval: float = HEARTBEAT_SECONDS,
    ) -> None:
        self.lease = lease
        self.interval = interval
        self._storage = (
            storage
            if isinstance(storage, BaseHeartbeat) and storage.get_heartbeat_interval() is not None
            else None
        )
        self._trial: int | None = None
        self._woken = threading.Event()
        self._stopped = threading.Event()
        self._lost = False
        self._thread = threading.Thread(target=self._loop, name="autoloader-heartbeat", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def beating(self, trial_id: int | None) -> None:
        """Record ``trial_id``'s heartbeats from now on: the first at once, in the calling
        thread, then every interval from the thread; ``None`` once the trial has ended.

        Optuna's ``fail_stale_trials`` never fails a running trial with no heartbeat: left
        to the thread, the first beat came after the run had gone on, and a run killed
        before the thread ran (a full test run on a slow machine) left its trial so."""
        self._trial = trial_id
        if trial_id is not None:
            self._beat(trial_id)

    def stop(self) -> None:
        """End the thread: at once, unless a storage call of its own hangs (a database
        that stopped answering), which it is left to finish, a daemon, after a warning."""
        self._stopped.set()
        self._woken.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(_STOP_SECONDS)
            if self._thread.is_alive():
                _logger.warning(
                    "study %s: the heartbeat's storage call has not returned in %d s; "
                    "the run ends without it",
                    self.lease.study.study_name,
                    _STOP_SECONDS,
                )

    def _loop(self) -> None:
        next_renewal = time.monotonic() + self.interval
        while not self._stopped.is_set():
            self._woken.wait(self.interval)
            self._woken.clear()
            if self._stopped.is_set():
                return
            trial = self._trial
            if trial is not None:
                self._beat(trial)
            try:
                if time.monotonic() >= next_renewal and not self._lost:
                    next_renewal = time.monotonic() + self.interval
                    self._lost = not self.lease.renew()
                    if self._lost:
                        _logger.warning(
                            "study %s: another run took its lease over (this run did not "
                            "beat for %d s: was the process stopped?); the two runs' "
                            "trials now mix",
                            self.lease.study.study_name,
                            HEARTBEAT_GRACE,
                        )
            except Exception as error:  # a storage briefly unreachable: beat again later
                self._failed(error)

    def _beat(self, trial: int) -> None:
        """Record ``trial``'s Optuna heartbeat, where the storage keeps them."""
        if self._storage is None:
            return
        try:
            self._storage.record_heartbeat(trial)
        except Exception as error:  # a storage briefly unreachable: beat again later
            self._failed(error)

    def _failed(self, error: Exception) -> None:
        _logger.warning("heartbeat of study %s failed: %s", self.lease.study.study_name, error)


def _holder(study: optuna.Study) -> Holder | None:
    raw = study.user_attrs.get(_KEY)
    if not isinstance(raw, Mapping):
        return None
    with contextlib.suppress(TypeError, ValueError):
        return Holder(**raw)
    _logger.warning("study %s: its lease record is not readable: %r", study.study_name, raw)
    return None


def _in_use(study: optuna.Study, held: Holder) -> StudyInUseError:
    lapses = ""
    if not held.here():
        left = max(0.0, held.heartbeat + HEARTBEAT_GRACE - time.time())
        lapses = (
            f" If that run is dead, its lease lapses {HEARTBEAT_GRACE} s after its last "
            f"heartbeat (in {left:.0f} s)."
        )
    return StudyInUseError(
        f"Study {study.study_name} is being tuned by another run: {held.describe()}. Two "
        "runs at once would measure each trial under the other's load and mix their "
        f"trials. Wait for that run to end or stop it, or give this run another storage."
        f"{lapses}"
    )


def _pid_namespace() -> int | None:
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:  # not Linux
        return None


def this_process() -> dict[str, Any]:
    """This process as trials and leases record their owner: host, pid and start time."""
    process = psutil.Process()
    return {"host": socket.gethostname(), "pid": process.pid, "started": process.create_time()}


def is_alive(owner: Mapping[str, Any]) -> bool:
    """Whether the process ``owner`` names (on this machine) still runs, and is not a
    reused pid."""
    try:
        process = psutil.Process(int(owner["pid"]))
        return bool(abs(process.create_time() - float(owner["started"])) < 1.0)
    except (psutil.NoSuchProcess, KeyError, TypeError, ValueError):
        return False
