"""A reused setting checked by measurement before it is trusted.

NOTE [ A reused setting checked ]
A result file is reused where its problem's description matches (``_reuse.py``), and
the description cannot see everything that sets the speed: the storage (a cold cache,
a remote disk), a dataset's attribute (a latency, a resolution), code reached through
objects (``NOTE [ Code fingerprints ]``). So a reused setting is measured first, and
compared with the saved trial of the same setting:

- ``tune()`` runs one short trial of it, through the runner its search would use:
  ``_SHARE`` of the time budget, or where that is shorter, what an unchanged setting
  needs to deliver batches to time (the saved trial's start-up twice over, and at its
  pace the batches its workers queue as they start and two timing windows' more:
  ``measurable_batches``), stopped at the first window where the verdict is clear. A
  check in which no batch came at all waited longer than that for the first, and one
  that timed only batches queued as its workers started (``NOTE [ Warm-up ]``) saw none
  loaded at the setting's pace in that time: the setting does not hold. (With a floor
  of 1 s, the check cost 5.8% of a 20 s budget, benchmarks/reuse_check.py.) Timing
  the queued batches as the setting's loading, a check of 3 workers x prefetch 2 on
  storage 20x slower held in 2 of 5 runs (1,138-1,156 samples/s, 597 when tuned: one
  queued batch timed), where its length fit 4 batches and no burst.
- ``AutoLoader`` times the first batches it loads with it (:class:`FirstBatchesCheck`):
  the training's own batches, at no cost but the timing. An epoch that ends before
  they go past the queued ones is too short to time, as one with none is.

Neither check decides while every batch it timed was queued as its workers started.

What counts is the loop's wait for data, a batch: it may grow by the saved trial's
own error (its 95% interval) plus the check's, as a share of a batch's time when
tuned, never less than 25% (``_LEAST_BAND``: noise alone does not tune again) and never
more than 100% (``_MOST_BAND``: a noisy saved trial still sees the loop's rate
halved); a check too short for an error of its own (fewer than two timing windows) is
allowed 50% (``_TOO_SHORT_BAND``). Beyond that, the run tunes again, and a warning
says what moved (``loading 11x slower than when tuned``); a setting that fails its
check tunes again too. Within it, the result is reused, and its notes say what the
check measured. The step's own time is not the setting's to fix: a step slower than
when tuned (a model warming up, a busy machine: a fresh Trainer's first steps ran 1.5x
slower in a test) leaves the setting, which still feeds it, reused; a step faster, for
which loading now keeps the loop waiting, is tuned again, by its wait. Under torchrun
the ranks reuse the file unchecked: a trial there is every rank's at once, which the
reuse does not start.

A busy machine is not a changed pipeline. Where the defaults' loop found loading and the
step as when tuned but other processes on the CPUs (``NOTE [ The defaults' loop
first ]``), and they held the CPUs the setting needs through its check too (free but for
``_CPU_SLACK`` of one, as for the probe), a check that does not hold is theirs: the
setting is reused, a warning and its notes saying what the check measured beside them.
Tuned again there, the search would have measured the neighbours as well, and replaced
the file with what suits them while they run (a suite of tests run three at once on the
2-core VM saw a setting checked 1.9x slower and tuned again). ``AutoLoader`` has no
defaults' loop: its first batches' check, not holding while others held the CPUs (its
own workers' time the loop's) and slower by no more than their share explains (needed /
free CPUs: ``_explains``), reuses the setting unconfirmed, with the warning (beside a
busy loop a test's check found a wait of 6.9 ms a batch, 1.2 ms when tuned: tuned again).

NOTE [ The defaults' loop first ]
A setting with process workers cannot be timed in 2% of a short budget: four workers
took 0.4 s to deliver a first batch on the 2-core VM, and the check of a 20 s budget
cost 5.0% (benchmarks/reuse_check.py). But what the check must see, loading and the
step as they were when tuned, the saved baseline trial measured too, with no workers
to start: ``num_workers=0``, each batch loaded in this process, then the step. So
``tune()`` first times that loop, in ``_SHARE`` of the budget (``_LEAST_SECONDS`` at
least), timing as many batches as fit in ``_PROBE_FILL`` of that at the saved baseline
trial's pace after the first batch (untimed: its saved time to come and a step), the
rest left to the call's own work, ``_PROBE_TIMED`` at least (or it is not run), and
compares it with that trial. Where the wait for data grew by no more than the band,
the step is not faster by more than it (a faster step may outrun the setting's
workers), and the CPUs the setting's workers and loop would use were free meanwhile
but for ``_CPU_SLACK`` of one (``_CpuUse``: a neighbour busy on them slows the workers,
which a loop of one thread does not see), the setting is reused, its notes saying so.
A probe too short for an error of its own is allowed ``_TOO_SHORT_BAND``, as the
setting's check is (a single batch of the images pipeline at a 20 s budget); one that
timed no batch tells nothing. Otherwise, or where it did not hold, the setting's own
check decides as above: the probe only ever makes a reuse cheaper, never tunes again
by itself. On the images pipeline at 20 s the reusing call took 0.29-0.32 s (1.5-1.6%:
the first batch and one timed, at 0.11-0.14 s each; 0.44-0.55 s when the clock left a
second batch untimed and the probe planned for the whole share), where the setting's
check took 1.0-1.7 s.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import psutil

from autoloader.checks import usable_cpus
from autoloader.measure import (
    FIRST_STEP_TIMEOUT,
    Deadlines,
    Measurement,
    MemoryBudgetExceeded,
    Runner,
    TrialError,
    format_seconds,
    measurable_batches,
)
from autoloader.results import TrialRecord, TuneResult

_logger = logging.getLogger("autoloader")

# tune(): the check's share of the time budget; what an unchanged setting needs (its
# start-ups, and at the saved trial's pace its burst and the batches of _WINDOWS timing
# windows); and the least seconds, for the clock.
_SHARE = 0.02
_START_UPS = 2.0
_WINDOWS = 2
_LEAST_SECONDS = 0.2
# The band: the loop's wait for data may grow by this share of a batch's time when
# tuned (NOTE [ A reused setting checked ]).
_LEAST_BAND = 0.25
_MOST_BAND = 1.0
_TOO_SHORT_BAND = 0.5
# A batch of the check may take this many times the saved trial's before it is hung,
# and _LEAST_HUNG seconds at least, as in the search (NOTE [ Hang deadlines ]): with the
# check's own length as the floor, a 0.2 s check failed a tiny model's step as hung
# when it stalled 0.2 s on a busy machine, and a good saved setting was tuned again.
_HUNG = 20.0
_LEAST_HUNG = 3.0
# The probe of the defaults' loop (NOTE [ The defaults' loop first ]): the share of a
# CPU other processes may use of those the setting would use (the machine's own
# daemons, a shell) before the CPUs count as taken. A neighbour that would take a whole
# CPU gets its fair share of them beside this process's runnable threads: 2/(k+1) of
# two CPUs beside k of them. The probes and checks of a thread-worker setting read other
# processes at 0.47-0.99 CPUs beside one busy loop (24 readings of 0.15-0.35 s on the
# 2-core VM), 0-0.14 quiet. At 0.5, one busy reading (0.47) counted the CPUs free:
# had its check not held, the slowdown would have been the pipeline's, and the run
# tuned again (likely what a test's reuse beside a busy loop did in a full run).
_CPU_SLACK = 0.3
# Batches the probe must time to judge at all: at the saved baseline's pace, they must
# fit after the first (timed alone: NOTE [ Warm-up ]) in _PROBE_FILL of the probe's
# seconds, the rest left to the reusing call's own work (the runner's set-up, the file,
# the CPU reading: 0.03-0.05 s on the images pipeline).
_PROBE_TIMED = 1
_PROBE_FILL = 0.75


@dataclass(frozen=True, slots=True)
class ReuseCheck:
    """A reused setting's loop, measured, against its saved trial's.

    Attributes:
        then: samples per second of the saved trial, and ``now``: of the check.
        band: how much longer the loop may wait for data a batch, as a share of a
            batch's time when tuned.
        load_then, load_now: seconds per batch the loop waited for data.
        step_then, step_now: seconds per batch in the step.
        seconds: seconds the check took.
        delivered: whether a batch came in the check at all (none: the first took
            longer than the check's seconds, which an unchanged setting's start-up
            fits twice over).
        first_then: seconds the saved trial waited for its first batch, and
            ``first_now``: the check.
        past_burst: whether the check timed a batch its workers loaded at their pace,
            not only those they queued as they started (``Measurement.only_queued``).
    """

    then: float
    now: float
    band: float
    load_then: float
    load_now: float
    step_then: float
    step_now: float
    seconds: float
    delivered: bool = True
    first_then: float = 0.0
    first_now: float = 0.0
    past_burst: bool = True

    @property
    def holds(self) -> bool:
        """Whether the setting still feeds the loop as it did: a batch came, one loaded
        at the setting's pace among them, and its wait for data grew by no more than the
        band's share of a batch's time when tuned."""
        grew = self.load_now - self.load_then
        batch = self.load_then + self.step_then
        return self.delivered and self.past_burst and grew <= self.band * batch

    def moved(self) -> str:
        """What moved, in words: loading or the step, whichever added or saved more
        time a batch, by how much; or that no batch came."""
        if not self.delivered:
            return (
                f"no batch came in the check's {format_seconds(self.seconds)}, the first "
                f"in {format_seconds(self.first_then)} when tuned"
            )
        if not self.past_burst:
            return (
                f"only batches queued as its workers started came in the check's "
                f"{format_seconds(self.seconds)}, none at its loading pace (the first in "
                f"{format_seconds(self.first_now)}, {format_seconds(self.first_then)} "
                "when tuned)"
            )
        if abs(self.load_now - self.load_then) < abs(self.step_now - self.step_then):
            return f"the step {_factor(self.step_then, self.step_now)} than when tuned"
        if self.load_then > 0 and self.load_then >= self.step_then:
            # Loading was the loop's bottleneck: its wait was its whole cost.
            return f"loading {_factor(self.load_then, self.load_now)} than when tuned"
        return (
            f"the loop waits {format_seconds(self.load_now)} a batch for data, "
            f"{format_seconds(self.load_then)} when tuned"
        )

    def note(self) -> str:
        """The check, for the result's notes."""
        return (
            f"checked before reuse: {self.now:,.0f} samples/s in "
            f"{format_seconds(self.seconds)}, {self.then:,.0f} when tuned; the loop waits "
            f"{format_seconds(self.load_now)} a batch for data, "
            f"{format_seconds(self.load_then)} when tuned (up to {self.band:.0%} of a "
            "batch's time more allowed): reused"
        )


def _factor(then: float, now: float) -> str:
    """``now`` against ``then`` in words: ``11x slower``, ``1.5x faster``."""
    if then <= 0 or now <= 0:
        return f"{format_seconds(now)} a batch, {format_seconds(then)}"
    ratio = now / then
    factor = max(ratio, 1 / ratio)
    amount = f"{factor:.0f}x" if factor >= 2 else f"{factor:.1f}x"
    return f"{amount} {'faster' if ratio < 1 else 'slower'}"


def compared(saved: TrialRecord, measured: Measurement, *, seconds: float) -> ReuseCheck:
    """``measured``, the check of ``saved``'s setting, against ``saved``."""
    assert saved.samples_per_second is not None
    if measured.too_short:
        band = _TOO_SHORT_BAND
    else:
        errors = (saved.relative_error or 0.0) + measured.relative_error
        band = min(_MOST_BAND, max(_LEAST_BAND, errors))
    return ReuseCheck(
        then=saved.samples_per_second,
        now=measured.samples_per_second,
        band=band,
        load_then=saved.load_seconds or 0.0,
        load_now=measured.load_seconds,
        step_then=saved.step_seconds or 0.0,
        step_now=measured.step_seconds,
        seconds=seconds,
        delivered=measured.batches > 0 or measured.samples_per_second > 0,
        first_then=saved.time_to_first_batch or 0.0,
        first_now=measured.time_to_first_batch,
        past_burst=not measured.only_queued,
    )


def saved_trial(result: TuneResult) -> TrialRecord | None:
    """The saved trial of ``result``'s setting that a check compares with: the latest
    complete one with a rate, or ``None`` (nothing to compare with)."""
    chosen = result.chosen_trial
    if chosen is None or not chosen.samples_per_second:
        return None
    return chosen


def decided(saved: TrialRecord, window: int, measured: Measurement) -> bool:
    """Whether the check can stop at this timing window: its wait for data known well
    enough to be within its band, or beyond it; never while every batch it timed was
    queued as its workers started (``NOTE [ A reused setting checked ]``)."""
    if window < 2 or not math.isfinite(measured.relative_error):
        return False
    if measured.only_queued:
        return False
    check = compared(saved, measured, seconds=0.0)
    margin = check.band * (check.load_then + check.step_then) - (check.load_now - check.load_then)
    return abs(margin) > measured.relative_error * (check.load_now + check.step_now)


def check_seconds(budget: float, saved: TrialRecord) -> float:
    """Seconds ``tune()``'s check of ``saved``'s setting may take: its share of the
    budget, or what the setting needs unchanged where that is longer: its start-up twice
    over, and its start-up burst and two windows' batches at its pace (``NOTE [ A reused
    setting checked ]``)."""
    batches = measurable_batches(saved.params, _WINDOWS)
    needed = _START_UPS * (saved.time_to_first_batch or 0.0) + batches * _batch_seconds(saved)
    return max(_SHARE * budget, needed, _LEAST_SECONDS)


def _batch_seconds(saved: TrialRecord) -> float:
    """Seconds a batch took the loop in ``saved``: its wait for data and its step."""
    return (saved.load_seconds or 0.0) + (saved.step_seconds or 0.0)


def checked(result: TuneResult, runner: Runner, *, budget: float, path: Path) -> TuneResult | None:
    """``result``, reused from ``path``, once the loop of the defaults found loading and
    the step as when tuned (``NOTE [ The defaults' loop first ]``), or else one short
    trial of its setting found the loop waiting for data within its band, or slower only
    beside other processes on the CPUs, its notes saying so; ``None`` where it did not,
    or failed: then the run tunes again, and a warning says why (``NOTE [ A reused
    setting checked ]``)."""
    saved = saved_trial(result)
    if saved is None:
        _logger.info("reusing %s unchecked: it keeps no measurement of its setting", path)
        return result
    probe = _defaults_probe(result, runner, budget=budget, path=path)
    if probe is not None and probe.holds:
        _logger.info("%s: %s", path, probe.note())
        return dataclasses.replace(result, notes=(*result.notes, probe.note()))
    seconds = check_seconds(budget, saved)
    workers = int(result.params.get("num_workers") or 0)
    deadlines = _check_deadlines(seconds, saved, workers=workers)
    cpus = _CpuUse()
    try:
        measured = runner.measure(
            result.params,
            max_seconds=seconds,
            on_window=lambda window, estimate: decided(saved, window, estimate),
            deadlines=deadlines,
        )
    except (TrialError, MemoryBudgetExceeded) as error:
        _logger.warning(
            "not reusing %s: its setting failed when checked (%s). Tuning again; the file "
            "will be replaced.",
            path,
            error,
        )
        return None
    check = compared(saved, measured, seconds=measured.duration)
    free, needed = cpus.free(), _needed_cpus(cpus, workers)
    busy = probe is not None and probe.unchanged and not probe.cpus_free
    if not check.holds and busy and not _free_enough(free, needed):
        note = _beside_others(check, free, needed, probed=True)
        _logger.warning("%s: %s", path, note)
        return dataclasses.replace(result, notes=(*result.notes, note))
    if not _told(check, path, who=""):
        return None
    return dataclasses.replace(result, notes=(*result.notes, check.note()))


def _beside_others(check: ReuseCheck, free: float, needed: float, *, probed: bool) -> str:
    """A check slower beside other processes (``NOTE [ A reused setting checked ]``),
    for the warning and the result's notes; ``probed``: the defaults' loop found loading
    and the step as when tuned."""
    why = "a busy machine, not a changed pipeline"
    if probed:
        why = f"and the defaults' loop found loading and the step as when tuned: {why}"
    return (
        f"reused unconfirmed: its check found {check.moved()} ({check.now:,.0f} "
        f"samples/s, {check.then:,.0f} then), but {_taken(free, needed)}, {why}"
    )


def _needed_cpus(cpus: _CpuUse, workers: int) -> float:
    """The CPUs a setting of ``workers`` worker processes and its loop would use."""
    return min(float(cpus.usable), workers + 1.0)


def saved_baseline(result: TuneResult) -> TrialRecord | None:
    """The saved trial of the defaults (``num_workers=0``) that the probe compares with:
    the latest complete one with its wait for data and step, or ``None``."""
    found = [
        t
        for t in result.trials
        if t.phase == "baseline"
        and t.state == "complete"
        and not t.params.get("num_workers")
        and t.samples_per_second
        and t.load_seconds is not None
        and t.step_seconds is not None
    ]
    return found[-1] if found else None


def probe_length(budget: float, baseline: TrialRecord) -> tuple[float, int] | None:
    """Seconds the probe of the defaults' loop may run, and the batches it times
    (``NOTE [ The defaults' loop first ]``): ``_SHARE`` of the budget
    (``_LEAST_SECONDS`` at least), and as many batches at the saved baseline's pace as
    fit in ``_PROBE_FILL`` of it after the first batch (its saved time to come, and a
    step); ``None`` where fewer than ``_PROBE_TIMED`` fit."""
    seconds, batch = max(_SHARE * budget, _LEAST_SECONDS), _batch_seconds(baseline)
    first = (baseline.time_to_first_batch or 0.0) + (baseline.step_seconds or 0.0)
    left = _PROBE_FILL * seconds - first
    timed = math.floor(left / batch) if batch > 0 else _PROBE_TIMED
    return (seconds, timed) if timed >= _PROBE_TIMED else None


@dataclass(frozen=True, slots=True)
class DefaultsProbe:
    """The defaults' loop timed now, against the saved baseline trial (``NOTE [ The
    defaults' loop first ]``).

    Attributes:
        check: the loop's wait for data and step, now and when tuned.
        measured_well: whether the probe timed ``_PROBE_TIMED`` batches or more (a
            probe of fewer than two windows is allowed ``_TOO_SHORT_BAND``, as the
            setting's check is).
        free_cpus: CPUs no other process used meanwhile, and ``needed_cpus``: those the
            setting's workers and loop would use.
    """

    check: ReuseCheck
    measured_well: bool
    free_cpus: float
    needed_cpus: float

    @property
    def holds(self) -> bool:
        """Whether loading and the step are as when tuned, and the CPUs free."""
        return self.unchanged and self.cpus_free

    @property
    def unchanged(self) -> bool:
        """Whether loading and the step are as when tuned, whoever used the CPUs."""
        check = self.check
        batch = check.load_then + check.step_then
        faster = check.step_then - check.step_now
        return self.measured_well and check.holds and faster <= check.band * batch

    @property
    def cpus_free(self) -> bool:
        """Whether the CPUs the setting would use were free, but for ``_CPU_SLACK``."""
        return _free_enough(self.free_cpus, self.needed_cpus)

    def why_not(self) -> str:
        """Why the probe does not hold, in words."""
        if not self.measured_well:
            return "too short to tell"
        if not self.cpus_free:
            return _taken(self.free_cpus, self.needed_cpus)
        return self.check.moved()

    def note(self) -> str:
        """The probe, for the result's notes."""
        check = self.check
        return (
            f"checked before reuse by the defaults' loop (num_workers=0): {check.now:,.0f} "
            f"samples/s in {format_seconds(check.seconds)}, {check.then:,.0f} when tuned; "
            f"loading {format_seconds(check.load_now)} a batch "
            f"({format_seconds(check.load_then)} when tuned), the step "
            f"{format_seconds(check.step_now)} ({format_seconds(check.step_then)}): reused"
        )


def _check_deadlines(seconds: float, saved: TrialRecord, *, workers: int) -> Deadlines:
    """The hang deadlines of a check ``seconds`` long of ``saved``'s setting (or the
    defaults' loop against it): _HUNG times its batch, _LEAST_HUNG seconds at least,
    never less than the check; its first step may be the process's first call of
    step_fn (NOTE [ The first step ])."""
    hung = max(seconds, _LEAST_HUNG, _HUNG * _batch_seconds(saved))
    return Deadlines.per_batch(hung, workers=workers, first_step=max(hung, FIRST_STEP_TIMEOUT))


def _defaults_probe(
    result: TuneResult, runner: Runner, *, budget: float, path: Path
) -> DefaultsProbe | None:
    """The defaults' loop timed now against the saved baseline trial (``NOTE [ The
    defaults' loop first ]``), the log saying why where it does not hold; ``None``
    where it was not timed, or failed: the setting's own check decides."""
    baseline = saved_baseline(result)
    length = None if baseline is None else probe_length(budget, baseline)
    if baseline is None or length is None:
        return None
    seconds, timed = length
    cpus = _CpuUse()
    try:
        measured = runner.measure(
            baseline.params,
            max_seconds=seconds,
            on_window=lambda window, estimate: decided(baseline, window, estimate),
            # The search's hang deadlines, as the setting's check: a batch (its step
            # included) cut short by the probe's own length would be the user's step
            # interrupted.
            deadlines=_check_deadlines(seconds, baseline, workers=0),
            max_batches=timed,
        )
    except (TrialError, MemoryBudgetExceeded) as error:
        _logger.info(
            "%s: the defaults' loop does not settle the check (it failed: %s): checking "
            "the setting",
            path,
            error,
        )
        return None
    workers = int(result.params.get("num_workers") or 0)
    probe = DefaultsProbe(
        compared(baseline, measured, seconds=measured.duration),
        measured_well=measured.batches >= _PROBE_TIMED and measured.samples_per_second > 0,
        free_cpus=cpus.free(),
        needed_cpus=_needed_cpus(cpus, workers),
    )
    if not probe.holds:
        _logger.info(
            "%s: the defaults' loop does not settle the check (%s): checking the setting",
            path,
            probe.why_not(),
        )
    return probe


class _CpuUse:
    """CPU time used by other processes than this one and its children, from here to
    :meth:`free`, read from the machine's and this process's counters."""

    def __init__(self, workers: Callable[[], Iterable[int]] = tuple) -> None:
        self.usable = usable_cpus()  # its affinity, capped by the cgroup's quota
        self.workers = workers  # the loop's worker processes, their CPU time its own
        self.started = time.perf_counter()
        self.machine = _busy_seconds()
        self.own = _own_seconds(workers())

    def free(self) -> float:
        """CPUs no other process used since this was made, on average (never below 0)."""
        wall = time.perf_counter() - self.started
        if wall <= 0:
            return float(self.usable)
        machine = _busy_seconds() - self.machine
        own = _own_seconds(self.workers()) - self.own
        others = max(0.0, machine - own) / wall
        total = float(psutil.cpu_count() or self.usable)
        return max(0.0, min(float(self.usable), total - others))


def _free_enough(free: float, needed: float) -> bool:
    """Whether ``free`` CPUs leave the ``needed`` ones free, but for ``_CPU_SLACK``."""
    return free >= needed - _CPU_SLACK


def _explains(free: float, needed: float, check: ReuseCheck) -> bool:
    """Whether others holding all but ``free`` (``_CPU_SLACK`` at least) of the ``needed``
    CPUs account for ``check``'s rate: slower than when tuned, by needed / free at most."""
    taken = not _free_enough(free, needed)
    return taken and check.now * needed >= check.then * max(free, _CPU_SLACK)


def _taken(free: float, needed: float) -> str:
    """Other processes' use of the CPUs, in words."""
    return f"other processes used the CPUs meanwhile ({free:.1f} of {needed:.0f} needed free)"


def _busy_seconds() -> float:
    """Seconds the machine's CPUs spent on anything but idling, a hypervisor's stolen
    time included (as ``psutil.cpu_percent`` counts them; on Linux a guest's time is
    in ``user`` already)."""
    times = psutil.cpu_times()
    idle = sum(getattr(times, name, 0.0) for name in ("idle", "iowait", "guest", "guest_nice"))
    return float(sum(times) - idle)


def _own_seconds(workers: Iterable[int]) -> float:
    """CPU seconds of this process, its reaped children, and the loop's live ``workers``."""
    times = psutil.Process().cpu_times()
    total = times.user + times.system + times.children_user + times.children_system
    for pid in workers:
        try:
            running = psutil.Process(pid).cpu_times()
        except psutil.Error:  # ended meanwhile: its time is in children_* once reaped
            continue
        total += running.user + running.system
    return float(total)


def _told(check: ReuseCheck, path: Path, *, who: str) -> bool:
    """Whether the setting reused from ``path`` holds, said in the log (``who``: the
    log line's opening)."""
    if check.holds:
        _logger.info("%s%s: %s", who, path, check.note())
        return True
    _logger.warning(
        "%snot reusing %s: %s (%.0f samples/s now, %.0f when tuned): re-tuning; the file "
        "will be replaced.",
        who,
        path,
        check.moved(),
        check.now,
        check.then,
    )
    return False
