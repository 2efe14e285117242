"""What is checked before any trial: the arguments, the dataset's facts, the machine.

Modules::

    _validation     tune()'s arguments, refused with a clear error before any work
    _facts          the checks before the search (repeated randomness, thread safety,
                    worker start-up...) and the facts the report's advice rests on
    _copy_on_read   the probe of how much of the dataset a forked worker copies by
                    reading it
    _batched_fetch  whether the dataset can be fetched a whole batch at a time
    _forked         a check run in a forked process, killed at its time: one that
                    blocks forever leaves nothing blocked here
    _environment    the machine (CPUs, memory, torch, accelerator, ranks), and how
                    another machine differs from it
"""

from autoloader.checks._copy_on_read import copied_per_worker
from autoloader.checks._environment import Environment, affinity, usable_cpus, world, world_nodes
from autoloader.checks._facts import Checks, checks_seconds
from autoloader.checks._validation import (
    ISOLATIONS,
    Isolation,
    check_batch_size,
    check_dataset,
    check_isolation,
    check_loader_kwargs,
    check_n_trials,
    check_picklable,
    check_seconds,
    check_step_fn,
    count_batches,
    env_int,
    unpicklable,
)
from autoloader.loader import start_method

__all__ = [
    "ISOLATIONS",
    "Checks",
    "Environment",
    "Isolation",
    "affinity",
    "check_batch_size",
    "check_dataset",
    "check_isolation",
    "check_loader_kwargs",
    "check_n_trials",
    "check_picklable",
    "check_seconds",
    "check_step_fn",
    "checks_seconds",
    "copied_per_worker",
    "count_batches",
    "env_int",
    "start_method",
    "unpicklable",
    "usable_cpus",
    "world",
    "world_nodes",
]
