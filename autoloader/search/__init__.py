"""The search: a pure policy that decides, a driver that runs its trials by ask and tell.

Layers, each importing only those below it::

    _driver          Driver: the loop; the one place an outcome is mapped to a study state
    _study           the study's storage and its name: which problem it keeps trials of
    _lease           who tunes a study now: the live run's lease, its heartbeat thread
    _policy          Policy: every rule, pure functions of the finished trials
    _patience        when the search has seen enough (patience)
    _choice          the final choice among the complete trials (Choice)
    _hang_deadlines  how long a batch or a worker's start may take (HangRules)
    _known_failures  what failed trials tell of settings not yet run; the failure boundary
    _objective       what a trial is worth (the epoch model) and how long it may measure
    _cost_model      a first guess at the worker count, from the baseline
    _faults          classify(): what a failed trial's error means; baseline_advice()
    _space           SearchSpace: the settings searched, resolved for this machine
    _setting_rules   what each tuned setting may hold (SETTING_RULES), one definition
    _outcome         TrialSpec, Trial and the typed outcomes Completed | Pruned | Failed
    _reasons         why the search stopped, and notes for the user, typed; render()
    _code            the fingerprint of the dataset's and the step's code
"""

from autoloader.search._choice import Choice
from autoloader.search._code import NOT_FINGERPRINTED, dataset_code, step_code
from autoloader.search._cost_model import (
    CPU_BOUND_SHARE,
    STEP_BOUND_WAIT,
    STEP_ON_CPU,
    cpu_bound_seconds,
    step_competes_with_workers,
)
from autoloader.search._driver import (
    Driver,
    Interruption,
    Proposal,
    Terminated,
    quiet_optuna,
    remember_ctrl_c,
)
from autoloader.search._objective import trial_seconds
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
    state_of,
)
from autoloader.search._policy import Plan, Policy, Stop
from autoloader.search._reasons import (
    BudgetGivenBack,
    Interrupted,
    Note,
    Resumed,
    SpaceNote,
    TunedJointly,
    render,
)
from autoloader.search._setting_rules import SETTING_RULES, Rule
from autoloader.search._space import (
    SearchSpace,
    Startup,
    check_search_space,
    default_max_workers,
    resolve_space,
    without_batched_fetch,
)
from autoloader.search._study import ProblemIdentity, open_storage, study_name

__all__ = [
    "CPU_BOUND_SHARE",
    "NOT_FINGERPRINTED",
    "SETTING_RULES",
    "STEP_BOUND_WAIT",
    "STEP_ON_CPU",
    "BudgetGivenBack",
    "Choice",
    "Completed",
    "Driver",
    "Failed",
    "FaultKind",
    "Interrupted",
    "Interruption",
    "Note",
    "Outcome",
    "Phase",
    "Plan",
    "Policy",
    "ProblemIdentity",
    "Proposal",
    "PruneKind",
    "Pruned",
    "Resumed",
    "Rule",
    "SearchSpace",
    "SpaceNote",
    "Startup",
    "Stop",
    "Terminated",
    "Trial",
    "TrialSpec",
    "TunedJointly",
    "check_search_space",
    "cpu_bound_seconds",
    "dataset_code",
    "default_max_workers",
    "open_storage",
    "quiet_optuna",
    "remember_ctrl_c",
    "render",
    "resolve_space",
    "state_of",
    "step_code",
    "step_competes_with_workers",
    "study_name",
    "trial_seconds",
    "without_batched_fetch",
]
