"""Which DataLoader settings are tuned, over what ranges, and how a trial draws them."""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from autoloader._exceptions import InvalidInputError

if TYPE_CHECKING:
    import optuna

TUNED_KEYS = ("num_workers", "prefetch_factor", "persistent_workers", "pin_memory")

# Latency-bound datasets (network or disk waits) want far more workers than cores: a
# 2-core machine reading items that each sleep 5 ms is fastest near 12-16 workers.
_MIN_DEFAULT_MAX_WORKERS = 16
_WORKERS_PER_CPU = 2

Params = dict[str, Any]


def _int_range(name: str, value: object) -> tuple[int, int]:
    if isinstance(value, bool) or not isinstance(value, int | tuple | list):
        raise InvalidInputError(
            f"SearchSpace.{name} must be an int or a (low, high) pair of ints, but got {value!r}."
        )
    pair = (value, value) if isinstance(value, int) else tuple(value)
    if len(pair) != 2 or not all(isinstance(v, int) and not isinstance(v, bool) for v in pair):
        raise InvalidInputError(
            f"SearchSpace.{name} must be an int or a (low, high) pair of ints, but got {value!r}."
        )
    low, high = pair
    if low > high:
        raise InvalidInputError(
            f"SearchSpace.{name} range ({low}, {high}) is empty; give low <= high."
        )
    return low, high


def _choices(name: str, value: object) -> tuple[bool, ...]:
    choices = (value,) if isinstance(value, bool) else value
    if not isinstance(choices, tuple | list) or not all(isinstance(c, bool) for c in choices):
        raise InvalidInputError(
            f"SearchSpace.{name} must be a bool or a tuple of bools, but got {value!r}."
        )
    if not choices:
        raise InvalidInputError(
            f"SearchSpace.{name} has no choices; give True, False or (False, True)."
        )
    return tuple(dict.fromkeys(choices))


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

    Example::

        space = autoloader.SearchSpace(num_workers=(2, 32), persistent_workers=True)
    """

    num_workers: int | tuple[int, int] | None = None
    prefetch_factor: int | tuple[int, int] = (1, 8)
    persistent_workers: bool | tuple[bool, ...] = (False, True)
    pin_memory: bool | tuple[bool, ...] | None = None

    def __post_init__(self) -> None:
        if self.num_workers is not None:
            low, high = _int_range("num_workers", self.num_workers)
            if low < 0:
                raise InvalidInputError(
                    f"SearchSpace.num_workers cannot be negative but got {low}; "
                    "use 0 to load in the main process."
                )
            object.__setattr__(self, "num_workers", (low, high))
        low, high = _int_range("prefetch_factor", self.prefetch_factor)
        if low < 1:
            raise InvalidInputError(
                f"SearchSpace.prefetch_factor must be at least 1 but got {low}."
            )
        object.__setattr__(self, "prefetch_factor", (low, high))
        object.__setattr__(
            self, "persistent_workers", _choices("persistent_workers", self.persistent_workers)
        )
        if self.pin_memory is not None:
            object.__setattr__(self, "pin_memory", _choices("pin_memory", self.pin_memory))

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
        self, *, usable_cpus: int, has_accelerator: bool, batches_per_epoch: int | None
    ) -> tuple[SearchSpace, list[str]]:
        """Fill in the defaults for this machine and dataset.

        Returns:
            The concrete space, and notes for the user about settings fixed here.
        """
        notes = []
        num_workers = self.num_workers
        if num_workers is None:
            high = max(_MIN_DEFAULT_MAX_WORKERS, _WORKERS_PER_CPU * usable_cpus)
            if batches_per_epoch is not None and batches_per_epoch < high:
                # More workers than batches in an epoch never have anything to do.
                high = batches_per_epoch
                notes.append(
                    f"num_workers searched up to {high}: an epoch has only {high} batches."
                )
            num_workers = (0, high)
        pin_memory = self.pin_memory
        if not has_accelerator:
            if isinstance(pin_memory, tuple) and True in pin_memory:
                notes.append("pin_memory=True was asked for, but there is no accelerator here.")
            pin_memory = (False,)
            notes.append("pin_memory fixed to False: this machine has no accelerator.")
        elif pin_memory is None:
            pin_memory = (False, True)
        return dataclasses.replace(self, num_workers=num_workers, pin_memory=pin_memory), notes

    def _bounds(
        self,
    ) -> tuple[tuple[int, int], tuple[int, int], tuple[bool, ...], tuple[bool, ...]]:
        if not isinstance(self.num_workers, tuple) or self.pin_memory is None:
            raise RuntimeError("SearchSpace.resolve() must be called before drawing settings")
        # __post_init__ turned every single value into a range or a tuple of choices.
        return (
            self.num_workers,
            self.prefetch_factor,  # type: ignore[return-value]
            self.persistent_workers,
            self.pin_memory,
        )

    def suggest(self, trial: optuna.Trial) -> Params:
        """Draw one setting from a resolved space; worker options only with workers."""
        workers, prefetch, persistent, pin = self._bounds()
        num_workers = trial.suggest_int("num_workers", *workers)
        params: Params = {"num_workers": num_workers}
        if num_workers > 0:
            params["prefetch_factor"] = trial.suggest_int("prefetch_factor", *prefetch)
            params["persistent_workers"] = trial.suggest_categorical(
                "persistent_workers", persistent
            )
        params["pin_memory"] = trial.suggest_categorical("pin_memory", pin)
        return normalize_params(params)

    def ladder(self, first: Sequence[int] = ()) -> list[Params]:
        """Starting points: worker counts doubling across the range, other options typical.

        The throughput of a loader is mostly a function of ``num_workers``; a doubling
        ladder brackets the right count in a handful of trials, which the sampler then
        refines. Counts in ``first`` (a cost model's guesses) come before it.
        """
        (low, high), (pf_low, pf_high), persistent, pin = self._bounds()
        counts = [n for n in first if low <= n <= high and n > 0]
        count = 1
        while count <= high:
            if count >= low and count not in counts:
                counts.append(count)
            count *= 2
        if high > 0 and high not in counts:
            counts.append(high)
        return [
            normalize_params(
                {
                    "num_workers": n,
                    "prefetch_factor": min(max(2, pf_low), pf_high),
                    "persistent_workers": True in persistent,
                    "pin_memory": True in pin,
                }
            )
            for n in counts
        ]


def normalize_params(params: Mapping[str, Any]) -> Params:
    """Settings in canonical form: worker options are ``None``/``False`` without workers."""
    num_workers = int(params.get("num_workers", 0))
    workers = num_workers > 0
    return {
        "num_workers": num_workers,
        "prefetch_factor": int(params.get("prefetch_factor") or 2) if workers else None,
        "persistent_workers": bool(params.get("persistent_workers", False)) and workers,
        "pin_memory": bool(params.get("pin_memory", False)),
    }


BASELINE_PARAMS: Params = normalize_params({"num_workers": 0})
