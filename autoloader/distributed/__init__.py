"""Tuning every rank of a torchrun job together.

Modules::

    _joint   JointRunner: rank 0's search measures each setting on every rank at once
    _ranks   Ranks: who the ranks are, and how they agree on arguments and outcomes

The lockstep the ranks' loops keep within a trial is measure/_lockstep.py: a trial's
loop takes its decisions there, whether one process measures or many.
"""

from autoloader.distributed._joint import (
    JointRunner,
    agree_on_arguments,
    follow,
    job_outcome,
    node_memory_budget,
    spare_batch,
)
from autoloader.distributed._ranks import Ranks

__all__ = [
    "JointRunner",
    "Ranks",
    "agree_on_arguments",
    "follow",
    "job_outcome",
    "node_memory_budget",
    "spare_batch",
]
