"""The outcome of a tuning run: per-trial records, the tuned settings, and their JSON file."""

from __future__ import annotations

import json
import logging
import math
import os
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torch.utils.data import DataLoader, Dataset

from autoloader._exceptions import EnvironmentMismatchWarning, ResultFileError
from autoloader.checks import Environment, world, world_nodes
from autoloader.loader import build_loader, dataloader_kwargs, merge_loader_kwargs, set_step_threads
from autoloader.results._fields import (
    JSON_SCALARS,
    amount,
    check_counts,
    checked_settings,
    count,
    environment_of,
    facts_of,
    is_int,
    optional_amount,
    problem_of,
    shown,
    strings,
    trial_record,
    typed,
)
from autoloader.results._files import new_file, read_result_json
from autoloader.results._record import TrialRecord
from autoloader.search import default_max_workers

_logger = logging.getLogger(__name__)

SCHEMA_VERSION = 7
# Version 1 had no batched_fetch, worker_threads or in_order; their defaults are what
# it measured. Version 2 had no trial kinds: they are read from the reasons' words.
# Version 3 had no worker_kind: its workers were processes. Versions 1 to 4 kept one
# throughput and baseline, the steady rates (the settings were chosen by the epoch
# rate, which they did not keep): those are read as the steady rates and kept as
# throughput and baseline too; their start-up is unknown. Versions 1 to 5 did not
# name their problem: tune(path=...) tunes again rather than reuse them. Versions 1 to
# 6 had no step_threads: they left the training process's threads as they were.
_READABLE_VERSIONS = (1, 2, 3, 4, 5, 6, 7)


@dataclass(frozen=True)
class TuneResult:
    """Tuned DataLoader settings and how they were measured.

    Attributes:
        params: the tuned settings, by name: ``DataLoader`` options (``num_workers``,
            ``prefetch_factor``, ``persistent_workers``, ``pin_memory``, ``in_order``)
            and autoloader's own keys, which no ``DataLoader`` takes
            (``batched_fetch``, ``worker_threads``, ``worker_kind``, and
            ``step_threads``, the training process's torch threads, ``None`` where
            left as they were). Not for ``DataLoader(**params)``:
            :meth:`loader_kwargs` turns them into the keyword arguments to splat,
            :meth:`make_loader` builds the loader, and :meth:`apply_threads` sets
            ``step_threads``, which no loader can carry.
        throughput: samples per second of the training loop with ``params`` over a
            training epoch, worker start-up included: the objective the settings were
            chosen by (``NOTE [ Epoch model ]``), the median over the setting's trials.
            In files of schema versions 1 to 4, the steady rate (see below).
        baseline: the same for the ``num_workers=0`` defaults, measured in the same run.
        steady_throughput: samples/s with ``params`` once the workers run, start-up
            excluded (median over the same trials); ``None`` if not given. Files of
            versions 1 to 4 kept only this rate: it is also their ``throughput``.
        steady_baseline: the same for the defaults.
        startup_seconds: seconds to start the workers of ``params`` and get the first
            batch; ``None`` if unknown (files of versions 1 to 4).
        startup_each_epoch: whether every epoch pays ``startup_seconds`` (workers not
            persistent: ``throughput`` includes it) or only the first of a training run
            (persistent workers: ``throughput`` charges later epochs a refill only).
        batch_size: the batch size tuned for.
        trials: one record per trial, in the order they ran.
        environment: the machine the figures were measured on.
        tuning_seconds: wall time of the tuning run.
        memory_budget: bytes the process tree was allowed during trials.
        notes: facts about the run a user should know (settings fixed, limits hit).
        partial: the run was interrupted; the settings are the best of the trials
            that finished.
        fixed_loader_kwargs: the user's fixed DataLoader options that the file keeps.
        unsaved_loader_kwargs: names of fixed options the file cannot keep (a
            collate_fn, a sampler...): pass them to :meth:`make_loader` after
            :func:`autoloader.load`.
        facts: what was checked of the dataset and machine before the search (see
            ``autoloader.checks._facts``), for the report's advice.
        problem: the tuning problem by name, part by part (the dataset's type and
            length, the step, the batch size, the search space, the fixed options,
            the device): ``tune(path=...)`` reuses the file only for the same problem
            on the same machine. Empty in files of versions 1 to 5.

    Example::

        result = autoloader.tune(dataset, step, batch_size=64)
        result.save("best.json")
        loader = result.make_loader(dataset)
    """

    params: dict[str, Any]
    throughput: float
    baseline: float
    batch_size: int
    trials: tuple[TrialRecord, ...]
    environment: Environment
    tuning_seconds: float
    memory_budget: int
    steady_throughput: float | None = None
    steady_baseline: float | None = None
    startup_seconds: float | None = None
    startup_each_epoch: bool = False
    notes: tuple[str, ...] = ()
    partial: bool = False
    fixed_loader_kwargs: dict[str, Any] = field(default_factory=dict)
    unsaved_loader_kwargs: tuple[str, ...] = ()
    facts: dict[str, Any] = field(default_factory=dict)
    problem: dict[str, str] = field(default_factory=dict)
    _in_memory_kwargs: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @property
    def speedup(self) -> float:
        """``throughput / baseline``: over a training epoch, start-up included."""
        return self.throughput / self.baseline if self.baseline > 0 else math.inf

    def versus_defaults(self) -> str:
        """The speedup in words: ``"2.57x the defaults"``, or where the defaults timed
        no batch (a budget spent before any came), that no ratio was measured."""
        if self.baseline > 0:
            return f"{self.speedup:.2f}x the defaults"
        return "no ratio to the defaults (they timed no batch)"

    @property
    def chosen_trial(self) -> TrialRecord | None:
        """The latest complete measurement of the tuned setting (a runoff one if any)."""
        matches = [t for t in self.trials if t.state == "complete" and t.params == self.params]
        return matches[-1] if matches else None

    @property
    def step_ceiling(self) -> float | None:
        """Samples/s the step alone allows (batch size over the step's time, measured in
        the tuned setting's trial): no loader setting can run faster."""
        chosen = self.chosen_trial
        if chosen is None or not chosen.step_seconds:
            return None
        return self.batch_size / chosen.step_seconds

    def loader_kwargs(
        self, dataset: Dataset[Any] | None = None, /, **overrides: Any
    ) -> dict[str, Any]:
        """Keyword arguments for ``DataLoader(dataset, ...)``: the batch size, the user's
        fixed options and the tuned settings, with ``overrides`` winning.

        Settings that fetch whole batches (``batched_fetch``) build their sampler over
        ``dataset``, which must then be given; settings that limit the workers' threads
        (``worker_threads``) come as a ``worker_init_fn`` that then calls the user's.
        Settings with thread workers (``worker_kind="threads"``) are keyword arguments
        for :class:`~autoloader.ThreadLoader`, not ``DataLoader``: use
        :meth:`make_loader`, which picks the class.

        Raises:
            InvalidInputError: the settings fetch whole batches and ``dataset`` is missing, or
                an override does not go with them (a ``collate_fn``: pass
                ``batched_fetch=False`` with it).
        """
        return dataloader_kwargs(dataset, self._options(overrides))

    def _options(self, overrides: dict[str, Any]) -> dict[str, Any]:
        """The loader's options (:func:`merge_loader_kwargs`), warning of fixed options
        the file could not keep and the caller did not pass again."""
        missing = [k for k in self.unsaved_loader_kwargs if k not in overrides]
        missing = [k for k in missing if k not in self._in_memory_kwargs]
        if missing:
            warnings.warn(
                f"The tuning run used {', '.join(missing)}, which a JSON file cannot keep; "
                f"pass {'it' if len(missing) == 1 else 'them'} as keyword arguments "
                f"(e.g. make_loader(dataset, {missing[0]}=...)) to load as tuned.",
                stacklevel=3,  # the caller of loader_kwargs() or make_loader()
            )
        fixed = {**self.fixed_loader_kwargs, **self._in_memory_kwargs}
        return merge_loader_kwargs(
            self.params, batch_size=self.batch_size, fixed=fixed, overrides=overrides
        )

    def make_loader(self, dataset: Dataset[Any], **overrides: Any) -> DataLoader[Any]:
        """A ``DataLoader`` over ``dataset`` with the tuned settings; overrides win.

        With thread workers tuned (``params["worker_kind"] == "threads"``), a
        :class:`~autoloader.ThreadLoader`: a ``DataLoader`` whose workers are threads
        of this process (see ``NOTE [ Thread workers ]``).

        The loader does not set ``params["step_threads"]``, the training process's
        torch threads the settings were measured with: no loader can carry a setting
        of the process. Call :meth:`apply_threads` too.

        Example::

            loader = result.make_loader(dataset)
            result.apply_threads()  # torch.set_num_threads(...) as tuned
        """
        return build_loader(dataset, self._options(overrides))

    def apply_threads(self) -> int | None:
        """Set this process's torch threads (``torch.set_num_threads``) to the tuned
        ``params["step_threads"]``, as the settings were measured with; nothing where
        they were left as they are (``None``). Call it in the process that trains, once
        before training (under torchrun, on every rank).

        Returns:
            The thread count the process had before, to put back with
            ``torch.set_num_threads`` if needed; ``None`` if nothing was changed.
        """
        return set_step_threads(self.params.get("step_threads"))

    def as_dict(self) -> dict[str, Any]:
        """The JSON-able content of the result file."""
        return {
            "schema_version": SCHEMA_VERSION,
            "params": dict(self.params),
            "throughput": self.throughput,
            "baseline": self.baseline,
            "speedup": self.speedup,
            "steady_throughput": self.steady_throughput,
            "steady_baseline": self.steady_baseline,
            "startup_seconds": self.startup_seconds,
            "startup_each_epoch": self.startup_each_epoch,
            "batch_size": self.batch_size,
            "fixed_loader_kwargs": dict(self.fixed_loader_kwargs),
            "unsaved_loader_kwargs": list(self.unsaved_loader_kwargs),
            "tuning_seconds": self.tuning_seconds,
            "memory_budget": self.memory_budget,
            "notes": list(self.notes),
            "partial": self.partial,
            "environment": self.environment.as_dict(),
            "facts": dict(self.facts),
            "problem": dict(self.problem),
            "trials": [t.as_dict() for t in self.trials],
        }

    def save(self, path: str | os.PathLike[str]) -> Path | None:
        """Write the result as JSON; the file is replaced atomically: written beside it
        under a hidden name, then renamed over it, so that a reader, or a process killed
        while saving, finds the old file or the new one, never part of one. Its
        permissions follow the umask, as ``open()``'s do.

        In a torchrun job that tuned jointly, every rank holds the same result and only
        global rank 0 writes it: the others write nothing and return ``None`` (logged
        at INFO), so that every rank can call ``save()`` on a shared file system.

        Returns:
            The path written, or ``None`` on a rank that does not write.
        """
        path = Path(path)
        rank, _, _ = world()
        if self.environment.world_size > 1 and rank != 0:
            _logger.info(
                "rank %d of a joint tuning: not writing %s, which rank 0 writes", rank, path
            )
            return None
        text = json.dumps(self.as_dict(), indent=2, allow_nan=False) + "\n"
        path.parent.mkdir(parents=True, exist_ok=True)
        descriptor, temporary = new_file(path)
        try:
            with os.fdopen(descriptor, "w") as file:
                file.write(text)
                file.flush()
                os.fsync(file.fileno())
            os.replace(temporary, path)
        except BaseException:
            temporary.unlink(missing_ok=True)
            raise
        return path

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> TuneResult:
        """Rebuild a result from :meth:`as_dict` output.

        Every setting is checked as strictly as :class:`~autoloader.SearchSpace` checks
        its own, and every figure for its type and range, so that content edited by hand
        or damaged is refused here rather than by the loader it would build. A worker
        option given without workers is dropped if its value is valid (see
        :func:`~autoloader.loader._params.normalize_params`).

        Raises:
            ResultFileError: the content is not a result of a known schema version, a
                field is missing, of the wrong type or out of range (the message names
                it and its value), or it asks for more workers than any search would
                have tried for it (see ``NOTE [ A saved worker count ]``).
        """
        if not isinstance(data, Mapping):
            raise ResultFileError("a result must be a JSON object")
        version = data.get("schema_version")
        if not is_int(version) or version not in _READABLE_VERSIONS:
            raise ResultFileError(
                f"schema_version is {shown(version)}, but this autoloader reads versions "
                f"{', '.join(map(str, _READABLE_VERSIONS))} (an int); tune again with this "
                "version"
            )
        try:
            params = checked_settings(typed(data, "params", dict))
            trials = tuple(
                trial_record(raw, index, version)
                for index, raw in enumerate(typed(data, "trials", list))
            )
            environment = environment_of(data)
            check_counts(params, environment=environment, trials=trials)
            fixed = typed(data, "fixed_loader_kwargs", dict)
            if not all(isinstance(v, JSON_SCALARS) for v in fixed.values()):
                raise ResultFileError("fixed_loader_kwargs holds a value that is not a scalar")
            throughput = amount(data, "throughput")
            baseline = amount(data, "baseline")
            steady_throughput: float | None
            steady_baseline: float | None
            if version < 5:  # they kept the steady rates only, as throughput and baseline
                steady_throughput, steady_baseline = throughput, baseline
                startup, each_epoch = None, False
            else:
                steady_throughput = optional_amount(data, "steady_throughput")
                steady_baseline = optional_amount(data, "steady_baseline")
                startup = optional_amount(data, "startup_seconds")
                each_epoch = typed(data, "startup_each_epoch", bool)
            return cls(
                params=params,
                throughput=throughput,
                baseline=baseline,
                steady_throughput=steady_throughput,
                steady_baseline=steady_baseline,
                startup_seconds=startup,
                startup_each_epoch=each_epoch,
                batch_size=count(data, "batch_size", least=1),
                trials=trials,
                environment=environment,
                tuning_seconds=amount(data, "tuning_seconds"),
                memory_budget=count(data, "memory_budget", least=0),
                notes=strings(data, "notes"),
                partial=typed({"partial": False, **data}, "partial", bool),
                fixed_loader_kwargs=fixed,
                unsaved_loader_kwargs=strings(data, "unsaved_loader_kwargs"),
                facts=facts_of(typed({"facts": {}, **data}, "facts", dict)),
                problem=problem_of(data) if version >= 6 else {},
            )
        except (TypeError, ValueError) as error:
            raise ResultFileError(f"malformed result: {error}") from None


def split_loader_kwargs(fixed: Mapping[str, Any]) -> tuple[dict[str, Any], tuple[str, ...]]:
    """Separate the fixed options a JSON file can keep from those it cannot."""
    saved = {k: v for k, v in fixed.items() if isinstance(v, JSON_SCALARS)}
    return saved, tuple(k for k in fixed if k not in saved)


def in_memory_kwargs(fixed: Mapping[str, Any]) -> dict[str, Any]:
    """The fixed loader options a result keeps in memory only (a sampler, a collate_fn):
    this process's own, also under torchrun where each rank has its own sampler."""
    _, unsaved = split_loader_kwargs(fixed)
    return {name: fixed[name] for name in unsaved}


def load(path: str | os.PathLike[str]) -> TuneResult:
    """Read a result written by :meth:`TuneResult.save`.

    Only JSON is parsed; nothing in the file is executed. Warns with
    :class:`~autoloader.EnvironmentMismatchWarning` when this machine differs from the
    one the result was measured on (CPUs, memory, torch version, accelerator), or for
    another number of torchrun ranks (each rank's share of the node differs).

    A result that asks for more workers than this machine can sensibly run, tuned on
    a bigger one, loads and says so in that warning; one that asks for more than any
    search would have tried for it, or holds a setting or figure out of range, is
    refused (see :meth:`TuneResult.from_dict`).

    Raises:
        ResultFileError: the file is missing, not JSON, or not a result, or a field in it
            is out of range; the message names the path, the field and its value.
    """
    path = Path(path)
    data = read_result_json(path)
    try:
        result = TuneResult.from_dict(data)
    except ResultFileError as error:
        raise ResultFileError(f"{path}: {error}") from None
    except RecursionError:  # a field nested nearly as deep as json.loads could go
        raise ResultFileError(
            f"{path} is not a result: its JSON is nested deeper than any result's"
        ) from None
    _, world_size, local_world_size = world()
    here = Environment.current(
        world_size=world_size, local_world_size=local_world_size, nodes=world_nodes()
    )
    differences = result.environment.differences(here)
    if differences:
        doubt = "its settings may not be the best here"
        advice = "Run autoloader.tune() again on this machine"
        excess = _excess_workers(result, here)
        if excess:
            doubt += f", and {excess}"
            advice += ", or pass num_workers= to make_loader() for fewer"
        warnings.warn(
            f"{path} was measured on a different machine ({'; '.join(differences)}); "
            f"{doubt}. {advice}.",
            EnvironmentMismatchWarning,
            stacklevel=2,
        )
    return result


def _excess_workers(result: TuneResult, here: Environment) -> str | None:
    """Words on a worker count tuned on a bigger machine that a search here would not
    try (see ``NOTE [ A saved worker count ]``), if it is one."""
    workers = result.params["num_workers"]
    most = default_max_workers(here.usable_cpus)
    if workers <= most or here.usable_cpus >= result.environment.usable_cpus:
        return None
    return (
        f"its {workers} workers are more than this machine's {here.usable_cpus} usable CPUs "
        f"can sensibly run (a search here tries at most {most})"
    )
