"""What each tuned setting may hold, and a search space's field read into its choices:
the one definition SearchSpace checks by and a saved result is read by."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass

from autoloader._exceptions import InvalidInputError
from autoloader.loader import WORKER_KINDS


@dataclass(frozen=True, slots=True)
class Rule:
    """What one value of a tuned setting must be: a value that fixes it in a
    :class:`SearchSpace`, each of its choices, the low end of its range, and the setting
    a saved result holds (``results/_result.py``).

    Attributes:
        allows: whether a value keeps the rule (its type too: ``True`` is no int here).
        words: the rule in words, in JSON's terms (a saved result's messages quote them).
    """

    allows: Callable[[object], bool]
    words: str


def _int_at_least(low: int) -> Callable[[object], bool]:
    return lambda value: isinstance(value, int) and not isinstance(value, bool) and value >= low


def _is_bool(value: object) -> bool:
    return isinstance(value, bool)


def _or_none(allows: Callable[[object], bool]) -> Callable[[object], bool]:
    return lambda value: value is None or allows(value)


# The one definition of each setting's values: SearchSpace checks by it, a saved result
# too. None, where allowed, leaves the pools as they are.
SETTING_RULES: dict[str, Rule] = {
    "num_workers": Rule(_int_at_least(0), "an int >= 0 (0 loads in the main process)"),
    "prefetch_factor": Rule(_int_at_least(1), "an int >= 1"),
    "persistent_workers": Rule(_is_bool, "true or false"),
    "pin_memory": Rule(_is_bool, "true or false"),
    "batched_fetch": Rule(_is_bool, "true or false"),
    "worker_threads": Rule(
        _or_none(_int_at_least(1)),
        "an int >= 1, or null to leave the workers' thread pools as they are",
    ),
    "in_order": Rule(_is_bool, "true or false"),
    "worker_kind": Rule(
        lambda value: isinstance(value, str) and value in WORKER_KINDS,
        " or ".join(json.dumps(kind) for kind in WORKER_KINDS),
    ),
    "step_threads": Rule(
        _or_none(_int_at_least(1)),
        "an int >= 1, or null to leave the training process's threads as they are",
    ),
}


def int_range(name: str, value: object) -> tuple[int, int]:
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


def thread_choices(value: object) -> tuple[int | None, ...]:
    choices = (value,) if value is None or isinstance(value, int) else value
    if (
        not isinstance(choices, tuple | list)
        or not choices
        or not all(c is None or (isinstance(c, int) and not isinstance(c, bool)) for c in choices)
    ):
        raise InvalidInputError(
            "SearchSpace.worker_threads must be an int, or a tuple of ints and None (None "
            f"leaves the workers' thread pools as they are), but got {value!r}."
        )
    if not all(SETTING_RULES["worker_threads"].allows(c) for c in choices):
        raise InvalidInputError(
            f"SearchSpace.worker_threads must be at least 1 but got {value!r}; use None to "
            "leave the workers' thread pools as they are."
        )
    return tuple(dict.fromkeys(choices))


def step_thread_range(value: object) -> tuple[int, int] | None:
    if value is None:
        return None
    low, high = int_range("step_threads", value)
    if not SETTING_RULES["step_threads"].allows(low):
        raise InvalidInputError(
            f"SearchSpace.step_threads must be at least 1 but got {low}; use None to leave "
            "the training process's threads as they are."
        )
    return low, high


def kind_choices(value: object) -> tuple[str, ...]:
    choices = (value,) if isinstance(value, str) else value
    if (
        not isinstance(choices, tuple | list)
        or not choices
        or not all(SETTING_RULES["worker_kind"].allows(c) for c in choices)
    ):
        raise InvalidInputError(
            'SearchSpace.worker_kind must be "processes", "threads" or a tuple of them, but '
            f"got {value!r}."
        )
    return tuple(dict.fromkeys(choices))


def bool_choices(name: str, value: object) -> tuple[bool, ...]:
    choices = (value,) if isinstance(value, bool) else value
    if not isinstance(choices, tuple | list) or not all(
        SETTING_RULES[name].allows(c) for c in choices
    ):
        raise InvalidInputError(
            f"SearchSpace.{name} must be a bool or a tuple of bools, but got {value!r}."
        )
    if not choices:
        raise InvalidInputError(
            f"SearchSpace.{name} has no choices; give True, False or (False, True)."
        )
    return tuple(dict.fromkeys(choices))
