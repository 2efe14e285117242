"""The ranks of a ``torchrun`` job, tuning together: who they are, and how they agree.

A job whose ranks each call :func:`autoloader.tune` after
``torch.distributed.init_process_group()`` tunes jointly (see ``NOTE [ Joint trials ]``
in ``measure/_lockstep.py``). Everything the ranks say to each other goes through a gloo
group made here, on the CPU, whatever the default group's backend (NCCL for GPUs), and with its own
timeout: a rank that stops answering is an error within that time, never a hang.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import pickle
import socket
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from autoloader._exceptions import RankError
from autoloader.checks._environment import affinity

_logger = logging.getLogger(__name__)

# Seconds a rank waits for the others at one exchange, past the trial's own deadlines
# (the timeout covers a rank that stops answering, not a slow trial: trials end by
# their own deadlines first).
DEFAULT_TIMEOUT = 120.0
# All-reduces timed when the ranks meet (the first makes the connections: it is slower).
_EXCHANGES_TIMED = 7


@dataclass(frozen=True)
class Ranks:
    """This process's place among the ranks tuning together, and their control channel.

    Attributes:
        rank: global rank; rank 0 drives the study.
        world_size: ranks in the job.
        local_rank: this rank's place among the ranks on its node.
        local_world_size: ranks on this node.
        node_pids: process ids of the ranks on this node, by local rank.
        hosts: the host of each rank, by global rank (a node is a host name: ranks in
            containers of one machine that share a host name share a node).
        node_cpus: CPUs any rank of this node may run on (their affinities' union).
        timeout: seconds an exchange waits for the other ranks.
        exchange_seconds: what one small all-reduce (a checkpoint's) took when the
            ranks met, the slowest rank's median of a few; the same on every rank.
    """

    group: Any
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    node_pids: tuple[int, ...]
    hosts: tuple[str, ...]
    node_cpus: int
    timeout: float
    exchange_seconds: float = 0.0

    @classmethod
    def join(cls, *, timeout: float = DEFAULT_TIMEOUT) -> Ranks | None:
        """The job's ranks, or ``None`` when this process tunes alone (no process group,
        or a world of one). Every rank must call it: it makes the control group."""
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
            return None
        try:
            group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout))
        except (RuntimeError, ValueError) as error:
            raise RankError(
                f"could not make the gloo group the ranks tune through: {error}. "
                "autoloader needs gloo (built into every torch) next to the job's backend."
            ) from error
        rank, size = dist.get_rank(), dist.get_world_size()
        here = (socket.gethostname(), os.getpid(), affinity())
        everyone: list[Any] = [None] * size
        try:
            dist.all_gather_object(everyone, here, group=group)
        except RuntimeError as error:
            raise _lost(error, "while the ranks met") from error
        node = [(pid, cpus) for host, pid, cpus in everyone if host == here[0]]
        pids = [pid for pid, _ in node]
        _logger.info(
            "tuning jointly as rank %d of %d (%d on this node, %s)", rank, size, len(node), here[0]
        )
        ranks = cls(
            group=group,
            rank=rank,
            world_size=size,
            local_rank=pids.index(here[1]),
            local_world_size=len(node),
            node_pids=tuple(pids),
            hosts=tuple(host for host, _, _ in everyone),
            node_cpus=len(frozenset().union(*(cpus for _, cpus in node))),
            timeout=timeout,
        )
        return dataclasses.replace(ranks, exchange_seconds=ranks._time_exchange())

    def _time_exchange(self, times: int = _EXCHANGES_TIMED) -> float:
        """The slowest rank's median time of a checkpoint-sized all-reduce."""
        seconds = []
        for _ in range(times):
            started = time.perf_counter()
            self.maximum([0.0] * 6, during="while the ranks met")  # a checkpoint's few floats
            seconds.append(time.perf_counter() - started)
        return self.maximum([statistics.median(seconds)], during="while the ranks met")[0]

    @property
    def nodes(self) -> int:
        """Nodes of the job: its distinct hosts."""
        return len(set(self.hosts))

    @property
    def drives(self) -> bool:
        """Whether this rank drives the study (global rank 0)."""
        return self.rank == 0

    def broadcast(self, value: Any, *, during: str) -> Any:
        """Rank 0's ``value``, on every rank (the others pass anything)."""
        box = [value if self.drives else None]
        try:
            dist.broadcast_object_list(box, src=0, group=self.group)
        except RuntimeError as error:
            raise _lost(error, during) from error
        return box[0]

    def gather(self, value: Any, *, during: str) -> list[Any]:
        """Every rank's ``value``, by rank, on every rank. A value that does not pickle
        is sent as its text, so one rank's odd exception cannot stop the exchange."""
        try:
            pickle.dumps(value)
        except Exception:
            value = RankError(f"{type(value).__name__}: {value}")
        everyone: list[Any] = [None] * self.world_size
        try:
            dist.all_gather_object(everyone, value, group=self.group)
        except RuntimeError as error:
            raise _lost(error, during) from error
        return everyone

    def maximum(self, values: Sequence[float], *, during: str) -> list[float]:
        """Each value's largest over the ranks (a flag's: whether any rank set it): one
        small all-reduce, about 0.2 ms between two local ranks on the development VM,
        cheap enough to take every few batches."""
        tensor = torch.tensor([float(v) for v in values], dtype=torch.float64)
        try:
            dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=self.group)
        except RuntimeError as error:
            raise _lost(error, during) from error
        return [float(v) for v in tensor.tolist()]

    def node(self, values: Sequence[Any]) -> list[Any]:
        """Of values gathered from every rank, those of this node's ranks."""
        here = self.hosts[self.rank]
        return [v for v, host in zip(values, self.hosts, strict=True) if host == here]

    def close(self) -> None:
        """Free the control group."""
        try:
            dist.destroy_process_group(self.group)
        except (RuntimeError, ValueError, AssertionError) as error:  # the job is ending anyway
            _logger.debug("the control group was not destroyed: %s", error)


def _lost(error: BaseException, during: str) -> RankError:
    return RankError(
        f"another rank stopped answering {during} ({error}); the ranks cannot go on "
        "tuning together. Look for the first error in the other ranks' output: a rank "
        "that died, or one that called tune() with other arguments."
    )
