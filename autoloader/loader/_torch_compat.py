"""Every private torch API autoloader touches, in one place.

DataLoader keeps its worker machinery private (``torch._C``, ``torch.utils.data._utils``,
its iterators' attributes), and autoloader needs some of it: to report a dead worker
as DataLoader does, to stop a trial's workers when a killed one left a lock held, and to
build :class:`~autoloader.loader._thread_loader.ThreadLoader` on DataLoader's iterator.
Each is named here once, with the torch versions it was checked against: torch 2.6
(the floor in ``pyproject.toml``) and 2.13 (the version pinned in development). A torch
release that moves one of them is fixed here, and nowhere else.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from multiprocessing.process import BaseProcess
from typing import Any

from torch._C import _error_if_any_worker_fails
from torch._utils import KeyErrorMessage as _KeyErrorMessage
from torch.utils.data import DataLoader, _utils
from torch.utils.data._utils import signal_handling as _signal_handling
from torch.utils.data._utils.pin_memory import pin_memory as _pin_memory
from torch.utils.data.dataloader import _BaseDataLoaderIter, _MultiProcessingDataLoaderIter

# The base class of DataLoader's iterators (torch 2.6 to 2.13). A subclass gets from
# its __init__ the loader's settings as ``_dataset``, ``_auto_collation``,
# ``_collate_fn``, ``_num_workers``, ``_timeout``, ``_pin_memory`` and
# ``_pin_memory_device``, draws indices with ``_next_index()``, and implements
# ``_next_data()`` and ``_shutdown_workers()``; DataLoader builds it in ``_get_iterator()``.
BaseDataLoaderIter = _BaseDataLoaderIter

# A str whose repr is itself: DataLoader wraps a KeyError's message in it, so that the
# message, with its traceback, prints as it is (torch 2.6 to 2.13).
KeyErrorMessage = _KeyErrorMessage


def pin_memory(data: Any, device: str | None = None) -> Any:
    """``data`` (a tensor or a nested batch of them) copied to pinned memory, as
    DataLoader's pinning thread does (``torch.utils.data._utils.pin_memory``; the
    same signature in torch 2.6 to 2.13)."""
    return _pin_memory(data, device)  # type: ignore[no-untyped-call]


def raise_if_any_worker_failed() -> None:
    """Raise DataLoader's own error ("DataLoader worker (pid ...) exited unexpectedly",
    "... is killed by signal") if a worker process of this process has died; what
    DataLoader's SIGCHLD handler calls (``torch._C``; torch 2.6 to 2.13)."""
    _error_if_any_worker_fails()


@contextlib.contextmanager
def sigchld_handler_held() -> Iterator[None]:
    """Keep DataLoader from installing its SIGCHLD handler in the block: the caller's
    handler does its work (:func:`raise_if_any_worker_failed`) there. After the block,
    DataLoader installs its handler the next time it starts workers, as it would have
    without the block, and finds in place the handler it would have found.

    DataLoader installs its handler once per process, for good, the first time workers
    start, and notes that it did in ``_SIGCHLD_handler_set``
    (``torch.utils.data._utils.signal_handling``; torch 2.6 to 2.13).
    """
    with _held_lock:
        if not _held:
            _held.append(_signal_handling._SIGCHLD_handler_set)
            _signal_handling._SIGCHLD_handler_set = True
        _held.append(True)
    try:
        yield
    finally:
        with _held_lock:
            _held.pop()
            if len(_held) == 1:  # the last block held ends, whatever the order they end
                _signal_handling._SIGCHLD_handler_set = _held.pop()


# The flag as found before the first of the blocks held now, then one entry a block.
_held: list[bool] = []
_held_lock = threading.RLock()  # a finalizer may run while it is held


def exiting() -> bool:
    """Whether the interpreter is exiting, as DataLoader sees it: its iterators' shutdown
    then does nothing (``torch.utils.data._utils.python_exit_status``, set by an atexit
    hook; torch 2.6 to 2.13)."""
    return _utils.python_exit_status is not False


def worker_processes(iterator: object) -> list[BaseProcess]:
    """The worker processes of a DataLoader iterator; none for an iterator without
    them (``_workers`` of ``_MultiProcessingDataLoaderIter``; torch 2.6 to 2.13)."""
    return list(getattr(iterator, "_workers", None) or ())


def loader_iterator(loader: object) -> object:
    """The iterator a persistent DataLoader keeps across epochs, or ``None``
    (``DataLoader._iterator``; torch 2.6 to 2.13)."""
    return getattr(loader, "_iterator", None)


def awaited_batch(iterator: object) -> tuple[int, int, dict[int, int]] | None:
    """The batch an in-order DataLoader iterator waits for: its index, the worker it was
    given to, and for each other worker the batches given out after it that this worker
    has delivered (kept until their turn comes). ``None`` without worker processes, out
    of order, or when the awaited batch has arrived.

    Relies on ``_MultiProcessingDataLoaderIter``'s ``_task_info`` (index -> ``(worker,)``
    until the batch arrives, then ``(worker, data)``), ``_rcvd_idx`` and ``_in_order``
    (torch 2.6 to 2.13). Only the main thread changes them, so reading them there (in a
    signal handler) sees them whole.
    """
    tasks = getattr(iterator, "_task_info", None)
    if not isinstance(tasks, dict) or not getattr(iterator, "_in_order", True):
        return None
    index = getattr(iterator, "_rcvd_idx", None)
    awaited = tasks.get(index)
    if not isinstance(index, int) or not awaited or len(awaited) != 1:
        return None
    worker = awaited[0]
    later: dict[int, int] = {}
    for task, info in list(tasks.items()):
        if task > index and len(info) == 2 and info[0] != worker:
            later[info[0]] = later.get(info[0], 0) + 1
    return index, worker, later


def shutdown_workers(
    iterator: object, loader: DataLoader[Any] | None, *, abandon: bool = False
) -> None:
    """Stop the workers of a trial's iterator (and of a persistent loader's own).

    With ``abandon`` (the trial failed and its workers were killed), the shutdown
    touches nothing a killed worker may have left locked: it skips telling each worker
    to stop through its queue (a put interrupted by a worker-death error may have left
    that queue's lock held) and the shared "done" event. The workers are dead; joining
    them and closing the queues is enough.

    Relies on ``DataLoader._iterator`` and on ``_MultiProcessingDataLoaderIter``'s
    ``_shutdown_workers()``, ``_workers_status``, ``_persistent_workers`` and
    ``_workers_done_event`` (torch 2.6 to 2.13); a :class:`ThreadLoader`'s iterator
    has only ``_shutdown_workers()``.
    """
    for it in (iterator, getattr(loader, "_iterator", None)):
        shutdown = getattr(it, "_shutdown_workers", None)
        if shutdown is None:
            continue
        if abandon and hasattr(it, "_workers_status"):
            it._workers_status = [False] * len(it._workers_status)
            it._persistent_workers = False  # type: ignore[union-attr]
            # Workers check this event in their loop, under a lock they share with this
            # process: one killed while it held the lock would make setting the event
            # wait forever. The workers are dead; nobody is left to see it set.
            it._workers_done_event = threading.Event()  # type: ignore[union-attr]
        shutdown()
    if loader is not None:
        loader._iterator = None


# NOTE [ A half-built iterator ]
# An exception raised inside iter(loader) while _MultiProcessingDataLoaderIter.__init__
# starts its workers (Ctrl-C: the start-up is the slow part of a trial) leaves the
# iterator half built, reachable only from the traceback, with some workers running.
# Freed later, its __del__ shuts it down, but before __init__ has set
# ``_workers_status`` (in ``_reset``, after every worker started) that raises
# AttributeError, which Python prints as "Exception ignored in ... __del__" (a CLI test
# saw it on a Ctrl-C beside a busy loop), and a worker started but not yet listed in
# ``_workers`` is never stopped. So the caller of iter() completes what __init__ did
# not and shuts it down at once: the started workers listed, each told to stop
# through its queue as a finished epoch's are. Only for an interrupt (a BaseException
# that is no Exception): an error there (a worker's death) is the trial's failure,
# whose clean-up knows not to touch the locks a killed worker may hold.


def stop_half_built_iterator(error: BaseException) -> None:
    """Shut down the workers of a DataLoader iterator whose ``__init__`` ``error``
    interrupted (``NOTE [ A half-built iterator ]``); nothing where it was not one.

    Relies on ``_MultiProcessingDataLoaderIter.__init__``'s order and names (torch 2.6
    to 2.13): ``_shutdown``, then ``_workers_done_event``, ``_index_queues`` and
    ``_workers``, each worker started as the local ``w`` with its ``index_queue``, then
    listed; ``_workers_status`` set by ``_reset()`` at the end.
    """
    traceback = error.__traceback__
    while traceback is not None:
        frame = traceback.tb_frame
        it = frame.f_locals.get("self") if frame.f_code.co_name == "__init__" else None
        if isinstance(it, _MultiProcessingDataLoaderIter):
            _complete(it, frame.f_locals)
            it._shutdown_workers()
            return
        traceback = traceback.tb_next


def _complete(it: Any, names: dict[str, Any]) -> None:
    """What ``it._shutdown_workers()`` needs that an interrupted ``__init__`` did not set."""
    if not hasattr(it, "_workers_done_event"):
        it._shutdown = True  # no worker started: nothing to shut down
        return
    it.__dict__.setdefault("_index_queues", [])
    it.__dict__.setdefault("_workers", [])
    worker, queue = names.get("w"), names.get("index_queue")
    started = isinstance(worker, BaseProcess) and getattr(worker, "_popen", None) is not None
    if started and worker not in it._workers:
        if queue is not None and queue not in it._index_queues:
            it._index_queues.append(queue)
        it._workers.append(worker)
    if not hasattr(it, "_workers_status"):
        # Every listed worker waits for its queue's stop (None): told so, it exits
        # at once, where a worker not told waits out DataLoader's 5 s join.
        it._workers_status = [True] * len(it._workers)


def batches_yielded(iterator: object) -> int:
    """The batches a DataLoader iterator delivered in its epoch (``_num_yielded``)."""
    return int(getattr(iterator, "_num_yielded", 0))
