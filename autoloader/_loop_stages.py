"""The stages of AutoLoader's tuning (``NOTE [ AutoLoader's tuning ]``), the machine
:class:`~autoloader._loop_tuning.LoopTuning` runs, drawn where its states are named.
"""

from __future__ import annotations

import enum

# NOTE [ AutoLoader's tuning ]
# The tuning is in one of four stages (Stage) and moves only where a trial starts or
# ends; each trial started is its stage's:
#
#              first batch                   the search ends (alone: the policy stops;
#   WAITING ─────────────────► SEARCHING ──── under torchrun: rank 0 says so) ───► TUNED
#      │                         │   ▲                                             │   ▲
#      │   a trial fails,        │   │ those batches loaded            the chosen  │   │ those
#      │   giving batches back   │   │ (under torchrun, then           setting     │   │ batches
#      │                         ▼   │ the trial's exchange)           fails       ▼   │ loaded
#      │                       MAKING_UP                                         MAKING_UP
#      │
#      └─── first batch: a saved result of this problem (_reuse.py), or a state
#           loaded from a checkpoint taken once tuned ────────────────────────────► TUNED
#                                                                                   │
#          SEARCHING ◄─── its first batches timed outside its band (_reuse_check.py) ┘
#          SEARCHING ◄─── loading drifted for a sustained stretch (_drift.py) ──────┘
#
# - WAITING: nothing measured yet; the first batch starts the run (Ranks.join, the
#   saved result, the checks before the search, the study); a state loaded from a
#   checkpoint taken while searching starts it with the trials finished then
#   (NOTE [ An AutoLoader's state ], in _loader_state.py).
# - SEARCHING: each trial is the search's (_loop_search.py, chosen here once): alone,
#   the driver's proposal, ended by its time or its windows' vote; under torchrun,
#   rank 0's proposal as a segment of batches, the same on every rank (NOTE [ Joint
#   segments ]).
# - MAKING_UP: the last good setting (the last that completed; the baseline at first)
#   loads, unmeasured, the batches a failed setting gave back (under torchrun, the rest
#   of its segment); then the stage it came from goes on. Where the last good setting
#   fails there too, the baseline takes its place (MAKING_UP again); where the baseline
#   fails, the error is the dataset's and reaches the loop, as DataLoader would raise it.
# - TUNED: the chosen setting loads every batch, its loader kept across epochs where
#   its workers persist. Where it fails, the last good other setting is chosen, the
#   baseline making up the batches it gave back. A setting reused from a file has its
#   first batches timed (NOTE [ A reused setting checked ]): outside their band, the
#   search starts from there, as at a first batch with no file. Once the chosen
#   setting serves, its wait for data is watched (NOTE [ Drift ]): where loading
#   drifted, a search of a share of the budget starts from there too.
# A trial of any stage but TUNED that the epoch ends in the middle of goes on in the
# next epoch (NOTE [ Live trials span epochs ], in measure/_live.py): the stages move
# where trials start and end, never at an epoch's end.


class Stage(enum.Enum):
    """Where AutoLoader's tuning stands (``NOTE [ AutoLoader's tuning ]``)."""

    WAITING = "waiting for the first batch"
    SEARCHING = "searching"
    MAKING_UP = "the last good setting loads batches given back"
    TUNED = "tuned"
