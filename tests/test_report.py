"""The report and its advice, from trial records with known figures, and the facts the
advice rests on, measured for real."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset, TensorDataset

from autoloader import TrialRecord, TuneResult
from autoloader._environment import Environment
from autoloader._facts import dataset_facts
from autoloader._report import advise, report
from autoloader._search_space import normalize_params

from .workloads import AugmentedDataset, SleepDataset

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
    assert "1,200 samples/s against 200 with the defaults: 6.00x" in text
    assert "80% of the loop's time with the defaults, 2% tuned" in text
    assert "a batch took 60.0 ms to load (mostly waiting on I/O" in " ".join(text.split())
    assert result.report() == text


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


def test_a_loader_still_slower_than_the_step_gets_the_dataset_size() -> None:
    tuned = {"num_workers": 2}
    slow = _trial(1, "search", tuned, 300.0, data_wait_fraction=0.7, load_seconds=0.03)
    (line,) = advise(_result([BASELINE, slow], tuned))
    assert "waits for data 70% of the time: 30.0 ms per batch on top of the step's 10.0 ms" in line
    # 1 MiB per batch of 16, 10,000 items
    assert "about 625.0 MiB" in line and "preload it" in line


def test_repeated_randomness_advice_comes_from_the_facts() -> None:
    tuned = {"num_workers": 2}
    facts = {"dataset_length": 10, "shm_bytes": None, "workers_repeat_randomness": True}
    result = _result([BASELINE, _trial(1, "search", tuned, 1500.0)], tuned, facts=facts)
    (line,) = advise(result)
    assert "Workers repeat each other's randomness" in line and "worker_init_fn" in line


class OwnGeneratorDataset(Dataset[torch.Tensor]):
    """Augments with a generator it holds: forked workers each get the same copy."""

    def __init__(self) -> None:
        self.rng = np.random.default_rng(0)

    def __len__(self) -> int:
        return 8

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.tensor(self.rng.random(3) + index)


def test_facts_tell_workers_that_repeat_randomness_from_those_that_do_not() -> None:
    repeating = dataset_facts(OwnGeneratorDataset(), 8, {}, start_method="fork")
    assert repeating["random_items"] is True and repeating["workers_repeat_randomness"] is True
    # numpy's global generator, which DataLoader seeds per worker
    seeded = dataset_facts(AugmentedDataset(8), 8, {}, start_method="fork")
    assert seeded["random_items"] is True and seeded["workers_repeat_randomness"] is False
    plain = dataset_facts(TensorDataset(torch.arange(8)), 8, {}, start_method="fork")
    assert plain["random_items"] is False and plain["workers_repeat_randomness"] is None
    assert plain["dataset_length"] == 8 and plain["shm_bytes"] and plain["shm_bytes"] > 0
    assert dataset_facts(SleepDataset(4), 4, {}, start_method="fork")["random_items"] is False


class PythonRecords(Dataset[torch.Tensor]):
    """Items kept as Python objects: reading one writes its reference counts."""

    def __init__(self, length: int = 20_000) -> None:
        self.records = [{"id": i, "values": [float(i)] * 16} for i in range(length)]

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.tensor(self.records[index]["values"])


def test_the_probe_finds_copy_on_read_in_python_objects_and_not_in_tensors() -> None:
    records = dataset_facts(PythonRecords(), 20_000, {}, start_method="fork")
    tensors = dataset_facts(TensorDataset(torch.randn(20_000, 16)), 20_000, {}, start_method="fork")
    assert records["copy_on_read_items"] and tensors["copy_on_read_items"]
    assert records["copy_on_read"] > 10 * max(tensors["copy_on_read"], 100.0)
    assert dataset_facts(PythonRecords(), 20_000, {}, start_method="spawn")["copy_on_read"] is None
