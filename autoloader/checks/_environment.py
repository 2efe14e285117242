"""The machine a result was measured on, and how another machine differs from it."""

from __future__ import annotations

import dataclasses
import math
import os
import platform
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from autoloader.loader import default_start_method
from autoloader.measure import accelerator, format_bytes, total_memory

# Memory sizes that differ by less than this are the same machine (kernels and
# firmware reserve slightly different amounts).
_MEMORY_TOLERANCE = 0.05


def affinity() -> frozenset[int]:
    """The CPUs this process may run on."""
    try:
        return frozenset(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return frozenset(range(os.cpu_count() or 1))


def _affinity() -> int:
    return len(affinity())


def cgroup_cpus(*, cgroup_root: Path = Path("/sys/fs/cgroup")) -> float | None:
    """CPUs the cgroup's quota allows (v2 ``cpu.max``, else v1's CFS quota), if any."""
    try:
        quota, period = (cgroup_root / "cpu.max").read_text().split()[:2]
        if quota != "max":
            return int(quota) / int(period)
        return None
    except (OSError, ValueError):
        pass
    try:
        quota = (cgroup_root / "cpu" / "cpu.cfs_quota_us").read_text().strip()
        period = (cgroup_root / "cpu" / "cpu.cfs_period_us").read_text().strip()
        return int(quota) / int(period) if int(quota) > 0 else None
    except (OSError, ValueError):
        return None


def usable_cpus(*, local_world_size: int = 1, node_cpus: int | None = None) -> int:
    """CPUs this process may use: its affinity (``taskset``, ``numactl``), capped by the
    cgroup's quota. Under torchrun, its share of ``node_cpus`` (the CPUs any rank of the
    node may run on) among the ``local_world_size`` ranks there; a rank bound to fewer
    CPUs of its own keeps those."""
    affinity = _affinity()
    node = node_cpus or affinity
    quota = cgroup_cpus()
    if quota is not None:
        node = min(node, math.ceil(quota))
    return max(1, min(affinity, node // max(1, local_world_size)))


def _accelerator_name() -> str | None:
    device = accelerator()
    if device is None:
        return None
    count = torch.accelerator.device_count()
    name = device.type
    if device.type == "cuda":
        name = f"cuda: {torch.cuda.get_device_name(0)}"
    return f"{name} x{count}"


@dataclass(frozen=True, slots=True)
class Environment:
    """What about a machine decides the best DataLoader settings.

    Attributes:
        cpu_count: logical CPUs of the machine.
        usable_cpus: CPUs this process may run on (affinity, e.g. ``taskset``, and the
            cgroup's quota); under torchrun, this rank's share of its node's.
        memory_total: bytes of memory, or the cgroup limit where that is smaller.
        torch_version: ``torch.__version__``.
        python_version: ``platform.python_version()``.
        platform: ``platform.platform()``.
        accelerator: e.g. ``"cuda: NVIDIA A100 x8"``, or ``None``.
        start_method: the multiprocessing start method DataLoader workers use by default.
        world_size: ranks of the torchrun job tuned together (1 alone).
        local_world_size: of those, the ranks on each node.
        nodes: the job's nodes (hosts), 1 alone or on one node.
    """

    cpu_count: int
    usable_cpus: int
    memory_total: int
    torch_version: str
    python_version: str
    platform: str
    accelerator: str | None
    start_method: str
    world_size: int = 1
    local_world_size: int = 1
    nodes: int = 1

    @classmethod
    def current(
        cls,
        *,
        world_size: int = 1,
        local_world_size: int = 1,
        nodes: int = 1,
        node_cpus: int | None = None,
    ) -> Environment:
        """This machine, for a process alone or for one of ``local_world_size`` ranks of
        a node in a job of ``world_size`` (see :func:`usable_cpus`)."""
        return cls(
            cpu_count=os.cpu_count() or 1,
            usable_cpus=usable_cpus(local_world_size=local_world_size, node_cpus=node_cpus),
            memory_total=total_memory(),
            torch_version=torch.__version__,
            python_version=platform.python_version(),
            platform=platform.platform(),
            accelerator=_accelerator_name(),
            start_method=default_start_method(),
            world_size=world_size,
            local_world_size=local_world_size,
            nodes=nodes,
        )

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Environment:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})

    def differences(self, other: Environment) -> list[str]:
        """How ``other`` differs from this environment, one phrase per difference."""
        found = []
        if _shape(self) != _shape(other):
            found.append(
                f"ranks: {_ranks(self)} when measured, {_ranks(other)} now; the settings "
                "were tuned for each rank's share of the node"
            )
        if self.usable_cpus != other.usable_cpus or self.cpu_count != other.cpu_count:
            found.append(
                f"CPUs: {self.usable_cpus} usable of {self.cpu_count} when measured, "
                f"{other.usable_cpus} usable of {other.cpu_count} now"
            )
        largest = max(self.memory_total, other.memory_total, 1)
        if abs(self.memory_total - other.memory_total) / largest > _MEMORY_TOLERANCE:
            found.append(
                f"memory: {format_bytes(self.memory_total)} when measured, "
                f"{format_bytes(other.memory_total)} now"
            )
        if self.torch_version != other.torch_version:
            found.append(f"torch: {self.torch_version} when measured, {other.torch_version} now")
        if self.accelerator != other.accelerator:
            found.append(
                f"accelerator: {self.accelerator or 'none'} when measured, "
                f"{other.accelerator or 'none'} now"
            )
        return found


def _shape(environment: Environment) -> tuple[int, int, int]:
    return environment.world_size, environment.local_world_size, environment.nodes


def _ranks(environment: Environment) -> str:
    if environment.world_size == 1:
        return "one process"
    nodes = f" on {environment.nodes} nodes" if environment.nodes > 1 else ""
    return f"{environment.world_size} ranks{nodes}, {environment.local_world_size} per node"


def world() -> tuple[int, int, int]:
    """(global rank, world size, local world size) of this process: from the default
    process group where one is initialised, else torchrun's environment, else a world of
    one. The local world size is the ranks on this node."""
    if dist.is_available() and dist.is_initialized():
        rank, size = dist.get_rank(), dist.get_world_size()
    else:
        rank, size = _env_int("RANK", 0), _env_int("WORLD_SIZE", 1)
    return rank, size, max(1, min(size, _env_int("LOCAL_WORLD_SIZE", 1)))


def world_nodes() -> int:
    """Nodes of this process's torchrun job: torchrun's ``GROUP_WORLD_SIZE`` (its
    agents, one per node), else the ranks over the ranks per node, 1 alone."""
    _, size, local = world()
    return max(1, _env_int("GROUP_WORLD_SIZE", -(-size // local)))


def _env_int(name: str, default: int) -> int:
    try:
        return int(os.environ.get(name, default))
    except ValueError:
        return default
