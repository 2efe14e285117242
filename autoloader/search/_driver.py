"""The thin loop that runs the policy's trials against an Optuna study, by ask and tell.

``Driver.run()`` repeats: ask the :class:`~autoloader.search.Policy` for the next trial;
``study.ask()`` for its number (and the sampler's proposal, when the policy leaves the
setting to it); run it with the runner; map what happened to one typed outcome
(:meth:`Driver._run`, the one place that does); ``study.tell()`` it, and store it in the
trial's user attributes so that a resumed run rebuilds the same history.

The entry point runs it inside :func:`quiet_optuna` (autoloader logs each trial
itself) and :func:`remember_ctrl_c` (which sets the driver's ``interrupted``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import signal
import sys
import threading
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass
from time import perf_counter
from types import FrameType
from typing import Any

import optuna
from optuna.distributions import (
    BaseDistribution,
    IntDistribution,
    distribution_to_json,
    json_to_distribution,
)
from optuna.trial import FrozenTrial, TrialState, create_trial

from autoloader._exceptions import BaselineError, StudyInUseError
from autoloader.loader import normalize_params
from autoloader.measure import Measurement, MemoryBudgetExceeded, Runner, TrialError
from autoloader.search._faults import baseline_advice, classify
from autoloader.search._known_failures import failing_from, known_failure
from autoloader.search._lease import Heartbeat, Lease, this_process
from autoloader.search._outcome import (
    Completed,
    Failed,
    FaultKind,
    Outcome,
    Phase,
    Pruned,
    PruneKind,
    Trial,
    TrialSpec,
    baseline_measurement,
    orphan_reason,
    outcome_attrs,
    state_of,
    stored_outcome,
    told,
)
from autoloader.search._policy import Plan, Policy, Stop
from autoloader.search._reasons import SearchEnd, StopReason, render

_logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Proposal:
    """A trial asked of the study and not yet told: its spec, and its outcome where it
    is known without running (a setting past a failure boundary)."""

    asked: optuna.Trial
    spec: TrialSpec
    known: Outcome | None = None


class Driver:
    """Runs one tuning run's trials: the policy decides, the runner measures, the study
    keeps them.

    Args:
        policy: the rules.
        runner: measures one setting; ``None`` where the caller measures each trial itself
            (:meth:`propose`, then :meth:`finish`), and :meth:`run` is not called.
        study: the Optuna study (``direction="maximize"``); it may hold an earlier run's
            trials of the same problem, which the policy sees as ``earlier``.
        deadline: ``perf_counter()`` time when the run must end.
        on_trial: called after each trial.
        clock: seconds, as ``deadline`` counts them (a fake one in tests).
        interrupted: set by Ctrl-C (see :func:`remember_ctrl_c`) or SIGTERM (see
            ``NOTE [ SIGTERM while tuning ]``); checked at every timing window and trial,
            in case the KeyboardInterrupt itself was lost on its way.

    After :meth:`run`, :attr:`search_ended` says why the search phase ended and
    :attr:`stopped` why the trials did, as typed reasons (``search/_reasons.py``).
    """

    def __init__(
        self,
        policy: Policy,
        runner: Runner | None,
        study: optuna.Study,
        *,
        deadline: float,
        on_trial: Callable[[Trial], None] | None = None,
        interrupted: Interruption | None = None,
        clock: Callable[[], float] = perf_counter,
    ) -> None:
        self.policy = policy
        self.runner = runner
        self.study = study
        self.deadline = deadline
        self.on_trial = on_trial
        self.interrupted = interrupted
        self.history: list[Trial] = []
        self.stopped: StopReason | None = None
        self.search_ended: SearchEnd | None = None
        self.search_seconds = 0.0
        self._owner = this_process()
        self._clock = clock
        self._heartbeat: Heartbeat | None = None
        self._unconfirmed: Lease | None = None  # claimed by begin(confirm_later=True)

    def run(self) -> None:
        """Run trials until the policy stops; :attr:`history` then holds every trial.

        Raises:
            StudyInUseError: another live run is tuning the study (before any trial).
        """
        self.begin()
        try:
            while (proposal := self.propose()) is not None:
                try:
                    outcome = proposal.known or self._run(proposal.spec)
                except KeyboardInterrupt as error:
                    by = "SIGTERM" if isinstance(error, Terminated) else "Ctrl-C"
                    self.finish(proposal, Failed(FaultKind.INTERRUPTED, f"interrupted ({by})"))
                    raise
                self.finish(proposal, outcome)
        finally:
            self.end()

    # A trial in three parts, for a loop that measures it itself (AutoLoader's, in the
    # user's training loop): begin() once, then propose() the next trial, measure it,
    # and finish() it with its outcome (outcome() or failure() map what happened).

    def begin(self, *, confirm_later: bool = False) -> None:
        """Take the study's lease, fail a dead run's trials and load the earlier ones,
        once, before the first :meth:`propose`. A study kept in a storage (not in
        memory) is then this run's until :meth:`end`, which must follow.
        ``confirm_later``: the lease is claimed now and confirmed as the first trial is
        told (:meth:`finish`), not waited for here (``NOTE [ The study's lease ]``).

        Raises:
            StudyInUseError: another live run is tuning the study.
        """
        storage = self.study._storage
        if not isinstance(storage, optuna.storages.InMemoryStorage):
            lease = Lease.claim(self.study)
            if confirm_later:
                self._unconfirmed = lease
            else:
                lease.confirm()
            self._heartbeat = Heartbeat(lease, storage)
        try:
            self._fail_orphans()
            self.history = self._load()
        except BaseException:
            self.end()
            raise
        if self._heartbeat is not None:
            self._heartbeat.start()

    def end(self) -> None:
        """Stop the heartbeat and give the study's lease back; idempotent."""
        self._unconfirmed = None
        heartbeat, self._heartbeat = self._heartbeat, None
        if heartbeat is not None:
            heartbeat.stop()
            heartbeat.lease.release()

    def propose(self) -> Proposal | None:
        """The next trial to measure, or ``None`` once the policy stops (``stopped``
        then says why). A trial known to fail is recorded here without running."""
        while True:
            self._stop_if_interrupted()
            plan = self.policy.next(self.history, seconds_left=self._seconds_left())
            if self.search_ended is None and (isinstance(plan, Stop) or plan.phase is Phase.RUNOFF):
                self.search_ended = self.policy.search_ended(
                    self.history, seconds_left=self._seconds_left()
                )
                if self.search_ended is not None:
                    _logger.info("the search ends: %s", render(self.search_ended))
            if isinstance(plan, Stop):
                self.stopped = plan.why
                _logger.info("no more trials: %s", render(plan.why))
                return None
            if plan.phase is Phase.SEARCH and not any(
                t.phase is not Phase.BASELINE and not t.earlier for t in self.history
            ):
                self.search_seconds = self._seconds_left()
            proposal = self._ask(plan)
            if proposal.known is None:
                return proposal
            self.finish(proposal, proposal.known)

    def _ask(self, plan: Plan) -> Proposal:
        with warnings.catch_warnings():
            # A storage with heartbeats warns that they are kept only by optimize():
            # this run's heartbeat thread keeps them (NOTE [ The study's lease ]).
            warnings.filterwarnings("ignore", message=".*[Hh]eartbeat", category=UserWarning)
            asked = self.study.ask(self._sampler_bounds() if plan.params is None else None)
        if self._heartbeat is not None:
            self._heartbeat.beating(asked._trial_id)
        with warnings.catch_warnings():
            # Drawn from the bounds above, num_workers is then asked again with the
            # space's own range: Optuna keeps the first, and says so.
            warnings.filterwarnings("ignore", "Inconsistent parameter values", RuntimeWarning)
            params = (
                plan.params
                if plan.params is not None
                else self.policy.sampled_space(self.history).suggest(asked)
            )
        spec = TrialSpec(
            number=asked.number,
            phase=plan.phase,
            params=params,
            # A plan is made before its trial runs: hold it to the time actually left.
            # Measuring starts once the workers have: they get their start-up on top.
            max_seconds=max(
                0.5,
                min(
                    plan.max_seconds + self.policy.startup_seconds(params, self.history),
                    self._seconds_left(),
                ),
            ),
            deadlines=self.policy.deadlines(params, self.history),
        )
        asked.set_user_attr("phase", spec.phase.value)
        asked.set_user_attr("params", params)
        asked.set_user_attr("owner", self._owner)
        known = known_failure(params, self.history) if plan.params is None else None
        return Proposal(asked, spec, known)

    def finish(self, proposal: Proposal, outcome: Outcome) -> None:
        """Record ``proposal``'s trial with its ``outcome``.

        Raises:
            StudyInUseError: the lease claimed by ``begin(confirm_later=True)`` is
                another run's: the trial is told failed, and the run ends here.
        """
        lease, self._unconfirmed = self._unconfirmed, None
        if lease is not None:
            try:
                lease.confirm()
            except StudyInUseError:
                with contextlib.suppress(Exception):  # this run's own trial, not left running
                    self.study.tell(proposal.asked, state=TrialState.FAIL)
                self.end()
                raise
        self._tell(proposal.asked, proposal.spec, outcome)

    def vote(self, spec: TrialSpec, window: int, measurement: Measurement) -> bool:
        """Whether the trial should stop at this timing window (the policy's vote)."""
        self._stop_if_interrupted()
        return self.policy.vote(spec.phase, spec.params, window, measurement, self.history)

    def _run(self, spec: TrialSpec) -> Outcome:
        """Measure ``spec`` and map whatever happened to its outcome."""
        voted = False

        def on_window(window: int, measurement: Measurement) -> bool:
            nonlocal voted
            voted = self.vote(spec, window, measurement)
            return voted

        assert self.runner is not None, "run() needs a runner"
        try:
            measurement = self.runner.measure(
                spec.params,
                max_seconds=spec.max_seconds,
                on_window=on_window,
                deadlines=spec.deadlines,
                max_batches=spec.max_batches,
            )
        except (MemoryBudgetExceeded, TrialError) as error:
            return self.failure(spec, error)
        return self.outcome(spec, measurement, voted=voted)

    def outcome(self, spec: TrialSpec, measurement: Measurement, *, voted: bool) -> Outcome:
        """The outcome of a trial measured to its end (``voted``: stopped by :meth:`vote`)."""
        return self.policy.judge(spec.phase, spec.params, measurement, self.history, voted=voted)

    def failure(self, spec: TrialSpec, error: MemoryBudgetExceeded | TrialError) -> Outcome:
        """The outcome of a trial that failed with ``error``.

        Raises:
            BaselineError: the baseline failed: the fault is the dataset's or the step's.
        """
        if isinstance(error, MemoryBudgetExceeded):
            if spec.phase is Phase.BASELINE:
                raise BaselineError(
                    f"The baseline (num_workers=0) alone went over the memory budget: "
                    f"{error}. Raise memory_budget or use a smaller batch_size."
                ) from None
            return Pruned(PruneKind.MEMORY, f"memory: {error}", peak_memory=error.peak)
        # Ctrl-C reaches the workers too: their deaths are its doing, not the setting's.
        self._stop_if_interrupted()
        if spec.phase is Phase.BASELINE:
            where = f" at {error.where}" if error.where else ""
            raise BaselineError(
                f"The baseline (num_workers=0) failed while {error.stage}: "
                f"{error.summary}{where}. {baseline_advice(error)}"
            ) from error.error
        return classify(error, params=spec.params, batch_bytes=self._batch_bytes())

    def _tell(self, asked: optuna.Trial, spec: TrialSpec, outcome: Outcome) -> None:
        measurement = outcome.measurement if isinstance(outcome, (Completed, Pruned)) else None
        if measurement is not None:
            asked.set_user_attr("measurement", asdict(measurement))
        asked.set_user_attr("outcome", outcome_attrs(outcome))  # then told: _fail_orphans
        if isinstance(outcome, Pruned) and measurement is not None:
            # the sampler ranks pruned trials by it
            asked.report(self.policy.value(spec.params, measurement, self.history), 0)
        self.study.tell(asked, **told(outcome))
        if self._heartbeat is not None:
            self._heartbeat.beating(None)
        trial = Trial(spec.number, spec.phase, spec.params, outcome)
        self.history.append(trial)
        if self.on_trial is not None:
            self.on_trial(trial)
        self._stop_if_interrupted()

    # Resuming ---------------------------------------------------------------------

    def checkpoint(self) -> dict[str, Any]:
        """This run's finished trials as the study keeps them, and the search's time,
        in plain values (``NOTE [ An AutoLoader's state ]``): :meth:`resume` takes them."""
        mine = {trial.number for trial in self.history if not trial.earlier}
        trials = [
            _plain(frozen)
            for frozen in self.study.get_trials(deepcopy=False)
            if frozen.number in mine
        ]
        return {"trials": trials, "search_seconds": self.search_seconds}

    def resume(self, state: Mapping[str, Any]) -> None:
        """This run's trials before a checkpoint (:meth:`checkpoint`), after :meth:`begin`:
        told to the study again, and this run's history, not an earlier run's.

        Raises:
            KeyError, TypeError, ValueError: ``state`` is not a checkpoint's.
        """
        trials: Sequence[Mapping[str, Any]] = state["trials"]
        for plain in trials:
            self.study.add_trial(_frozen(plain))
            trial = _trial_of(self.study.get_trials(deepcopy=False)[-1])
            if trial is None:
                raise ValueError(f"trial {plain!r} is not one of autoloader's")
            self.history.append(dataclasses.replace(trial, earlier=False))
        self.search_seconds = float(state["search_seconds"])

    def _load(self) -> list[Trial]:
        """The finished trials of earlier runs on this study, as the policy reads them."""
        earlier = []
        for frozen in self.study.get_trials(deepcopy=False):
            trial = _trial_of(frozen)
            if trial is not None:
                earlier.append(trial)
        if earlier:
            _logger.info("resuming: %d trials of earlier runs", len(earlier))
        return earlier

    def _fail_orphans(self) -> None:
        """Fail the RUNNING trials of tuning runs that died.

        A run killed mid-trial (SIGKILL, the OOM killer, a power cut) leaves its trial
        RUNNING in the storage forever. This run holds the study's lease: no other run
        on it is alive, on this machine or another (``NOTE [ The study's lease ]``), so
        every trial still RUNNING will never finish. A study in memory has none. A run
        killed between storing a trial's outcome and telling it (:meth:`_tell`) had
        measured the setting: that trial is told its outcome, not failed.
        """
        if self._heartbeat is None:
            return
        running = self.study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))
        for trial in running:
            try:
                stored = stored_outcome(trial.user_attrs)
            except (KeyError, TypeError, ValueError):  # unreadable: failed, as none stored
                stored = None
            if stored is not None:
                self.study.tell(trial.number, **told(stored))
                _logger.info(
                    "trial %d: its run died once it was measured: kept, %s",
                    trial.number,
                    state_of(stored),
                )
                continue
            self.study.tell(trial.number, state=TrialState.FAIL)
            _logger.info(
                "trial %d: %s", trial.number, orphan_reason(trial.user_attrs.get("owner") or {})
            )

    # Helpers ------------------------------------------------------------------------

    def _sampler_bounds(self) -> dict[str, BaseDistribution] | None:
        """Past a failure boundary, the sampler draws the worker count below it: Optuna's
        TPE learns nothing from failed trials, and would keep proposing counts that are
        known to fail (each recorded without running, but a proposal spent). Nor does it
        draw more workers than can start in the time left (``Policy.startable``), nor
        more than the CPUs where loading and the step are both CPU work
        (``Policy.workers_cap``)."""
        low, high = self.policy.space.num_workers  # type: ignore[misc]
        bound = high
        smallest = failing_from(self.history)
        if smallest is not None:
            bound = min(bound, smallest - 1)
        startable = self.policy.startable(self.history, self._seconds_left())
        if startable is not None:
            bound = min(bound, startable)
        cap = self.policy.workers_cap(self.history)
        if cap is not None:
            bound = min(bound, cap.cpus)
        if not low <= bound < high:
            return None
        return {"num_workers": IntDistribution(low, bound)}

    def has_baseline(self) -> bool:
        """Whether the baseline finished: without it there is nothing to compare to."""
        return baseline_measurement(self.history) is not None

    def _batch_bytes(self) -> int:
        measured = baseline_measurement(self.history)
        return measured.batch_bytes if measured is not None else 0

    def _stop_if_interrupted(self) -> None:
        if self.interrupted is not None:
            self.interrupted.stop_if_set()

    def _seconds_left(self) -> float:
        return max(0.0, self.deadline - self._clock())


class Terminated(KeyboardInterrupt):
    """SIGTERM while tuning (``NOTE [ SIGTERM while tuning ]``): a KeyboardInterrupt, so
    that every path that stops a trial and its workers on Ctrl-C stops them on it too."""


class Interruption(threading.Event):
    """Set by the first Ctrl-C or SIGTERM of a run; :attr:`by` says which."""

    def __init__(self) -> None:
        super().__init__()
        self.by: str | None = None

    def note(self, by: str) -> None:
        """``by`` (``"Ctrl-C"`` or ``"SIGTERM"``) stopped the run, unless one did already."""
        if not self.is_set():
            self.by = by
            self.set()

    def error(self) -> KeyboardInterrupt:
        """The exception that stops the run: :class:`Terminated` for SIGTERM."""
        return Terminated() if self.by == "SIGTERM" else KeyboardInterrupt()

    def stop_if_set(self) -> None:
        """Raise :meth:`error` once Ctrl-C or SIGTERM was noted, whether its own exception
        reached the run or was lost on its way."""
        if self.is_set():
            raise self.error()


@contextlib.contextmanager
def remember_ctrl_c(interrupted: Interruption | None) -> Iterator[None]:
    """Note each Ctrl-C in ``interrupted``, then raise KeyboardInterrupt as usual.

    The KeyboardInterrupt is raised at whatever bytecode the main thread runs. If that
    is a ``__del__``, a weakref finalizer (DataLoader iterators and queues have both) or
    a fork's at-fork hook (logging's, as a worker starts), Python prints "Exception
    ignored" and the run would go on; the search checks ``interrupted`` at every timing
    window and trial, and stops all the same, so that print is dropped
    (:func:`_lost_interrupts_unsaid`).
    """
    if interrupted is None:
        yield
        return
    previous = signal.getsignal(signal.SIGINT)
    with _lost_interrupts_unsaid(interrupted):
        if threading.current_thread() is not threading.main_thread() or previous in (
            signal.SIG_IGN,
            None,  # Ctrl-C is ignored, or not Python's to handle
        ):
            yield
            return

        def handle(signum: int, frame: FrameType | None) -> None:
            interrupted.note("Ctrl-C")
            if callable(previous):
                previous(signum, frame)
            else:
                raise KeyboardInterrupt

        signal.signal(signal.SIGINT, handle)
        try:
            yield
        finally:
            signal.signal(signal.SIGINT, previous)


@contextlib.contextmanager
def _lost_interrupts_unsaid(interrupted: Interruption) -> Iterator[None]:
    """Within the block, a KeyboardInterrupt (or SIGTERM's :class:`Terminated`) that
    Python could not raise, once ``interrupted`` noted it, is not printed: the run
    stops on the note. Every other unraisable exception goes to the hook found, which
    is put back after the block unless something replaced this one meanwhile."""
    found = sys.unraisablehook

    def hook(unraisable: Any) -> None:
        if isinstance(unraisable.exc_value, KeyboardInterrupt) and interrupted.is_set():
            _logger.debug("an interrupt raised where it could not stop the run: %s", unraisable)
            return
        found(unraisable)

    sys.unraisablehook = hook
    try:
        yield
    finally:
        if sys.unraisablehook is hook:
            sys.unraisablehook = found


@contextlib.contextmanager
def quiet_optuna() -> Iterator[None]:
    """Silence Optuna's per-trial log lines: autoloader logs each trial itself.

    The verbosity is restored afterwards, whatever happens.
    """
    verbosity = optuna.logging.get_verbosity()
    optuna.logging.set_verbosity(optuna.logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
            yield
    finally:
        optuna.logging.set_verbosity(verbosity)


def _trial_of(frozen: FrozenTrial) -> Trial | None:
    """An earlier run's finished trial, as this run's history holds it; ``None`` for a
    trial still running or not autoloader's."""
    attrs = frozen.user_attrs
    if not frozen.state.is_finished() or "params" not in attrs:
        return None
    try:
        phase = Phase(attrs["phase"])
        params = normalize_params(attrs["params"])
        outcome = stored_outcome(attrs)
        if outcome is None and frozen.state == TrialState.FAIL:  # by _fail_orphans, or stale
            outcome = Failed(FaultKind.INTERRUPTED, orphan_reason(attrs.get("owner") or {}))
        elif outcome is None:
            return None
    except (KeyError, TypeError, ValueError) as error:
        _logger.warning("trial %d of the study is not readable: %s", frozen.number, error)
        return None
    return Trial(frozen.number, phase, params, outcome, earlier=True)


def _plain(frozen: FrozenTrial) -> dict[str, Any]:
    """A finished trial in plain values (strings, numbers, lists, dicts): a checkpoint
    loaded with ``torch.load(weights_only=True)`` keeps them."""
    plain = {
        "state": frozen.state.name,
        "value": frozen.value,
        "params": dict(frozen.params),
        "distributions": {
            name: distribution_to_json(distribution)
            for name, distribution in frozen.distributions.items()
        },
        "user_attrs": dict(frozen.user_attrs),
        "intermediate_values": {
            str(step): value for step, value in frozen.intermediate_values.items()
        },
    }
    loaded: dict[str, Any] = json.loads(json.dumps(plain))
    return loaded


def _frozen(plain: Mapping[str, Any]) -> FrozenTrial:
    """The trial :func:`_plain` made plain, to add to a study."""
    return create_trial(
        state=TrialState[plain["state"]],
        value=plain["value"],
        params=plain["params"],
        distributions={
            name: json_to_distribution(text) for name, text in plain["distributions"].items()
        },
        user_attrs=plain["user_attrs"],
        intermediate_values={int(step): v for step, v in plain["intermediate_values"].items()},
    )
