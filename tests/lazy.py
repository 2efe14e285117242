"""Modules a test imports when it runs, not when pytest collects its test module.

Every pytest-xdist worker collects, so imports, every test module, and each DataLoader
worker a test forks copies its process's page tables: Lightning imported at collection
(157 MB, 2,100 modules) made a fork of the worker cost 38 ms of CPU where it cost 18 ms
without it, for every worker of every trial in the suite; transformers and accelerate
(1 s to import, 40 MB, 650 modules) 16-18 ms where it cost 14 ms. A test module names such a
module with :class:`LazyModule`; the first test to use an attribute imports it then, or
is skipped where it is not installed, as ``pytest.importorskip`` skips a module.
``tests/conftest.py`` records which of them collecting imported, and
``tests/test_lazy.py`` checks that it imported none.
"""

from __future__ import annotations

import importlib.util
import sys
import types
from typing import Any, ClassVar

import pytest


class LazyModule:
    """The module ``name``, imported at the first attribute asked of it."""

    names: ClassVar[set[str]] = set()  # every LazyModule's, for the check after collection

    def __init__(self, name: str) -> None:
        self._name = name
        self._module: types.ModuleType | None = None
        LazyModule.names.add(name)

    def __getattr__(self, attribute: str) -> Any:
        if attribute.startswith("__") and attribute.endswith("__"):
            # What pytest asks of every object of a module it collects (``__test__``,
            # ``__bases__``), and copy and pickle of any object: not the module's.
            raise AttributeError(attribute)
        if self._module is None:
            self._module = pytest.importorskip(self._name)
        return getattr(self._module, attribute)

    def __repr__(self) -> str:
        return f"LazyModule({self._name!r})"


def imported(names: set[str]) -> set[str]:
    """Those of ``names`` imported already."""
    return {name for name in names if name in sys.modules}


def skip_unless_installed(*names: str) -> pytest.MarkDecorator:
    """A test module's ``pytestmark`` where its tests need ``names`` and import them as
    they run: skipped where one is not installed, found without importing it."""
    absent = [name for name in names if importlib.util.find_spec(name) is None]
    return pytest.mark.skipif(bool(absent), reason=f"not installed: {', '.join(absent)}")
