"""A result kept in a file and reused: ``tune(path=...)`` on a problem tuned before,
on the same machine, searches nothing.

A result file names its problem part by part (:attr:`TuneResult.problem`: the dataset's
type and length, the step, the batch size, the search space asked, the fixed loader
options, the device, the fingerprints of the dataset's and the step's code) and the
machine it was measured on (its environment). A later run reuses the file only where
both are the same, and once a measurement of its setting agrees
(``NOTE [ A reused setting checked ]``, in ``_reuse_check.py``); where not, it says
which part differs, or what moved, tunes again and replaces the file. A file that
cannot be read, or whose run was interrupted, is tuned again too. Under torchrun,
global rank 0 reads the file (it is the one that writes it) and every rank takes its
decision.

NOTE [ An unfinished search kept ]
A training run can end before ``AutoLoader``'s search does (a first run of a few
epochs, a debugging run, a job stopped early). Its trials are not lost: where the loader
has a ``path``, the search's study is kept beside it (:func:`study_beside`, an Optuna
journal, written as each trial ends), and the next run of the same problem, finding no
finished result at ``path``, continues that study: the trials it finished are not
measured again and the search goes on where it stopped. Once the search ends and its
result is saved at ``path``, the study beside it is removed: the result holds every
trial. The journal is opened only where the search starts (a result reused opens
nothing); one that cannot be opened, or that another live run is tuning, leaves the
search in memory, with a warning.
"""

from __future__ import annotations

import dataclasses
import logging
import warnings
from pathlib import Path

from autoloader._exceptions import EnvironmentMismatchWarning, ResultFileError
from autoloader._problem import Problem
from autoloader.distributed import Ranks
from autoloader.results import TuneResult, in_memory_kwargs, load

_logger = logging.getLogger("autoloader")


def study_beside(path: Path) -> Path:
    """Where ``AutoLoader`` keeps the study of a search not finished yet, beside its
    result file ``path`` (``NOTE [ An unfinished search kept ]``)."""
    return path.with_name(path.name + ".study")


def reused(problem: Problem, ranks: Ranks | None) -> TuneResult | None:
    """The result kept at ``problem.path`` if it is this problem's on this machine,
    else ``None`` (logged with the reason); the same on every rank."""
    if problem.path is None:
        return None
    found = _saved(problem) if ranks is None or ranks.drives else None
    if ranks is not None:
        found = ranks.broadcast(found, during="reading the saved result")
    if found is None:
        return None
    # The options a file cannot keep (a sampler, a collate_fn): this process's own.
    return dataclasses.replace(found, _in_memory_kwargs=in_memory_kwargs(problem.fixed))


def _saved(problem: Problem) -> TuneResult | None:
    path = problem.path
    assert path is not None
    if not path.exists():
        _logger.info("no result at %s yet: tuning, then saving the result there", path)
        return None
    try:
        with warnings.catch_warnings():
            # Told below, with the problem's differences, as the reason to tune again.
            warnings.simplefilter("ignore", EnvironmentMismatchWarning)
            result = load(path)
    except ResultFileError as error:
        _logger.warning("not reusing %s: %s. Tuning again; the file will be replaced.", path, error)
        return None
    differences = differences_from(result, problem)
    if differences:
        _logger.warning(
            "not reusing %s, tuned for another problem or machine (%s). Tuning again; "
            "the file will be replaced.",
            path,
            "; ".join(differences),
        )
        return None
    _logger.info(
        "reusing the settings in %s, tuned for this problem on this machine: %s "
        "(%.2fx the defaults)",
        path,
        result.params,
        result.speedup,
    )
    return result


def differences_from(result: TuneResult, problem: Problem) -> list[str]:
    """How ``problem`` differs from the one ``result`` was tuned for, one phrase per
    difference; empty when ``result`` can be reused for it.

    A file saved before the problem carried its code's fingerprints (``NOTE [ Code
    fingerprints ]``) is not refused for that: its code is not compared, and the check
    by measurement (``NOTE [ A reused setting checked ]``) tells whether it still holds."""
    if result.partial:
        return ["its tuning run was interrupted before it ended"]
    if not result.problem:
        return ["it was saved by an earlier autoloader, which did not record the problem"]
    now = problem.key()
    parts = sorted(set(now) | set(result.problem))
    differ = {part for part in parts if result.problem.get(part) != now.get(part)}
    found = [
        _difference(part, result.problem.get(part), now.get(part))
        for part in parts
        if part in differ
        # A file without fingerprints; or another type: its code differs too.
        and not (
            part in _CODE_PARTS and (part not in result.problem or _CODE_PARTS[part][1] in differ)
        )
    ]
    return found + result.environment.differences(problem.environment)


# The parts that fingerprint code (NOTE [ Code fingerprints ]): whose code, and the part
# that names its type.
_CODE_PARTS = {"dataset code": ("the dataset's", "dataset"), "step code": ("the step's", "step_fn")}


def _difference(part: str, then: str | None, now: str | None) -> str:
    """One part that differs, in words: a code fingerprint as the code that changed."""
    if part not in _CODE_PARTS:
        return f"{part}: {then} then, {now} now"
    whose = _CODE_PARTS[part][0]
    compiled = [value.split(":")[0] for value in (then, now) if value and ":" in value]
    if len(compiled) == 2 and compiled[0] != compiled[1]:
        return f"{whose} code cannot be compared ({compiled[0]} then, {compiled[1]} now)"
    return f"{whose} code changed"
