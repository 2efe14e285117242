"""The outcome of a tuning run: per-trial records, the tuned settings, and their JSON file."""

from __future__ import annotations

import difflib
import json
import logging
import math
import os
import secrets
import stat
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, TypeGuard

from torch.utils.data import DataLoader, Dataset

from autoloader._exceptions import EnvironmentMismatchWarning, InvalidInputError, ResultFileError
from autoloader.checks._environment import Environment, usable_cpus, world, world_nodes
from autoloader.loader._factory import build_loader, dataloader_kwargs, merge_loader_kwargs
from autoloader.loader._params import TUNED_KEYS, Params, normalize_params
from autoloader.loader._step_threads import set_step_threads
from autoloader.measure._units import format_bytes
from autoloader.search._outcome import Completed, FaultKind, Trial, state_of
from autoloader.search._space import SETTING_RULES, Rule, SearchSpace, default_max_workers

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
# How versions 1 and 2 worded the reasons of trials pruned as slower or too short.
_V2_SLOWER = "clearly slower than the best setting so far"
_V2_TOO_SHORT = "too short"

# Fixed DataLoader options of these types are written to the JSON file; others
# (a collate_fn, a sampler, a generator) live only in the result returned by tune().
_JSON_SCALARS = (bool, int, float, str, type(None))


@dataclass(frozen=True, slots=True)
class TrialRecord:
    """One measured setting.

    Attributes:
        number: the trial's number in the Optuna study.
        phase: ``"baseline"`` (``num_workers=0`` defaults), ``"search"`` or ``"runoff"``
            (a close candidate measured again to decide between settings).
        params: the DataLoader settings measured.
        state: ``"complete"``, ``"pruned"`` or ``"failed"``.
        samples_per_second: steady rate of the training loop.
        epoch_samples_per_second: the objective: samples per second over a whole
            epoch, worker start-up included (see ``NOTE [ Epoch model ]``).
        data_wait_fraction: share of loop time blocked waiting for a batch.
        time_to_first_batch: seconds from ``iter(loader)`` to the first batch.
        peak_memory: bytes, highest PSS of the process tree.
        relative_error: 95% confidence half-width of ``samples_per_second``, relative.
        duration: seconds the trial took.
        reason: why the trial was pruned or failed, for people.
        kind: what the reason is, for programs: for a pruned trial ``"slower"``,
            ``"too short"``, ``"memory"`` or ``"killed"``; for a failed one ``"worker
            crashed"``, ``"timeout"``, ``"shared memory"``, ``"too many open files"``,
            ``"trial process died"``, ``"error"`` or ``"interrupted"``.
        load_seconds: mean seconds per batch the loop was blocked waiting for data.
        step_seconds: mean seconds per batch in the step.
        load_cpu_seconds: mean CPU seconds of the main process per batch while it
            waited (with ``num_workers=0``: the CPU part of loading).
        batch_bytes: bytes of the tensors in one batch.
        step_cpu_seconds: mean CPU seconds of the main process per batch in the step,
            all its threads counted (a step training on the CPU keeps that many cores
            busy per second of step).
        step_thread_cpu_seconds: the same for the thread that ran the step alone:
            close to ``step_seconds`` where the step works on the CPU, close to 0 where
            it waits (see ``NOTE [ Step threads ]``).
    """

    number: int
    phase: str
    params: dict[str, Any]
    state: str
    samples_per_second: float | None = None
    epoch_samples_per_second: float | None = None
    data_wait_fraction: float | None = None
    time_to_first_batch: float | None = None
    peak_memory: int | None = None
    relative_error: float | None = None
    duration: float | None = None
    reason: str | None = None
    load_seconds: float | None = None
    step_seconds: float | None = None
    load_cpu_seconds: float | None = None
    batch_bytes: int | None = None
    step_cpu_seconds: float | None = None
    kind: str | None = None
    step_thread_cpu_seconds: float | None = None

    @property
    def too_short(self) -> bool:
        """Whether the trial ran out of time before its rate could be trusted: it was
        pruned, and its rate is not a finding."""
        return self.state == "pruned" and self.kind == "too short"

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def record_of(trial: Trial) -> TrialRecord:
    """A finished trial of the search, as the result reports it."""
    outcome = trial.outcome
    m = trial.measurement
    value = outcome.value if isinstance(outcome, Completed) else None
    peak = m.peak_memory if m is not None else None
    if not isinstance(outcome, Completed) and outcome.peak_memory is not None:
        peak = outcome.peak_memory
    return TrialRecord(
        number=trial.number,
        phase=trial.phase.value,
        params=dict(trial.params),
        state=state_of(outcome),
        samples_per_second=m.samples_per_second if m else None,
        epoch_samples_per_second=value,
        data_wait_fraction=m.data_wait_fraction if m else None,
        time_to_first_batch=m.time_to_first_batch if m else None,
        peak_memory=peak,
        relative_error=m.relative_error if m and math.isfinite(m.relative_error) else None,
        duration=m.duration if m else None,
        reason=None if isinstance(outcome, Completed) else outcome.reason,
        load_seconds=m.load_seconds if m else None,
        step_seconds=m.step_seconds if m else None,
        load_cpu_seconds=m.load_cpu_seconds if m else None,
        batch_bytes=m.batch_bytes if m else None,
        step_cpu_seconds=m.step_cpu_seconds if m else None,
        kind=None if isinstance(outcome, Completed) else outcome.kind.value,
        step_thread_cpu_seconds=m.step_thread_cpu_seconds if m else None,
    )


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
        descriptor, temporary = _new_file(path)
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
        if not _is_int(version) or version not in _READABLE_VERSIONS:
            raise ResultFileError(
                f"schema_version is {_shown(version)}, but this autoloader reads versions "
                f"{', '.join(map(str, _READABLE_VERSIONS))} (an int); tune again with this "
                "version"
            )
        try:
            params = _settings(_typed(data, "params", dict))
            trials = tuple(
                _trial(raw, index, version)
                for index, raw in enumerate(_typed(data, "trials", list))
            )
            environment = _environment(data)
            _check_counts(params, environment=environment, trials=trials)
            fixed = _typed(data, "fixed_loader_kwargs", dict)
            if not all(isinstance(v, _JSON_SCALARS) for v in fixed.values()):
                raise ResultFileError("fixed_loader_kwargs holds a value that is not a scalar")
            throughput = _amount(data, "throughput")
            baseline = _amount(data, "baseline")
            steady_throughput: float | None
            steady_baseline: float | None
            if version < 5:  # they kept the steady rates only, as throughput and baseline
                steady_throughput, steady_baseline = throughput, baseline
                startup, each_epoch = None, False
            else:
                steady_throughput = _optional_amount(data, "steady_throughput")
                steady_baseline = _optional_amount(data, "steady_baseline")
                startup = _optional_amount(data, "startup_seconds")
                each_epoch = _typed(data, "startup_each_epoch", bool)
            return cls(
                params=params,
                throughput=throughput,
                baseline=baseline,
                steady_throughput=steady_throughput,
                steady_baseline=steady_baseline,
                startup_seconds=startup,
                startup_each_epoch=each_epoch,
                batch_size=_count(data, "batch_size", least=1),
                trials=trials,
                environment=environment,
                tuning_seconds=_amount(data, "tuning_seconds"),
                memory_budget=_count(data, "memory_budget", least=0),
                notes=_strings(data, "notes"),
                partial=_typed({"partial": False, **data}, "partial", bool),
                fixed_loader_kwargs=fixed,
                unsaved_loader_kwargs=_strings(data, "unsaved_loader_kwargs"),
                facts=_facts(_typed({"facts": {}, **data}, "facts", dict)),
                problem=_problem(data) if version >= 6 else {},
            )
        except (TypeError, ValueError) as error:
            raise ResultFileError(f"malformed result: {error}") from None


# Saving ------------------------------------------------------------------------------


def check_writable(path: Path) -> None:
    """Raise :class:`InvalidInputError` unless :meth:`TuneResult.save` can write at
    ``path``: the nearest of its folders that exists (``save()`` creates the others) is
    a folder this process can create a file in.

    Tried by creating a file there and removing it: permission bits do not tell (root
    writes past them, a read-only mount or ``/proc`` refuses root too). For a run that
    writes its result only at its end, so that a path it cannot write is refused before
    its first trial rather than after its whole budget.
    """
    folder = path.absolute().parent
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    if not folder.is_dir():
        raise InvalidInputError(
            f"cannot write the result at {str(path)!r}: {str(folder)!r} is not a folder. "
            "Give another path."
        )
    try:
        descriptor, probe = _new_file(folder / "autoloader-probe")
    except OSError as error:
        raise InvalidInputError(
            f"cannot write the result at {str(path)!r}: creating a file in "
            f"{str(folder)!r} failed ({error.strerror or error}). Give a path in a folder "
            "you can write to."
        ) from None
    os.close(descriptor)
    probe.unlink(missing_ok=True)


def _new_file(path: Path) -> tuple[int, Path]:
    """A new, empty file beside ``path``, hidden, opened for writing: its descriptor and
    path. Created with mode 0o666 as ``open()`` creates files, so that the umask sets
    its permissions (``tempfile.mkstemp`` would make it 0o600, and the result unreadable
    to the user's group)."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)
    for _ in range(100):
        temporary = path.with_name(f".{path.name}.{secrets.token_hex(4)}")
        try:
            return os.open(temporary, flags, 0o666), temporary
        except FileExistsError:
            continue
    raise FileExistsError(f"no free name for a temporary file beside {path}")


# What to do about a field that fails a check.
_FIX = "tune again with autoloader.tune(), or correct the field"


def _is_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_bool(value: object) -> bool:
    return isinstance(value, bool)


# What each tuned setting may hold: SearchSpace's rules (search/_space.py), but for
# prefetch_factor, which a setting without workers holds as null (normalize_params)
# where a space always has a range.
_SETTING_RULES: dict[str, Rule] = {
    **SETTING_RULES,
    "prefetch_factor": Rule(
        lambda v: v is None or SETTING_RULES["prefetch_factor"].allows(v),
        f"{SETTING_RULES['prefetch_factor'].words} (null without workers)",
    ),
}

# The JSON types of a trial record's fields; the others are numbers or null.
_RECORD_TYPES: dict[str, Any] = {
    "number": int,
    "phase": str,
    "params": dict,
    "state": str,
    "reason": str | None,
    "kind": str | None,
}
_RECORD_NAMES = frozenset(f.name for f in fields(TrialRecord))


def _check_settings(settings: Mapping[str, Any], *, label: str) -> None:
    """Refuse a setting ``settings`` (the field ``label`` of the file) has no rule for, or
    a value its rule does not allow."""
    for name, value in settings.items():
        if name not in _SETTING_RULES:
            close = difflib.get_close_matches(str(name), TUNED_KEYS, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ResultFileError(
                f"field {label!r} has unknown key {name!r}{hint}; the settings are "
                f"{', '.join(TUNED_KEYS)}; {_FIX}"
            )
        rule = _SETTING_RULES[name]
        if not rule.allows(value):
            raise ResultFileError(
                f"field '{label}.{name}' is {_shown(value)}, but it must be {rule.words}; {_FIX}"
            )


def _settings(raw: Mapping[str, Any]) -> Params:
    """The result's settings, checked, in canonical form. Settings a version predates
    take the defaults it measured."""
    _check_settings(raw, label="params")
    if "num_workers" not in raw:
        raise ResultFileError(
            f"field 'params' has no 'num_workers': the file does not say how many workers "
            f"to run; {_FIX}"
        )
    workers = raw["num_workers"]
    if workers > 0 and "prefetch_factor" in raw and raw["prefetch_factor"] is None:
        raise ResultFileError(
            f"field 'params.prefetch_factor' is null, but with num_workers {workers} it must "
            f"be an int >= 1 (DataLoader's default is 2); {_FIX}"
        )
    return normalize_params(raw)


def _trial(raw: object, index: int, version: int) -> TrialRecord:
    if not isinstance(raw, dict) or not {"number", "phase", "params", "state"} <= set(raw):
        raise ResultFileError(f"malformed trial record {raw!r}")
    label = f"trials[{index}]"
    record = {k: v for k, v in raw.items() if k in _RECORD_NAMES}
    for key in record:
        kind = _RECORD_TYPES.get(key)
        if kind is None:  # a figure: a count, seconds, a rate or a share
            _figure(record, key, label=f"{label}.{key}")
        else:
            _typed(record, key, kind, label=f"{label}.{key}")
    if record["number"] < 0:
        raise ResultFileError(
            f"field '{label}.number' is {record['number']}, but it must be an int >= 0; {_FIX}"
        )
    _check_settings(record["params"], label=f"{label}.params")
    if version < 3:
        record["kind"] = _v2_kind(record)
    return TrialRecord(**record)


# More CPUs or ranks than any machine or job has: a damaged count, which would raise
# the bound on a saved worker or thread count with it (NOTE [ A saved worker count ]).
_MOST_CPUS = 1 << 16
_MOST_RANKS = 1 << 20


def _environment(data: Mapping[str, Any]) -> Environment:
    raw = _typed(data, "environment", dict)
    for key, most in (
        ("cpu_count", _MOST_CPUS),
        ("usable_cpus", raw.get("cpu_count", _MOST_CPUS)),
        ("world_size", _MOST_RANKS),
        ("local_world_size", raw.get("world_size", _MOST_RANKS)),
        ("nodes", raw.get("world_size", _MOST_RANKS)),
    ):
        if key in raw:
            _count(raw, key, least=1, most=most, label=f"environment.{key}")
    if "memory_total" in raw:
        _count(raw, "memory_total", least=0, label="environment.memory_total")
    for key in ("torch_version", "python_version", "platform", "start_method"):
        if key in raw:
            _typed(raw, key, str, label=f"environment.{key}")
    if "accelerator" in raw:
        _typed(raw, "accelerator", str | None, label="environment.accelerator")
    return Environment.from_dict(raw)


# NOTE [ A saved worker count ]
# A result file asks for a number of worker processes or threads, and a damaged or
# hand-edited one may ask for a billion. load() refuses a count that no search would
# have tried for the file: more than the search space's default bound on this machine
# (default_max_workers) and on the machine it was measured on (a result tuned on 64
# CPUs rightly asks for 48 workers), and more than any complete trial of the file
# measured (a search space of one's own may go past the default bound: without that,
# tune(path=...) would refuse its own file and tune again on every run). A count within
# those but past this machine's bound loads, with a word in load()'s
# EnvironmentMismatchWarning: a result kept with the code is loaded on laptops and CI
# machines too, where it runs, slowly, and make_loader(num_workers=...) runs fewer.
# The other counts are bound alike: prefetch_factor (batches each worker loads ahead,
# each held in memory) by the default search's highest, and worker_threads and
# step_threads (threads started in every worker, and in the training process) by the
# CPUs here and there; each also by its complete trials.


def _check_counts(
    params: Params, *, environment: Environment, trials: Sequence[TrialRecord]
) -> None:
    """Refuse more workers, batches ahead or threads than any search would have tried for
    the file (see ``NOTE [ A saved worker count ]``)."""
    cpus = usable_cpus(local_world_size=world()[2])
    there_cpus = environment.usable_cpus
    prefetch = SearchSpace().prefetch_factor  # the default search's (low, high)
    most_prefetch = prefetch[1] if isinstance(prefetch, tuple) else prefetch
    bounds = {
        "num_workers": (default_max_workers(cpus), default_max_workers(there_cpus)),
        "prefetch_factor": (most_prefetch, most_prefetch),
        "worker_threads": (cpus, there_cpus),
        "step_threads": (cpus, there_cpus),
    }
    for name, (here, there) in bounds.items():
        value = params.get(name)
        if value is None:
            continue
        complete = [t.params.get(name) for t in trials if t.state == "complete"]
        measured = max((v for v in complete if _is_int(v)), default=0)
        ceiling = max(here, there, measured)
        if value <= ceiling:
            continue
        by_trials = (
            f"; its complete trials measured {measured}" if measured > max(here, there) else ""
        )
        if name == "num_workers":
            raise ResultFileError(
                f"field 'params.num_workers' is {value}, more workers than a search would try "
                f"for this result: at most {here} on this machine's {cpus} usable CPUs, and "
                f"{there} on the {there_cpus} of the machine it was measured on{by_trials}. "
                f"Tune again on this machine with autoloader.tune(); or, to run that many "
                f"anyway, set the field to at most {ceiling} and pass num_workers={value} to "
                "make_loader() or loader_kwargs()"
            )
        if name == "prefetch_factor":
            bound = f"at most {here} by default{by_trials}"
        else:
            bound = (
                f"at most this machine's {cpus} usable CPUs, and the {there_cpus} of the "
                f"machine it was measured on{by_trials}"
            )
        anyway = (
            f"call torch.set_num_threads({value}) rather than apply_threads()"
            if name == "step_threads"
            else f"pass {name}={value} to make_loader() or loader_kwargs()"
        )
        raise ResultFileError(
            f"field 'params.{name}' is {value}, more than a search would try for this "
            f"result: {bound}. Tune again on this machine with autoloader.tune(); or, to "
            f"run with that many anyway, set the field to at most {ceiling} and {anyway}"
        )


def _problem(data: Mapping[str, Any]) -> dict[str, str]:
    problem = _typed(data, "problem", dict)
    if not all(isinstance(v, str) for v in problem.values()):
        raise ResultFileError("problem holds a value that is not a string")
    return {str(k): v for k, v in problem.items()}


def _is_count(value: object) -> bool:
    return _is_int(value) and value >= 0


def _is_figure(value: object) -> bool:
    return (
        isinstance(value, int | float)
        and not isinstance(value, bool)
        and math.isfinite(value)
        and value >= 0
    )


def _is_scalar(value: object) -> bool:
    return isinstance(value, _JSON_SCALARS) and not (
        isinstance(value, float) and not math.isfinite(value)
    )


# What each fact the checks record may hold (checks/_facts.py's docstring), and the rule
# in words; the report does arithmetic and formatting with them.
_FACT_RULES: dict[str, tuple[Callable[[object], bool], str]] = {
    "dataset_length": (lambda v: v is None or _is_count(v), "an int >= 0, or null"),
    "shm_bytes": (lambda v: v is None or _is_count(v), "an int >= 0, or null"),
    "random_items": (lambda v: v is None or _is_bool(v), "true, false or null"),
    "workers_repeat_randomness": (lambda v: v is None or _is_bool(v), "true, false or null"),
    "worker_start_seconds": (lambda v: v is None or _is_figure(v), "a number >= 0, or null"),
    "worker_start_at_least": (_is_bool, "true or false"),
    "start_method": (lambda v: v is None or isinstance(v, str), "a string, or null"),
    "copy_on_read": (lambda v: v is None or _is_figure(v), "a number >= 0, or null"),
    "copy_on_read_items": (lambda v: v is None or _is_count(v), "an int >= 0, or null"),
    "process_bytes": (lambda v: v is None or _is_count(v), "an int >= 0, or null"),
    "missing": (
        lambda v: isinstance(v, dict) and all(isinstance(w, str) for w in v.values()),
        "an object of strings",
    ),
}


def _facts(facts: dict[str, Any]) -> dict[str, Any]:
    """The checks' facts, each known one of its type; any other a JSON scalar (a fact a
    later check records, which this report does not read)."""
    for name, value in facts.items():
        allows, rule = _FACT_RULES.get(name, (_is_scalar, ""))
        if not allows(value):
            rule = rule or "a number, a string, true, false or null"
            raise ResultFileError(
                f"field 'facts.{name}' is {_shown(value)}, but it must be {rule}; {_FIX}"
            )
    return facts


def _v2_kind(record: Mapping[str, Any]) -> str | None:
    reason = str(record.get("reason") or "")
    if record.get("state") == "failed":  # "shared memory: ...": the kind, then its story
        prefix = reason.split(":", 1)[0]
        return prefix if prefix in {kind.value for kind in FaultKind} else None
    if record.get("state") != "pruned":
        return None
    if reason == _V2_SLOWER:
        return "slower"
    if reason.startswith(_V2_TOO_SHORT):
        return "too short"
    return reason.split(":", 1)[0] if reason.startswith(("memory", "killed")) else None


def _typed(data: Mapping[str, Any], key: str, kind: Any, *, label: str | None = None) -> Any:
    """``data[key]``, refused unless of type ``kind`` (a bool is no number); ``label``
    names the field where it is not at the top of the file."""
    name = label or key
    if key not in data:
        raise ResultFileError(f"missing field {name!r}")
    value = data[key]
    if (isinstance(value, bool) and kind is not bool) or not isinstance(value, kind):
        raise ResultFileError(f"field {name!r} has the wrong type: {_shown(value)}; {_FIX}")
    return value


def _count(
    data: Mapping[str, Any],
    key: str,
    *,
    least: int,
    most: int | None = None,
    label: str | None = None,
) -> int:
    value: int = _typed(data, key, int, label=label)
    if value < least or (most is not None and value > most):
        rule = f"an int >= {least}" if most is None else f"an int from {least} to {most}"
        raise ResultFileError(f"field {label or key!r} is {value}, but it must be {rule}; {_FIX}")
    return value


def _figure(data: Mapping[str, Any], key: str, *, label: str) -> float | None:
    """A measured figure of a trial (a count, seconds, a rate, a share): a finite number
    >= 0, or null."""
    value = _typed(data, key, int | float | None, label=label)
    if value is not None and not (math.isfinite(value) and value >= 0):
        raise ResultFileError(
            f"field {label!r} is {_shown(value)}, but it must be a finite number >= 0, or "
            f"null; {_FIX}"
        )
    return value  # type: ignore[no-any-return]


def _strings(data: Mapping[str, Any], key: str) -> tuple[str, ...]:
    """``data[key]``, a list of strings."""
    values = _typed(data, key, list)
    for index, value in enumerate(values):
        if not isinstance(value, str):
            raise ResultFileError(
                f"field '{key}[{index}]' has the wrong type: {_shown(value)}; {_FIX}"
            )
    return tuple(values)


def _amount(data: Mapping[str, Any], key: str) -> float:
    value = _typed(data, key, int | float)
    if not (math.isfinite(value) and value >= 0):
        raise ResultFileError(
            f"field {key!r} is {_shown(value)}, but it must be a finite number >= 0; {_FIX}"
        )
    return float(value)


def _optional_amount(data: Mapping[str, Any], key: str) -> float | None:
    value = _typed(data, key, int | float | None)
    if value is None:
        return None
    if not (math.isfinite(value) and value >= 0):
        raise ResultFileError(
            f"field {key!r} is {_shown(value)}, but it must be a finite number >= 0, or null; "
            f"{_FIX}"
        )
    return float(value)


def _shown(value: object) -> str:
    """``value`` as the file spells it."""
    try:
        return json.dumps(value)
    except (TypeError, ValueError):
        return repr(value)


def split_loader_kwargs(fixed: Mapping[str, Any]) -> tuple[dict[str, Any], tuple[str, ...]]:
    """Separate the fixed options a JSON file can keep from those it cannot."""
    saved = {k: v for k, v in fixed.items() if isinstance(v, _JSON_SCALARS)}
    return saved, tuple(k for k in fixed if k not in saved)


def in_memory_kwargs(fixed: Mapping[str, Any]) -> dict[str, Any]:
    """The fixed loader options a result keeps in memory only (a sampler, a collate_fn):
    this process's own, also under torchrun where each rank has its own sampler."""
    _, unsaved = split_loader_kwargs(fixed)
    return {name: fixed[name] for name in unsaved}


# NOTE [ Reading a result file ]
# load() is given a path, and a path may name something that is not a file a result
# was saved to: a FIFO (open() waits for a writer forever), a symlink to /dev/zero or
# another device (read() never ends, and memory grows until the process dies), a
# directory, or a file of gigabytes. The file is opened without blocking (O_NONBLOCK:
# a FIFO opens at once, with or without a writer), checked with fstat to be a regular
# file no larger than MAX_RESULT_BYTES, and read for at most that many bytes plus one,
# so a file growing under the read is caught too. A result of 10,000 trials is about
# 7 MiB. JSON nested deeper than Python's recursion limit raises RecursionError in
# json.loads (and would in any code that walks it): refused as malformed like any
# other bad JSON. Every refusal is a ResultFileError naming the path and what it is.
MAX_RESULT_BYTES = 64 * 1024**2


def read_result_json(path: Path) -> Any:
    """The JSON content of the result file at ``path``, read as ``NOTE [ Reading a result
    file ]`` says.

    Raises:
        ResultFileError: ``path`` cannot be opened, is not a regular file, is larger than
            ``MAX_RESULT_BYTES``, or does not hold JSON.
    """
    try:
        descriptor = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as error:
        raise ResultFileError(f"cannot read {path}: {error.strerror or error}") from None
    try:
        mode = os.fstat(descriptor)
        if not stat.S_ISREG(mode.st_mode):
            raise ResultFileError(
                f"{path} is {_file_kind(mode.st_mode)}, not a result file: a result is the "
                "regular JSON file TuneResult.save() writes; give the path of one"
            )
        if mode.st_size > MAX_RESULT_BYTES:
            raise ResultFileError(
                f"{path} is {format_bytes(mode.st_size)}, larger than any result file "
                f"(at most {format_bytes(MAX_RESULT_BYTES)}); give the path of the JSON "
                "file TuneResult.save() wrote"
            )
        with os.fdopen(descriptor, "rb", closefd=False) as file:
            content = file.read(MAX_RESULT_BYTES + 1)
    except OSError as error:
        raise ResultFileError(f"cannot read {path}: {error.strerror or error}") from None
    finally:
        os.close(descriptor)
    if len(content) > MAX_RESULT_BYTES:
        raise ResultFileError(
            f"{path} grew past {format_bytes(MAX_RESULT_BYTES)} while it was read, larger "
            "than any result file; give the path of the JSON file TuneResult.save() wrote"
        )
    try:
        return json.loads(content)
    except RecursionError:
        raise ResultFileError(
            f"{path} is not a result: its JSON is nested deeper than any result's"
        ) from None
    except ValueError as error:  # UnicodeDecodeError included
        raise ResultFileError(f"{path} is not valid JSON: {error}") from None


def _file_kind(mode: int) -> str:
    for test, kind in (
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISFIFO, "a FIFO (named pipe)"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
    ):
        if test(mode):
            return kind
    return "not a regular file"


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
