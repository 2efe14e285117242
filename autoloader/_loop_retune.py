"""AutoLoader's tuning searched again once TUNED, where loading drifted (``NOTE [ Drift
]``, in ``_drift.py``): the watch and the searches it starts (:class:`Retuning`), and
such a search's end, where the setting chosen before may be kept (:func:`faster_of`).
"""

from __future__ import annotations

import dataclasses
import logging

from autoloader._drift import DriftWatch, research_budget, watch
from autoloader._loop_search import describe_params
from autoloader._problem import Problem
from autoloader._reuse import study_beside
from autoloader.checks import world
from autoloader.loader import Params, normalize_params
from autoloader.results import TuneResult

_logger = logging.getLogger("autoloader")


class Retuning:
    """The searches loading's drift starts once a tuning is TUNED (``NOTE [ Drift ]``):
    the watch of the chosen setting's wait for data (:attr:`drift`), the searches it
    started (:attr:`researches`), and, while one runs, the problem as given
    (:attr:`home`) and what started it. The tuning (``LoopTuning``) calls :meth:`taken`
    where it takes a result, and :meth:`start` where the watch says loading drifted.

    Args:
        retune: watch at all (``AutoLoader(retune=...)``).
    """

    def __init__(self, *, retune: bool) -> None:
        self.retune = retune
        self.drift: DriftWatch | None = None
        self.researches = 0
        self.home: Problem | None = None  # while a search drift started runs
        # While a search drift started runs: the watch that started it, and the result
        # it may keep.
        self.drifted: tuple[DriftWatch, TuneResult] | None = None
        self._off_said = False  # under torchrun, that it is not watched

    def start(self, problem: Problem, chosen: Params, result: TuneResult) -> Problem:
        """The ``chosen`` setting's wait for data drifted: the problem of the search it
        starts, ``problem`` with a share of its budget, in a study of its own (the old
        world's trials, kept beside its ``path``, deleted); and say why (WARNING).
        ``result``, the one it chose, is kept where it loads as fast as the best found."""
        drift, self.drift = self.drift, None
        assert drift is not None
        self.drifted = (drift, result)
        self.researches += 1
        budget = research_budget(problem.budget)
        _logger.warning(
            "AutoLoader: loading drifted: %s: searching again for up to %s (%s was chosen; "
            "search %d of at most %d)",
            drift.why(),
            f"{budget:g} s",
            describe_params(chosen),
            self.researches,
            drift.most,
        )
        if problem.path is not None:
            study_beside(problem.path).unlink(missing_ok=True)  # the old world's trials
        self.home = problem
        keeping_up = drift.keeping_up(chosen)
        first = () if keeping_up is None else (keeping_up,)
        return dataclasses.replace(problem, budget=budget, storage=None, first=first)

    def taken(self, result: TuneResult, problem: Problem) -> tuple[TuneResult, Problem]:
        """The tuning takes ``result`` (searched, read, or a checkpoint's) while it has
        ``problem``: the result to train with and the problem from here on, the problem
        as given where a search drift started ended (and the setting chosen before kept
        where it loads as fast: :func:`faster_of`); the setting's watch set."""
        drifted, self.drifted = self.drifted, None
        if self.home is not None:  # a search drift started ended
            problem, self.home = self.home, None
            if drifted is not None:
                result = faster_of(result, *drifted, problem=problem)
        self.drift = self._watch(result, drifted, budget=problem.budget)
        return result, problem

    def _watch(
        self, result: TuneResult, drifted: tuple[DriftWatch, TuneResult] | None, *, budget: float
    ) -> DriftWatch | None:
        """The watch of ``result``'s setting, just taken: from its trial, or where a
        search drift started kept it, from the windows that started it; ``None`` with
        ``retune=False``, under torchrun (said once), or where no more searches may
        start."""
        if not self.retune:
            return None
        if world()[1] > 1:
            if not self._off_said:
                self._off_said = True
                _logger.info(
                    "AutoLoader: under torchrun, loading is not watched for drift once "
                    "tuned: the setting chosen stays for the run"
                )
            return None
        if drifted is not None and result is drifted[1]:  # kept: drift from here on
            more = self.researches < DriftWatch.most
            return drifted[0].now(time_budget=budget) if more else None
        return watch(result, time_budget=budget, researches=self.researches)


def faster_of(
    found: TuneResult, drift: DriftWatch, kept: TuneResult, *, problem: Problem
) -> TuneResult:
    """``found`` by the search ``drift`` started, or ``kept``, the result it chose
    before, where its setting loads as fast now as the best found (``NOTE [ Drift
    ]``): then saved back at ``problem``'s ``path``, and said."""
    rate = drift.rate(problem.batch_size)
    best = found.chosen_trial
    if best is None or best.samples_per_second is None or best.samples_per_second > rate:
        return found
    _logger.warning(
        "AutoLoader: searched again: the best found, %s at %.0f samples/s, is no faster "
        "than %s now (%.0f samples/s): kept",
        describe_params(normalize_params(found.params)),
        best.samples_per_second,
        describe_params(normalize_params(kept.params)),
        rate,
    )
    path = problem.path
    if path is not None:
        try:
            kept.save(path)
        except OSError as error:
            _logger.warning("AutoLoader: could not save the result kept to %s: %s", path, error)
    return kept
