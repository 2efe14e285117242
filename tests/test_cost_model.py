from __future__ import annotations

from typing import Any

import pytest

import autoloader.search._cost_model
from autoloader.search._cost_model import (
    batch_seconds,
    guess_threads,
    guess_workers,
    loads_on_several_threads,
    step_competes_with_workers,
)
from autoloader.search._space import SearchSpace


@pytest.mark.parametrize(
    ("load", "cpu", "step", "cpus", "expected"),
    [
        # Latency-bound: 40 ms of waiting per batch, 10 ms step: 4 workers keep up,
        # however few the cores.
        (0.040, 0.001, 0.010, 2, [4, 5]),
        # CPU-bound: the same load, all CPU: two cores are all there is.
        (0.040, 0.039, 0.010, 2, [2, 3]),
        # Loading already faster than the step: one worker hides it.
        (0.004, 0.000, 0.010, 2, [1, 2]),
        # A step that takes no time: as many workers as cores, for CPU-bound loading.
        (0.010, 0.010, 0.000, 4, [4, 5]),
    ],
)
def test_guesses_follow_the_cost_model(
    load: float, cpu: float, step: float, cpus: int, expected: list[int]
) -> None:
    baseline = {"load_seconds": load, "load_cpu_seconds": cpu, "step_seconds": step}
    assert guess_workers(baseline, usable_cpus=cpus) == expected


def test_no_guess_when_nothing_is_loaded() -> None:
    assert guess_workers({"load_seconds": 0.0, "step_seconds": 0.01}, usable_cpus=2) == []


def test_guesses_come_before_the_ladder_held_to_the_range() -> None:
    space = SearchSpace(num_workers=(0, 8), prefetch_factor=2, persistent_workers=True)
    resolved, _ = space.resolve(usable_cpus=2, has_accelerator=False, batches_per_epoch=100)
    counts = [p["num_workers"] for p in resolved.ladder(first=[5, 6, 40])]
    assert counts == [5, 6, 8, 1, 2, 4]


@pytest.mark.parametrize(
    ("load", "cpu", "expected"),
    [(0.010, 0.019, True), (0.010, 0.010, False), (0.010, 0.0, False), (0.0, 0.0, False)],
    ids=["two-threads", "one-thread", "waiting", "nothing-loaded"],
)
def test_loading_on_several_threads_is_told_by_cpu_over_wall_time(
    load: float, cpu: float, expected: bool
) -> None:
    baseline = {"load_seconds": load, "load_cpu_seconds": cpu}
    assert loads_on_several_threads(baseline) is expected


@pytest.mark.parametrize(
    ("case", "figures", "competes"),
    [
        # A CNN trained on the CPU: 36 ms on 1.8 of 2 CPUs; loading 13 ms of CPU.
        ("cpu step, 2 CPUs", (0.036, 0.065, 0.013, 1.0, 2), True),
        # The same with 16 CPUs: cores to spare, the step's own time bounds the loop.
        ("cpu step, 16 CPUs", (0.036, 0.065, 0.013, 1.0, 16), False),
        # A step that does nothing: nothing to take cores from.
        ("no-op step", (0.000002, 0.000002, 0.013, 1.0, 2), False),
        # A step on an accelerator: it waits, the CPUs are the workers'.
        ("accelerator step", (0.020, 0.0002, 0.025, 1.0, 2), False),
        # A single-threaded step leaves a core to a worker.
        ("one-thread step", (0.036, 0.036, 0.013, 1.0, 2), False),
        # The tutorial's: loading mostly waits on storage (24% on the CPU).
        ("latency-bound loading", (0.0082, 0.0082, 0.026, 0.24, 2), False),
    ],
)
def test_a_step_competes_with_workers_only_where_the_cpus_bound_the_loop(
    case: str, figures: tuple[float, float, float, float, int], competes: bool
) -> None:
    step, step_cpu, load_cpu, share, cpus = figures
    assert (
        step_competes_with_workers(
            step=step,
            step_cpu=step_cpu,
            load_cpu=load_cpu,
            loading_cpu_share=share,
            usable_cpus=cpus,
        )
        is competes
    ), case


@pytest.mark.parametrize(
    ("load", "cpu", "gil", "expected"),
    [
        # Waiting 40 ms a batch for a 10 ms step: 4 keep up; threads cost little, so
        # the guesses reach twice that.
        (0.040, 0.001, True, [5, 8]),
        # Python work under the GIL: threads would take turns, no guess.
        (0.040, 0.039, True, []),
        # The same work without a GIL (free-threaded CPython) runs in parallel.
        (0.040, 0.039, False, [5, 8]),
        (0.0, 0.0, True, []),
    ],
    ids=["waiting", "cpu-under-gil", "cpu-free-threaded", "nothing-loaded"],
)
def test_thread_guesses_only_where_threads_overlap_loading(
    load: float, cpu: float, gil: bool, expected: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(autoloader.search._cost_model, "gil_enabled", lambda: gil)
    baseline = {"load_seconds": load, "load_cpu_seconds": cpu, "step_seconds": 0.010}
    assert guess_threads(baseline) == expected


def test_a_batchs_expected_time_is_the_step_or_the_shared_load_with_a_refill_an_epoch() -> None:
    """NOTE [ Cost model ]: what a joint segment's length is sized by."""
    waits = {"load_seconds": 0.096, "load_cpu_seconds": 0.002, "step_seconds": 0.004}
    kwargs: dict[str, Any] = {"usable_cpus": 2, "batches_per_epoch": None}
    assert batch_seconds(waits, 0, **kwargs) == pytest.approx(0.1)
    assert batch_seconds(waits, 12, **kwargs) == pytest.approx(0.008)  # 96 ms over 12
    assert batch_seconds(waits, 48, **kwargs) == pytest.approx(0.004)  # the step
    # 12-batch epochs refill an empty pipeline once an epoch: a batch's load.
    epochs = {"usable_cpus": 2, "batches_per_epoch": 12}
    assert batch_seconds(waits, 12, **epochs) == pytest.approx((0.096 + 11 * 0.008) / 12)
    # Decoding on the CPU shares the 2 cores, whatever the workers.
    decoding = {"load_seconds": 0.045, "load_cpu_seconds": 0.045, "step_seconds": 0.02}
    assert batch_seconds(decoding, 8, **kwargs) == pytest.approx(0.0225)
    assert batch_seconds({}, 4, **kwargs) is None
