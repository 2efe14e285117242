"""The public surface changes only on purpose (as httpx's test_exported_members)."""

import inspect
import re
import subprocess
import sys
import types
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import autoloader


def test_all_is_every_public_name_of_the_package() -> None:
    """``__all__`` lists every public name the package defines, and nothing else:
    a name added to ``__init__`` without ``__all__`` (or the reverse) fails here.
    Subpackages (``autoloader.search``) are reached by their path, not exported. The
    names imported on demand (NOTE [ A package imported on demand ]) count as well."""
    public = {
        name
        for name in dir(autoloader)
        if (not name.startswith("_") or name == "__version__")
        and not isinstance(getattr(autoloader, name), types.ModuleType)
    }
    assert sorted(autoloader.__all__) == sorted(public)
    assert list(autoloader.__all__) == sorted(autoloader.__all__)


def test_every_exported_error_shares_the_one_root() -> None:
    errors = [
        value
        for name in autoloader.__all__
        if inspect.isclass(value := getattr(autoloader, name))
        and issubclass(value, Exception)
        and not issubclass(value, Warning)
    ]
    assert len(errors) >= 7
    assert all(issubclass(error, autoloader.AutoloaderError) for error in errors)
    assert issubclass(autoloader.InvalidInputError, ValueError)


def test_every_exported_name_is_documented() -> None:
    for name in autoloader.__all__:
        value = getattr(autoloader, name)
        if callable(value):
            assert inspect.getdoc(value), f"{name} has no docstring"


def _runs_with_this_torch() -> bool:
    """Whether the package finds the machine and builds a loader with the torch as it is
    now: its AttributeError or TypeError is what an API torch lacks would raise."""
    from autoloader.loader._factory import build_loader, merge_loader_kwargs
    from autoloader.loader._params import BASELINE_PARAMS

    try:
        autoloader.Environment.current()
        build_loader(
            TensorDataset(torch.zeros(8, 2)), merge_loader_kwargs(BASELINE_PARAMS, batch_size=4)
        )
    except (AttributeError, TypeError):
        return False
    return True


def test_the_torch_floor_covers_the_apis_the_package_uses(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``torch.accelerator`` and ``DataLoader(in_order=...)`` arrived in torch 2.6: if the
    package breaks on a torch without them (2.5, simulated here), the floor in
    pyproject.toml must not promise an older torch."""
    package = Path(autoloader.__file__).parent
    pyproject = (package.parent / "pyproject.toml").read_text()
    floor = re.search(r'^\s*"torch>=(\d+)\.(\d+)', pyproject, re.MULTILINE)
    assert floor is not None, "pyproject.toml has no torch>= floor"
    assert _runs_with_this_torch()
    init = DataLoader.__init__

    def init_of_torch_2_5(self: DataLoader[Any], *args: Any, **kwargs: Any) -> None:
        if "in_order" in kwargs:
            raise TypeError("DataLoader.__init__() got an unexpected keyword argument 'in_order'")
        init(self, *args, **kwargs)

    with monkeypatch.context() as torch_2_5:
        torch_2_5.delattr(torch, "accelerator")
        torch_2_5.setattr(DataLoader, "__init__", init_of_torch_2_5)
        needs = (2, 0) if _runs_with_this_torch() else (2, 6)
    assert (int(floor[1]), int(floor[2])) >= needs


def test_the_version_is_kept_in_one_place() -> None:
    """The installed distribution's version is read from ``autoloader.__version__``
    (``dynamic`` in pyproject.toml), under the distribution's own name."""
    from importlib.metadata import version

    pyproject = (Path(autoloader.__file__).parent.parent / "pyproject.toml").read_text()
    assert 'name = "torch-autoloader"' in pyproject
    assert 'dynamic = ["version"]' in pyproject
    assert version("torch-autoloader") == autoloader.__version__


@pytest.mark.slow  # over 2.5 s here: the full suite's (docs/development/checks.md)
def test_importing_the_package_imports_a_part_when_it_is_asked_for() -> None:
    """``import autoloader`` imports torch's DataLoader and no search: a spawned worker
    that unpickles autoloader's worker code pays for the loader alone (NOTE [ A package
    imported on demand ]); a public name brings its part when first asked for."""
    code = (
        "import sys, autoloader, autoloader.loader\n"
        "print('optuna' in sys.modules, 'autoloader.results' in sys.modules)\n"
        "autoloader.tune\n"
        "print('optuna' in sys.modules, autoloader.TuneResult.__module__)\n"
    )
    ran = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert ran.returncode == 0, ran.stderr
    assert ran.stdout.split() == ["False", "False", "True", "autoloader.results._result"]
    with pytest.raises(AttributeError, match="has no attribute 'tuner'"):
        autoloader.tuner  # noqa: B018
