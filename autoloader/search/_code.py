"""A fingerprint of the code that loads and trains: the dataset's reads and the step.

NOTE [ Code fingerprints ]
A problem's description names the dataset and the step by their types, which stay the
same when their code changes: a ``__getitem__`` that now decodes a larger image, a step
that now runs a bigger model. So the description also carries a fingerprint of their
code: a hash of the bytecode (not the source: a class made in a notebook or by ``exec``
has none) of

- the dataset's ``__getitem__``, ``__getitems__``, ``__len__`` and ``__iter__``, and
  those of the datasets it holds (a ``Subset``'s, a ``ConcatDataset``'s);
- the step: a function, a bound method, a ``functools.partial``'s function, or a
  callable object's ``__call__``;
- and, from each, what its code reaches by name: functions of the class it was looked
  up on (``self.decode(...)``), functions its closure holds, and functions of its own
  module that it calls (``augment(...)``), up to ``_MOST_FUNCTIONS`` in all.

The hash covers the instructions, constants and names, not the file or line numbers (a
function moved in its file is the same code), and is the same in every process: no
address, and the sets among the constants sorted. It is prefixed with the Python
version that compiled it, whose bytecode differs from another's. Code reached through
objects (a ``transform`` attribute, a model held by the step) is not covered: the
check by measurement of a reused setting (``NOTE [ A reused setting checked ]``) sees
what it changes. An object with no Python code to hash is ``"not fingerprinted"``.
"""

from __future__ import annotations

import functools
import hashlib
import sys
import types
from collections.abc import Callable, Iterator
from typing import Any

from torch.utils.data import Dataset

NOT_FINGERPRINTED = "not fingerprinted"

# Functions hashed for one object at most: what the code reaches stays cheap to follow.
_MOST_FUNCTIONS = 64
# The methods by which a DataLoader reads a dataset.
_READS = ("__getitem__", "__getitems__", "__len__", "__iter__")


def dataset_code(dataset: Dataset[Any]) -> str:
    """The fingerprint of the code that reads ``dataset`` (``NOTE [ Code fingerprints ]``)."""
    code = _Fingerprint()
    seen: set[int] = set()
    stack: list[object] = [dataset]
    while stack:
        held = stack.pop(0)
        if id(held) in seen:
            continue
        seen.add(id(held))
        owner = type(held)
        for name in _READS:
            for found in _defined(owner, name):
                code.add(found, owner)
        for value in getattr(held, "__dict__", {}).values():
            stack.extend(_datasets_in(value))
    return code.digest()


def step_code(step_fn: Callable[[Any], object]) -> str:
    """The fingerprint of the code of ``step_fn`` (``NOTE [ Code fingerprints ]``)."""
    code = _Fingerprint()
    target: object = step_fn
    while isinstance(target, functools.partial):
        target = target.func
    if isinstance(target, types.MethodType):
        code.add(target.__func__, type(target.__self__))
    elif isinstance(target, types.FunctionType):
        code.add(target, None)
    else:
        for found in _defined(type(target), "__call__"):
            code.add(found, type(target))
    return code.digest()


def _datasets_in(value: object) -> Iterator[Dataset[Any]]:
    if isinstance(value, Dataset):
        yield value
    elif isinstance(value, (list, tuple)):
        yield from (item for item in value if isinstance(item, Dataset))


class _Fingerprint:
    """The functions hashed so far, in the order they were reached."""

    def __init__(self) -> None:
        self.hash = hashlib.sha256()
        self.seen: set[int] = set()

    def add(self, found: object, owner: type | None) -> None:
        """Hash ``found`` (a function, or a static or class method of ``owner``) and
        what its code reaches by name."""
        queue: list[tuple[object, type | None]] = [(found, owner)]
        while queue and len(self.seen) < _MOST_FUNCTIONS:
            item, cls = queue.pop(0)
            if isinstance(item, (staticmethod, classmethod)):
                item = item.__func__
            if not isinstance(item, types.FunctionType) or id(item) in self.seen:
                continue
            self.seen.add(id(item))
            self.hash.update(item.__qualname__.encode())
            _hash_code(self.hash, item.__code__)
            queue.extend(_reached(item, cls))

    def digest(self) -> str:
        if not self.seen:
            return NOT_FINGERPRINTED
        version = f"{sys.version_info.major}.{sys.version_info.minor}"
        return f"python {version}: {self.hash.hexdigest()[:16]}"


def _reached(
    function: types.FunctionType, owner: type | None
) -> Iterator[tuple[object, type | None]]:
    """The functions ``function``'s code reaches by name: its class's, its closure's and
    its module's own."""
    for cell in function.__closure__ or ():
        try:
            held = cell.cell_contents
        except ValueError:  # a cell not filled yet
            continue
        if isinstance(held, types.MethodType):
            yield held.__func__, type(held.__self__)
        elif isinstance(held, types.FunctionType):
            yield held, None
    module = function.__module__
    for name in _names(function.__code__):
        defined = list(_defined(owner, name)) if owner is not None else []
        if defined:
            yield from ((method, owner) for method in defined)
            continue
        value = function.__globals__.get(name)
        if isinstance(value, types.FunctionType) and value.__module__ == module:
            yield value, None


def _defined(owner: type, name: str) -> Iterator[object]:
    """Every definition of ``name`` along ``owner``'s classes, the overridden ones too
    (``super().__getitem__(index)`` reaches them)."""
    for cls in owner.__mro__:
        if name in vars(cls):
            yield vars(cls)[name]


def _names(code: types.CodeType) -> Iterator[str]:
    yield from code.co_names
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _names(const)


def _hash_code(hash: Any, code: types.CodeType) -> None:
    """Hash what ``code`` does, not where it is: no file name, no line numbers."""
    for part in (
        code.co_code,
        repr(code.co_names).encode(),
        repr(code.co_varnames).encode(),
        repr(code.co_freevars).encode(),
        repr(code.co_cellvars).encode(),
        repr((code.co_argcount, code.co_kwonlyargcount, code.co_posonlyargcount)).encode(),
    ):
        hash.update(part)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            _hash_code(hash, const)
        else:
            hash.update(_stable_repr(const).encode())


def _stable_repr(value: object) -> str:
    """``repr(value)`` the same in every process: a set's order follows string hashing,
    which changes with each process (PYTHONHASHSEED)."""
    if isinstance(value, frozenset):
        return "frozenset(" + repr(sorted(_stable_repr(item) for item in value)) + ")"
    if isinstance(value, tuple):
        return "(" + ", ".join(_stable_repr(item) for item in value) + ")"
    return repr(value)
