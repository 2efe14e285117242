"""A torchrun job for ``tests/test_torchrun_path.py``: every rank tunes with ``path=``,
then runs again as a next job would, and reuses the file rank 0 saved.

Run as ``torchrun --standalone --nproc_per_node=N -m tests.torchrun_path_job OUT``; each
rank writes what it saw to ``OUT/rank<r>.json``: ``tune(path=OUT/tuned.json)`` twice
(the steps each call ran, the results), then ``AutoLoader(path=OUT/loader.json)`` until
it has tuned, and a second AutoLoader of the same problem for one epoch (whether it was
tuned at its first batch, its result); then an AutoLoader whose study beside its path
another run claims as its first batch arrives.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from pathlib import Path
from typing import Any

import optuna
import torch.distributed as dist
from optuna.storages.journal import JournalFileBackend
from torch.utils.data import DistributedSampler

import autoloader
from autoloader._reuse import study_beside
from tests.torchrun_job import DDPStep
from tests.workloads import SleepDataset

SPACE = {"num_workers": (0, 2), "worker_kind": "processes"}


def _tune(dataset: SleepDataset, step: DDPStep, path: Path) -> tuple[dict[str, Any], int]:
    """``tune(path=path)``'s result, and how many steps the call ran."""
    before = step.steps
    result = autoloader.tune(
        dataset,
        step,
        batch_size=8,
        time_budget=4,
        search_space=SPACE,
        loader_kwargs={"sampler": DistributedSampler(dataset)},
        show_progress=False,
        path=path,
    )
    return result.as_dict(), step.steps - before


def _take(study_file: Path) -> None:
    """Another run's claim on the study in ``study_file``, written over this run's."""
    storage = optuna.storages.JournalStorage(JournalFileBackend(str(study_file)))
    (summary,) = optuna.get_all_study_summaries(storage)
    study = optuna.load_study(study_name=summary.study_name, storage=storage)
    held = dict(study.user_attrs["autoloader:run"])
    study.set_user_attr("autoloader:run", {**held, "token": "another run", "pid": 1})


def _autoloader(
    dataset: SleepDataset, step: DDPStep, path: Path, *, taken: bool = False
) -> dict[str, Any]:
    """An AutoLoader with ``path``, stepped until it has tuned: whether it was tuned at
    its first batch, and its result. ``taken``: another run claims the study kept beside
    ``path`` as rank 0's first batch arrives, before its claim is confirmed."""
    sampler: DistributedSampler[Any] = DistributedSampler(dataset)
    loader = autoloader.AutoLoader(
        dataset,
        batch_size=8,
        sampler=sampler,
        time_budget=4,
        search_space=SPACE,
        path=path,
        verbose=False,
    )
    tuned_at_first_batch = None
    try:
        for epoch in range(200):
            sampler.set_epoch(epoch)
            for batch in loader:
                if tuned_at_first_batch is None:
                    tuned_at_first_batch = loader.tuned
                    if taken and dist.get_rank() == 0:
                        _take(study_beside(path))
                step(batch)
            if loader.tuned:
                break
    finally:
        loader.close()
    assert loader.result is not None
    return {"tuned_at_first_batch": tuned_at_first_batch, "result": loader.result.as_dict()}


class _Warnings(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def main(out: Path) -> int:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    warned = _Warnings()
    logging.getLogger("autoloader").addHandler(warned)
    dataset = SleepDataset(length=256, latency=0.001)
    step = DDPStep()
    report: dict[str, object] = {"rank": rank}
    try:
        tuned = out / "tuned.json"
        report["tune"], report["tune_steps"] = _tune(dataset, step, tuned)
        report["tuned_saved"] = tuned.exists()
        dist.barrier()  # the next job starts once this one has ended
        report["again"], report["again_steps"] = _tune(dataset, step, tuned)
        loader = out / "loader.json"
        report["autoloader"] = _autoloader(dataset, step, loader)
        dist.barrier()
        report["autoloader_again"] = _autoloader(dataset, step, loader)
        report["warnings"], warned.messages = warned.messages, []
        report["taken"] = _autoloader(dataset, step, out / "taken.json", taken=True)
    except BaseException as error:
        report["error"] = f"{type(error).__name__}: {error}"
        report["failed_at"] = time.time()
        raise
    finally:
        report["steps"] = step.steps
        report["taken_warnings"] = warned.messages
        (out / f"rank{rank}.json").write_text(json.dumps(report))
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1])))
