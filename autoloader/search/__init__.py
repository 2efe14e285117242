"""The search: a pure policy that decides, a driver that runs its trials by ask and tell.

Layers, each importing only those below it::

    _driver          Driver: the loop; the one place an outcome is mapped to a study state
    _study           the study's storage and its name: which problem it keeps trials of
    _lease           who tunes a study now: the live run's lease, its heartbeat thread
    _policy          Policy: every rule, pure functions of the finished trials
    _choice          the final choice among the complete trials (Choice)
    _hang_deadlines  how long a batch or a worker's start may take (HangRules)
    _known_failures  what failed trials tell of settings not yet run; the failure boundary
    _objective       what a trial is worth (the epoch model) and how long it may measure
    _cost_model      a first guess at the worker count, from the baseline
    _faults          classify(): what a failed trial's error means
    _space           SearchSpace: the settings searched, resolved for this machine
    _outcome         TrialSpec, Trial and the typed outcomes Completed | Pruned | Failed
    _reasons         why the search stopped, and notes for the user, typed; render()
"""

from autoloader.search._choice import Choice
from autoloader.search._driver import Driver, Proposal
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
)
from autoloader.search._policy import Plan, Policy, Stop

__all__ = [
    "Choice",
    "Completed",
    "Driver",
    "Failed",
    "FaultKind",
    "Outcome",
    "Phase",
    "Plan",
    "Policy",
    "Proposal",
    "PruneKind",
    "Pruned",
    "Stop",
    "Trial",
    "TrialSpec",
]
