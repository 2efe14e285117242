"""How the processes measuring one setting together take the timing loop's decisions
at the same batch; alone, nothing is exchanged."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from autoloader.measure._measurement import Measurement

# NOTE [ Joint trials ]
# Under torchrun every rank measures the same setting at once (see distributed/_joint.py), and a
# step_fn that runs DDP collectives blocks until every rank has called it as often. So
# the ranks take every decision of the loop (warm-up over, a window closed, stop, time
# up, a failure) at the same batch: at checkpoints every few batches (as many as take
# about the spacing distributed/_joint.checkpoint_spacing sets from the cost of one
# all-reduce, the same count on every rank), where each says what it saw
# and all act on what any saw. A rank whose loader fails or hangs (found by its own
# deadline) does not leave the loop at once: it steps a spare batch (the last good one)
# until the next checkpoint, so that the others' collectives are matched, and there
# every rank abandons the trial together. A worker's death is reported at the next
# fetch, never in the middle of a step (whose collectives might be half done). A step
# waits in its collectives for the slowest rank's fetch: its deadline is a fetch's and
# a step's (TimingLoop._step_limit), or a rank starved of CPU would be blamed on the
# step of the rank waiting for it. Alone, every batch is a checkpoint and nothing is
# exchanged: the loop is what it always was.


@dataclass(frozen=True, slots=True)
class Checkpoint:
    """What one process measuring a setting saw since the last checkpoint; agreed, what
    any of the processes saw (for ``seconds``, the longest)."""

    time_up: bool = False  # the trial's time has run out
    warming: bool = False  # still in the warm-up
    not_ready: bool = False  # its timing window is not yet long enough to close
    failed: bool = False  # its loader or step failed; it steps the spare batch
    # its failure is a batch past its deadline (NOTE [ Memory growth against the hang
    # deadline ], in _clock.py: the node's watching rank looks at the node's growth)
    hung: bool = False
    seconds: float = 0.0  # since the last checkpoint


class Lockstep(Protocol):
    """How the processes that measure one setting together (every rank of a torchrun
    job) take the loop's decisions at the same batch (``NOTE [ Joint trials ]``)."""

    joint: bool
    # The last batch stepped well: a joint trial steps it in place of one it failed to load.
    spare: Any

    def begin(self, epoch_batches: int | None) -> None:
        """A trial starts, over epochs of ``epoch_batches`` (``None``: no length)."""

    def every(self) -> int:
        """Batches from one checkpoint to the next."""

    def agree(self, mine: Checkpoint) -> Checkpoint:
        """What any process saw."""

    def combine(self, estimate: Measurement) -> Measurement:
        """The job's estimate from each process's."""

    def decide(self, stop: bool) -> bool:
        """The driving process's decision to stop, on every process."""


class Alone:
    """A process measuring on its own: every batch a checkpoint, nothing exchanged."""

    joint = False
    spare = None

    def begin(self, epoch_batches: int | None) -> None:
        return None

    def every(self) -> int:
        return 1

    def agree(self, mine: Checkpoint) -> Checkpoint:
        return mine

    def combine(self, estimate: Measurement) -> Measurement:
        return estimate

    def decide(self, stop: bool) -> bool:
        return stop


class PeerFailed(Exception):
    """Another process of a joint trial failed; this one stopped with it (internal)."""

    def __init__(self) -> None:
        super().__init__("the trial failed on another rank")

    def __reduce__(self) -> tuple[type[PeerFailed], tuple[()]]:
        return type(self), ()
