"""autoloader: the fastest safe PyTorch DataLoader settings for your pipeline and machine.

Example::

    import autoloader

    result = autoloader.tune(dataset, train_step, batch_size=64)
    result.save("best.json")
    print(autoloader.report(result))
    loader = result.make_loader(dataset)
"""

import logging

from autoloader._autoloader import AutoLoader
from autoloader._diagnose import Diagnosis, diagnose
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
from autoloader._preserve import preserved
from autoloader._tune import tune
from autoloader.checks import Environment
from autoloader.loader import ThreadLoader
from autoloader.results import TrialRecord, TuneResult, load, plot, report
from autoloader.search import SearchSpace

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
