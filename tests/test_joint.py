"""Joint tuning's parts, without torchrun: the job's figures and outcome from each
rank's, the lockstep of one rank's loop (a fake of the other ranks), each rank's share
of the node, and what a result records of the job."""

from __future__ import annotations

import dataclasses
import gc
import json
import logging
import math
import pickle
import time
import warnings
from collections.abc import Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch

import autoloader
from autoloader import Environment, EnvironmentMismatchWarning, RankError
from autoloader.checks._environment import usable_cpus
from autoloader.distributed._joint import (
    JointLockstep,
    _Done,
    _Measure,
    agree_on_arguments,
    checkpoint_spacing,
    follow,
    job_measurement,
    job_outcome,
    next_stride,
    node_memory_budget,
)
from autoloader.distributed._ranks import Ranks, job_timeout
from autoloader.measure._deadlines import Deadlines, TrialTimeout
from autoloader.measure._errors import TrialError
from autoloader.measure._lockstep import Checkpoint, PeerFailed
from autoloader.measure._measurement import Measurement
from autoloader.measure._memory import MemoryBudgetExceeded
from autoloader.measure._process_memory import tree_memory
from autoloader.measure._runner import TrialRunner
from autoloader.measure._supervision import Guard
from autoloader.search import Interruption
from autoloader.search._faults import classify
from tests.workloads import FailingDataset, LeakingDataset, SleepDataset


def _measurement(rate: float, **changes: Any) -> Measurement:
    base = Measurement(
        samples_per_second=rate,
        relative_error=0.02,
        data_wait_fraction=0.1,
        load_seconds=0.001,
        step_seconds=0.01,
        time_to_first_batch=0.2,
        epoch_restart_seconds=None,
        batches=100,
        duration=2.0,
        peak_memory=1 << 30,
        epochs_samples_per_second=rate * 0.9,
    )
    return dataclasses.replace(base, **changes)


def test_the_job_runs_at_its_slowest_rank() -> None:
    fast = _measurement(1000.0, batches=120, peak_memory=3 << 30)
    slow = _measurement(600.0, relative_error=0.08, time_to_first_batch=0.9)
    job = job_measurement([fast, slow])
    assert job.samples_per_second == 600.0
    assert job.epochs_samples_per_second == 540.0
    assert (job.relative_error, job.time_to_first_batch) == (0.08, 0.9)
    assert job.batches == 100
    assert job.peak_memory == 3 << 30  # the node's first rank measures the whole node
    # A rank that timed no whole epoch: the job has none either.
    assert job_measurement([fast, dataclasses.replace(slow, epochs_samples_per_second=None)]) \
        .epochs_samples_per_second is None  # fmt: skip


def _trial_error(stage: str, cause: BaseException) -> TrialError:
    return TrialError(stage, cause, peak_memory=0)


def test_the_job_outcome_is_the_error_that_says_most_and_names_its_rank() -> None:
    step_timeout = _trial_error("running step_fn", TrialTimeout("running step_fn", 4.0))
    load_timeout = _trial_error("loading a batch", TrialTimeout("loading a batch", 4.0))
    with pytest.raises(TrialError) as raised:
        job_outcome([step_timeout, PeerFailed(), load_timeout])
    # The rank whose worker hangs, not the rank whose step waited for it.
    assert raised.value is load_timeout and load_timeout.rank == 2
    outcome = classify(load_timeout, params={"num_workers": 4, "prefetch_factor": 2})
    assert outcome.reason.endswith("(on rank 2)")

    memory = MemoryBudgetExceeded(peak=5 << 30, budget=4 << 30)
    with pytest.raises(MemoryBudgetExceeded) as overrun:
        job_outcome([load_timeout, memory])
    assert str(overrun.value).startswith("process tree reached 5.0 GiB")  # one node
    # On several nodes, the node whose watch saw it, and its ranks; sent whole to the others.
    hosts = ("node-a", "node-a", "node-b", "node-b")
    with pytest.raises(MemoryBudgetExceeded) as overrun:
        job_outcome([PeerFailed(), PeerFailed(), memory, PeerFailed()], hosts)
    said = "node node-b's process tree (ranks 2 and 3, with their workers) reached 5.0 GiB"
    assert str(overrun.value).startswith(said)
    assert str(pickle.loads(pickle.dumps(overrun.value))) == str(overrun.value)
    with pytest.raises(RankError, match="disagree"):
        job_outcome([PeerFailed(), PeerFailed()])
    assert job_outcome([_measurement(900.0), _measurement(800.0)]).samples_per_second == 800.0


def test_checkpoints_are_spaced_by_time_and_swing_at_most_fourfold() -> None:
    assert next_stride(2, 0.001) == 8  # fast batches: farther apart, but not at once
    assert next_stride(8, 0.05) == 8  # on target
    assert next_stride(64, 1.0) == 16  # one slow stretch
    assert next_stride(1, 10.0) == 1
    assert next_stride(3, 0.0) == 12


def test_checkpoints_are_spaced_to_cost_a_hundredth_of_the_loop_within_bounds() -> None:
    # Two local ranks (an all-reduce of 0.2 ms): the floor, 0.4% of the loop.
    assert checkpoint_spacing(0.0002) == 0.05
    # 8 nodes x 8 ranks over TCP (docs/multi_node.md): 1% where it fits, else the ceiling.
    assert checkpoint_spacing(0.0015) == pytest.approx(0.15)
    assert checkpoint_spacing(0.013) == 0.25
    # The stride follows: 0.05 s of batches at the floor, three times as many at 0.15 s.
    assert next_stride(8, 0.05, checkpoint_spacing(0.0015)) == 24
    assert next_stride(8, 0.05, checkpoint_spacing(0.0015), most=3) == 3


class _ReducingRanks:
    """Ranks whose all-reduce returns the largest of this rank's and the others' values."""

    exchange_seconds = 0.013  # 8 nodes x 8 ranks over TCP: checkpoints 0.25 s apart

    def __init__(self, others: list[list[float]]) -> None:
        self.others = others

    def maximum(self, values: Sequence[float], *, during: str) -> list[float]:
        return [max(column) for column in zip(values, *self.others, strict=True)]

    def within_trial(self) -> _ReducingRanks:
        return self


def test_checkpoints_come_at_least_four_times_an_epoch_on_every_rank() -> None:
    """An epoch's restart discards the open window: with checkpoints an epoch apart, no
    window would ever close (every trial of a job with 12-batch epochs was too short)."""
    # Another rank's epoch is 12 batches (its values as it sends them: -12 for the epoch).
    other = [0.0] * (len(dataclasses.fields(Checkpoint)) - 1) + [0.01, -12.0]
    lockstep = JointLockstep(_ReducingRanks([other]))  # type: ignore[arg-type]
    lockstep.begin(epoch_batches=48)
    strides = []
    for _ in range(4):
        lockstep.agree(Checkpoint(seconds=0.01))  # fast batches: the spacing asks for more
        strides.append(lockstep.every())
    assert strides == [3, 3, 3, 3]  # 12 // 4: the shortest epoch of any rank
    alone = JointLockstep(_ReducingRanks([]))  # type: ignore[arg-type]
    alone.begin(epoch_batches=None)  # no length: the spacing alone
    alone.agree(Checkpoint(seconds=0.01))
    assert alone.every() == 8


class _FakeRanks:
    """The other ranks, as one rank sees them: gather answers with their values."""

    def __init__(self, rank: int, others: Sequence[Any], hosts: Sequence[str] = ()) -> None:
        self.rank = rank
        self.others = list(others)
        self.hosts = tuple(hosts) or ("node",) * (len(others) + 1)

    def gather(self, value: Any, *, during: str) -> list[Any]:
        return [*self.others[: self.rank], value, *self.others[self.rank :]]

    def node(self, values: Sequence[Any]) -> list[Any]:
        return Ranks.node(self, values)  # type: ignore[arg-type]


def test_ranks_start_only_with_the_same_valid_arguments() -> None:
    same = (512, 16, 32)
    agree_on_arguments(_FakeRanks(0, [(None, same)]), error=None, arguments=same)  # type: ignore[arg-type]
    with pytest.raises(RankError, match=r"ranks \[1\] called tune\(\) with other arguments"):
        agree_on_arguments(_FakeRanks(0, [(None, (512, 16, 64))]), error=None, arguments=same)  # type: ignore[arg-type]
    other = ValueError("batch_size must be positive")
    with pytest.raises(RankError, match="rank 1 could not start tuning: batch_size"):
        agree_on_arguments(_FakeRanks(0, [(other, None)]), error=None, arguments=same)  # type: ignore[arg-type]
    # A rank with its own error raises it (after telling the others).
    with pytest.raises(ValueError, match="batch_size"):
        agree_on_arguments(_FakeRanks(1, [(None, same)]), error=other, arguments=None)  # type: ignore[arg-type]


def test_the_memory_budget_is_the_nodes() -> None:
    gib = 1 << 30
    # Two ranks on this node, one on another: the other node's use does not count here.
    ranks = _FakeRanks(0, [(gib, 10 * gib), (7 * gib, 1 * gib)], hosts=("a", "a", "b"))
    budget = node_memory_budget(ranks, None)  # type: ignore[arg-type]
    in_use = budget - int(0.8 * 10 * gib)
    assert gib < in_use < 3 * gib  # this process's tree and the other local rank's
    explicit = node_memory_budget(ranks, "64GiB")  # type: ignore[arg-type]
    assert explicit == 64 * gib
    with pytest.raises(autoloader.InvalidInputError, match="node's whole process tree"):
        node_memory_budget(ranks, gib)  # type: ignore[arg-type]


class _FakeLockstep:
    """This rank's side of a joint trial; ``others_fail_at`` is the checkpoint at which
    another rank says it failed."""

    joint = True

    def __init__(
        self,
        spare: Any,
        others_fail_at: int | None = None,
        *,
        others_fail_after: float | None = None,
        others_hang_for: float = 0.0,
    ) -> None:
        self.spare = spare
        self.others_fail_at = others_fail_at
        # Or at the first checkpoint this many seconds after the trial's start.
        self.others_fail_after = others_fail_after
        self.others_hang_for = others_hang_for  # their failure: a batch that long overdue
        self.checkpoints: list[Checkpoint] = []
        self.began = time.monotonic()

    def begin(self, epoch_batches: int | None) -> None:
        self.checkpoints.clear()
        self.began = time.monotonic()

    def every(self) -> int:
        return 4

    def agree(self, mine: Checkpoint) -> Checkpoint:
        self.checkpoints.append(mine)
        after = self.others_fail_after
        if len(self.checkpoints) == self.others_fail_at or (
            after is not None and time.monotonic() - self.began >= after
        ):
            hung = self.others_hang_for > 0
            seconds = max(mine.seconds, self.others_hang_for)
            return dataclasses.replace(mine, failed=True, hung=hung, seconds=seconds)
        return mine

    def combine(self, estimate: Measurement) -> Measurement:
        return estimate

    def decide(self, stop: bool) -> bool:
        return stop


class _CountingStep:
    def __init__(self) -> None:
        self.batches: list[torch.Tensor] = []

    def __call__(self, batch: torch.Tensor) -> None:
        self.batches.append(batch)


def test_a_rank_that_fails_to_load_steps_the_spare_batch_until_the_checkpoint() -> None:
    step = _CountingStep()
    spare = torch.full((4, 8), -1.0)
    # Item 10 raises: the third batch of four items fails to load.
    runner = TrialRunner(FailingDataset(bad=10), step, batch_size=4, memory_budget=1 << 40)
    lockstep = _FakeLockstep(spare)
    with pytest.raises(TrialError, match="corrupt"):
        runner.measure({"num_workers": 0}, max_seconds=5.0, lockstep=lockstep)
    # The first batch, then a checkpoint every 4: the failure waited for the one after
    # batch 5, stepping the last good batch meanwhile (the others' collectives matched).
    assert len(step.batches) == 5
    last_good = step.batches[1]
    assert last_good is not spare and all(b is last_good for b in step.batches[2:])
    assert [c.failed for c in lockstep.checkpoints] == [False, True]


def test_a_rank_whose_workers_fail_to_start_steps_the_spare_batch_to_the_first_checkpoint(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A worker dead as the trial's iterator started (Ctrl-C reaches the whole job's
    process group as workers fork) fails the trial at the first checkpoint, the spare
    batch stepped first: the others' first step waits in its collectives for this one's.
    Raised at once, the other rank of a DDP step waited in its first backward until
    torchrun killed it."""
    started: list[bool] = []

    def dead_as_it_starts(guard: Guard) -> Any:
        started.append(True)
        raise RuntimeError("DataLoader worker (pid 12345) exited unexpectedly")

    monkeypatch.setattr(Guard, "start", dead_as_it_starts)
    step = _CountingStep()
    spare = torch.full((4, 8), -1.0)
    runner = TrialRunner(SleepDataset(latency=0.0), step, batch_size=4, memory_budget=1 << 40)
    lockstep = _FakeLockstep(spare)
    with pytest.raises(TrialError, match="exited unexpectedly"):
        runner.measure({"num_workers": 0}, max_seconds=5.0, lockstep=lockstep)
    assert started == [True]
    assert len(step.batches) == 1 and step.batches[0] is spare
    assert [c.failed for c in lockstep.checkpoints] == [True]


def test_a_rank_stops_with_the_others_when_another_fails() -> None:
    step = _CountingStep()
    runner = TrialRunner(SleepDataset(latency=0.0), step, batch_size=4, memory_budget=1 << 40)
    lockstep = _FakeLockstep(torch.zeros(4, 8), others_fail_at=3)
    with pytest.raises(PeerFailed):
        runner.measure({"num_workers": 0}, max_seconds=5.0, lockstep=lockstep)
    assert len(step.batches) == 1 + 2 * 4  # stopped at the third checkpoint, with the rest


class _Rank0:
    """Rank 0 as a following rank sees it: it sends ``commands`` one by one, lets each
    trial go on at every timing window, and says what it measured as this rank did."""

    def __init__(self, commands: Sequence[Any]) -> None:
        self.commands = list(commands)
        self.exchanges: list[str] = []
        self.hosts = ("node", "node")
        self.rank = 1
        self.exchange_seconds = 0.001

    def within_trial(self) -> _Rank0:
        return self

    def broadcast(self, value: Any, *, during: str) -> Any:
        self.exchanges.append(during)
        return self.commands.pop(0) if during == "waiting for the next trial" else False

    def gather(self, value: Any, *, during: str) -> list[Any]:
        self.exchanges.append(during)
        return [value, value]

    def maximum(self, values: Sequence[float], *, during: str) -> list[float]:
        self.exchanges.append(during)
        return list(values)


class _InterruptedAfter(_CountingStep):
    """A step during which Ctrl-C comes, its KeyboardInterrupt lost (raised in a fork's
    at-fork hook, say): only the run's interruption notes it."""

    def __init__(self, batches: int, interruption: Interruption) -> None:
        super().__init__()
        self.after = batches
        self.interruption = interruption

    def __call__(self, batch: torch.Tensor) -> None:
        super().__call__(batch)
        if len(self.batches) == self.after:
            self.interruption.note("Ctrl-C")


def test_a_following_rank_stops_at_the_timing_window_after_a_lost_ctrl_c() -> None:
    """It stops where rank 0 looks at its own Ctrl-C, a window's decision, not going on
    with the trial alone to its end's exchange (which rank 0, stopped, never makes)."""
    interruption = Interruption()
    step = _InterruptedAfter(6, interruption)
    runner = TrialRunner(SleepDataset(latency=0.0), step, batch_size=4, memory_budget=1 << 40)
    trial = _Measure({"num_workers": 0}, 30.0, None, None)
    ranks = _Rank0([trial, _Done(result="never")])
    with pytest.raises(KeyboardInterrupt):
        follow(runner, ranks, spare=torch.zeros(4, 8), stop_if_interrupted=interruption.stop_if_set)  # type: ignore[arg-type]
    # At the first window, once the ranks combined their figures (rank 0 looks at its own
    # Ctrl-C there too), before rank 0's decision: the trial of 30 s cut short.
    assert ranks.exchanges.count("a trial's timing window") == 1, ranks.exchanges
    assert "the end of a trial" not in ranks.exchanges


def test_a_following_rank_interrupted_between_trials_measures_no_more() -> None:
    interruption = Interruption()
    interruption.note("Ctrl-C")
    step = _CountingStep()
    runner = TrialRunner(SleepDataset(latency=0.0), step, batch_size=4, memory_budget=1 << 40)
    ranks = _Rank0([_Measure({"num_workers": 0}, 30.0, None, None)])
    with pytest.raises(KeyboardInterrupt):
        follow(runner, ranks, spare=None, stop_if_interrupted=interruption.stop_if_set)  # type: ignore[arg-type]
    assert step.batches == [] and ranks.exchanges == ["waiting for the next trial"]


@pytest.mark.alone  # the memory watch must see the tree grow before the hang deadline
@pytest.mark.parametrize("others_hang_for", [0.0, 1000.0])
def test_a_rank_whose_tree_outgrows_its_budget_reports_that_where_another_hung(
    others_hang_for: float,
) -> None:
    # Another rank of the node hung on a batch 1,000 s overdue, where this rank watches
    # the node's tree: 64 KiB an item, about 30 MB/s (less on a busy machine), it passes the
    # budget's 300 MiB head-room within those 1,000 s, not within the trial's 5 s, so its
    # own watch did not stop it. The job's outcome prefers the memory fault to the hang
    # (NOTE [ Memory growth against the hang deadline ]); any other failure of another
    # rank stops this one as before.
    # An earlier test's leak, garbage not yet collected, freed during this trial would
    # read as the tree shrinking: no growth (it failed so after the case before it).
    gc.collect()
    dataset = LeakingDataset(64 << 10, in_workers_only=False)
    budget = tree_memory(psutil.Process()) + (300 << 20)
    runner = TrialRunner(
        dataset, _CountingStep(), batch_size=4, memory_budget=budget, target_relative_error=0.0
    )
    # The others fail 2 s in, once the watch's growth rate is known (it needs a second
    # of samples), however busy the machine.
    lockstep = _FakeLockstep(
        torch.zeros(4, 8), others_fail_after=2.0, others_hang_for=others_hang_for
    )
    with pytest.raises((PeerFailed, MemoryBudgetExceeded)) as raised:
        runner.measure({"num_workers": 0}, max_seconds=5.0, lockstep=lockstep)
    if others_hang_for:
        assert isinstance(raised.value, MemoryBudgetExceeded)
        assert raised.value.projected is not None and raised.value.projected > budget
        assert raised.value.peak < budget
    else:
        assert isinstance(raised.value, PeerFailed)
    assert time.monotonic() - lockstep.began >= 2.0  # it ended where the others failed


def test_alone_a_failure_is_raised_at_once() -> None:
    step = _CountingStep()
    runner = TrialRunner(FailingDataset(bad=10), step, batch_size=4, memory_budget=1 << 40)
    with pytest.raises(TrialError, match="corrupt"):
        runner.measure({"num_workers": 0}, max_seconds=5.0)
    assert len(step.batches) == 2


def test_each_rank_gets_its_share_of_the_nodes_cpus(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("autoloader.checks._environment._affinity", lambda: 32)
    monkeypatch.setattr("autoloader.checks._environment.cgroup_cpus", lambda: None)
    assert usable_cpus() == 32
    assert usable_cpus(local_world_size=8, node_cpus=32) == 4
    assert usable_cpus(local_world_size=64, node_cpus=32) == 1
    monkeypatch.setattr("autoloader.checks._environment.cgroup_cpus", lambda: 12.5)  # a quota
    assert usable_cpus() == 13
    assert usable_cpus(local_world_size=4, node_cpus=32) == 3
    # Ranks bound to CPUs of their own (numactl, torchrun --numa-binding): 2 each of 8.
    monkeypatch.setattr("autoloader.checks._environment.cgroup_cpus", lambda: None)
    monkeypatch.setattr("autoloader.checks._environment._affinity", lambda: 2)
    assert usable_cpus(local_world_size=4, node_cpus=8) == 2
    # Every rank of the job held to the same 8 CPUs (taskset): they share them.
    monkeypatch.setattr("autoloader.checks._environment._affinity", lambda: 8)
    assert usable_cpus(local_world_size=4, node_cpus=8) == 2


def test_a_cgroup_cpu_quota_is_read(tmp_path: Path) -> None:
    from autoloader.checks._environment import cgroup_cpus

    (tmp_path / "cpu.max").write_text("250000 100000\n")
    assert cgroup_cpus(cgroup_root=tmp_path) == 2.5
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert cgroup_cpus(cgroup_root=tmp_path) is None
    assert cgroup_cpus(cgroup_root=tmp_path / "missing") is None


def _joint_result() -> autoloader.TuneResult:
    environment = Environment.current(world_size=8, local_world_size=8)
    return autoloader.TuneResult(
        params={"num_workers": 2},
        throughput=900.0,
        baseline=300.0,
        batch_size=32,
        trials=(),
        environment=environment,
        tuning_seconds=30.0,
        memory_budget=1 << 33,
    )


def test_only_global_rank_0_writes_a_joint_result(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    result = _joint_result()
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "8")
    with caplog.at_level(logging.INFO, logger="autoloader"):
        assert result.save(tmp_path / "best.json") is None  # not a path it never wrote
    assert not (tmp_path / "best.json").exists()
    assert "rank 3 of a joint tuning: not writing" in caplog.text
    monkeypatch.setenv("RANK", "0")
    assert result.save(tmp_path / "best.json") == tmp_path / "best.json"
    assert json.loads((tmp_path / "best.json").read_text())["environment"]["world_size"] == 8


def test_loading_warns_when_the_ranks_differ(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = _joint_result().save(tmp_path / "best.json")
    with pytest.warns(EnvironmentMismatchWarning, match="ranks: 8 ranks, 8 per node when "
                      "measured, one process now"):  # fmt: skip
        autoloader.load(path)
    for name, value in {"RANK": "0", "WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "8"}.items():
        monkeypatch.setenv(name, value)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        autoloader.load(path)
    assert not [w for w in caught if "ranks:" in str(w.message)]


def test_loading_tells_a_job_of_two_nodes_from_one_of_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same 8 ranks, 4 per node or 8 on one: each rank's share of its node differs."""
    environment = Environment.current(world_size=8, local_world_size=4, nodes=2)
    result = dataclasses.replace(_joint_result(), environment=environment)
    path = result.save(tmp_path / "best.json")
    # torchrun's environment on a rank of a 2-node job: one agent per node.
    for name, value in {"RANK": "0", "WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("GROUP_WORLD_SIZE", "2")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        autoloader.load(path)
    assert not [w for w in caught if "ranks:" in str(w.message)]
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    monkeypatch.setenv("GROUP_WORLD_SIZE", "1")
    with pytest.warns(EnvironmentMismatchWarning, match="ranks: 8 ranks on 2 nodes, 4 per "
                      "node when measured, 8 ranks, 8 per node now"):  # fmt: skip
        autoloader.load(path)


def test_no_process_group_means_tuning_alone() -> None:
    assert not torch.distributed.is_initialized()
    assert Ranks.join() is None


@pytest.mark.light  # mostly waits
@pytest.mark.slow  # over 2.5 s here: the full suite's (docs/development/checks.md)
def test_a_world_of_one_tunes_alone(tmp_path: Path) -> None:
    torch.distributed.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1
    )
    try:
        assert Ranks.join() is None
        result = autoloader.tune(
            SleepDataset(length=256),
            lambda batch: None,
            batch_size=8,
            time_budget=3.0,
            search_space={"num_workers": (0, 1)},
            show_progress=False,
        )
        assert result.environment.world_size == 1
        assert not any("jointly" in note for note in result.notes)
    finally:
        torch.distributed.destroy_process_group()
    assert math.isfinite(result.throughput)


def test_the_ranks_wait_outside_a_trial_as_long_as_the_jobs_own_group(tmp_path: Path) -> None:
    """NOTE [ How long a rank waits ]: the default group's timeout, as given to
    init_process_group or torch's default (30 min with gloo)."""
    for given, expected in ((timedelta(seconds=37), 37.0), (None, 1800.0)):
        store = tmp_path / f"store{expected:.0f}"
        options: dict[str, Any] = {} if given is None else {"timeout": given}
        torch.distributed.init_process_group(
            "gloo", init_method=f"file://{store}", rank=0, world_size=1, **options
        )
        try:
            assert job_timeout() == expected
        finally:
            torch.distributed.destroy_process_group()


def test_each_rank_runs_its_step_on_the_trials_threads_from_its_share_of_the_node(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """NOTE [ Step threads ] under torchrun: the space's range is the rank's share of the
    node's CPUs, and each rank's trial sets its own process's threads, and puts them
    back even when another rank fails the trial."""
    monkeypatch.setattr("autoloader.checks._environment._affinity", lambda: 8)
    monkeypatch.setattr("autoloader.checks._environment.cgroup_cpus", lambda: None)
    share = usable_cpus(local_world_size=2, node_cpus=8)
    space, _ = autoloader.SearchSpace().resolve(
        usable_cpus=share, has_accelerator=False, batches_per_epoch=None
    )
    assert space.step_threads == (1, 4)
    before = torch.get_num_threads()
    seen: list[int] = []

    def step(batch: torch.Tensor) -> None:
        seen.append(torch.get_num_threads())

    runner = TrialRunner(SleepDataset(latency=0.0), step, batch_size=4, memory_budget=1 << 40)
    lockstep = _FakeLockstep(torch.zeros(4, 8), others_fail_at=2)
    with pytest.raises(PeerFailed):
        runner.measure({"num_workers": 0, "step_threads": 1}, max_seconds=5.0, lockstep=lockstep)
    assert seen and set(seen) == {1}
    assert torch.get_num_threads() == before


class _WaitingStep(_CountingStep):
    """A step whose third call waits ``wait`` s in its collectives for a rank whose
    fetch is slow."""

    def __init__(self, wait: float) -> None:
        super().__init__()
        self.wait = wait

    def __call__(self, batch: torch.Tensor) -> None:
        super().__call__(batch)
        if len(self.batches) == 3:
            time.sleep(self.wait)


@pytest.mark.parametrize("joint", [True, False])
@pytest.mark.slow  # over 2.5 s here: the full suite's (docs/development/checks.md)
def test_a_step_waits_for_another_ranks_fetch_within_its_deadline(joint: bool) -> None:
    """A step waits in its collectives while another rank fetches its batch, for up to
    that fetch's deadline: in a joint trial its deadline is a fetch's and a step's
    (NOTE [ Joint trials ]). A step 1.5 s long with a batch's deadline of 1 s hangs
    alone; in a joint trial it waited for a rank that fetched within its own 1 s."""
    step = _WaitingStep(1.5)
    runner = TrialRunner(SleepDataset(latency=0.0), step, batch_size=4, memory_budget=1 << 40)
    deadlines = Deadlines(first=1.0, each=1.0)
    lockstep = _FakeLockstep(torch.zeros(4, 8)) if joint else None
    if not joint:
        with pytest.raises(TrialError, match="running step_fn"):
            runner.measure({"num_workers": 0}, max_seconds=3.0, deadlines=deadlines)
        return
    measured = runner.measure(
        {"num_workers": 0}, max_seconds=3.0, deadlines=deadlines, lockstep=lockstep
    )
    assert measured.batches > 3
