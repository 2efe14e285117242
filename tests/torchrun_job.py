"""A training script for the torchrun tests: every rank tunes the same DDP job.

Run as ``torchrun --standalone --nproc_per_node=N -m tests.torchrun_job OUT SCENARIO
[BUDGET]`` (or on several nodes, ``tests/nodes.py``); each rank writes what tune()
returned or raised, its host and the call's seconds to ``OUT/rank<r>.json``. Scenarios:
``plain``; ``faults-on-last-rank`` (on the last rank only, with 3 workers the third fills
1 GiB, over its node's budget of 1 GiB, and with 4 the fourth segfaults);
``hang-on-last-rank`` (that rank's workers from index 2 up hang); ``stored`` (the study
in ``study.db`` next to ``OUT``, for jobs run in folders side by side); ``long`` (a long
budget, for the tests that kill a rank or press Ctrl-C); ``stopped-rank`` (a process
group whose timeout is ``PG_TIMEOUTS``'s, for a test that stops a rank with SIGSTOP);
``autoloader``, ``autoloader-crash-on-last-rank``, ``autoloader-evaluates-on-rank-0`` and
``autoloader-short-epochs``, an ``AutoLoader`` in place of tune() (see
:func:`autoloader_job`). ``BUDGET`` replaces
the scenario's time budget.
"""

from __future__ import annotations

import faulthandler
import json
import signal
import socket
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils.data import DistributedSampler, get_worker_info

import autoloader
from autoloader.distributed import _ranks
from tests.workloads import FaultInWorkersDataset, SleepDataset, _fault

# The faults come with a worker process's index: thread workers have none. With 2 to 4
# workers, 3 (the memory fault, or the first to hang) is sure to be tried: as a guess,
# or bisecting between 2 (which works) and 4 (which fails); with 0 to 4 a run once never
# came to it (with 4 ranks on 2 cores, each rank has 1 CPU, and the cost model's guesses
# stay low).
SPACES: dict[str, dict[str, object]] = {
    "faults-on-last-rank": {"num_workers": (2, 4), "worker_kind": "processes"},
    "hang-on-last-rank": {"num_workers": (2, 4), "worker_kind": "processes"},
}

# stopped-rank: long enough to be stopped mid-search, short enough that rank 0's checks
# before it (a tenth of the budget) keep well within the group's timeout.
BUDGETS = {"long": 120.0, "stopped-rank": 30.0, "faults-on-last-rank": 14.0, "stored": 6.0}

# The default process group's timeout (init_process_group's timeout=), where a scenario
# sets one: how long the job's own collectives (DDP's) wait for a rank.
PG_TIMEOUTS = {"stopped-rank": 10.0, "autoloader-evaluates-on-rank-0": 60.0}
# autoloader-evaluates-on-rank-0: rank 0 alone spends EVALUATION seconds between its first
# two epochs (an evaluation, a checkpoint), longer than a trial's own exchanges may wait
# (TRIAL_TIMEOUT, shrunk from 120 s to keep the test short), shorter than the job's
# process group waits.
EVALUATION = 8.0
_TRIAL_TIMEOUT = 3.0
# autoloader-short-epochs: 12 batches a rank per epoch, fewer than the 16 that 8 workers x
# prefetch 2 hold at once, and a validation between epochs.
SHORT_EPOCHS_SPACE: dict[str, object] = {
    "num_workers": (2, 8),
    "prefetch_factor": 2,
    "worker_kind": "processes",
}
SHORT_EPOCHS_VALIDATION = 0.05


def init_process_group(scenario: str) -> None:
    """The job's default group, on gloo, with the scenario's timeout if it sets one."""
    seconds = PG_TIMEOUTS.get(scenario)
    if seconds is None:
        dist.init_process_group("gloo")
    else:
        dist.init_process_group("gloo", timeout=timedelta(seconds=seconds))


class FaultsOnOneRank(SleepDataset):
    """Worker 2 fills 1 GiB as it loads its first item; worker 3 segfaults.

    Filling memory is slow on the development VM (page faults: 2 GiB took 2.3-4.6 s), and
    the item's batch is late all the while, past the siblings' pace (``NOTE [ Sibling
    pace ]``: 1-1.5 s here): the trial failed as a hang once in CI, with 2 GiB over a
    budget of 1.5 GiB, and once in a full run beside three other tests (the test is
    `calm` since). A worker filling memory uses CPU, and is now waited for (``NOTE [ A
    late worker that works ]``) until the node (about 550 MiB without it) passes its
    budget, or the batch's own deadline.
    """

    def __init__(self) -> None:
        super().__init__(length=768, latency=0.002)
        self.held: torch.Tensor | None = None

    def __getitem__(self, index: int) -> torch.Tensor:
        info = get_worker_info()
        if info is not None and info.id == 2 and self.held is None:
            self.held = torch.ones(1 << 30, dtype=torch.uint8)  # written: resident
        if info is not None and info.id >= 3:
            _fault("SIGSEGV")
        return super().__getitem__(index)


class DDPStep:
    """A DDP training step on the CPU: its backward all-reduces across the ranks."""

    def __init__(self) -> None:
        self.model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(8, 1))
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.01)
        self.steps = 0

    def __call__(self, batch: torch.Tensor) -> None:
        self.steps += 1  # before the step's collective: a step cut short still ran it
        self.optimizer.zero_grad()
        self.model(batch).sum().backward()
        self.optimizer.step()
        time.sleep(0.004)


def autoloader_job(out: Path, scenario: str) -> int:
    """``AutoLoader`` over a DistributedSampler, stepped by a DDP step, until it has tuned
    and one epoch more: each rank reports the setting that loaded each of its batches,
    each epoch's ids against DataLoader's, and the result. With
    ``autoloader-crash-on-last-rank``, that rank's workers from index 1 up die; with
    ``autoloader-evaluates-on-rank-0``, rank 0 spends ``EVALUATION`` seconds alone after
    its first epoch; with ``autoloader-short-epochs``, each rank's epoch is 12 batches,
    fewer than 8 workers x prefetch 2 hold at once, and every rank spends
    ``SHORT_EPOCHS_VALIDATION`` seconds after each epoch (a validation)."""
    init_process_group(scenario)
    if scenario == "autoloader-evaluates-on-rank-0":
        _ranks.TRIAL_TIMEOUT = _TRIAL_TIMEOUT
    rank, size = dist.get_rank(), dist.get_world_size()
    short = scenario == "autoloader-short-epochs"
    length = 12 * 8 * size if short else 384
    dataset: SleepDataset = SleepDataset(length=length, latency=0.002)
    if scenario == "autoloader-crash-on-last-rank" and rank == size - 1:
        dataset = FaultInWorkersDataset("SIGKILL", length=384, from_worker=1, after=3)
    sampler = DistributedSampler(dataset, seed=3)
    reference = torch.utils.data.DataLoader(
        dataset, batch_size=8, sampler=DistributedSampler(dataset, seed=3)
    )
    loader = autoloader.AutoLoader(
        dataset,
        batch_size=8,
        sampler=sampler,
        time_budget=8,
        search_space=SHORT_EPOCHS_SPACE
        if short
        else {"num_workers": (0, 3), "worker_kind": "processes"},
    )
    step = DDPStep()
    report: dict[str, object] = {"rank": rank, "settings": [], "epochs_equal": []}
    batch_number = 0
    last = None
    try:
        for epoch in range(100):
            sampler.set_epoch(epoch)
            reference.sampler.set_epoch(epoch)  # type: ignore[attr-defined]
            tuned_before = loader.tuned
            seen = []
            for batch in loader:
                setting = json.dumps(loader.setting, sort_keys=True)
                if setting != last:
                    report["settings"].append([batch_number, setting])  # type: ignore[attr-defined]
                    last = setting
                seen.append(batch[:, 0].tolist())
                step(batch)
                batch_number += 1
            expected = [b[:, 0].tolist() for b in reference]
            report["epochs_equal"].append(seen == expected)  # type: ignore[attr-defined]
            if short:
                time.sleep(SHORT_EPOCHS_VALIDATION)
            if scenario == "autoloader-evaluates-on-rank-0" and rank == 0 and epoch == 0:
                report["evaluated_while_tuning"] = not loader.tuned
                report["evaluation_began"] = time.time()
                time.sleep(EVALUATION)
            if tuned_before:
                break
        assert loader.result is not None
        report["result"] = loader.result.as_dict()
        report["failures"] = loader.failures
    except BaseException as error:
        report["error"] = f"{type(error).__name__}: {error}"
        report["failed_at"] = time.time()
        raise
    finally:
        loader.close()
        report["steps"] = step.steps
        (out / f"rank{rank}.json").write_text(json.dumps(report))
        dist.destroy_process_group()
    return 0


def main(out: Path, scenario: str, budget: float | None = None) -> int:
    # A test may ask a rank for its threads' stacks (SIGUSR1), one that does not stop.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    if scenario.startswith("autoloader"):
        return autoloader_job(out, scenario)
    init_process_group(scenario)
    rank, size = dist.get_rank(), dist.get_world_size()
    dataset: SleepDataset = SleepDataset(length=768, latency=0.002)
    if scenario == "faults-on-last-rank" and rank == size - 1:
        dataset = FaultsOnOneRank()
    if scenario == "hang-on-last-rank" and rank == size - 1:
        dataset = FaultInWorkersDataset("hang", length=768, from_worker=2)
    step = DDPStep()
    report: dict[str, object] = {"rank": rank, "host": socket.gethostname()}
    called = time.monotonic()
    try:
        result = autoloader.tune(
            dataset,
            step,
            batch_size=16,
            time_budget=budget or BUDGETS.get(scenario, 10.0),
            memory_budget="1GiB" if scenario == "faults-on-last-rank" else None,
            search_space=SPACES.get(scenario, {"num_workers": (0, 4)}),
            loader_kwargs={"sampler": DistributedSampler(dataset)},
            storage=f"sqlite:///{out.parent / 'study.db'}" if scenario == "stored" else None,
            show_progress=False,
        )
        report["seconds"] = time.monotonic() - called  # the call, joining the ranks included
        report["result"] = result.as_dict()
        report["saved"] = str(result.save(out / "best.json"))
    except BaseException as error:
        report["error"] = f"{type(error).__name__}: {error}"
        report["failed_at"] = time.time()
        raise
    finally:
        # torchrun stops the other ranks with SIGTERM when one fails: let this rank
        # finish its report, written whole or not at all.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        report["steps"] = step.steps
        written = out / f".rank{rank}.json"
        written.write_text(json.dumps(report))
        written.replace(out / f"rank{rank}.json")
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1]), sys.argv[2], *map(float, sys.argv[3:4])))
