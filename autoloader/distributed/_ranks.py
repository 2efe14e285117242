"""The ranks of a ``torchrun`` job, tuning together: who they are, and how they agree.

A job whose ranks each call :func:`autoloader.tune` after
``torch.distributed.init_process_group()`` tunes jointly (see ``NOTE [ Joint trials ]``
in ``measure/_lockstep.py``). Everything the ranks say to each other goes through gloo
groups made here, on the CPU, whatever the default group's backend (NCCL for GPUs), and with
timeouts of their own (``NOTE [ How long a rank waits ]``): a rank that stops answering is an
error within that time, never a hang.
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
from autoloader.checks import affinity

_logger = logging.getLogger(__name__)

# NOTE [ How long a rank waits ]
# Outside a measured trial the ranks wait for each other as long as the job's own
# collectives do: the default process group's timeout (init_process_group's timeout=;
# by default 30 min with gloo, 10 with NCCL). There the others may be busy with the
# job's own work, as DDP lets them be: rank 0 evaluating or checkpointing alone between
# epochs (every exchange of AutoLoader comes between the user's steps), or running the
# checks and the search between tune()'s trials. A wait of its own, shorter than DDP's,
# failed jobs that DDP lets live (rank 1 raised RankError at 121 s while rank 0
# evaluated for 130 s). Within a measured trial (tune()'s checkpoints and its end) the
# ranks meet every fraction of a second and every slow part has a deadline
# of its own (a batch's load, a step), so there a rank silent TRIAL_TIMEOUT seconds past
# them has stopped answering; or after the group's timeout, if that is shorter. Neither
# bounds a stopped rank while another waits in the step's own collectives (DDP's
# all-reduce, in C++, where no alarm reaches): that wait is the process group's, and the
# trial's exchange comes after it (docs/guides/torchrun.md, "How long a rank waits").
TRIAL_TIMEOUT = 120.0
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
        timeout: seconds an exchange waits for the other ranks: outside a trial, the
            default process group's timeout; within one (:meth:`within_trial`), at most
            ``TRIAL_TIMEOUT`` (``NOTE [ How long a rank waits ]``).
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
    # The group, and its timeout, of the exchanges within a trial.
    trial_group: Any = None
    trial_timeout: float = TRIAL_TIMEOUT

    @classmethod
    def join(cls) -> Ranks | None:
        """The job's ranks, or ``None`` when this process tunes alone (no process group,
        or a world of one). Every rank must call it: it makes the control groups."""
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
            return None
        timeout = job_timeout()
        trial_timeout = min(TRIAL_TIMEOUT, timeout)
        try:
            group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout))
            trial_group = dist.new_group(backend="gloo", timeout=timedelta(seconds=trial_timeout))
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
            trial_group=trial_group,
            trial_timeout=trial_timeout,
        )
        return dataclasses.replace(ranks, exchange_seconds=ranks.within_trial()._time_exchange())

    def within_trial(self) -> Ranks:
        """These ranks, exchanging within a measured trial: through the group whose
        timeout is a trial's (``NOTE [ How long a rank waits ]``)."""
        return dataclasses.replace(self, group=self.trial_group, timeout=self.trial_timeout)

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
        """Free the control groups."""
        for group in (self.group, self.trial_group):
            if group is None:  # (None would name the default group: the job's own)
                continue
            try:
                dist.destroy_process_group(group)
            except (RuntimeError, ValueError, AssertionError) as error:  # the job is ending
                _logger.debug("a control group was not destroyed: %s", error)


def job_timeout() -> float:
    """Seconds the job's own collectives wait for a rank: the default process group's
    timeout (``init_process_group(timeout=...)``), or torch's default for its backend
    where the group does not say (``NOTE [ How long a rank waits ]``)."""
    # Each of the group's backends (gloo for the CPU, NCCL for CUDA, say) keeps the
    # timeout in its options (torch 2.6 to 2.13; _set_pg_timeout changes it there).
    seconds = []
    try:
        group: Any = dist.distributed_c10d._get_default_group()
        devices = list(group._device_types)
    except (AttributeError, RuntimeError, ValueError):
        devices = []
    for device in devices:
        try:
            timeout = group._get_backend(device).options._timeout
        except (AttributeError, RuntimeError, ValueError):  # a backend without options
            continue
        if isinstance(timeout, timedelta) and timeout.total_seconds() > 0:
            seconds.append(timeout.total_seconds())
    if seconds:
        return max(seconds)
    try:
        default = dist.distributed_c10d._get_default_timeout(dist.get_backend())
    except (AttributeError, RuntimeError, ValueError):
        default = dist.default_pg_timeout  # gloo's: 30 min
    return float(default.total_seconds())


def _lost(error: BaseException, during: str) -> RankError:
    return RankError(
        f"another rank stopped answering {during} ({error}); the ranks cannot go on "
        "tuning together. Look for the first error in the other ranks' output: a rank "
        "that died, or one that called tune() with other arguments."
    )
