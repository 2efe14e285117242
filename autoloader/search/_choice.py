"""The final choice: the settings a run returns, from every complete trial."""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from autoloader._exceptions import BaselineError
from autoloader.loader import BASELINE_PARAMS, Params
from autoloader.measure import Measurement
from autoloader.search._known_failures import params_key
from autoloader.search._outcome import Completed, Trial

# Candidates whose median value is within this fraction of the best are ties; the
# cheapest of them (fewest workers, then smallest prefetch) is chosen. The band widens
# to the best's own error where that is larger (NOTE [ A tie within the best's error ]).
TIE_TOLERANCE = 0.02
# NOTE [ A tie within the best's error ]
# The best score is a measurement, with a 95% error of its own. A candidate scoring
# within that error of it cannot be told from it, and it is a tie: the cheapest of the
# ties wins. Without this, a setting measured once, in a trial that ended before its
# rate settled, won on a lucky sample where the runoff had no time to measure it
# again: on the development VM's images pipeline (JPEG decoding on 2 cores), 16
# workers scored 1,162 samples/s at +-20% against 2 workers' 1,091 at +-5% and were
# chosen; in a 33-epoch run of benchmarks/autoloader_training.py such a choice trained
# at 740 samples/s, 2 workers at 974. The error is the median of the best's trials'
# errors, over the square root of their number (a median of repeated measurements errs
# less); a trial's error is its value's, the epoch's rate, where the epoch's start-up
# takes a share of its time that the steady rate's error does not touch (_error). The
# band is held to _MOST_TIE_BAND: a lead of a quarter or more is taken as
# real however short the trials were. Held to half, it gave the defaults a tie in a
# Lightning DDP fit with a 4 s budget (tests/test_autoloader_lightning.py): 3 workers
# scored 312 samples/s at +-37% in a 0.8 s trial, the defaults 211 at +-13% while
# waiting 75% of the time for data, and the defaults, the cheapest, were chosen.
_MOST_TIE_BAND = 0.25


@dataclass(frozen=True, slots=True)
class Choice:
    """The chosen settings and what they measured: medians over their complete trials.

    Attributes:
        params: the chosen settings.
        throughput: the objective the choice ranks by: samples/s over a training epoch
            with ``params``, worker start-up included (``NOTE [ Epoch model ]``).
        baseline: the same for the ``num_workers=0`` defaults; 0.0 if not measured.
        steady_throughput: samples/s with ``params`` once started (start-up excluded).
        steady_baseline: the same for the defaults; 0.0 if not measured.
        startup_seconds: seconds to start ``params``'s workers and get the first
            batch: without persistent workers, what each epoch pays (a measured epoch
            restart where there is one, else the time to first batch, as the epoch
            model charges it); with them, the time to first batch, paid once.
        startup_each_epoch: whether ``startup_seconds`` is paid every epoch (workers
            not persistent: the epoch rate includes it) or once per training run
            (persistent workers: the epoch rate leaves it out, and charges each epoch
            only a refill).
    """

    params: Params
    throughput: float
    baseline: float
    steady_throughput: float
    steady_baseline: float
    startup_seconds: float
    startup_each_epoch: bool


def choose(history: Sequence[Trial]) -> Choice:
    """The settings to return, from every complete trial of the study.

    Each setting is scored by the median of its values (a heavy-tailed sample moves a
    median of three little). Only the baseline and settings measured as often as the
    best-measured ones (the baseline's repeats aside) may be the best (at most twice is
    asked: the runoff's candidates are measured in the search and then in each round,
    interleaved), so a setting measured once cannot beat repeated, side-by-side
    measurements with one lucky sample. Among every setting within ``TIE_TOLERANCE`` of
    the best's score, or within the best's own error where that is larger (``NOTE [ A
    tie within the best's error ]``), the cheapest wins: more workers or prefetch only
    cost memory and start-up. A cheaper setting measured once may tie: a runoff with the time to
    measure only its first candidate again would otherwise choose it over every
    setting within its error.

    The figures returned are medians over the same trials: the objective's values
    (those the choice ranks by, see ``NOTE [ Epoch model ]``), the steady rates and
    the start-up, of the chosen setting and of the baseline.

    Raises:
        BaselineError: no trial completed, the baseline's included (the baseline
            always completes, or the run stops with this error before a choice).
    """
    groups = values_by_setting(history)
    if not groups:
        raise BaselineError(
            "No trial completed, not even the baseline (num_workers=0): there is no "
            "setting to choose, and nothing to compare one with. Tune again; the "
            "baseline's failure, if any, says what to fix."
        )
    baseline_key = params_key(BASELINE_PARAMS)
    # The baseline's own repeats do not count: a runoff whose every candidate's repeat
    # failed or ran too short measured the baseline twice and nothing else, and chose
    # it over a setting measured once at 7.6x (the tutorial on a 10 s budget, in CI).
    most = max((len(v) for k, (_, v) in groups.items() if k != baseline_key), default=1)
    scores = {key: statistics.median(values) for key, (_, values) in groups.items()}
    eligible = [k for k, (_, v) in groups.items() if len(v) >= min(2, most) or k == baseline_key]
    best = max(eligible, key=scores.__getitem__)
    band = min(_MOST_TIE_BAND, max(TIE_TOLERANCE, _error(*groups[best])))
    ties = [key for key, score in scores.items() if score >= (1 - band) * scores[best]]
    chosen = min(ties, key=lambda key: _cost(json.loads(key)))
    params = json.loads(chosen)
    measurements = groups[chosen][0]
    baseline_measurements, baseline_values = groups.get(baseline_key, ([], []))
    startup, each_epoch = _startup(params, measurements)
    return Choice(
        params,
        throughput=float(scores[chosen]),
        baseline=float(statistics.median(baseline_values)) if baseline_values else 0.0,
        steady_throughput=_median_rate(measurements),
        steady_baseline=_median_rate(baseline_measurements),
        startup_seconds=startup,
        startup_each_epoch=each_epoch,
    )


def values_by_setting(trials: Sequence[Trial]) -> dict[str, tuple[list[Measurement], list[float]]]:
    """Complete trials grouped by their settings: their measurements and values."""
    groups: dict[str, tuple[list[Measurement], list[float]]] = {}
    for trial in trials:
        if isinstance(trial.outcome, Completed):
            measurements, values = groups.setdefault(params_key(trial.params), ([], []))
            measurements.append(trial.outcome.measurement)
            values.append(trial.outcome.value)
    return groups


def _cost(params: Mapping[str, Any]) -> tuple[int, int, int, bool, bool, bool]:
    """Fewest worker processes (each a copy of what it reads, and a start-up), then
    fewest threads, smallest prefetch, no pinning; then one indexing per batch (less
    CPU), then batches in order (reproducible)."""
    threads = params.get("worker_kind") == "threads"
    return (
        0 if threads else params["num_workers"],
        params["num_workers"] if threads else 0,
        params["prefetch_factor"] or 0,
        params["pin_memory"],
        not params.get("batched_fetch", False),
        not params.get("in_order", True),
    )


def _error(measurements: list[Measurement], values: list[float]) -> float:
    """The relative 95% error of the median of ``values``, the objective of each of
    ``measurements``: their median error over the square root of their number (``NOTE
    [ A tie within the best's error ]``); infinite where none has an error estimate.

    A measurement's error is its steady rate's, in the share of the epoch's time the
    steady batches take (``NOTE [ Epoch model ]``: the value over the steady rate); the
    epoch's start-up, a median of its own, is taken as known. With 12-batch epochs and 12
    workers the pipeline's refill took two thirds of each epoch, and the steady part's
    +-49% was +-17% of the epoch's rate.
    """
    errors = [
        m.relative_error * min(1.0, value / m.samples_per_second)
        for m, value in zip(measurements, values, strict=True)
        if math.isfinite(m.relative_error) and m.samples_per_second > 0
    ]
    if not errors:
        return math.inf
    return float(statistics.median(errors)) / math.sqrt(len(measurements))


def _median_rate(measurements: list[Measurement]) -> float:
    """Median steady samples/s, start-up excluded; 0.0 for no measurement."""
    if not measurements:
        return 0.0
    return float(statistics.median(m.samples_per_second for m in measurements))


def _startup(params: Mapping[str, Any], measurements: list[Measurement]) -> tuple[float, bool]:
    """Median seconds to start ``params``'s workers and get the first batch, and whether
    each epoch pays them, as ``NOTE [ Epoch model ]`` charges them: without persistent
    workers every epoch starts them again (a measured restart, else the time to first
    batch); with them only the first epoch does, and later ones refill the pipeline."""
    each_epoch = not params["persistent_workers"]
    seconds = [
        (m.epoch_restart_seconds or m.time_to_first_batch) if each_epoch else m.time_to_first_batch
        for m in measurements
    ]
    return float(statistics.median(seconds)), each_epoch
