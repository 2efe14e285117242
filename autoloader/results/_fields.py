"""The fields of a saved result, each checked for its type and range as it is read, so
that content edited by hand or damaged is refused with the field's name and value."""

from __future__ import annotations

import difflib
import json
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import fields
from typing import Any, TypeGuard

from autoloader._exceptions import ResultFileError
from autoloader.checks import Environment, usable_cpus, world
from autoloader.loader import TUNED_KEYS, Params, normalize_params
from autoloader.results._record import TrialRecord
from autoloader.search import SETTING_RULES, FaultKind, Rule, SearchSpace, default_max_workers

# Fixed DataLoader options of these types are written to the JSON file; others
# (a collate_fn, a sampler, a generator) live only in the result returned by tune().
JSON_SCALARS = (bool, int, float, str, type(None))
# How versions 1 and 2 worded the reasons of trials pruned as slower or too short.
_V2_SLOWER = "clearly slower than the best setting so far"
_V2_TOO_SHORT = "too short"


# What to do about a field that fails a check.
_FIX = "tune again with autoloader.tune(), or correct the field"


def is_int(value: object) -> TypeGuard[int]:
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
                f"field '{label}.{name}' is {shown(value)}, but it must be {rule.words}; {_FIX}"
            )


def checked_settings(raw: Mapping[str, Any]) -> Params:
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


def trial_record(raw: object, index: int, version: int) -> TrialRecord:
    if not isinstance(raw, dict) or not {"number", "phase", "params", "state"} <= set(raw):
        raise ResultFileError(f"malformed trial record {raw!r}")
    label = f"trials[{index}]"
    record = {k: v for k, v in raw.items() if k in _RECORD_NAMES}
    for key in record:
        kind = _RECORD_TYPES.get(key)
        if kind is None:  # a figure: a count, seconds, a rate or a share
            _figure(record, key, label=f"{label}.{key}")
        else:
            typed(record, key, kind, label=f"{label}.{key}")
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


def environment_of(data: Mapping[str, Any]) -> Environment:
    raw = typed(data, "environment", dict)
    for key, most in (
        ("cpu_count", _MOST_CPUS),
        ("usable_cpus", raw.get("cpu_count", _MOST_CPUS)),
        ("world_size", _MOST_RANKS),
        ("local_world_size", raw.get("world_size", _MOST_RANKS)),
        ("nodes", raw.get("world_size", _MOST_RANKS)),
    ):
        if key in raw:
            count(raw, key, least=1, most=most, label=f"environment.{key}")
    if "memory_total" in raw:
        count(raw, "memory_total", least=0, label="environment.memory_total")
    for key in ("torch_version", "python_version", "platform", "start_method"):
        if key in raw:
            typed(raw, key, str, label=f"environment.{key}")
    if "accelerator" in raw:
        typed(raw, "accelerator", str | None, label="environment.accelerator")
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


def check_counts(
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
        measured = max((v for v in complete if is_int(v)), default=0)
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


def problem_of(data: Mapping[str, Any]) -> dict[str, str]:
    problem = typed(data, "problem", dict)
    if not all(isinstance(v, str) for v in problem.values()):
        raise ResultFileError("problem holds a value that is not a string")
    return {str(k): v for k, v in problem.items()}


def _is_count(value: object) -> bool:
    return is_int(value) and value >= 0


def _is_figure(value: object) -> bool:
    return (
        isinstance(value, int | float)
        and not isinstance(value, bool)
        and math.isfinite(value)
        and value >= 0
    )


def _is_scalar(value: object) -> bool:
    return isinstance(value, JSON_SCALARS) and not (
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


def facts_of(facts: dict[str, Any]) -> dict[str, Any]:
    """The checks' facts, each known one of its type; any other a JSON scalar (a fact a
    later check records, which this report does not read)."""
    for name, value in facts.items():
        allows, rule = _FACT_RULES.get(name, (_is_scalar, ""))
        if not allows(value):
            rule = rule or "a number, a string, true, false or null"
            raise ResultFileError(
                f"field 'facts.{name}' is {shown(value)}, but it must be {rule}; {_FIX}"
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


def typed(data: Mapping[str, Any], key: str, kind: Any, *, label: str | None = None) -> Any:
    """``data[key]``, refused unless of type ``kind`` (a bool is no number); ``label``
    names the field where it is not at the top of the file."""
    name = label or key
    if key not in data:
        raise ResultFileError(f"missing field {name!r}")
    value = data[key]
    if (isinstance(value, bool) and kind is not bool) or not isinstance(value, kind):
        raise ResultFileError(f"field {name!r} has the wrong type: {shown(value)}; {_FIX}")
    return value


def count(
    data: Mapping[str, Any],
    key: str,
    *,
    least: int,
    most: int | None = None,
    label: str | None = None,
) -> int:
    value: int = typed(data, key, int, label=label)
    if value < least or (most is not None and value > most):
        rule = f"an int >= {least}" if most is None else f"an int from {least} to {most}"
        raise ResultFileError(f"field {label or key!r} is {value}, but it must be {rule}; {_FIX}")
    return value


def _figure(data: Mapping[str, Any], key: str, *, label: str) -> float | None:
    """A measured figure of a trial (a count, seconds, a rate, a share): a finite number
    >= 0, or null."""
    value = typed(data, key, int | float | None, label=label)
    if value is not None and not (math.isfinite(value) and value >= 0):
        raise ResultFileError(
            f"field {label!r} is {shown(value)}, but it must be a finite number >= 0, or "
            f"null; {_FIX}"
        )
    return value  # type: ignore[no-any-return]


def strings(data: Mapping[str, Any], key: str) -> tuple[str, ...]:
    """``data[key]``, a list of strings."""
    values = typed(data, key, list)
    for index, value in enumerate(values):
        if not isinstance(value, str):
            raise ResultFileError(
                f"field '{key}[{index}]' has the wrong type: {shown(value)}; {_FIX}"
            )
    return tuple(values)


def amount(data: Mapping[str, Any], key: str) -> float:
    value = typed(data, key, int | float)
    if not (math.isfinite(value) and value >= 0):
        raise ResultFileError(
            f"field {key!r} is {shown(value)}, but it must be a finite number >= 0; {_FIX}"
        )
    return float(value)


def optional_amount(data: Mapping[str, Any], key: str) -> float | None:
    value = typed(data, key, int | float | None)
    if value is None:
        return None
    if not (math.isfinite(value) and value >= 0):
        raise ResultFileError(
            f"field {key!r} is {shown(value)}, but it must be a finite number >= 0, or null; {_FIX}"
        )
    return float(value)


def shown(value: object) -> str:
    """``value`` as the file spells it."""
    try:
        return json.dumps(value)
    except (TypeError, ValueError):
        return repr(value)
