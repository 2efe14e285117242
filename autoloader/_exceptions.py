"""Exceptions raised by autoloader.

The tree::

    AutoloaderError
    ├── InvalidInputError (also a ValueError)   bad arguments, found before any work starts
    │   └── UnpicklableError                    an object workers need cannot be pickled
    ├── BaselineError                           the num_workers=0 run failed: the dataset,
    │                                           collate_fn or step_fn is broken, not a setting
    ├── AllSettingsFailedError                  every setting with workers failed: the
    │                                           pipeline does not run in worker processes
    ├── LoopError                               diagnose(): the loop over the user's
    │                                           loader failed
    ├── IsolationError                          under isolation="subprocess", a trial's
    │                                           process could not start or load its work
    ├── RankError                               under torchrun, another rank stopped
    │                                           answering, or the ranks disagree
    ├── ResultFileError                         a saved result cannot be read back
    └── StorageError                            the study's storage (storage=) cannot
        │                                       be used: a journal file not readable
        └── StudyInUseError                     another live run is tuning the same
                                                study in that storage

    EnvironmentMismatchWarning (a UserWarning)  a loaded result was measured elsewhere
"""

from __future__ import annotations


class AutoloaderError(Exception):
    """Base class of every error autoloader raises on purpose."""


class InvalidInputError(AutoloaderError, ValueError):
    """An argument is wrong; raised before any loader is built or any trial is run."""


class UnpicklableError(InvalidInputError):
    """An object the DataLoader workers need cannot be pickled under the start method."""


class BaselineError(AutoloaderError):
    """The ``num_workers=0`` baseline failed, so no setting can be measured.

    The original exception is chained as ``__cause__``.
    """


class AllSettingsFailedError(AutoloaderError):
    """Every setting tried so far failed while the baseline works.

    The fault is in running the pipeline in worker processes, not in one setting, so
    the run stops instead of spending its budget on more failures.
    """


class LoopError(AutoloaderError):
    """:func:`autoloader.diagnose` could not run the loop over the given loader: the
    dataset, collate_fn or step_fn raised, or a worker died. The original exception is
    chained as ``__cause__``.
    """


class IsolationError(AutoloaderError):
    """Under ``isolation="subprocess"``, a trial's process, or the helper that forks
    them, died before it could run.

    Nothing about a setting was learnt: the process could not start (a script without
    an ``if __name__ == "__main__":`` guard) or load what it was sent.
    """


class RankError(AutoloaderError):
    """Under ``torchrun``, the ranks could not tune together: another rank stopped
    answering (it died, or hangs outside a trial), or the ranks called
    :func:`autoloader.tune` with different arguments. Every rank raises it; the first
    error in the other ranks' output says which rank and why.
    """


class ResultFileError(AutoloaderError):
    """A result file is missing, malformed or of an unknown schema version."""


class StorageError(AutoloaderError):
    """The storage given as ``storage=`` (``--storage``) cannot be used as it is: the
    message says what to do with it."""


class StudyInUseError(StorageError):
    """Another tuning run, still alive, is tuning the same study in the same storage.

    Two runs at once would measure each trial under the other's load and mix their
    trials; the message names the live run (host, pid, since when). Raised before any
    trial is recorded: by ``tune()`` before its first, by ``AutoLoader`` as its first
    ends (its training goes on meanwhile; that trial is recorded failed).
    """


class EnvironmentMismatchWarning(UserWarning):
    """A loaded result was measured on a machine that differs from this one."""
