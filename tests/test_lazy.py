"""Modules the tests import when they run (``tests/lazy.py``): collecting the suite
imports none of them, so that a pytest-xdist worker forks DataLoader workers from a
process without Lightning (or transformers, or accelerate) until a test of it runs
there."""

from __future__ import annotations

import sys

import pytest

from tests.conftest import IMPORTED_AT_COLLECTION
from tests.lazy import LazyModule, skip_unless_installed


def test_collecting_imported_no_module_the_tests_import_when_they_run(
    pytestconfig: pytest.Config,
) -> None:
    if not LazyModule.names:
        pytest.skip("no test module that imports a module when it runs was collected")
    assert pytestconfig.stash[IMPORTED_AT_COLLECTION] == set()


def test_a_lazy_module_is_imported_at_its_first_attribute_and_not_before() -> None:
    name = "tests.lazy_target"
    sys.modules.pop(name, None)
    lazy = LazyModule(name)
    # What pytest asks of each object of a module it collects, which must not import.
    assert getattr(lazy, "__test__", False) is False
    assert not hasattr(lazy, "__bases__")
    assert name not in sys.modules
    try:
        assert lazy.VALUE == 7
        assert name in sys.modules
    finally:
        sys.modules.pop(name, None)


def test_a_test_using_a_module_that_is_not_installed_is_skipped() -> None:
    lazy = LazyModule("a_module_that_is_not_installed")
    with pytest.raises(pytest.skip.Exception, match="a_module_that_is_not_installed"):
        lazy.anything  # noqa: B018


def test_a_module_whose_tests_need_a_module_not_installed_is_skipped_without_importing() -> None:
    name = "tests.lazy_target"
    sys.modules.pop(name, None)
    needed = skip_unless_installed(name)
    assert needed.args == (False,) and name not in sys.modules
    missing = skip_unless_installed(name, "a_module_that_is_not_installed")
    assert missing.args == (True,)
    assert missing.kwargs["reason"] == "not installed: a_module_that_is_not_installed"
