"""When the search has seen enough: patience (``NOTE [ Enough searching ]``)."""

from __future__ import annotations

from collections.abc import Sequence

from autoloader.search._choice import TIE_TOLERANCE
from autoloader.search._outcome import Trial

# NOTE [ Enough searching ]
# Once the starting points (the cost model's guesses and the ladder) are measured, the
# search stops when PATIENCE measured trials in a row (settings skipped as known to
# fail do not count) found nothing more than TIE_TOLERANCE better than the best
# before them: the sampler is circling a plateau, and the time is better spent on the
# runoff, or given back. A loop that is bound by its step reaches such a plateau
# quickly: nothing beats the step.
# A search in training (AutoLoader's) counts the starting points too, and is patient for
# TRAINING_PATIENCE trials: there each search trial runs the user's training at its
# setting's pace, the switch to it stalls the loop while its workers start, and the
# sampler's first proposals are drawn at random from the whole space. The starting
# points are the cost model's neighbourhood of the best guess; where three of them in
# a row are no better than the best before them, that is a plateau already. On the
# development VM's images pipeline (JPEG decoding on 2 cores, a 20 s budget) the
# sampler's two proposals after such a plateau (9 workers with prefetch 5, 16 threads)
# cost 2.4 s of training, more than a third of what the whole first run lost to tuning,
# and were pruned as slower; the time went to the runoff instead. A gain there is one
# beyond the trial's own measurement error too (as a tie is in the final choice, NOTE
# [ A tie within the best's error ]): there 4 workers measured 3% over 2 workers at
# +-5%, reset the patience, and the sampler's proposals ran after all.
PATIENCE = 6
TRAINING_PATIENCE = 3


def patience(*, in_training: bool) -> int:
    """Measured search trials in a row without gain after which the search stops."""
    return TRAINING_PATIENCE if in_training else PATIENCE


def searched_enough(measured: Sequence[Trial], *, starting_points: int, in_training: bool) -> bool:
    """Whether the last :func:`patience` of the ``measured`` search trials (settings
    skipped as known to fail left out) found nothing better than the best before them,
    the ``starting_points`` being measured, or counted among them in training (see
    ``NOTE [ Enough searching ]``)."""
    trials = patience(in_training=in_training)
    needed = max(starting_points, trials + 1) if in_training else starting_points + trials
    if len(measured) < needed:
        return False
    before, recent = measured[:-trials], measured[-trials:]
    best_before = max((t.value for t in before if t.value is not None), default=None)
    if best_before is None:
        return False
    return not any(
        trial.value is not None and trial.value > (1 + _gain_band(trial, in_training)) * best_before
        for trial in recent
    )


def _gain_band(trial: Trial, in_training: bool) -> float:
    """How much better than the best a trial must be to count as a gain: TIE_TOLERANCE,
    or in training the trial's own measurement error where that is wider (``NOTE [
    Enough searching ]``)."""
    measurement = trial.measurement
    if not in_training or measurement is None:
        return TIE_TOLERANCE
    return max(TIE_TOLERANCE, measurement.relative_error)
