"""Timing one setting safely: one trial's loop, watched for memory, hangs and dead workers.

Modules, from the top down, one job each::

    _isolation     SubprocessRunner: each trial in a fresh process of its own
    _trial_processes  how those processes start: forked from a helper, or spawned
    _runner        TrialRunner: builds a setting's loader and times it under guard
    _live          LiveTrial: a trial timed by the user's own training loop (AutoLoader's)
    _timing_loop   TimingLoop: one trial's loop that calls the step (checkpoints, epochs)
    _clock         TrialClock: the rules both loops follow (warm-up, windows, pace,
                   the memory horizon of an overdue batch)
    _batches       samples in a batch, its bytes, batches in an epoch
    _supervision   the trial's worker processes: their deaths, shutdown and reaping
    _lockstep      Checkpoint, Lockstep: the processes of a joint trial decide together
    _memory        the memory budget, and the watch that stops a trial passing it
    _deadlines     Deadlines, and the alarm that breaks a batch that overruns them
    _measurement   Measurement: what one trial measured
    _cpu_demand    CPU time plus the time runnable but waiting for a CPU (run delay)
    _errors        TrialError: what failed and where (the user's frame where a timeout
                   found it stuck), sendable between processes
    _device        the device batches go to, and the accelerator on this machine
    _pickling      which part of an object does not pickle, and why
    _units         bytes and seconds, parsed and shown
"""

from autoloader.measure._clock import measurable_batches
from autoloader.measure._cpu_demand import ChildrenRunDelay
from autoloader.measure._deadlines import (
    FIRST_STEP_STAGE,
    FIRST_STEP_TIMEOUT,
    STARTUP_PER_WORKER,
    Deadlines,
    TrialTimeout,
    time_limit,
)
from autoloader.measure._device import accelerator, resolve_device
from autoloader.measure._errors import (
    TrialError,
    TrialProcessDied,
    describe_error,
    exception_chain,
)
from autoloader.measure._isolation import SubprocessRunner
from autoloader.measure._live import MIN_WINDOWS, LiveTrial, TrialEnded
from autoloader.measure._lockstep import Checkpoint, Lockstep, PeerFailed
from autoloader.measure._measurement import Measurement, WindowCallback
from autoloader.measure._memory import (
    DEFAULT_BUDGET_SHARE,
    MemoryBudgetExceeded,
    available_memory,
    default_memory_budget,
    is_oom_error,
    resolve_memory_budget,
    total_memory,
)
from autoloader.measure._pickling import _dumps, describe_unpicklable
from autoloader.measure._process_memory import tree_memory
from autoloader.measure._runner import Runner, TrialRunner
from autoloader.measure._supervision import release
from autoloader.measure._units import format_bytes, format_seconds, parse_bytes

__all__ = [
    "DEFAULT_BUDGET_SHARE",
    "FIRST_STEP_STAGE",
    "FIRST_STEP_TIMEOUT",
    "MIN_WINDOWS",
    "STARTUP_PER_WORKER",
    "Checkpoint",
    "ChildrenRunDelay",
    "Deadlines",
    "LiveTrial",
    "Lockstep",
    "Measurement",
    "MemoryBudgetExceeded",
    "PeerFailed",
    "Runner",
    "SubprocessRunner",
    "TrialEnded",
    "TrialError",
    "TrialProcessDied",
    "TrialRunner",
    "TrialTimeout",
    "WindowCallback",
    "_dumps",
    "accelerator",
    "available_memory",
    "default_memory_budget",
    "describe_error",
    "describe_unpicklable",
    "exception_chain",
    "format_bytes",
    "format_seconds",
    "is_oom_error",
    "measurable_batches",
    "parse_bytes",
    "release",
    "resolve_device",
    "resolve_memory_budget",
    "time_limit",
    "total_memory",
    "tree_memory",
]
