"""The result of a run, its JSON file, and its presenters.

Modules; the presenters take a result, and the result imports none of them::

    _report     report(result): the settings against the defaults, the bottleneck, advice
    _plot       plot(result): the trials as a picture (matplotlib, optional)
    _progress   the progress bar of a running search
    _result     TuneResult: the tuned settings, their loader, save() and load()
    _record     TrialRecord: one measured setting
    _fields     a saved result's fields, each checked as it is read
    _files      a result's file: where one can be written, reading one safely
"""

from autoloader.results._files import check_writable, read_result_json
from autoloader.results._plot import plot
from autoloader.results._progress import Progress
from autoloader.results._record import TrialRecord, record_of
from autoloader.results._report import describe, report
from autoloader.results._result import (
    SCHEMA_VERSION,
    TuneResult,
    in_memory_kwargs,
    load,
    split_loader_kwargs,
)

__all__ = [
    "SCHEMA_VERSION",
    "Progress",
    "TrialRecord",
    "TuneResult",
    "check_writable",
    "describe",
    "in_memory_kwargs",
    "load",
    "plot",
    "read_result_json",
    "record_of",
    "report",
    "split_loader_kwargs",
]
