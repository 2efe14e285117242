"""autoloader: the fastest safe PyTorch DataLoader settings for your pipeline and machine.

Example::

    import autoloader

    result = autoloader.tune(dataset, train_step, batch_size=64)
    result.save("best.json")
    print(autoloader.report(result))
    loader = result.make_loader(dataset)
"""

import importlib
import logging
import typing

from autoloader._exceptions import (
    AllSettingsFailedError,
    AutoloaderError,
    BaselineError,
    EnvironmentMismatchWarning,
    InvalidInputError,
    IsolationError,
    LoopError,
    RankError,
    ResultFileError,
    StorageError,
    StudyInUseError,
    UnpicklableError,
)

if typing.TYPE_CHECKING:
    from autoloader._autoloader import AutoLoader
    from autoloader._diagnose import Diagnosis, diagnose
    from autoloader._preserve import preserved
    from autoloader._tune import tune
    from autoloader.checks import Environment
    from autoloader.loader import ThreadLoader
    from autoloader.results import TrialRecord, TuneResult, load, plot, report
    from autoloader.search import SearchSpace

# NOTE [ A package imported on demand ]
# `import autoloader` imports its errors only; each other public name is imported from
# its module the first time it is asked for (PEP 562), then kept here. A process that
# needs one part imports that part: a DataLoader worker started by spawn or forkserver
# (Windows, macOS, Python 3.14's Linux default) unpickles autoloader's worker code
# (`autoloader.loader`) and imported the whole package with it, the search (Optuna,
# SQLAlchemy) and the results included: four spawned workers took 2.32 s of CPU each
# and 3.42 s to the first batch, against 1.90 s and 2.66 s now
# (benchmarks/spawn_worker_start.py), paid again each epoch without persistent workers.
_ON_DEMAND = {
    "AutoLoader": "autoloader._autoloader",
    "Diagnosis": "autoloader._diagnose",
    "diagnose": "autoloader._diagnose",
    "preserved": "autoloader._preserve",
    "tune": "autoloader._tune",
    "Environment": "autoloader.checks",
    "ThreadLoader": "autoloader.loader",
    "TrialRecord": "autoloader.results",
    "TuneResult": "autoloader.results",
    "load": "autoloader.results",
    "plot": "autoloader.results",
    "report": "autoloader.results",
    "SearchSpace": "autoloader.search",
}


def __getattr__(name: str) -> object:
    module = _ON_DEMAND.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_ON_DEMAND})


__version__ = "0.1.0"

# A library's logger (Python's logging HOWTO, "Configuring Logging for a Library"): its
# records go where the application's logging sends them, and nowhere (not to stderr
# through logging's last resort) where the application configured none. The CLI does
# (logging.basicConfig); AutoLoader(verbose=True) and tune()'s progress print their own.
logging.getLogger("autoloader").addHandler(logging.NullHandler())

__all__ = [
    "AllSettingsFailedError",
    "AutoLoader",
    "AutoloaderError",
    "BaselineError",
    "Diagnosis",
    "Environment",
    "EnvironmentMismatchWarning",
    "InvalidInputError",
    "IsolationError",
    "LoopError",
    "RankError",
    "ResultFileError",
    "SearchSpace",
    "StorageError",
    "StudyInUseError",
    "ThreadLoader",
    "TrialRecord",
    "TuneResult",
    "UnpicklableError",
    "__version__",
    "diagnose",
    "load",
    "plot",
    "preserved",
    "report",
    "tune",
]
