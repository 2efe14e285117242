"""What a forked worker process takes from the process that forks it: its temporary
directory, and its parent, which it must not outlive.

NOTE [ The workers' temporary directory ]
A worker process that hands a tensor to the main process over a file descriptor
(torch's default sharing strategy) listens on a socket in multiprocessing's
per-process temporary directory, /tmp/pymp-*, made at its first use and removed at
its process's exit. A worker that is killed (the memory watch, a hang, the OOM
killer) or crashes leaves its own behind: a full test run left 50. A forked worker
takes the directory of the process it was forked from where that has one, and removes
nothing of it: so the training process makes its own (multiprocessing's, removed at
its exit) before it forks workers, and nothing a worker dies with stays. Spawned and
forkserver workers start without it, and are left as they are.

NOTE [ A worker whose parent died as it started ]
torch's worker exits once its parent is gone, by a watchdog that compares
``os.getppid()`` with the parent it read, but reads it only after the user's
``worker_init_fn``: a worker forked just before its process died (a torchrun rank
killed mid-trial) reads init's pid, or a subreaper's, as its parent's, and never
exits. It holds every descriptor it inherited, the rank's process-group sockets among
them, so the other ranks see no death until torchrun kills them 30 s after its
SIGTERM (a two-node test took 32, 33 and 62 s). ``ExitWithParent`` asks
multiprocessing, which recorded the parent's pid before the fork: a worker whose
parent is another process once its ``worker_init_fn`` is done, and whose recorded
parent is gone (or a zombie not yet reaped), exits at once. What is left open is the
fetcher's creation after it (an iterable dataset's ``iter()``).
"""

from __future__ import annotations

import multiprocessing.util
import os
from collections.abc import Callable, Mapping
from typing import Any


class ExitWithParent:
    """A ``worker_init_fn`` that calls the user's, then exits the worker if the process
    that started it is gone (``NOTE [ A worker whose parent died as it started ]``).

    Args:
        then (callable, optional): the user's ``worker_init_fn``. (default: ``None``)

    A module-level class: it pickles like the function it wraps, and holds no pid of
    its own, so a loader moved to another process before it starts workers keeps it.
    """

    def __init__(self, then: Callable[[int], object] | None = None) -> None:
        self.then = then

    def __call__(self, worker_id: int) -> None:
        if self.then is not None:
            self.then(worker_id)
        parent = multiprocessing.parent_process()
        if parent is None or parent.pid is None or os.getppid() == parent.pid:
            return
        if not _running(parent.pid):
            os._exit(0)

    def __repr__(self) -> str:
        return f"ExitWithParent(then={self.then!r})"


def _running(pid: int) -> bool:
    """Whether process ``pid`` is there and not a zombie (Linux's ``/proc`` tells;
    elsewhere, whether it can be signalled)."""
    if os.path.isdir("/proc/self"):
        try:
            with open(f"/proc/{pid}/stat", "rb") as stat:
                return stat.read().rsplit(b")", 1)[1].split()[0] != b"Z"
        except FileNotFoundError:
            return False
        except (OSError, IndexError):
            pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def start_method(options: Mapping[str, Any], default: str) -> str:
    """The start method workers of a loader with ``options`` get: its
    ``multiprocessing_context``'s, by name or context, else ``default``."""
    context = options.get("multiprocessing_context")
    if context is None:
        return default
    if isinstance(context, str):
        return context
    name: str = context.get_start_method()
    return name


def forked_worker_kwargs(kwargs: Mapping[str, Any], default_method: str) -> Mapping[str, Any]:
    """``DataLoader`` arguments ``kwargs`` made ready for workers forked from this
    process: its temporary directory made (``NOTE [ The workers' temporary directory
    ]``) and ``worker_init_fn`` wrapped in :class:`ExitWithParent`. Unchanged without
    workers, or where they start otherwise (``default_method`` where ``kwargs`` names
    no ``multiprocessing_context``)."""
    if not kwargs.get("num_workers") or start_method(kwargs, default_method) != "fork":
        return kwargs
    multiprocessing.util.get_temp_dir()
    init = kwargs.get("worker_init_fn")
    if isinstance(init, ExitWithParent):
        return kwargs
    return {**kwargs, "worker_init_fn": ExitWithParent(init)}
