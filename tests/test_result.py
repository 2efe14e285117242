from __future__ import annotations

import dataclasses
import json
import math
import re
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import BatchSampler, DataLoader, TensorDataset

import autoloader
import autoloader.loader._factory
from autoloader import EnvironmentMismatchWarning, ResultFileError, TrialRecord, TuneResult
from autoloader.checks._batched_fetch import same_batch
from autoloader.checks._environment import Environment
from autoloader.loader._params import normalize_params
from autoloader.loader._worker_threads import LimitThreads
from autoloader.search._space import default_max_workers

from .workloads import SleepDataset


def _result(**changes: Any) -> TuneResult:
    fields: dict[str, Any] = {
        "params": {
            "num_workers": 3,
            "prefetch_factor": 4,
            "persistent_workers": True,
            "pin_memory": False,
            "batched_fetch": False,
            "worker_threads": None,
            "in_order": True,
            "worker_kind": "processes",
            "step_threads": None,
        },
        "throughput": 700.0,
        "baseline": 150.0,
        "steady_throughput": 910.0,
        "steady_baseline": 155.0,
        "startup_seconds": 2.5,
        "startup_each_epoch": True,
        "batch_size": 8,
        "trials": (
            TrialRecord(
                number=0,
                phase="baseline",
                params={"num_workers": 0},
                state="complete",
                samples_per_second=150.0,
                relative_error=0.02,
            ),
            TrialRecord(
                number=1,
                phase="search",
                params={"num_workers": 9},
                state="pruned",
                reason="memory: process tree reached 5.0 GiB",
            ),
        ),
        "environment": Environment.current(),
        "tuning_seconds": 31.5,
        "memory_budget": 6 * 1024**3,
        "notes": ("pin_memory fixed to False: this machine has no accelerator.",),
        "fixed_loader_kwargs": {"shuffle": True, "drop_last": True},
        "unsaved_loader_kwargs": (),
    }
    fields.update(changes)
    return TuneResult(**fields)


def test_json_round_trip(tmp_path: Path) -> None:
    result = _result()
    path = result.save(tmp_path / "nested" / "best.json")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # same machine: no warning
        again = autoloader.load(path)
    assert again == result
    saved = json.loads(path.read_text())
    assert saved["schema_version"] == 7
    assert (saved["throughput"], saved["steady_throughput"]) == (700.0, 910.0)
    assert (saved["startup_seconds"], saved["startup_each_epoch"]) == (2.5, True)
    assert [p.name for p in path.parent.iterdir()] == ["best.json"]  # no temp file left


def test_a_version_1_file_loads_with_the_defaults_it_measured(tmp_path: Path) -> None:
    data = _result().as_dict()
    data["schema_version"] = 1
    for key in ("batched_fetch", "worker_threads", "in_order", "step_threads"):
        del data["params"][key]
    path = tmp_path / "best.json"
    path.write_text(json.dumps(data))
    assert autoloader.load(path).params == _result().params


def test_a_version_2_file_has_its_trial_kinds_read_from_the_reasons(tmp_path: Path) -> None:
    data = _result().as_dict()
    data["schema_version"] = 2
    reasons = [
        ("pruned", "too short: the trial's 1.0 s ran out before two timing windows", "too short"),
        ("pruned", "clearly slower than the best setting so far", "slower"),
        ("pruned", "memory: process tree reached 4.2 GiB", "memory"),
        ("failed", "worker crashed (SIGSEGV)", None),
        ("failed", "shared memory: /dev/shm ran out (bus error)", "shared memory"),
    ]
    template = {k: v for k, v in data["trials"][0].items() if k != "kind"}
    data["trials"] = [
        {**template, "number": n, "state": state, "reason": reason}
        for n, (state, reason, _) in enumerate(reasons)
    ]
    path = tmp_path / "best.json"
    path.write_text(json.dumps(data))
    trials = autoloader.load(path).trials
    assert [t.kind for t in trials] == [kind for _, _, kind in reasons]
    assert [t.too_short for t in trials] == [True, False, False, False, False]


def test_a_version_4_file_has_its_steady_rates_as_throughput_and_as_steady_rates(
    tmp_path: Path,
) -> None:
    """Versions 1 to 4 kept the steady rates only; their start-up is unknown."""
    data = _result().as_dict()
    data["schema_version"] = 4
    for key in ("steady_throughput", "steady_baseline", "startup_seconds", "startup_each_epoch"):
        del data[key]
    path = tmp_path / "v4.json"
    path.write_text(json.dumps(data))
    again = autoloader.load(path)
    assert (again.throughput, again.baseline) == (700.0, 150.0)
    assert (again.steady_throughput, again.steady_baseline) == (700.0, 150.0)
    assert again.startup_seconds is None and again.startup_each_epoch is False
    assert again.trials == _result().trials and again.params == _result().params
    # Saved again, it is a file of the current version that reads back the same.
    assert autoloader.load(again.save(tmp_path / "current.json")) == again


def test_the_step_threads_are_kept_and_applied_only_when_asked(tmp_path: Path) -> None:
    """NOTE [ Step threads ]: a setting of the training process, which the loader cannot
    carry: saved with the rest, set by apply_threads(), never by make_loader()."""
    params = {**_result().params, "step_threads": 1}
    again = autoloader.load(_result(params=params).save(tmp_path / "best.json"))
    assert again.params["step_threads"] == 1
    before = torch.get_num_threads()
    try:
        loader = again.make_loader(TensorDataset(torch.arange(8)), num_workers=0)
        assert torch.get_num_threads() == before  # the loader leaves the process alone
        assert "step_threads" not in again.loader_kwargs(TensorDataset(torch.arange(8)))
        assert sorted(next(iter(loader))[0].tolist()) == list(range(8))
        assert again.apply_threads() == before
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
    # Left as they were: nothing to apply.
    assert _result().apply_threads() is None and torch.get_num_threads() == before


def test_a_version_6_file_leaves_the_step_threads_as_they_were(tmp_path: Path) -> None:
    data = _result().as_dict()
    data["schema_version"] = 6
    del data["params"]["step_threads"]
    path = tmp_path / "v6.json"
    path.write_text(json.dumps(data))
    assert autoloader.load(path).params["step_threads"] is None


@pytest.mark.parametrize("value", [0, -1, 1.5, "2", True])
def test_a_step_thread_count_out_of_range_is_refused(tmp_path: Path, value: object) -> None:
    data = _result().as_dict()
    data["params"]["step_threads"] = value
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ResultFileError, match=r"'params\.step_threads' is .* int >= 1, or null"):
        autoloader.load(path)


def test_a_result_without_steady_rates_round_trips(tmp_path: Path) -> None:
    result = _result(steady_throughput=None, steady_baseline=None, startup_seconds=None)
    assert autoloader.load(result.save(tmp_path / "best.json")) == result


def test_a_partial_result_stays_partial(tmp_path: Path) -> None:
    again = autoloader.load(_result(partial=True).save(tmp_path / "best.json"))
    assert again.partial is True


def test_speedup_compares_the_epoch_rates_not_the_steady_ones(tmp_path: Path) -> None:
    """The speedup is over a training epoch, start-up included (the objective the
    settings were chosen by): 600 against 150 samples/s is 4x, where the steady rates,
    900 against 100, would say 9x."""
    result = _result(
        throughput=600.0, baseline=150.0, steady_throughput=900.0, steady_baseline=100.0
    )
    assert result.speedup == 4.0
    result.save(tmp_path / "best.json")
    assert json.loads((tmp_path / "best.json").read_text())["speedup"] == 4.0
    # No baseline measured: no finite ratio, and no ZeroDivisionError either.
    assert _result(baseline=0.0).speedup == math.inf


def test_loader_kwargs_merge_fixed_and_tuned_and_overrides_win() -> None:
    result = _result()
    assert result.loader_kwargs() == {
        "batch_size": 8,
        "shuffle": True,
        "drop_last": True,
        "num_workers": 3,
        "prefetch_factor": 4,
        "persistent_workers": True,
        "pin_memory": False,
        "in_order": True,
    }
    assert result.loader_kwargs(shuffle=False, prefetch_factor=6)["prefetch_factor"] == 6
    no_workers = result.loader_kwargs(num_workers=0)
    assert "prefetch_factor" not in no_workers
    assert no_workers["persistent_workers"] is False


def test_make_loader_builds_a_working_loader() -> None:
    loader = _result().make_loader(SleepDataset(20, latency=0.0), persistent_workers=False)
    assert loader.num_workers == 3 and loader.prefetch_factor == 4
    assert loader.drop_last
    assert sum(batch.shape[0] for batch in loader) == 16
    del loader


def test_batched_fetch_loads_the_same_batches_in_the_same_order() -> None:
    dataset = TensorDataset(torch.arange(40.0).reshape(20, 2), torch.arange(20))
    batched = _result(params=normalize_params({"batched_fetch": True}))
    per_item = _result(params=normalize_params({}))
    for seed in (0, 1):  # shuffle=True and drop_last=True are fixed options of _result()
        a = batched.make_loader(dataset, generator=torch.Generator().manual_seed(seed))
        b = per_item.make_loader(dataset, generator=torch.Generator().manual_seed(seed))
        assert a.batch_size is None and isinstance(a.sampler, BatchSampler)
        assert len(a) == len(b) == 2
        assert all(same_batch(x, y) for x, y in zip(a, b, strict=True))


def test_out_of_order_loading_gives_every_batch() -> None:
    reordered = _result(params=normalize_params({"num_workers": 2, "in_order": False}))
    loader = reordered.make_loader(SleepDataset(24, latency=0.0), shuffle=False)
    try:
        assert loader.in_order is False
        assert sorted(float(x) for batch in loader for x in batch[:, 0]) == list(range(24))
    finally:
        del loader


def test_batched_fetch_needs_the_dataset_and_no_collate_fn() -> None:
    batched = _result(params=normalize_params({"batched_fetch": True}))
    with pytest.raises(autoloader.InvalidInputError, match="pass the dataset, or use make_loader"):
        batched.loader_kwargs()
    dataset = TensorDataset(torch.zeros(8, 2))
    with pytest.raises(
        autoloader.InvalidInputError, match="without a collate_fn; pass batched_fetch=False"
    ):
        batched.make_loader(dataset, collate_fn=list)
    assert batched.make_loader(dataset, collate_fn=list, batched_fetch=False).batch_size == 8


def test_worker_threads_wrap_the_users_worker_init_fn() -> None:
    limited = _result(params=normalize_params({"num_workers": 2, "worker_threads": 1}))
    kwargs = limited.loader_kwargs(worker_init_fn=print)
    assert isinstance(kwargs["worker_init_fn"], LimitThreads)
    assert kwargs["worker_init_fn"].threads == 1 and kwargs["worker_init_fn"].then is print
    assert "worker_threads" not in kwargs and "batched_fetch" not in kwargs
    assert "worker_init_fn" not in limited.loader_kwargs(num_workers=0)


def test_options_the_file_cannot_keep_are_asked_for(tmp_path: Path) -> None:
    result = _result(unsaved_loader_kwargs=("collate_fn",))
    again = autoloader.load(result.save(tmp_path / "best.json"))
    with pytest.warns(UserWarning, match="collate_fn, which a JSON file cannot keep"):
        again.loader_kwargs()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert again.loader_kwargs(collate_fn=list)["collate_fn"] is list


def test_another_machine_is_warned_about(tmp_path: Path) -> None:
    here = Environment.current()
    there = dataclasses.replace(
        here,
        usable_cpus=here.usable_cpus + 62,
        cpu_count=here.cpu_count + 62,
        torch_version="1.0.0",
        accelerator="cuda: NVIDIA H100 x8",
        memory_total=here.memory_total * 10,
    )
    path = _result(environment=there).save(tmp_path / "best.json")
    with pytest.warns(EnvironmentMismatchWarning) as caught:
        autoloader.load(path)
    message = str(caught[0].message)
    for part in (
        "CPUs",
        "memory",
        "torch: 1.0.0 when measured",
        "accelerator: cuda: NVIDIA H100 x8",
        "tune() again",
    ):
        assert part in message


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("{not json", "is not valid JSON"),
        ("[]", "a result must be a JSON object"),
        (
            '{"schema_version": 99}',
            "schema_version is 99, but this autoloader reads versions 1, 2, 3",
        ),
        ('{"schema_version": 1}', "missing field 'params'"),
    ],
)
def test_malformed_files_are_rejected(tmp_path: Path, content: str, message: str) -> None:
    path = tmp_path / "best.json"
    path.write_text(content)
    with pytest.raises(ResultFileError, match=message):
        autoloader.load(path)


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("throughput", "fast", "field 'throughput' has the wrong type"),
        ("steady_throughput", "fast", "field 'steady_throughput' has the wrong type"),
        ("startup_seconds", True, "field 'startup_seconds' has the wrong type"),
        ("startup_each_epoch", 1, "field 'startup_each_epoch' has the wrong type"),
        ("batch_size", True, "field 'batch_size' has the wrong type"),
        ("partial", "yes", "field 'partial' has the wrong type"),
        ("trials", [{"number": 0}], "malformed trial record"),
        ("params", {"num_workers": 2, "evil": "__import__('os')"}, "unknown key 'evil'"),
        ("fixed_loader_kwargs", {"collate_fn": {"py/function": "os.system"}}, "not a scalar"),
    ],
)
def test_wrong_fields_are_rejected(tmp_path: Path, key: str, value: object, message: str) -> None:
    data = _result().as_dict()
    data[key] = value
    path = tmp_path / "best.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ResultFileError, match=message):
        autoloader.load(path)


def test_a_version_5_file_without_its_steady_rates_is_rejected(tmp_path: Path) -> None:
    data = _result().as_dict()
    del data["steady_baseline"]
    path = tmp_path / "best.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ResultFileError, match="missing field 'steady_baseline'"):
        autoloader.load(path)


def test_missing_file() -> None:
    with pytest.raises(ResultFileError, match="cannot read"):
        autoloader.load("/nonexistent/best.json")


def test_environment_differences_tolerate_small_memory_changes() -> None:
    here = Environment.current()
    assert (
        here.differences(dataclasses.replace(here, memory_total=int(here.memory_total * 1.01)))
        == []
    )


def test_thread_settings_round_trip_and_load_as_a_thread_loader(tmp_path: Path) -> None:
    params = normalize_params({"num_workers": 4, "prefetch_factor": 3, "worker_kind": "threads"})
    path = _result(params=params).save(tmp_path / "threads.json")
    again = autoloader.load(path)
    assert again.params == params
    dataset = SleepDataset(length=40, latency=0.0)
    loader = again.make_loader(dataset)
    assert isinstance(loader, autoloader.ThreadLoader)
    assert (loader.num_workers, loader.prefetch_factor, loader.batch_size) == (4, 3, 8)
    assert sorted(int(x) for batch in loader for x in batch[:, 0]) == list(range(40))
    # An override back to processes gives DataLoader's own workers.
    plain = again.make_loader(dataset, worker_kind="processes")
    assert type(plain) is DataLoader and plain.num_workers == 4


def test_a_version_3_file_loads_with_worker_processes(tmp_path: Path) -> None:
    path = _result().save(tmp_path / "v3.json")
    data = json.loads(path.read_text())
    data["schema_version"] = 3
    del data["params"]["worker_kind"]
    path.write_text(json.dumps(data))
    assert autoloader.load(path).params["worker_kind"] == "processes"


def _load_changed(tmp_path: Path, change: Callable[[dict[str, Any]], object]) -> TuneResult:
    """``autoloader.load`` of ``_result()``'s file, edited by ``change``."""
    path = _result().save(tmp_path / "best.json")
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))
    return autoloader.load(path)


@pytest.mark.parametrize(
    ("key", "value", "rule"),
    [
        ("num_workers", -1, "an int >= 0"),
        ("num_workers", 1_000_000_000, "more workers than a search would try"),
        ("num_workers", "4", "an int >= 0"),
        ("num_workers", True, "an int >= 0"),
        ("num_workers", 2.5, "an int >= 0"),
        ("prefetch_factor", 0, "an int >= 1"),
        ("prefetch_factor", -1, "an int >= 1"),
        ("prefetch_factor", "2", "an int >= 1"),
        ("prefetch_factor", None, "with num_workers 3 it must be an int >= 1"),
        ("worker_kind", "gpu", '"processes" or "threads"'),
        ("persistent_workers", "yes", "true or false"),
        ("pin_memory", 1, "true or false"),
        ("batched_fetch", None, "true or false"),
        ("worker_threads", 0, "an int >= 1, or null"),
        ("worker_threads", 1.0, "an int >= 1, or null"),
        ("in_order", None, "true or false"),
        # Counts no search would try: a billion batches ahead, a million threads.
        ("prefetch_factor", 1_000_000_000, "more than a search would try"),
        ("worker_threads", 1_000_000, "more than a search would try"),
        ("step_threads", 1_000_000, "more than a search would try"),
    ],
)
def test_a_tampered_setting_is_refused_naming_the_field_and_the_value(
    tmp_path: Path, key: str, value: object, rule: str
) -> None:
    """A file edited by hand or damaged: make_loader() would fail with DataLoader's bare
    error, start a billion threads, or quietly build another loader than the file says."""
    with pytest.raises(ResultFileError) as caught:
        _load_changed(tmp_path, lambda data: data["params"].update({key: value}))
    message = str(caught.value)
    assert message.startswith(f"{tmp_path / 'best.json'}: ")
    assert f"field 'params.{key}' is {json.dumps(value)}" in message
    assert rule in message
    assert "autoloader.tune()" in message


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("prefetch_factor", 0),
        ("prefetch_factor", "2"),
        ("worker_threads", -3),
        ("in_order", "no"),
        ("worker_kind", "gpu"),
    ],
)
def test_a_worker_option_without_workers_is_checked_too(
    tmp_path: Path, key: str, value: object
) -> None:
    with pytest.raises(ResultFileError, match=f"field 'params.{key}' is "):
        _load_changed(tmp_path, lambda data: data["params"].update(num_workers=0, **{key: value}))


def test_valid_worker_options_without_workers_are_dropped(tmp_path: Path) -> None:
    """Setting num_workers to 0 by hand needs no other edit: the worker options left
    behind are valid values that no loader without workers uses."""
    again = _load_changed(tmp_path, lambda data: data["params"].update(num_workers=0))
    assert again.params == normalize_params({"num_workers": 0})
    assert again.params["prefetch_factor"] is None


def test_an_unknown_setting_is_named_with_the_one_meant(tmp_path: Path) -> None:
    def misspell(data: dict[str, Any]) -> None:
        data["params"]["num_worker"] = data["params"].pop("num_workers")

    with pytest.raises(ResultFileError, match=r"unknown key 'num_worker' \(did you mean 'num_wo"):
        _load_changed(tmp_path, misspell)


def test_a_result_must_say_how_many_workers(tmp_path: Path) -> None:
    with pytest.raises(ResultFileError, match="field 'params' has no 'num_workers'"):
        _load_changed(tmp_path, lambda data: data["params"].pop("num_workers"))


@pytest.mark.parametrize(
    ("key", "value", "rule"),
    [
        ("batch_size", 0, "an int >= 1"),
        ("memory_budget", -1, "an int >= 0"),
        ("throughput", -700.0, "a finite number >= 0"),
        ("throughput", math.nan, "a finite number >= 0"),
        ("baseline", math.inf, "a finite number >= 0"),
        ("steady_throughput", -1.0, "a finite number >= 0, or null"),
        ("startup_seconds", math.nan, "a finite number >= 0, or null"),
        ("tuning_seconds", -31.5, "a finite number >= 0"),
    ],
)
def test_a_figure_out_of_range_is_refused(
    tmp_path: Path, key: str, value: object, rule: str
) -> None:
    with pytest.raises(ResultFileError) as caught:
        _load_changed(tmp_path, lambda data: data.update({key: value}))
    assert f"field {key!r} is {json.dumps(value)}, but it must be {rule}" in str(caught.value)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda trials: trials[1].update(params="fast"), "field 'trials[1].params' has the wrong"),
        (
            lambda trials: trials[1]["params"].update(num_workers=-2),
            "field 'trials[1].params.num_workers' is -2",
        ),
        (
            lambda trials: trials[0]["params"].update(workers=2),
            "field 'trials[0].params' has unknown key 'workers'",
        ),
        (lambda trials: trials[0].update(number="0"), "field 'trials[0].number' has the wrong"),
        (lambda trials: trials[0].update(state=None), "field 'trials[0].state' has the wrong"),
        (
            lambda trials: trials[0].update(samples_per_second="fast"),
            "field 'trials[0].samples_per_second' has the wrong",
        ),
        (lambda trials: trials[1].update(reason=7), "field 'trials[1].reason' has the wrong"),
        (
            lambda trials: trials[0].update(samples_per_second=math.nan),
            "field 'trials[0].samples_per_second' is NaN, but it must be a finite number >= 0",
        ),
        (
            lambda trials: trials[0].update(duration=-math.inf),
            "field 'trials[0].duration' is -Infinity, but it must be a finite number >= 0",
        ),
        (
            lambda trials: trials[0].update(relative_error=-0.5),
            "field 'trials[0].relative_error' is -0.5, but it must be a finite number >= 0",
        ),
        (
            lambda trials: trials[1].update(peak_memory=math.inf),
            "field 'trials[1].peak_memory' is Infinity",
        ),
        (lambda trials: trials[0].update(number=-1), "field 'trials[0].number' is -1"),
    ],
)
def test_a_damaged_trial_record_is_refused(
    tmp_path: Path, change: Callable[[list[dict[str, Any]]], None], message: str
) -> None:
    with pytest.raises(ResultFileError, match=re.escape(message)):
        _load_changed(tmp_path, lambda data: change(data["trials"]))


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("usable_cpus", 0),
        ("cpu_count", "64"),
        ("cpu_count", 10**9),  # it would raise the bound on the workers with it
        ("usable_cpus", 10**4),  # more than its cpu_count
        ("torch_version", ["2", ["13"]]),
        ("accelerator", 7),
    ],
)
def test_a_damaged_environment_is_refused(tmp_path: Path, key: str, value: object) -> None:
    with pytest.raises(ResultFileError, match=re.escape(f"field 'environment.{key}'")):
        _load_changed(tmp_path, lambda data: data["environment"].update({key: value}))


def test_an_absurd_worker_count_says_what_this_machine_runs_and_what_to_do(
    tmp_path: Path,
) -> None:
    with pytest.raises(ResultFileError) as caught:
        _load_changed(tmp_path, lambda data: data["params"].update(num_workers=10**9))
    message = str(caught.value)
    cpus = Environment.current().usable_cpus
    assert f"at most {default_max_workers(cpus)} on this machine's {cpus} usable CPUs" in message
    assert "Tune again on this machine with autoloader.tune()" in message
    assert "pass num_workers=1000000000 to make_loader()" in message


def test_a_count_beyond_the_default_bound_loads_where_its_trials_measured_it(
    tmp_path: Path,
) -> None:
    """A search space of one's own may go past the default bound (a dataset waiting on
    the network): the count a complete trial measured is one tune() could choose, and a
    file that tune(path=...) cannot read back would be tuned again on every run."""
    workers = default_max_workers(Environment.current().usable_cpus) + 8
    params = normalize_params({"num_workers": workers, "prefetch_factor": 2})
    measured = TrialRecord(number=2, phase="search", params=params, state="complete")
    result = _result(params=params, trials=(*_result().trials, measured))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the same machine: nothing to say
        assert autoloader.load(result.save(tmp_path / "measured.json")) == result
    pruned = dataclasses.replace(measured, state="pruned")
    unmeasured = _result(params=params, trials=(*_result().trials, pruned))
    with pytest.raises(ResultFileError, match=f"field 'params.num_workers' is {workers}, more"):
        autoloader.load(unmeasured.save(tmp_path / "unmeasured.json"))


def test_a_result_of_a_bigger_machine_loads_and_warns_of_its_worker_count(
    tmp_path: Path,
) -> None:
    """48 workers tuned on 64 CPUs, loaded on 2, run there, slowly: refused, a result
    kept with the code would not load on a laptop or a CI machine at all."""
    here = Environment.current()
    most = default_max_workers(here.usable_cpus)
    workers = most + 32  # 48 on 2 CPUs
    there = dataclasses.replace(here, usable_cpus=workers + 16, cpu_count=workers + 16)
    params = normalize_params({"num_workers": workers, "prefetch_factor": 2})
    path = _result(params=params, environment=there).save(tmp_path / "best.json")
    with pytest.warns(EnvironmentMismatchWarning) as caught:
        again = autoloader.load(path)
    assert again.params["num_workers"] == workers
    message = str(caught[0].message)
    for part in (
        f"its {workers} workers are more than this machine's {here.usable_cpus} usable CPUs",
        f"a search here tries at most {most}",
        "autoloader.tune() again on this machine",
        "pass num_workers= to make_loader()",
    ):
        assert part in message


def test_a_result_of_a_smaller_machine_says_nothing_of_its_worker_count(
    tmp_path: Path,
) -> None:
    here = Environment.current()
    there = dataclasses.replace(here, usable_cpus=1, cpu_count=here.cpu_count + 1)
    path = _result(environment=there).save(tmp_path / "best.json")
    with pytest.warns(EnvironmentMismatchWarning) as caught:
        autoloader.load(path)
    assert "workers are more than" not in str(caught[0].message)


@pytest.mark.parametrize("version", [7.0, 6.0])
def test_a_schema_version_must_be_an_int(tmp_path: Path, version: object) -> None:
    """7.0 equals 7, and was read as version 7."""
    shown = re.escape(json.dumps(version))
    with pytest.raises(ResultFileError, match=f"schema_version is {shown}, but"):
        _load_changed(tmp_path, lambda data: data.update(schema_version=version))


@pytest.mark.parametrize(
    ("key", "value", "rule"),
    [
        ("dataset_length", "many", "an int >= 0, or null"),
        ("copy_on_read", "x", "a number >= 0, or null"),
        ("copy_on_read_items", 2.5, "an int >= 0, or null"),
        ("worker_start_seconds", -3.0, "a number >= 0, or null"),
        ("worker_start_at_least", "no", "true or false"),
        ("missing", {"threads": 3}, "an object of strings"),
        ("a_later_fact", [[[1]]], "a number, a string, true, false or null"),
    ],
)
def test_a_fact_of_the_wrong_type_is_refused(
    tmp_path: Path, key: str, value: object, rule: str
) -> None:
    """The report does arithmetic with the facts: autoloader show raised TypeError."""
    with pytest.raises(ResultFileError) as caught:
        _load_changed(tmp_path, lambda data: data.update(facts={key: value}))
    assert f"field 'facts.{key}' is {json.dumps(value)}, but it must be {rule}" in str(caught.value)


def test_facts_of_their_types_and_a_later_scalar_fact_load(tmp_path: Path) -> None:
    facts = {
        "dataset_length": 100_000,
        "shm_bytes": None,
        "random_items": False,
        "worker_start_seconds": 0.02,
        "worker_start_at_least": False,
        "start_method": "fork",
        "copy_on_read": 312.5,
        "copy_on_read_items": 2000,
        "process_bytes": 10**9,
        "missing": {"threads": "ran out of its time"},
        "a_later_fact": 1.5,
    }
    assert _load_changed(tmp_path, lambda data: data.update(facts=facts)).facts == facts


@pytest.mark.parametrize("key", ["notes", "unsaved_loader_kwargs"])
def test_notes_and_option_names_must_be_strings(tmp_path: Path, key: str) -> None:
    """They were turned into strings whatever they held (str() of a list nested a
    thousand deep raises RecursionError)."""
    with pytest.raises(ResultFileError, match=re.escape(f"field '{key}[1]' has the wrong type")):
        _load_changed(tmp_path, lambda data: data.update({key: ["fine", ["not", "a string"]]}))


@pytest.mark.parametrize(
    ("key", "value"), [("prefetch_factor", 16), ("worker_threads", 64), ("step_threads", 64)]
)
def test_a_count_beyond_the_default_bound_loads_where_a_complete_trial_measured_it(
    tmp_path: Path, key: str, value: int
) -> None:
    """As for num_workers (NOTE [ A saved worker count ]): a search space of one's own
    may go past the default bound, and tune(path=...) must read its own file back."""
    params = normalize_params({"num_workers": 2, "prefetch_factor": 2, key: value})
    measured = TrialRecord(number=2, phase="search", params=params, state="complete")
    result = _result(params=params, trials=(*_result().trials, measured))
    assert autoloader.load(result.save(tmp_path / "measured.json")).params[key] == value
    pruned = dataclasses.replace(measured, state="pruned")
    unmeasured = _result(params=params, trials=(*_result().trials, pruned))
    with pytest.raises(ResultFileError, match=f"field 'params.{key}' is {value}, more than"):
        autoloader.load(unmeasured.save(tmp_path / "unmeasured.json"))
