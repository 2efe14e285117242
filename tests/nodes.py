"""A torchrun job of several nodes on one machine: each node's agent in a UTS namespace
of its own, with a host name of its own, rendezvousing on loopback.

autoloader tells nodes apart by host name (``Ranks.join``): the ranks of a node share
its memory budget, its watcher and its CPUs. Two agents started this way are two nodes
to it, as two machines would be, while they share this machine's memory and CPUs (which
the tests use: a budget counted over the whole machine instead of one node's would
already be passed before any trial). Used by the two-node tests of
``tests/test_torchrun.py`` and by ``benchmarks/two_node_budget.py``,
``benchmarks/torchrun_joint.py`` and ``benchmarks/control_traffic.py``.

Starting a namespace needs root (or CAP_SYS_ADMIN). Where it is not permitted the tests
skip and say why, unless ``AUTOLOADER_REQUIRE_NODES=1`` (set by ``.ci/run``, which runs
as root) turns that skip into a failure, so that CI cannot pass without them.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import psutil

HOSTS = ("node-a", "node-b")
REQUIRE = "AUTOLOADER_REQUIRE_NODES"


def unavailable() -> str | None:
    """Why this machine cannot start a node in a namespace of its own, or ``None``."""
    if not sys.platform.startswith("linux"):
        return f"UTS namespaces are Linux's, and this is {sys.platform}"
    if shutil.which("unshare") is None:
        return "no unshare command here (util-linux)"
    try:
        done = subprocess.run(
            ["unshare", "--uts", "hostname", "probe"], capture_output=True, text=True, timeout=30
        )
    except (OSError, subprocess.TimeoutExpired) as error:
        return f"unshare --uts could not run: {error}"
    if done.returncode != 0:
        return (
            f"unshare --uts is not permitted here ({done.stderr.strip()}): it needs root "
            "or CAP_SYS_ADMIN"
        )
    return None


def free_port() -> int:
    """A TCP port on loopback that nothing listens on now, for the rendezvous."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def agent_command(
    host: str, node_rank: int, nodes: int, ranks_per_node: int, port: int, args: Sequence[str]
) -> list[str]:
    """One node's torchrun agent, started under ``host`` in a UTS namespace of its own."""
    return [
        "unshare", "--uts", "sh", "-c", 'hostname "$0" && exec "$@"', host,
        sys.executable, "-m", "torch.distributed.run",
        f"--nnodes={nodes}", f"--node_rank={node_rank}", f"--nproc_per_node={ranks_per_node}",
        "--master_addr=127.0.0.1", f"--master_port={port}", *args,
    ]  # fmt: skip


@dataclass
class NodeJob:
    """The agents of a job, one per node, each in a process group of its own; each
    node's output goes to ``<host>.log`` in the job's folder."""

    hosts: tuple[str, ...]
    agents: list[subprocess.Popen[bytes]]
    logs: list[Path]

    # What was still running when the job hung (:meth:`wait`), one line a process.
    left: list[str] = field(default_factory=list)

    def wait(self, timeout: float) -> bool:
        """Whether every agent exited within ``timeout`` seconds from now; if not (the
        job hung), what still runs is noted in :attr:`left` and the whole job killed."""
        deadline = time.monotonic() + timeout
        for agent in self.agents:
            try:
                agent.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.left = self._running()
                self.kill()
                return False
        return True

    def output(self, tail: int | None = None) -> str:
        """Every node's output so far (its last ``tail`` characters, if given), each under
        its host's name."""
        return "\n".join(
            f"--- {host} ---\n{log.read_text(errors='replace')[-(tail or 0) :]}"
            for host, log in zip(self.hosts, self.logs, strict=True)
        )

    def hung(self) -> str:
        """Why :meth:`wait` gave up, for a test's message: what still ran, each node's
        last output."""
        return "still running:\n" + "\n".join(self.left) + "\n" + self.output(tail=2500)

    def _members(self) -> list[psutil.Process]:
        """The job's processes: those of its agents' process groups, and those in its
        folder (torchrun starts each rank in a session of its own: its ranks, their
        workers, a worker whose rank died)."""
        groups = {agent.pid for agent in self.agents}
        folder = str(self.logs[0].parent)
        found = []
        for process in psutil.process_iter(["cwd"]):
            try:
                if process.info["cwd"] == folder or os.getpgid(process.pid) in groups:
                    found.append(process)
            except (ProcessLookupError, psutil.Error):
                continue
        return found

    def _running(self) -> list[str]:
        """What :meth:`_members` finds, one line a process, with its rank."""
        found = []
        for process in self._members():
            try:
                info = process.as_dict(["pid", "ppid", "name", "status"])
                found.append(f"  {info} rank={process.environ().get('RANK', '-')}")
            except psutil.Error:
                continue
        return found

    def kill(self) -> None:
        """SIGKILL every process of the job: each node's agent and everything it started."""
        for process in self._members():
            with contextlib.suppress(psutil.Error):
                process.kill()
        for agent in self.agents:
            agent.wait()

    @property
    def returncodes(self) -> list[int | None]:
        return [agent.returncode for agent in self.agents]


def start(
    args: Sequence[str],
    *,
    cwd: Path,
    hosts: Sequence[str] = HOSTS,
    ranks_per_node: int = 2,
    env: Mapping[str, str] | None = None,
) -> NodeJob:
    """Start a job of ``len(hosts)`` nodes of ``ranks_per_node`` ranks running ``args``
    (what follows torchrun's own options: ``-m module ...`` or a script), in ``cwd``."""
    port = free_port()
    environ = {**os.environ, **(env or {})}
    environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # the nodes' names resolve nowhere
    logs = [cwd / f"{host}.log" for host in hosts]
    agents = []
    for rank, (host, log) in enumerate(zip(hosts, logs, strict=True)):
        with log.open("wb") as output:
            agents.append(
                subprocess.Popen(
                    agent_command(host, rank, len(hosts), ranks_per_node, port, args),
                    cwd=cwd,
                    env=environ,
                    stdout=output,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,  # its own process group: the node's whole tree
                )
            )
    return NodeJob(tuple(hosts), agents, logs)
