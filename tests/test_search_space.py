from __future__ import annotations

from typing import Any

import optuna
import pytest

from autoloader import InvalidInputError, SearchSpace
from autoloader.loader._params import TUNED_KEYS, normalize_params
from autoloader.search._setting_rules import SETTING_RULES


def test_defaults_resolve_for_the_machine() -> None:
    space, notes = SearchSpace().resolve(
        usable_cpus=2, has_accelerator=False, batches_per_epoch=None
    )
    assert space.num_workers == (0, 16)
    assert space.prefetch_factor == (1, 8)
    assert space.persistent_workers == (False, True)
    assert space.pin_memory == (False,)
    assert any("no accelerator" in note for note in notes)


def test_many_cpus_widen_the_worker_range() -> None:
    space, _ = SearchSpace().resolve(usable_cpus=32, has_accelerator=True, batches_per_epoch=None)
    assert space.num_workers == (0, 64)
    assert space.pin_memory == (False, True)


def test_workers_capped_at_batches_per_epoch() -> None:
    space, notes = SearchSpace().resolve(usable_cpus=2, has_accelerator=False, batches_per_epoch=5)
    assert space.num_workers == (0, 5)
    assert any("only 5 batches" in note for note in notes)


def test_user_range_is_kept_and_single_values_fix() -> None:
    space, _ = SearchSpace(num_workers=(2, 40), prefetch_factor=4, persistent_workers=True).resolve(
        usable_cpus=2, has_accelerator=False, batches_per_epoch=10
    )
    assert space.num_workers == (2, 40)
    assert space.prefetch_factor == (4, 4)
    assert space.persistent_workers == (True,)


def test_pin_memory_asked_without_accelerator_is_fixed_off_and_said() -> None:
    space, notes = SearchSpace(pin_memory=True).resolve(
        usable_cpus=2, has_accelerator=False, batches_per_epoch=None
    )
    assert space.pin_memory == (False,)
    assert any("pin_memory=True was asked for" in note for note in notes)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"num_workers": (4, 2)}, r"range \(4, 2\) is empty"),
        ({"num_workers": -1}, "cannot be negative"),
        ({"num_workers": (0, 1, 2)}, "pair of ints"),
        ({"num_workers": "8"}, "pair of ints"),
        ({"prefetch_factor": 0}, "at least 1"),
        ({"persistent_workers": ()}, "has no choices"),
        ({"pin_memory": "yes"}, "bool or a tuple of bools"),
        ({"batched_fetch": "yes"}, "bool or a tuple of bools"),
        ({"in_order": ()}, "has no choices"),
        ({"worker_threads": 0}, "at least 1 but got 0; use None"),
        ({"worker_threads": (None, "2")}, "tuple of ints and None"),
        ({"worker_threads": True}, "tuple of ints and None"),
    ],
)
def test_bad_ranges_are_rejected(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(InvalidInputError, match=message):
        SearchSpace(**kwargs)  # type: ignore[arg-type]


def test_every_setting_has_one_rule_that_the_space_and_a_saved_result_share() -> None:
    """The rules are SearchSpace's own: a value it refuses to fix a setting to, a saved
    result may not hold either (results/_result.py derives its rules from these)."""
    assert list(SETTING_RULES) == list(TUNED_KEYS) == list(SearchSpace().as_dict())
    for name, rule in SETTING_RULES.items():
        for value in (-1, 0, 1, True, 1.0, "1", "threads"):
            if rule.allows(value):
                SearchSpace(**{name: value})
            else:
                with pytest.raises(InvalidInputError):
                    SearchSpace(**{name: value})


def test_from_dict_rejects_unknown_keys_with_a_suggestion() -> None:
    with pytest.raises(
        InvalidInputError,
        match=r"Unknown SearchSpace key 'num_worker'\. Did you mean 'num_workers'",
    ):
        SearchSpace.from_dict({"num_worker": 4})


def test_from_dict_accepts_json_lists() -> None:
    assert SearchSpace.from_dict({"num_workers": [1, 4]}).num_workers == (1, 4)


def test_ladder_doubles_across_the_range() -> None:
    space, _ = SearchSpace(num_workers=(0, 12)).resolve(
        usable_cpus=2, has_accelerator=False, batches_per_epoch=None
    )
    assert [p["num_workers"] for p in space.ladder()] == [1, 2, 4, 8, 12]
    assert all(p["prefetch_factor"] == 2 and p["persistent_workers"] for p in space.ladder())


def test_suggest_draws_worker_options_only_with_workers() -> None:
    space, _ = SearchSpace(num_workers=(0, 3)).resolve(
        usable_cpus=2, has_accelerator=True, batches_per_epoch=None, batched_fetch_problem=None
    )
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=1))
    seen = set()
    for _ in range(30):
        trial = study.ask()
        params = space.suggest(trial)
        seen.add(params["num_workers"])
        if params["num_workers"] == 0:
            # The training process's threads are drawn whatever the workers.
            assert set(trial.params) == {
                "num_workers", "pin_memory", "batched_fetch", "step_threads"
            }  # fmt: skip
            assert params["worker_threads"] is None and params["in_order"] is True
            assert params["prefetch_factor"] is None
            assert params["persistent_workers"] is False
        else:
            assert 1 <= params["prefetch_factor"] <= 8
        study.tell(trial, 1.0)
    assert seen == {0, 1, 2, 3}


def test_unresolved_space_cannot_draw() -> None:
    with pytest.raises(InvalidInputError, match="resolve"):
        SearchSpace().ladder()


def test_normalize_params() -> None:
    assert normalize_params(
        {"num_workers": 0, "prefetch_factor": 4, "persistent_workers": True}
    ) == {
        "num_workers": 0,
        "prefetch_factor": None,
        "persistent_workers": False,
        "pin_memory": False,
        "batched_fetch": False,
        "worker_threads": None,
        "in_order": True,
        "worker_kind": "processes",
        "step_threads": None,
    }
    # The training process's threads are its own, with or without workers.
    assert normalize_params({"num_workers": 0, "step_threads": 1})["step_threads"] == 1
    # Thread workers start in microseconds and share the process's native pools.
    threads = normalize_params(
        {
            "num_workers": 3,
            "persistent_workers": True,
            "worker_threads": 1,
            "worker_kind": "threads",
        }
    )
    assert (threads["persistent_workers"], threads["worker_threads"]) == (False, None)
    assert threads["worker_kind"] == "threads"
    assert (
        normalize_params({"num_workers": 0, "worker_kind": "threads"})["worker_kind"] == "processes"
    )


def test_worker_kind_is_searched_only_where_threads_were_checked() -> None:
    resolve = {"usable_cpus": 2, "has_accelerator": False, "batches_per_epoch": None}
    space, notes = SearchSpace().resolve(**resolve, threads_problem=None)
    assert space.worker_kind == ("processes", "threads")
    assert any("worker_kind searched" in note for note in notes)
    unchecked, _ = SearchSpace().resolve(**resolve)
    assert unchecked.worker_kind == ("processes",)
    with pytest.raises(InvalidInputError, match='"threads" was asked for, but it keeps state'):
        SearchSpace(worker_kind="threads").resolve(**resolve, threads_problem="it keeps state")
    with pytest.raises(InvalidInputError, match="worker_kind must be"):
        SearchSpace(worker_kind="fibres")


def test_thread_settings_draw_no_process_options() -> None:
    space, _ = SearchSpace(worker_kind="threads", num_workers=(1, 8)).resolve(
        usable_cpus=2, has_accelerator=False, batches_per_epoch=None, threads_problem=None
    )
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    for _ in range(10):
        trial = study.ask()
        params = space.suggest(trial)
        assert params["worker_kind"] == "threads"
        assert "persistent_workers" not in trial.params and "worker_threads" not in trial.params
        # pin_memory and batched_fetch: one choice each here, not drawn.
        assert space.drawn(params) == trial.params
        assert {"pin_memory", "batched_fetch"}.isdisjoint(trial.params)


def test_the_ladder_measures_the_guessed_thread_counts_after_the_process_guesses() -> None:
    space, _ = SearchSpace(num_workers=(0, 16)).resolve(
        usable_cpus=2, has_accelerator=False, batches_per_epoch=None, threads_problem=None
    )
    ladder = space.ladder(first=[5], first_threads=[5, 8])
    kinds = [(p["worker_kind"], p["num_workers"]) for p in ladder]
    assert kinds[:3] == [("processes", 5), ("threads", 5), ("threads", 8)]
    assert [n for kind, n in kinds[3:]] == [1, 2, 4, 8, 16]
    only, _ = SearchSpace(num_workers=(0, 4), worker_kind="threads").resolve(
        usable_cpus=2, has_accelerator=False, batches_per_epoch=None, threads_problem=None
    )
    assert {p["worker_kind"] for p in only.ladder() if p["num_workers"]} == {"threads"}


def test_new_options_resolve_to_what_applies() -> None:
    space, notes = SearchSpace().resolve(
        usable_cpus=2, has_accelerator=False, batches_per_epoch=None, batched_fetch_problem=None
    )
    assert space.batched_fetch == (False, True)
    assert any("batched_fetch searched" in note for note in notes)
    assert space.worker_threads == (None, 1)
    assert space.in_order == (True,)  # reordering only when the user allows it
    single, _ = SearchSpace().resolve(
        usable_cpus=1, has_accelerator=False, batches_per_epoch=None, batched_fetch_problem="no"
    )
    assert single.batched_fetch == (False,)
    assert single.worker_threads == (None,)


def test_batched_fetch_asked_of_a_dataset_that_cannot_is_an_error() -> None:
    with pytest.raises(InvalidInputError, match="batched_fetch=True was asked for, but it raised"):
        SearchSpace(batched_fetch=True).resolve(
            usable_cpus=2,
            has_accelerator=False,
            batches_per_epoch=None,
            batched_fetch_problem="it raised",
        )


def test_ladder_fetches_batches_limits_threads_and_reorders_where_allowed() -> None:
    space, _ = SearchSpace(num_workers=(0, 4), in_order=(True, False)).resolve(
        usable_cpus=2, has_accelerator=False, batches_per_epoch=None, batched_fetch_problem=None
    )
    ladder = space.ladder(limit_threads=True)
    assert [p["num_workers"] for p in ladder] == [0, 1, 2, 4]
    assert all(p["batched_fetch"] for p in ladder)
    # Without the cost model's split, the step keeps every core the space allows.
    assert ladder[0] == normalize_params(
        {"num_workers": 0, "batched_fetch": True, "step_threads": 2}
    )
    assert all(p["worker_threads"] == 1 and p["in_order"] is False for p in ladder[1:])
    plain = space.ladder(limit_threads=False)
    assert all(p["worker_threads"] is None for p in plain)


def test_queued_settings_name_what_suggest_draws() -> None:
    space, _ = SearchSpace(num_workers=(0, 2), in_order=(True, False)).resolve(
        usable_cpus=2, has_accelerator=False, batches_per_epoch=None, batched_fetch_problem=None
    )
    study = optuna.create_study()
    for params in space.ladder(limit_threads=True):
        study.enqueue_trial(space.drawn(params))
        trial = study.ask()
        assert space.suggest(trial) == params
        assert trial.params == space.drawn(params)
        study.tell(trial, 1.0)


def test_step_threads_resolve_to_the_cpus_and_check_what_is_asked() -> None:
    resolve: dict[str, Any] = {"has_accelerator": False, "batches_per_epoch": None}
    assert SearchSpace().resolve(usable_cpus=4, **resolve)[0].step_threads == (1, 4)
    # One CPU (a rank's share of a node included): nothing to split.
    assert SearchSpace().resolve(usable_cpus=1, **resolve)[0].step_threads is None
    assert SearchSpace(step_threads=2).step_threads == (2, 2)
    assert SearchSpace(step_threads=[1, 3]).step_threads == (1, 3)
    assert SearchSpace(step_threads=None).resolve(usable_cpus=4, **resolve)[0].step_threads is None
    with pytest.raises(InvalidInputError, match="step_threads must be at least 1 but got 0"):
        SearchSpace(step_threads=(0, 2))
    for bad in (True, "many", (3, 1), 2.5):
        with pytest.raises(InvalidInputError, match="step_threads"):
            SearchSpace(step_threads=bad)  # type: ignore[arg-type]
    assert SearchSpace.from_dict({"step_threads": [1, 2]}).step_threads == (1, 2)


def test_the_ladder_splits_the_cores_as_it_is_told_within_the_range() -> None:
    space, _ = SearchSpace(num_workers=(0, 8), step_threads=(1, 3)).resolve(
        usable_cpus=4, has_accelerator=False, batches_per_epoch=None, batched_fetch_problem="no"
    )
    ladder = space.ladder(step_threads=lambda kind, workers: 4 - workers)
    assert [(p["num_workers"], p["step_threads"]) for p in ladder] == [
        (1, 3), (2, 2), (4, 1), (8, 1)
    ]  # fmt: skip
    left, _ = SearchSpace(num_workers=(0, 2), step_threads=None).resolve(
        usable_cpus=4, has_accelerator=False, batches_per_epoch=None
    )
    assert {p["step_threads"] for p in left.ladder(step_threads=lambda k, n: 1)} == {None}


def test_step_threads_left_alone_are_not_drawn() -> None:
    space, _ = SearchSpace(num_workers=(0, 2), step_threads=None).resolve(
        usable_cpus=4, has_accelerator=False, batches_per_epoch=None
    )
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    for _ in range(5):
        trial = study.ask()
        assert space.suggest(trial)["step_threads"] is None
        assert "step_threads" not in trial.params
        study.tell(trial, 1.0)
    assert "step_threads" not in space.drawn(normalize_params({"num_workers": 1}))
