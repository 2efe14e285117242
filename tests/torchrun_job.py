"""A training script for the torchrun tests: every rank tunes the same DDP job.

Run as ``torchrun --standalone --nproc_per_node=N tests/torchrun_job.py OUT SCENARIO``;
each rank writes what tune() returned or raised to ``OUT/rank<r>.json``. Scenarios:
``plain``; ``crash-on-rank-1`` and ``hang-on-last-rank`` (that rank's workers from
index 2 up crash or hang; the others' are fine); ``long`` (a long budget, for the
tests that kill a rank or press Ctrl-C).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils.data import DistributedSampler

import autoloader
from tests.workloads import FaultInWorkersDataset, SleepDataset


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


def main(out: Path, scenario: str) -> int:
    dist.init_process_group("gloo")
    rank, size = dist.get_rank(), dist.get_world_size()
    dataset: SleepDataset = SleepDataset(length=768, latency=0.002)
    faulty = {"crash-on-rank-1": (1, "SIGSEGV"), "hang-on-last-rank": (size - 1, "hang")}
    if scenario in faulty and rank == faulty[scenario][0]:
        dataset = FaultInWorkersDataset(faulty[scenario][1], length=768, from_worker=2)
    step = DDPStep()
    report: dict[str, object] = {"rank": rank}
    try:
        result = autoloader.tune(
            dataset,
            step,
            batch_size=16,
            time_budget=120.0 if scenario == "long" else 14.0,
            search_space={"num_workers": (0, 4)},
            loader_kwargs={"sampler": DistributedSampler(dataset)},
            show_progress=False,
        )
        report["result"] = result.as_dict()
        report["saved"] = str(result.save(out / "best.json"))
    except BaseException as error:
        report["error"] = f"{type(error).__name__}: {error}"
        raise
    finally:
        report["steps"] = step.steps
        (out / f"rank{rank}.json").write_text(json.dumps(report))
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1]), sys.argv[2]))
