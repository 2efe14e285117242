"""Which part of an object does not pickle, and why, for messages that say what to fix."""

from __future__ import annotations

import pickle
from collections.abc import Callable, Iterator, Mapping
from multiprocessing.reduction import ForkingPickler

# How deep the search for the unpicklable part of an object goes.
_MAX_PICKLE_DEPTH = 6


Dumps = Callable[[object], object]


def describe_unpicklable(obj: object, name: str, dumps: Dumps = ForkingPickler.dumps) -> str:
    """``"dataset.pipeline.transform (function) cannot be pickled (...)"``: the innermost
    attribute of ``obj`` that ``dumps`` fails on, or ``obj`` itself."""
    found = _find_unpicklable(obj, name, depth=0, dumps=dumps)
    path, error = found or (name, "unknown reason")
    return f"{path} cannot be pickled ({error})"


def _dumps(obj: object, dumps: Dumps = ForkingPickler.dumps) -> BaseException | None:
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
