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
``worker_init_fn`` and the fetcher's creation (an iterable dataset's ``iter()``): a
worker forked just before its process died (a torchrun rank killed mid-trial) reads
init's pid, or a subreaper's, as its parent's, and never exits. It holds every
descriptor it inherited, the rank's process-group sockets among them, so the other
ranks see no death: torchrun killed them 30 s after its SIGTERM (a two-node test took
32, 33 and 62 s), or, where no rank of a node failed, the job hung (a CI run, 150 s).
``ExitWithParent`` closes that window twice over:

1. A worker forked from its process's main thread asks the kernel for SIGKILL when
   its parent dies (Linux's ``PR_SET_PDEATHSIG``), before the user's init runs. The
   signal comes when the thread that forked the worker ends, so only the main thread's
   forks are armed: it ends with its process. A worker forked from another thread (a
   loader iterated in a thread of the user's) is not: that thread may end long before.
2. Once its ``worker_init_fn`` is done, a worker whose parent is another process than
   multiprocessing recorded before the fork, and whose recorded parent is gone (or a
   zombie not yet reaped), exits at once: a parent that died before step 1 armed it.

A worker forked from another thread keeps a window as long as its fetcher's creation.
"""

from __future__ import annotations

import ctypes
import multiprocessing.util
import os
import signal
import sys
import threading
from collections.abc import Callable, Mapping
from typing import Any


class ExitWithParent:
    """A ``worker_init_fn`` that has the kernel kill the worker when the process that
    started it dies (forked from its main thread, on Linux), calls the user's, then
    exits the worker if that process is already gone (``NOTE [ A worker whose parent
    died as it started ]``).

    Args:
        then (callable, optional): the user's ``worker_init_fn``. (default: ``None``)

    A module-level class: it pickles like the function it wraps, and holds no pid of
    its own, so a loader moved to another process before it starts workers keeps it.
    """

    def __init__(self, then: Callable[[int], object] | None = None) -> None:
        self.then = then

    def __call__(self, worker_id: int) -> None:
        _die_with_parent()
        if self.then is not None:
            self.then(worker_id)
        parent = multiprocessing.parent_process()
        if parent is None or parent.pid is None or os.getppid() == parent.pid:
            return
        if not _running(parent.pid):
            os._exit(0)

    def __repr__(self) -> str:
        return f"ExitWithParent(then={self.then!r})"


# prctl(2)'s option: the signal a process gets when the thread that forked it ends.
_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> bool:
    """In a worker forked from its process's main thread, SIGKILL from the kernel when
    that thread (so the process) ends; whether it was armed. Linux only; a worker
    forked from another thread is left as it is (``NOTE [ A worker whose parent died
    as it started ]``)."""
    main_thread = getattr(threading, "_MainThread", None)
    # After a fork the forking thread is the child's only one, and threading keeps its
    # object: a _MainThread only where the parent's main thread forked.
    if not sys.platform.startswith("linux") or main_thread is None:
        return False
    if not isinstance(threading.current_thread(), main_thread):
        return False
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return False
    return bool(prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) == 0)


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
