from __future__ import annotations

import re
import time

import pytest
import torch
from torch.utils.data import DataLoader

import autoloader
from autoloader import Diagnosis, InvalidInputError, LoopError
from autoloader._verdict import OVERSUBSCRIBED, oversubscription
from benchmarks.copy_on_read import Records

from .workloads import (
    BusyDataset,
    FailingDataset,
    HangsIn,
    MemoryHogDataset,
    SleepDataset,
    TorchOpsDataset,
    failing_step,
    noop_step,
    sleep_10ms_step,
    slow_step,
)

# diagnose() measures the loop and the machine's CPUs: another test's processes beside it
# turned a latency-bound loop into a CPU-bound one. The tests that read its verdict or
# its CPU figures run alone; those of its arguments, its errors and its sentences do not.


@pytest.mark.alone
def test_a_loop_that_waits_on_reads_is_latency_bound() -> None:
    loader = DataLoader(SleepDataset(256, latency=0.005), batch_size=4)
    diagnosis = autoloader.diagnose(loader, noop_step, seconds=3)
    assert diagnosis.verdict == "loader-bound (latency)"
    assert diagnosis.num_workers == 0 and diagnosis.batch_size == 4
    assert diagnosis.data_wait_fraction is not None and diagnosis.data_wait_fraction > 0.5
    assert diagnosis.loading_cpu_share is not None and diagnosis.loading_cpu_share < 0.5
    # 4 items of 5 ms: the loader alone cannot take less than 20 ms a batch.
    assert diagnosis.loader_seconds is not None and diagnosis.loader_seconds >= 0.02
    assert diagnosis.peak_memory > 0 and diagnosis.memory_budget > diagnosis.peak_memory


@pytest.mark.alone
def test_a_loop_whose_workers_burn_cpu_is_cpu_bound() -> None:
    loader = DataLoader(BusyDataset(256, cpu_seconds=0.01), batch_size=4, num_workers=1)
    diagnosis = autoloader.diagnose(loader, noop_step, seconds=3)
    assert diagnosis.verdict == "loader-bound (CPU)"
    assert diagnosis.loading_cpu_share is not None and diagnosis.loading_cpu_share > 0.5
    assert "the worker on the CPU" in diagnosis.reason


@pytest.mark.alone
def test_a_loop_bound_by_its_step_is_step_bound_and_the_loader_still_works() -> None:
    loader = DataLoader(SleepDataset(64, latency=0.0), batch_size=4, num_workers=1)
    diagnosis = autoloader.diagnose(loader, slow_step, seconds=2)
    assert diagnosis.verdict == "step-bound"
    assert diagnosis.step_seconds is not None and diagnosis.step_seconds >= 0.2
    assert diagnosis.ceiling == pytest.approx(4 / diagnosis.step_seconds)
    # What the oversubscription check reads, whatever this machine's load made of it: the
    # worker's CPU seconds per second of the loop (one process, which DataLoader gives one
    # torch thread: at most 1, whatever the load), and the row that shows it.
    assert diagnosis.step_threads == torch.get_num_threads()
    assert diagnosis.workers_cpus is not None and 0 <= diagnosis.workers_cpus <= 1
    (row,) = [line for line in str(diagnosis).splitlines() if line.startswith("CPUs asked")]
    assert f" + the worker {diagnosis.workers_cpus:.1f} = " in row, row
    # The loader is left as it was: a full epoch, from new workers.
    assert sum(len(batch) for batch in loader) == 64


@pytest.mark.alone
def test_a_tree_over_the_memory_budget_is_memory_bound() -> None:
    from autoloader.measure._process_memory import tree_memory

    loader = DataLoader(MemoryHogDataset(hog_bytes=400 << 20), batch_size=4, num_workers=2)
    budget = tree_memory() + (300 << 20)
    diagnosis = autoloader.diagnose(loader, noop_step, seconds=4, memory_budget=budget)
    assert diagnosis.verdict == "memory-bound"
    assert diagnosis.samples_per_second is None
    assert "memory budget" in diagnosis.reason and "fewer workers" in diagnosis.reason


@pytest.mark.alone
@pytest.mark.slow  # over 2.5 s here: the full suite's (docs/development/checks.md)
def test_workers_that_will_copy_the_dataset_past_the_budget_are_memory_bound(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from autoloader.measure._process_memory import tree_memory

    # The checks get 3 s, not 1 s: the suite's first test, as the other workers imported
    # theirs, once found its copy-on-read probe cut short (its 0.45 s share spent, the
    # fact reported missing, as it should be): the probe's timing is not this test's.
    monkeypatch.setattr("autoloader._diagnose._MIN_CHECKS_SECONDS", 3.0)

    # 100,000 dicts: the probe puts what each forked worker copies over an epoch at
    # 330-640 MiB here (its random items touch a page each), while a short run grows the
    # tree by 30-45 MiB here and once by 124 MiB in CI (a 150 MiB headroom was then
    # within 90% of the budget). 400 MiB leaves both verdicts' conditions wide margins.
    loader = DataLoader(Records(100_000), batch_size=16, num_workers=2)
    budget = tree_memory() + (400 << 20)
    diagnosis = autoloader.diagnose(loader, noop_step, seconds=2, memory_budget=budget)
    assert diagnosis.copied_per_worker is not None and diagnosis.copied_per_worker > 50 << 20
    assert diagnosis.samples_per_second is not None  # the run itself stayed under budget
    assert diagnosis.verdict == "memory-bound"
    assert "copies the Python objects it reads" in diagnosis.reason
    assert "copy-on-read" in str(diagnosis)


@pytest.mark.alone
def test_a_main_process_busy_receiving_batches_is_cpu_bound() -> None:
    # Free items and no step: the workers wait on the main process, which spends its
    # time receiving batches. Epochs long enough not to be all worker start-up.
    dataset = SleepDataset(1 << 17, latency=0.0, width=4)
    loader = DataLoader(dataset, batch_size=64, num_workers=2)
    diagnosis = autoloader.diagnose(loader, noop_step, seconds=2)
    assert diagnosis.verdict == "loader-bound (CPU)"
    assert "The main process is the limit" in diagnosis.reason
    assert diagnosis.copied_per_worker is None  # tensors made on read: nothing copied


def test_str_shows_the_verdict_and_the_figures_behind_it() -> None:
    loader = DataLoader(SleepDataset(128, latency=0.002), batch_size=4)
    diagnosis = autoloader.diagnose(loader, noop_step, seconds=2)
    text = str(diagnosis)
    assert text.splitlines()[0].split() == ["verdict", *diagnosis.verdict.split()]
    for label in ("loop", "step", "loader alone", "first batch", "memory (process tree)"):
        assert any(line.startswith(label) for line in text.splitlines()), label
    assert diagnosis.as_dict()["verdict"] == diagnosis.verdict
    assert isinstance(diagnosis, Diagnosis)
    # No worker processes: nothing to weigh the step's threads against.
    assert diagnosis.step_threads == torch.get_num_threads()
    assert diagnosis.workers_cpus is None and "CPUs asked" not in text


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"loader": SleepDataset(8)}, "loader must be a torch.utils.data.DataLoader"),
        ({"step_fn": 3}, "step_fn must be callable"),
        ({"seconds": 0}, "seconds must be"),
        ({"memory_budget": "1KiB"}, "below what this process tree already uses"),
    ],
)
def test_bad_arguments_fail_before_anything_runs(arguments: dict, message: str) -> None:
    call = {"loader": DataLoader(SleepDataset(8), batch_size=2), "step_fn": noop_step}
    call.update(arguments)
    with pytest.raises(InvalidInputError, match=message):
        autoloader.diagnose(call.pop("loader"), call.pop("step_fn"), **call)


def test_a_broken_loop_says_what_raised() -> None:
    loader = DataLoader(FailingDataset(8, latency=0.0), batch_size=8, num_workers=1)
    with pytest.raises(LoopError, match="corrupt record 3") as caught:
        autoloader.diagnose(loader, noop_step, seconds=1)
    assert caught.value.__cause__ is not None
    with pytest.raises(LoopError, match="shape mismatch in step"):
        autoloader.diagnose(DataLoader(SleepDataset(8), batch_size=2), failing_step, seconds=1)


@pytest.mark.light  # waits for the hang's deadline
@pytest.mark.slow  # over 2.5 s here: the full suite's (docs/development/checks.md)
def test_a_worker_that_hangs_costs_diagnose_its_deadline_not_forever() -> None:
    """Twice the measuring time per batch; the first also has 3 s for its worker to start."""
    loader = DataLoader(HangsIn("workers", length=64), batch_size=4, num_workers=1)
    with pytest.raises(LoopError, match=r"made no progress for 5 s while loading a batch"):
        autoloader.diagnose(loader, noop_step, seconds=1)


@pytest.mark.alone
def test_a_sleeping_step_after_torch_op_loading_is_not_taken_for_cpu_work() -> None:
    """torch's OpenMP threads spin for a while after each op of the loading in this
    process: a step that only waits must not be charged for their spinning."""
    loader = DataLoader(TorchOpsDataset(512), batch_size=32)
    diagnosis = autoloader.diagnose(loader, sleep_10ms_step, seconds=2)
    assert diagnosis.verdict != "CPU-bound (step and loader)", str(diagnosis)
    assert diagnosis.step_cpus is not None and diagnosis.step_cpus < 0.3, str(diagnosis)


@pytest.mark.alone
@pytest.mark.slow  # over 2.5 s here: the full suite's (docs/development/checks.md)
def test_a_loop_bound_by_receiving_batches_is_told_that_threads_would_lift_it() -> None:
    dataset = SleepDataset(1 << 17, latency=0.0, width=4)
    loader = DataLoader(dataset, batch_size=64, num_workers=2)
    diagnosis = autoloader.diagnose(loader, noop_step, seconds=2)
    assert "Thread workers (autoloader.ThreadLoader) hand batches over" in diagnosis.reason
    # A ThreadLoader receives nothing from other processes: no such advice.
    threads = autoloader.ThreadLoader(dataset, batch_size=64, num_workers=2)
    diagnosis = autoloader.diagnose(threads, noop_step, seconds=2)
    assert diagnosis.num_workers == 2
    assert "receiving" not in diagnosis.reason and "ThreadLoader" not in diagnosis.reason
    assert diagnosis.workers_cpus is None  # thread workers' CPU time is this process's


def test_a_step_on_all_its_threads_beside_a_busy_worker_oversubscribes_the_cores() -> None:
    """On 2 cores, a 2-thread step measured 1.5 CPUs busy beside 1 worker at 0.5: it
    asks for both cores whenever it runs (see NOTE [ Oversubscription ])."""
    sentence = oversubscription(
        step_cpus=1.5, workers_cpus=0.5, workers=1, usable_cpus=2, step_threads=2
    )
    assert sentence == (
        "The step (2 torch threads, 1.5 CPUs busy) and the worker (0.5 CPUs) ask for 2.5 "
        "CPUs of the 2 here: they take turns on the cores. torch.set_num_threads(1) in "
        "the training process leaves the worker 1 core; autoloader.tune() measures the "
        "split (its step_threads setting, applied with result.apply_threads())."
    )
    sentence = oversubscription(
        step_cpus=1.8, workers_cpus=1.7, workers=2, usable_cpus=2, step_threads=2
    )
    assert sentence is not None
    assert "and the 2 workers (1.7 CPUs) ask for 3.7 CPUs of the 2 here" in sentence


@pytest.mark.parametrize(
    ("step_cpus", "workers_cpus", "step_threads"),
    [
        (0.02, 1.9, 2),  # a step on an accelerator leaves the cores to the workers
        (0.9, 1.0, 1),  # one thread and one worker: a core each
        (1.9, 0.2, 2),  # the worker mostly idle
        (1.9, OVERSUBSCRIBED * 2 - 2 - 0.01, 2),  # just within the margin
    ],
)
def test_a_step_and_workers_within_the_cores_are_not_oversubscribed(
    step_cpus: float, workers_cpus: float, step_threads: int
) -> None:
    assert (
        oversubscription(
            step_cpus=step_cpus,
            workers_cpus=workers_cpus,
            workers=2,
            usable_cpus=2,
            step_threads=step_threads,
        )
        is None
    )


@pytest.mark.parametrize(
    ("step_cpus", "workers_cpus", "workers", "usable_cpus", "step_threads"),
    [
        (1.9, OVERSUBSCRIBED * 2 - 2 + 0.01, 1, 2, 2),
        (3.0, 7.9, 8, 8, 8),  # the workers use every core
        (2.0, 12.0, 16, 8, 8),  # more than every core: still one thread
        (0.6, 1.9, 2, 2, 1),  # one thread already
        (1.0, 2.0, 2, 2, 1),
        (15.0, 3.4, 4, 16, 16),
        (0.02, 2.4, 3, 2, 4),  # a step off the CPU asks for what it used
    ],
)
def test_the_threads_suggested_are_at_least_one_and_fewer_than_now(
    step_cpus: float, workers_cpus: float, workers: int, usable_cpus: int, step_threads: int
) -> None:
    sentence = oversubscription(
        step_cpus=step_cpus,
        workers_cpus=workers_cpus,
        workers=workers,
        usable_cpus=usable_cpus,
        step_threads=step_threads,
    )
    assert sentence is not None and "take turns on the cores" in sentence
    assert "autoloader.tune() measures the split" in sentence
    suggested = re.search(r"torch\.set_num_threads\((\d+)\)", sentence)
    if suggested is None:
        assert "Fewer workers crowd them less" in sentence
    else:
        assert 1 <= int(suggested.group(1)) < step_threads
    if step_threads == 1:
        assert suggested is None


def test_workers_busy_half_a_core_more_are_left_the_whole_core() -> None:
    """round() takes 0.5 to 0 and 2.5 to 2: the workers would be left less than they use."""
    sentence = oversubscription(
        step_cpus=3.0, workers_cpus=2.5, workers=3, usable_cpus=4, step_threads=4
    )
    assert sentence is not None and "torch.set_num_threads(1)" in sentence
    assert "leaves the 3 workers 3 cores" in sentence


def test_str_shows_what_the_step_and_the_workers_ask_of_the_cpus() -> None:
    figures = {
        "verdict": "step-bound",
        "reason": "",
        "num_workers": 1,
        "batch_size": 4,
        "samples_per_second": None,
        "data_wait_fraction": None,
        "step_seconds": None,
        "loop_load_seconds": None,
        "loader_seconds": None,
        "time_to_first_batch": None,
        "peak_memory": 1 << 20,
        "memory_budget": 1 << 30,
        "loading_cpu_share": None,
        "usable_cpus": 2,
        "step_cpus": 1.5,
        "step_threads": 2,
    }
    crowded = str(Diagnosis(**figures, workers_cpus=0.5)).splitlines()
    row = "CPUs asked             step 2 torch threads (1.5 busy) + the worker 0.5 = 2.5 of 2"
    assert row + ": oversubscribed" in crowded
    one_thread = str(Diagnosis(**{**figures, "step_threads": 1}, workers_cpus=0.5))
    assert "step 1 torch thread (1.5 busy) + the worker 0.5 = 2.0 of 2\n" in one_thread + "\n"
    assert "CPUs asked" not in str(Diagnosis(**figures))


def _computes_for_a_third_of_a_second(batch: object) -> None:
    until = time.perf_counter() + 0.35
    while time.perf_counter() < until:
        pass


@pytest.mark.alone
def test_a_step_too_slow_to_time_alone_keeps_the_cpus_the_loop_measured() -> None:
    # NOTE [ Spinning threads ]: the step alone gets 15% of 2 s, less than one step.
    loader = DataLoader(SleepDataset(64, latency=0.0), batch_size=4)
    diagnosis = autoloader.diagnose(loader, _computes_for_a_third_of_a_second, seconds=2)
    assert diagnosis.step_cpus is not None and diagnosis.step_cpus >= 0.8, str(diagnosis)
