"""The search: a pure policy that decides, a driver that runs its trials by ask and tell.

Layers, each importing only those below it::

    _driver   Driver: the loop; the one place an outcome is mapped to a study state
    _policy   Policy: every rule, pure functions of the finished trials
    _faults   classify(): what a failed trial's error means
    _outcome  TrialSpec, Trial and the typed outcomes Completed | Pruned | Failed
"""

from autoloader.search._driver import Driver
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
from autoloader.search._policy import Choice, Plan, Policy, Stop

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
    "PruneKind",
    "Pruned",
    "Stop",
    "Trial",
    "TrialSpec",
]
