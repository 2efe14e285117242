"""The report and its advice, from trial records with known figures, and the facts the
advice rests on, measured for real."""

from __future__ import annotations

import dataclasses
from typing import Any

import autoloader
from autoloader import TrialRecord, TuneResult
from autoloader.checks._environment import Environment
from autoloader.loader._params import normalize_params
from autoloader.results._report import advise, report

MiB = 1 << 20


def _trial(
    number: int, phase: str, params: dict[str, Any], rate: float, **more: Any
) -> TrialRecord:
    values: dict[str, Any] = {
        "samples_per_second": rate,
        "epoch_samples_per_second": rate,
        "data_wait_fraction": 0.02,
        "load_seconds": 0.0002,
        "step_seconds": 0.01,
        "load_cpu_seconds": 0.0001,
        "batch_bytes": MiB,
        "peak_memory": 300 * MiB,
    }
    values.update(more)
    return TrialRecord(number, phase, normalize_params(params), "complete", **values)


def _result(trials: list[TrialRecord], params: dict[str, Any], **changes: Any) -> TuneResult:
    chosen = normalize_params(params)
    rate = max(t.epoch_samples_per_second or 0.0 for t in trials if t.params == chosen)
    fields: dict[str, Any] = {
        "params": chosen,
        "throughput": rate,
        "baseline": trials[0].epoch_samples_per_second,
        "batch_size": 16,
        "trials": tuple(trials),
        "environment": Environment.current(),
        "tuning_seconds": 30.0,
        "memory_budget": 8 << 30,
        "facts": {"dataset_length": 10_000, "shm_bytes": 64 * MiB},
    }
    fields.update(changes)
    return TuneResult(**fields)


BASELINE = _trial(
    0, "baseline", {}, 200.0, data_wait_fraction=0.8, load_seconds=0.06, load_cpu_seconds=0.006
)


def test_report_shows_settings_against_defaults_speedup_wait_and_bottleneck() -> None:
    tuned = {"num_workers": 6, "prefetch_factor": 2}
    result = _result([BASELINE, _trial(1, "search", tuned, 1200.0)], tuned)
    text = report(result)
    lines = text.splitlines()
    assert any(line.split()[:3] == ["num_workers", "6", "0"] for line in lines)
    assert (
        "throughput 1,200 samples/s over an epoch, start-up included, against 200 with the "
        "defaults: 6.00x"
    ) in " ".join(text.split())
    assert "80% of the loop's time with the defaults, 2% tuned" in text
    assert "a batch took 60.0 ms to load (mostly waiting on I/O" in " ".join(text.split())
    assert autoloader.report is report  # the public name


def test_defaults_that_timed_no_batch_give_no_ratio_not_an_infinite_one() -> None:
    """A budget spent before the defaults' first batch came (a starved machine): the
    defaults are returned, at a rate of 0, and no line says "infx the defaults"."""
    starved = _trial(0, "baseline", {}, 0.0)
    result = _result([starved], {}, throughput=0.0, baseline=0.0)
    assert result.versus_defaults() == "no ratio to the defaults (they timed no batch)"
    assert "with the defaults: no ratio (they timed no batch)" in " ".join(report(result).split())
    assert "inf" not in report(result)
    assert _result([BASELINE], {}).versus_defaults() == "1.00x the defaults"


def _spawned(*, persistent: bool = False, **changes: Any) -> TuneResult:
    """6 workers started every epoch: 1,440 samples/s once started, 1,200 over an epoch."""
    tuned = {"num_workers": 6, "prefetch_factor": 2, "persistent_workers": persistent}
    chosen = _trial(1, "search", tuned, 1200.0, samples_per_second=1440.0)
    fields: dict[str, Any] = {
        "steady_throughput": 1440.0,
        "steady_baseline": 210.0,
        "startup_seconds": 2.1,
        "startup_each_epoch": not persistent,
    }
    return _result([BASELINE, chosen], tuned, **{**fields, **changes})


def test_the_report_shows_the_steady_rate_and_the_startup_beside_the_epoch_rate() -> None:
    text = " ".join(report(_spawned()).split())
    assert (
        "throughput 1,200 samples/s over an epoch, start-up included, against 200 with the "
        "defaults: 6.00x steady rate 1,440 samples/s once started, against 210 with the "
        "defaults: 6.86x start-up 2.10 s each epoch to start the workers and load the first "
        "batch (workers not persistent), counted in the throughput"
    ) in text
    persistent = " ".join(report(_spawned(persistent=True)).split())
    assert "start-up 2.10 s once per training run to start the workers" in persistent
    assert "not counted in the throughput: later epochs only refill the pipeline" in persistent


def test_the_report_shows_only_the_headline_where_the_steady_rate_is_the_same() -> None:
    """Within 2% (1,210 against 1,200, 201 against 200) the rates are one figure."""
    same = _spawned(steady_throughput=1210.0, steady_baseline=201.0, startup_seconds=0.05)
    text = report(same)
    assert "1,200 samples/s over an epoch" in " ".join(text.split())
    assert not any(line.startswith(("steady rate", "start-up")) for line in text.splitlines())
    # A result without steady rates (built by hand) shows the headline alone too.
    unknown = _spawned(steady_throughput=None, steady_baseline=None, startup_seconds=None)
    assert "steady rate" not in report(unknown)


def test_the_steps_ceiling_is_compared_with_the_steady_rate() -> None:
    """The ceiling (16 samples per 10 ms step) is a steady rate: 1,440 steady reaches
    90% of it; the epoch rate, 1,200, start-up included, would say 75%."""
    text = " ".join(report(_spawned()).split())
    assert "tuned, the loop's steady rate reaches 90% of the step's ceiling of 1,600" in text


def test_no_advice_without_a_figure_that_calls_for_it() -> None:
    tuned = {"num_workers": 2}
    result = _result([BASELINE, _trial(1, "search", tuned, 1500.0)], tuned)
    assert list(advise(result)) == []
    assert "advice" not in report(result).splitlines()


def test_batched_fetch_advice_quotes_both_rates() -> None:
    batched = {"num_workers": 0, "batched_fetch": True}
    trials = [BASELINE, _trial(1, "search", {"num_workers": 2}, 400.0)]
    trials.append(_trial(2, "search", batched, 4800.0))
    (line,) = advise(_result(trials, batched))
    assert "12.0x faster than item by item" in line and "4,800 against 400" in line


def test_copy_on_read_advice_projects_the_probe_over_an_epoch() -> None:
    tuned = {"num_workers": 4}
    facts = {
        "dataset_length": 100_000,
        "copy_on_read": 8 * 1024,
        "copy_on_read_items": 500,
        "process_bytes": 2 << 30,
    }
    result = _result([BASELINE, _trial(1, "search", tuned, 900.0)], tuned, facts=facts)
    (line,) = advise(result)
    assert "8.0 KiB of private memory per item" in line and "(500 items measured)" in line
    # 100,000 x 8 KiB = 781 MiB, under the 2 GiB this process held
    assert "about 781.2 MiB of its own (3.1 GiB for the tuned 4 workers)" in line
    bounded = _result(
        [BASELINE, _trial(1, "search", tuned, 900.0)],
        tuned,
        facts={**facts, "process_bytes": 512 * MiB},
    )
    (line,) = advise(bounded)
    assert "about 512.0 MiB of its own" in line
    small = {**facts, "copy_on_read": 100.0}  # a TensorDataset measures ~100 B: noise
    assert not list(
        advise(_result([BASELINE, _trial(1, "search", tuned, 900.0)], tuned, facts=small))
    )


def test_shm_advice_counts_the_batches_in_flight() -> None:
    tuned = {"num_workers": 4, "prefetch_factor": 4}
    big = _trial(1, "search", tuned, 900.0, batch_bytes=2 * MiB)
    (line,) = advise(_result([BASELINE, big], tuned))
    assert "/dev/shm is 64.0 MiB" in line and "32.0 MiB of batches in flight" in line
    assert "2.0 MiB per batch x prefetch 4 x 4 workers" in line


def test_shared_memory_failures_are_counted_by_their_kind_not_their_words() -> None:
    tuned = {"num_workers": 2}
    ran_out = dataclasses.replace(
        _trial(2, "search", {"num_workers": 8}, 0.0),
        state="failed",
        kind="shared memory",
        reason="shared memory: a worker was killed by SIGBUS",
    )
    user_error = dataclasses.replace(
        _trial(3, "search", {"num_workers": 6}, 0.0),
        state="failed",
        kind="error",
        reason="OSError: cannot read /data/shm_index.bin",  # "shm" in a path: not a kind
    )
    result = _result([BASELINE, _trial(1, "search", tuned, 900.0), ran_out, user_error], tuned)
    (line,) = [line for line in advise(result) if "shared memory" in line]
    assert line.startswith("1 trial(s) failed on shared memory (/dev/shm is 64.0 MiB)")


def test_a_loader_still_slower_than_the_step_gets_the_dataset_size() -> None:
    tuned = {"num_workers": 2}
    slow = _trial(1, "search", tuned, 300.0, data_wait_fraction=0.7, load_seconds=0.03)
    cpu_only = dataclasses.replace(Environment.current(), accelerator=None)
    (line,) = advise(_result([BASELINE, slow], tuned, environment=cpu_only))
    assert "waits for data 70% of the time: 30.0 ms per batch on top of the step's 10.0 ms" in line
    # 1 MiB per batch of 16, 10,000 items
    assert "about 625.0 MiB" in line and "decode it once into tensors" in line


def test_repeated_randomness_advice_comes_from_the_facts() -> None:
    tuned = {"num_workers": 2}
    facts = {"dataset_length": 10, "shm_bytes": None, "workers_repeat_randomness": True}
    result = _result([BASELINE, _trial(1, "search", tuned, 1500.0)], tuned, facts=facts)
    (line,) = advise(result)
    assert "Workers repeat each other's randomness" in line and "worker_init_fn" in line


def _failed(
    number: int, workers: int, reason: str, state: str = "failed", kind: str = "error"
) -> TrialRecord:
    params = normalize_params({"num_workers": workers, "prefetch_factor": 2})
    return TrialRecord(number, "search", params, state, reason=reason, kind=kind)


def test_the_report_lists_each_distinct_failure_with_the_settings_that_met_it() -> None:
    shards = (
        "ValueError: No samples found in dataset; perhaps you have fewer shards than "
        "workers. (in DataLoader worker process {}) (while loading a batch)"
    )
    memory = "memory: process tree reached {} GiB, over the memory budget of 4.0 GiB"
    tuned = {"num_workers": 2}
    trials = [
        BASELINE,
        _trial(1, "search", tuned, 900.0),
        _failed(2, 3, shards.format(2)),
        _failed(3, 8, shards.format(2)),
        _failed(4, 4, shards.format(3)),
        _failed(5, 16, memory.format("4.2"), state="pruned", kind="memory"),
        _failed(6, 12, memory.format("4.5"), state="pruned", kind="memory"),
        _failed(7, 6, "clearly slower than the best setting so far", "pruned", "slower"),
    ]
    text = " ".join(report(_result(trials, tuned)).split())
    assert (
        "- ValueError: No samples found in dataset; perhaps you have fewer shards than "
        "workers. (in DataLoader worker process N) (while loading a batch): 3 trials, "
        "num_workers 3, 4, 8"
    ) in text
    assert "- memory: process tree reached 4.2 GiB, over the memory budget of 4.0 GiB" in text
    assert "4.0 GiB: 2 trials, num_workers 12, 16" in text
    assert "clearly slower" not in text


def test_loader_bound_advice_names_the_accelerator_only_where_there_is_one() -> None:
    tuned = {"num_workers": 2}
    waiting = _trial(1, "search", tuned, 400.0, data_wait_fraction=0.5, load_seconds=0.02)
    trials = [BASELINE, waiting]
    environment = Environment.current()
    cpu_only = dataclasses.replace(environment, accelerator=None)
    (line,) = advise(_result(trials, tuned, environment=cpu_only))
    assert "waits for data 50% of the time" in line
    assert "accelerator" not in line and "device" not in line
    assert "fits in memory" in line and "TensorDataset" in line
    with_gpu = dataclasses.replace(environment, accelerator="cuda: NVIDIA H100 x1")
    (line,) = advise(_result(trials, tuned, environment=with_gpu))
    assert "fits in the accelerator's memory, preload it there" in line


def test_a_step_that_trains_on_the_cpu_is_named_in_the_bottleneck() -> None:
    """The step keeps 1.8 of 2 CPUs busy for 36 ms, loading takes 13 ms of CPU: the CPUs,
    not the step, bound what workers could reach."""
    baseline = _trial(
        0,
        "baseline",
        {},
        1300.0,
        data_wait_fraction=0.26,
        load_seconds=0.013,
        load_cpu_seconds=0.013,
        step_seconds=0.036,
        step_cpu_seconds=0.065,
    )
    two_cpus = dataclasses.replace(Environment.current(), usable_cpus=2)
    result = _result([baseline], {}, environment=two_cpus)
    text = " ".join(report(result).split())
    assert "bottleneck the CPU, shared by the step and loading" in text
    assert "the step kept 1.8 of the 2 CPUs busy for 36.0 ms per batch" in text
    assert "tuned, loading stays in the main process" in text
    # With 16 CPUs there are cores to spare: loading is the bottleneck, as it was.
    sixteen = dataclasses.replace(Environment.current(), usable_cpus=16)
    text = " ".join(report(_result([baseline], {}, environment=sixteen)).split())
    assert "bottleneck loading: with the defaults a batch took 13.0 ms" in text


def test_the_steps_cpu_comes_from_trials_with_workers_where_loading_runs_elsewhere() -> None:
    """With num_workers=0 the loading's torch threads spin into the step: a step that
    only waits looks busy. Trials with workers measure it clean."""
    spun = _trial(
        0,
        "baseline",
        {},
        1000.0,
        data_wait_fraction=0.6,
        load_seconds=0.015,
        load_cpu_seconds=0.015,
        step_seconds=0.010,
        step_cpu_seconds=0.0095,
    )
    tuned = {"num_workers": 2}
    clean = _trial(1, "search", tuned, 2000.0, step_seconds=0.010, step_cpu_seconds=0.0002)
    two_cpus = dataclasses.replace(Environment.current(), usable_cpus=2)
    text = " ".join(report(_result([spun, clean], tuned, environment=two_cpus)).split())
    assert "bottleneck loading: with the defaults a batch took 15.0 ms" in text


def test_thread_workers_tuned_show_the_memory_saved_and_no_copy_on_read_advice() -> None:
    processes = {"num_workers": 6, "prefetch_factor": 2}
    threads = {"num_workers": 8, "prefetch_factor": 2, "worker_kind": "threads"}
    trials = [
        BASELINE,
        _trial(1, "search", processes, 1100.0, peak_memory=1900 * MiB),
        _trial(2, "search", threads, 1180.0, peak_memory=400 * MiB),
    ]
    facts = {
        "dataset_length": 100_000,
        "copy_on_read": 8 * 1024,
        "copy_on_read_items": 500,
        "process_bytes": 2 << 30,
    }
    result = _result(trials, threads, facts=facts)
    text = " ".join(report(result).split())
    assert "worker_kind threads processes <" in text
    assert (
        "400.0 MiB (process tree, tuned), budget 8.0 GiB; 1.5 GiB less than the fastest "
        "setting with worker processes (6 processes: 1.9 GiB, 1,100 samples/s)"
    ) in text
    # Threads share the dataset: nothing is copied on read.
    assert not any(line.startswith("Workers copy") for line in advise(result))
    # With processes tuned, the same trials give neither.
    with_processes = _result(trials, processes, facts=facts)
    assert "less than the fastest" not in report(with_processes)
    assert any(line.startswith("Workers copy") for line in advise(with_processes))


def test_workers_that_restart_every_epoch_are_advised_persistence_with_the_seconds() -> None:
    """4 spawned workers of 3.5 s each restart every epoch of 10,000 samples at 500
    samples/s (20 s, the restart included): 14 s of it. Persistent, or forked in
    milliseconds: no word."""
    tuned = {"num_workers": 4, "prefetch_factor": 2}
    facts = {
        "dataset_length": 10_000,
        "shm_bytes": None,
        "worker_start_seconds": 3.5,
        "worker_start_at_least": False,
        "start_method": "spawn",
    }
    result = _result([BASELINE, _trial(1, "search", tuned, 500.0)], tuned, facts=facts)
    (line,) = advise(result)
    assert line.startswith(
        "The 4 workers start again every epoch: about 14.0 s an epoch here (3.50 s a worker, "
        "spawn), 70% of an epoch of about 20 s. persistent_workers=True"
    )
    text = " ".join(report(result).split())
    assert "worker start 3.50 s to start one worker process (spawn) and get its first item" in text
    persistent = {**tuned, "persistent_workers": True}
    kept = _result([BASELINE, _trial(1, "search", persistent, 500.0)], persistent, facts=facts)
    assert list(advise(kept)) == []
    forked = {**facts, "worker_start_seconds": 0.02, "start_method": "fork"}
    assert (
        list(advise(_result([BASELINE, _trial(1, "search", tuned, 500.0)], tuned, facts=forked)))
        == []
    )
