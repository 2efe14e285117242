"""Which part of an object does not pickle, and why, for messages that say what to fix."""

from __future__ import annotations

import pickle
from collections.abc import Callable, Iterator, Mapping
from multiprocessing import context
from multiprocessing.reduction import ForkingPickler

# How deep the search for the unpicklable part of an object goes.
_MAX_PICKLE_DEPTH = 6


Dumps = Callable[[object], object]


class _StartingWorker:
    """Stands for the ``Popen`` of a worker that spawn or forkserver is starting, while
    the objects it is sent are pickled: multiprocessing's own objects (a ``Value``, a
    ``Lock``, a ``Semaphore``) pickle only then, their file descriptors passed on to the
    child (here, kept: nothing is sent)."""

    @staticmethod
    def duplicate_for_child(fd: int) -> int:
        return fd

    @staticmethod
    def DupFd(fd: int) -> int:  # multiprocessing's name
        return fd


def worker_dumps(obj: object) -> bytes:
    """``obj`` pickled as spawn and forkserver pickle what a worker is sent: by
    multiprocessing's reduction (:class:`ForkingPickler`), while a worker starts."""
    context.set_spawning_popen(_StartingWorker())  # type: ignore[arg-type]
    try:
        return bytes(ForkingPickler.dumps(obj))
    finally:
        context.set_spawning_popen(None)


def describe_unpicklable(obj: object, name: str, dumps: Dumps = worker_dumps) -> str:
    """``"dataset.pipeline.transform (function) cannot be pickled (...)"``: the innermost
    attribute of ``obj`` that ``dumps`` fails on, or ``obj`` itself."""
    found = _find_unpicklable(obj, name, depth=0, dumps=dumps)
    path, error = found or (name, "unknown reason")
    return f"{path} cannot be pickled ({error})"


def _dumps(obj: object, dumps: Dumps = worker_dumps) -> BaseException | None:
    try:
        dumps(obj)
    except Exception as error:  # pickling can raise almost anything
        return error
    return None


def _children(obj: object) -> Iterator[tuple[str, object]]:
    if isinstance(obj, Mapping):
        for key, value in obj.items():
            yield f"[{key!r}]", value
    elif isinstance(obj, list | tuple):
        for index, value in enumerate(obj):
            yield f"[{index}]", value
    else:
        for key, value in getattr(obj, "__dict__", {}).items():
            yield f".{key}", value
        for key in getattr(type(obj), "__slots__", ()):
            if hasattr(obj, key):
                yield f".{key}", getattr(obj, key)


def _find_unpicklable(obj: object, path: str, depth: int, dumps: Dumps) -> tuple[str, str] | None:
    error = _dumps(obj, dumps)
    if error is None:
        return None
    if depth < _MAX_PICKLE_DEPTH:
        for suffix, child in _children(obj):
            found = _find_unpicklable(child, path + suffix, depth + 1, dumps)
            if found is not None:
                return found
    reason = f"{type(error).__name__}: {error}"
    if isinstance(error, pickle.PicklingError | AttributeError | TypeError):
        reason = str(error)
    return f"{path} ({type(obj).__name__})", reason
