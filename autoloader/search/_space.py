"""Which DataLoader settings are tuned, over what ranges, and how a trial draws them."""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from autoloader._exceptions import InvalidInputError
from autoloader.loader import WORKER_KINDS, Params, normalize_params
from autoloader.search._reasons import (
    BatchedFetchSearched,
    NoAccelerator,
    PinMemoryAskedForInVain,
    ProcessesOnly,
    SpaceNote,
    ThreadsSearched,
    WorkersCappedAtEpoch,
    WorkersCappedAtStartup,
    render,
)
from autoloader.search._setting_rules import (
    SETTING_RULES,
    bool_choices,
    int_range,
    kind_choices,
    step_thread_range,
    thread_choices,
)

if TYPE_CHECKING:
    import optuna

# Latency-bound datasets (network or disk waits) want far more workers than cores: a
# 2-core machine reading items that each sleep 5 ms is fastest near 12-16 workers.
_MIN_DEFAULT_MAX_WORKERS = 16
_WORKERS_PER_CPU = 2


@dataclass(frozen=True, slots=True)
class Startup:
    """Worker start-up, as measured before the search (``NOTE [ Worker start-up ]`` in
    ``checks/_facts.py``).

    Attributes:
        seconds: to start one worker process and get its first item.
        start_method: how the user's loader starts workers.
        time_budget: the run's.
        trial_seconds: what one trial of the run measures for (``trial_seconds()``).
    """

    seconds: float
    start_method: str
    time_budget: float
    trial_seconds: float

    def most_workers(self) -> int:
        """The most workers whose start-up (serial: ``seconds`` each) fits in the time
        of two trials, and never fewer than 1."""
        if self.seconds <= 0:
            return 1 << 30
        return max(1, int(_STARTUP_TRIALS * self.trial_seconds / self.seconds))


# A setting's workers may take as long to start as this many trials take to measure.
_STARTUP_TRIALS = 2


def default_max_workers(usable_cpus: int) -> int:
    """The most workers a search tries by default on ``usable_cpus`` CPUs, before the
    cap at the batches in one epoch."""
    return max(_MIN_DEFAULT_MAX_WORKERS, _WORKERS_PER_CPU * usable_cpus)


@dataclass(frozen=True, kw_only=True)
class SearchSpace:
    """The DataLoader settings a tuning run may choose from.

    A range is an inclusive ``(low, high)`` pair; a single value fixes the setting.

    Args:
        num_workers (int or (int, int), optional): worker processes. ``None`` means
            ``(0, max(16, 2 * usable CPUs))``, capped at the batches in one epoch.
            (default: ``None``)
        prefetch_factor (int or (int, int), optional): batches each worker loads ahead;
            drawn only when ``num_workers > 0``. (default: ``(1, 8)``)
        persistent_workers (bool or tuple of bool, optional): keep workers between
            epochs; drawn only when ``num_workers > 0``. (default: ``(False, True)``)
        pin_memory (bool or tuple of bool, optional): ``None`` means ``(False, True)``
            where an accelerator exists and ``False`` elsewhere, where pinning does
            nothing but cost time. (default: ``None``)
        batched_fetch (bool or tuple of bool, optional): fetch a whole batch with one
            ``dataset[list_of_indices]`` instead of one ``dataset[index]`` per sample
            and a collate (see ``NOTE [ Batched fetch ]``). ``None`` means
            ``(False, True)`` when the dataset gives the same batches that way (checked
            before the run), else ``False``. (default: ``None``)
        worker_threads (int, None or tuple of them, optional): threads each worker's
            native thread pools (BLAS, OpenMP) may use; ``None`` as a value leaves them
            as they are. ``"auto"`` searches ``(None, 1)`` on a machine with several
            CPUs. (default: ``"auto"``)
        in_order (bool or tuple of bool, optional): whether batches must come in the
            sampler's order. ``(True, False)`` lets the tuner hand batches over as soon
            as any worker has one, which hides slow items behind fast ones but makes
            the order of batches depend on timing. (default: ``True``)
        worker_kind (str or tuple of str, optional): ``"processes"`` (DataLoader's
            worker processes) or ``"threads"`` (a :class:`~autoloader.ThreadLoader`:
            threads of the training process, see ``NOTE [ Thread workers ]``). ``None``
            means both where the dataset was seen to give the same batches read from
            several threads (checked before the run), else processes.
            (default: ``None``)
        step_threads (int, (int, int), None or "auto", optional): threads of torch's
            intra-op pool in the training process, where ``step_fn`` runs
            (``torch.set_num_threads``, see ``NOTE [ Step threads ]``): set for each
            trial and put back after it. ``None`` leaves them as they are. ``"auto"``
            searches ``(1, usable CPUs)`` where the baseline shows the step doing CPU
            work, and leaves them alone where it waits (on an accelerator, a sleep).
            (default: ``"auto"``)

    Example::

        space = autoloader.SearchSpace(num_workers=(2, 32), persistent_workers=True)
    """

    num_workers: int | tuple[int, int] | None = None
    prefetch_factor: int | tuple[int, int] = (1, 8)
    persistent_workers: bool | tuple[bool, ...] = (False, True)
    pin_memory: bool | tuple[bool, ...] | None = None
    batched_fetch: bool | tuple[bool, ...] | None = None
    worker_threads: int | tuple[int | None, ...] | Literal["auto"] | None = "auto"
    in_order: bool | tuple[bool, ...] = True
    worker_kind: str | tuple[str, ...] | None = None
    step_threads: int | tuple[int, int] | Literal["auto"] | None = "auto"

    def __post_init__(self) -> None:
        if self.num_workers is not None:
            low, high = int_range("num_workers", self.num_workers)
            if not SETTING_RULES["num_workers"].allows(low):
                raise InvalidInputError(
                    f"SearchSpace.num_workers cannot be negative but got {low}; "
                    "use 0 to load in the main process."
                )
            object.__setattr__(self, "num_workers", (low, high))
        low, high = int_range("prefetch_factor", self.prefetch_factor)
        if not SETTING_RULES["prefetch_factor"].allows(low):
            raise InvalidInputError(
                f"SearchSpace.prefetch_factor must be at least 1 but got {low}."
            )
        object.__setattr__(self, "prefetch_factor", (low, high))
        object.__setattr__(
            self, "persistent_workers", bool_choices("persistent_workers", self.persistent_workers)
        )
        if self.pin_memory is not None:
            object.__setattr__(self, "pin_memory", bool_choices("pin_memory", self.pin_memory))
        if self.batched_fetch is not None:
            object.__setattr__(
                self, "batched_fetch", bool_choices("batched_fetch", self.batched_fetch)
            )
        if self.worker_threads != "auto":
            object.__setattr__(self, "worker_threads", thread_choices(self.worker_threads))
        object.__setattr__(self, "in_order", bool_choices("in_order", self.in_order))
        if self.worker_kind is not None:
            object.__setattr__(self, "worker_kind", kind_choices(self.worker_kind))
        if self.step_threads != "auto":
            object.__setattr__(self, "step_threads", step_thread_range(self.step_threads))

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> SearchSpace:
        """Build a space from a mapping (e.g. parsed JSON), rejecting unknown keys."""
        names = [f.name for f in dataclasses.fields(cls)]
        for key in data:
            if key not in names:
                close = difflib.get_close_matches(str(key), names, n=1)
                hint = f" Did you mean {close[0]!r}?" if close else ""
                raise InvalidInputError(
                    f"Unknown SearchSpace key {key!r}.{hint} Valid keys: {', '.join(names)}."
                )
        return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in data.items()})

    def as_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    def resolve(
        self,
        *,
        usable_cpus: int,
        has_accelerator: bool,
        batches_per_epoch: int | None,
        batched_fetch_problem: str | None = "the dataset was not checked for it",
        threads_problem: str | None = "the dataset was not checked for it",
    ) -> tuple[SearchSpace, list[str]]:
        """Fill in the defaults for this machine and dataset.

        Args:
            usable_cpus: CPUs this process may run on.
            has_accelerator: whether pinning memory can do anything here.
            batches_per_epoch: ``len(loader)``, or ``None`` if unknown.
            batched_fetch_problem: why the dataset cannot be fetched a batch at a time
                (see :func:`autoloader.checks._batched_fetch.batched_fetch_problem`), or ``None``
                once it was checked that it can.
            threads_problem: why thread workers cannot load the dataset (see
                :meth:`autoloader.checks._facts.Checks.threads_problem`), or ``None`` once it
                was checked that they can.

        Returns:
            The concrete space, and notes for the user about settings fixed here, in
            words (:func:`resolve_space` gives them as typed values).

        Raises:
            InvalidInputError: ``batched_fetch=True`` was asked for a dataset that
                cannot be fetched a batch at a time, or ``worker_kind="threads"`` for
                one that thread workers cannot load.
        """
        space, notes = resolve_space(
            self,
            usable_cpus=usable_cpus,
            has_accelerator=has_accelerator,
            batches_per_epoch=batches_per_epoch,
            batched_fetch_problem=batched_fetch_problem,
            threads_problem=threads_problem,
        )
        return space, [render(note) for note in notes]

    def _bounds(self) -> _Choices:
        if (
            not isinstance(self.num_workers, tuple)
            or self.pin_memory is None
            or self.batched_fetch is None
            or self.worker_threads == "auto"
            or self.worker_kind is None
            or self.step_threads == "auto"
        ):
            raise InvalidInputError(
                "SearchSpace.resolve() must be called before drawing settings from it."
            )
        # __post_init__ and resolve() turned every option into a range or a tuple.
        return _Choices(
            num_workers=self.num_workers,
            prefetch_factor=self.prefetch_factor,  # type: ignore[arg-type]
            persistent_workers=self.persistent_workers,  # type: ignore[arg-type]
            pin_memory=self.pin_memory,  # type: ignore[arg-type]
            batched_fetch=self.batched_fetch,  # type: ignore[arg-type]
            worker_threads=self.worker_threads,  # type: ignore[arg-type]
            in_order=self.in_order,  # type: ignore[arg-type]
            worker_kind=self.worker_kind,  # type: ignore[arg-type]
            step_threads=self.step_threads,  # type: ignore[arg-type]
        )

    def suggest(self, trial: optuna.Trial) -> Params:
        """Draw one setting from a resolved space; worker options only with workers, and
        no option of one choice (see :func:`_choose`)."""
        choices = self._bounds()
        num_workers = trial.suggest_int("num_workers", *choices.num_workers)
        params: Params = {"num_workers": num_workers}
        if num_workers > 0:
            kind = _choose(trial, "worker_kind", choices.worker_kind)
            params["worker_kind"] = kind
            params["prefetch_factor"] = trial.suggest_int(
                "prefetch_factor", *choices.prefetch_factor
            )
            if kind == "processes":  # threads start in microseconds and share the pools
                params["persistent_workers"] = _choose(
                    trial, "persistent_workers", choices.persistent_workers
                )
                params["worker_threads"] = _choose(trial, "worker_threads", choices.worker_threads)
            params["in_order"] = _choose(trial, "in_order", choices.in_order)
        params["pin_memory"] = _choose(trial, "pin_memory", choices.pin_memory)
        params["batched_fetch"] = _choose(trial, "batched_fetch", choices.batched_fetch)
        if choices.step_threads is not None:
            params["step_threads"] = trial.suggest_int("step_threads", *choices.step_threads)
        return normalize_params(params)

    def drawn(self, params: Mapping[str, Any]) -> Params:
        """The values :meth:`suggest` draws for ``params`` from this resolved space: what
        a queued trial (``study.enqueue_trial``) must fix. Worker options are not drawn
        without workers, process options not for threads, no option of one choice, nor
        ``step_threads`` where they are left alone (``None``)."""
        choices = self._bounds()
        drawn = {k: v for k, v in params.items() if k != "step_threads" or v is not None}
        if params["num_workers"] == 0:
            drawn = {k: v for k, v in drawn.items() if k not in _WORKER_ONLY}
        elif params["worker_kind"] == "threads":
            drawn = {k: v for k, v in drawn.items() if k not in _PROCESS_ONLY}
        return {k: v for k, v in drawn.items() if k not in _CHOICES or len(getattr(choices, k)) > 1}

    def held(self, params: Mapping[str, Any]) -> Params | None:
        """``params`` with workers, their count held to this resolved space's range: a
        setting to measure first (``NOTE [ Drift ]``). ``None`` where the space has no
        workers or another of its options is outside the space."""
        choices = self._bounds()
        low, high = choices.num_workers
        workers = min(max(int(params.get("num_workers", 0)), low), high)
        if workers == 0:
            return None
        held = normalize_params({**params, "num_workers": workers})
        pf_low, pf_high = choices.prefetch_factor
        options = ["worker_kind", "pin_memory", "batched_fetch", "in_order"]
        if held["worker_kind"] == "processes":
            options += _PROCESS_ONLY
        inside = pf_low <= held["prefetch_factor"] <= pf_high and all(
            held[name] in getattr(choices, name) for name in options
        )
        if not inside:
            return None
        step = held["step_threads"]
        if choices.step_threads is not None:
            lowest, highest = choices.step_threads
            step = highest if step is None else min(max(step, lowest), highest)
        else:
            step = None
        return {**held, "step_threads": step}

    def ladder(
        self,
        first: Sequence[int] = (),
        *,
        limit_threads: bool = False,
        first_threads: Sequence[int] = (),
        step_threads: Callable[[str, int], int | None] | None = None,
    ) -> list[Params]:
        """Starting points: worker counts doubling across the range, other options typical.

        The throughput of a loader is mostly a function of ``num_workers``; a doubling
        ladder brackets the right count in a handful of trials, which the sampler then
        refines. Counts in ``first`` (a cost model's guesses), held to the range, come
        before it. Where the
        space allows, the ladder fetches whole batches (they were checked to be the same
        batches, and one indexing beats many), lets batches come out of order, and with
        ``limit_threads`` (loading was seen to use several threads) gives each worker's
        thread pools one thread. Thread workers at the counts of ``first_threads`` (where
        the space has them) come between ``first`` and the doubling ladder.

        Where the space searches ``step_threads``, each setting gets the training
        process's threads ``step_threads(worker_kind, num_workers)`` names (the cost
        model's split of the cores, see ``NOTE [ Cost model ]``), held to the space's
        range; without it, the most the range allows.
        """
        choices = self._bounds()
        low, high = choices.num_workers
        batched = True in choices.batched_fetch
        # A guess past the range is held to it: the most it allows is the nearest to
        # what loading wants (latency-bound loading guessed 24 workers where the range
        # ended at 12, and the ladder climbed to 12 from 1 instead).
        counts = list(dict.fromkeys(min(max(n, low), high) for n in first if n > 0 < high))
        if batched and low == 0:
            # A whole batch by one indexing is often quicker than a worker's hand-over.
            counts.insert(0, 0)
        guessed = len(counts)
        count = 1
        while count <= high:
            if count >= low and count not in counts:
                counts.append(count)
            count *= 2
        if high > 0 and high not in counts:
            counts.append(high)
        pf_low, pf_high = choices.prefetch_factor
        threads = choices.worker_threads
        kinds = [("processes", n) for n in counts]
        if "threads" in choices.worker_kind:
            with_threads = [("threads", n) for n in first_threads if low <= n <= high and n > 0]
            kinds[guessed:guessed] = with_threads
        if "processes" not in choices.worker_kind:
            kinds = [("threads", n) if n > 0 else (kind, n) for kind, n in kinds]
        kinds = list(dict.fromkeys(kinds))

        def threads_of(kind: str, workers: int) -> int | None:
            if choices.step_threads is None:
                return None
            lowest, highest = choices.step_threads
            wanted = step_threads(kind, workers) if step_threads is not None else None
            return highest if wanted is None else min(max(wanted, lowest), highest)

        return [
            normalize_params(
                {
                    "num_workers": n,
                    "prefetch_factor": min(max(2, pf_low), pf_high),
                    "persistent_workers": True in choices.persistent_workers,
                    "pin_memory": True in choices.pin_memory,
                    "batched_fetch": batched,
                    "worker_threads": 1 if limit_threads and 1 in threads else threads[0],
                    "in_order": False not in choices.in_order,
                    "worker_kind": kind,
                    "step_threads": threads_of(kind, n),
                }
            )
            for kind, n in kinds
        ]


@dataclass(frozen=True, slots=True)
class _Choices:
    """A resolved space's options, each a ``(low, high)`` range or a tuple of choices."""

    num_workers: tuple[int, int]
    prefetch_factor: tuple[int, int]
    persistent_workers: tuple[bool, ...]
    pin_memory: tuple[bool, ...]
    batched_fetch: tuple[bool, ...]
    worker_threads: tuple[int | None, ...]
    in_order: tuple[bool, ...]
    worker_kind: tuple[str, ...]
    step_threads: tuple[int, int] | None


_WORKER_ONLY = (
    "prefetch_factor",
    "persistent_workers",
    "worker_threads",
    "in_order",
    "worker_kind",
)
# Options drawn for worker processes only.
_PROCESS_ONLY = ("persistent_workers", "worker_threads")
# Options drawn from a set of choices: not drawn where it holds one (see _choose).
_CHOICES = (
    "worker_kind",
    "persistent_workers",
    "worker_threads",
    "in_order",
    "pin_memory",
    "batched_fetch",
)


def _choose(trial: optuna.Trial, name: str, choices: tuple[Any, ...]) -> Any:
    """One of ``choices``, drawn by the sampler where there are several. One choice is
    not drawn: a check that did not finish leaves this run one where the study it shares
    with earlier runs has two, and Optuna refuses a categorical parameter whose choices
    change within a study (``NOTE [ A study named by what stays ]`` in ``_session.py``)."""
    if len(choices) == 1:
        return choices[0]
    return trial.suggest_categorical(name, choices)


def resolve_space(
    space: SearchSpace,
    *,
    usable_cpus: int,
    has_accelerator: bool,
    batches_per_epoch: int | None,
    batched_fetch_problem: str | None,
    threads_problem: str | None,
    startup: Startup | None = None,
) -> tuple[SearchSpace, list[SpaceNote]]:
    """:meth:`SearchSpace.resolve`, with its notes as typed values, rendered to words
    once, at the end of the run (see ``search/_reasons.py``). ``startup``, measured
    before the search, caps the default range of ``num_workers`` where workers are slow
    to start (see ``NOTE [ Worker start-up ]`` in ``checks/_facts.py``)."""
    notes: list[SpaceNote] = []
    num_workers = space.num_workers
    if num_workers is None:
        high = default_max_workers(usable_cpus)
        if batches_per_epoch is not None and batches_per_epoch < high:
            # More workers than batches in an epoch never have anything to do.
            high = batches_per_epoch
            notes.append(WorkersCappedAtEpoch(high))
        if startup is not None and startup.most_workers() < high:
            high = startup.most_workers()
            notes.append(
                WorkersCappedAtStartup(
                    high, startup.seconds, startup.start_method, startup.time_budget
                )
            )
        num_workers = (0, high)
    pin_memory = space.pin_memory
    if not has_accelerator:
        if isinstance(pin_memory, tuple) and True in pin_memory:
            notes.append(PinMemoryAskedForInVain())
        pin_memory = (False,)
        notes.append(NoAccelerator())
    elif pin_memory is None:
        pin_memory = (False, True)
    batched_fetch = space.batched_fetch
    if batched_fetch_problem is not None:
        if batched_fetch is not None and True in batched_fetch:  # type: ignore[operator]
            raise InvalidInputError(
                f"SearchSpace.batched_fetch=True was asked for, but {batched_fetch_problem}. "
                "Leave batched_fetch unset, or set it to False."
            )
        batched_fetch = (False,)
    elif batched_fetch is None:
        batched_fetch = (False, True)
        notes.append(BatchedFetchSearched())
    worker_threads = space.worker_threads
    if worker_threads == "auto":
        # Each worker's pools start as wide as the machine (see NOTE [ Worker threads ]).
        worker_threads = (None, 1) if usable_cpus > 1 else (None,)
    worker_kind = space.worker_kind
    if threads_problem is not None:
        if worker_kind is not None and "threads" in worker_kind:
            raise InvalidInputError(
                f'SearchSpace.worker_kind "threads" was asked for, but {threads_problem}. '
                'Leave worker_kind unset, or set it to "processes".'
            )
        if worker_kind is None:
            notes.append(ProcessesOnly(threads_problem))
        worker_kind = ("processes",)
    elif worker_kind is None:
        worker_kind = WORKER_KINDS
        notes.append(ThreadsSearched())
    step_threads = space.step_threads
    if step_threads == "auto":
        # Whether the step does CPU work is known from the baseline: the policy leaves
        # the threads alone where it does not (Policy.sampled_space).
        step_threads = (1, usable_cpus) if usable_cpus > 1 else None
    resolved = dataclasses.replace(
        space,
        num_workers=num_workers,
        pin_memory=pin_memory,
        batched_fetch=batched_fetch,
        worker_threads=worker_threads,
        worker_kind=worker_kind,
        step_threads=step_threads,
    )
    return resolved, notes


def check_search_space(search_space: object) -> SearchSpace:
    """``search_space`` as tune() takes it (``None``, a SearchSpace or a dict), as a
    SearchSpace.

    Raises:
        InvalidInputError: it is none of those, or the dict is not a valid space.
    """
    if search_space is None:
        return SearchSpace()
    if isinstance(search_space, SearchSpace):
        return search_space
    if isinstance(search_space, Mapping):
        return SearchSpace.from_dict(search_space)
    raise InvalidInputError(
        f"search_space must be an autoloader.SearchSpace or a dict of its fields, but got "
        f"{type(search_space).__name__}."
    )


def without_batched_fetch(asked: object, *, refusal: str) -> SearchSpace:
    """The search space ``asked`` for (checked), with batched fetch fixed off: for a
    loader whose batches must come from a collate_fn or a sampler of its own.

    Raises:
        InvalidInputError: ``asked`` asks for batched fetch; its message is ``refusal``.
    """
    space = check_search_space(asked)
    if space.batched_fetch not in (None, (False,)):
        raise InvalidInputError(refusal)
    return dataclasses.replace(space, batched_fetch=False)
