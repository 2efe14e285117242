"""AutoLoader in real Lightning runs, which rebuild a DataLoader subclass from its
arguments or attributes (a DistributedSampler in a DDP fit, an index-recording batch
sampler to predict): the copy loads through its original's tuning, one search seen from
the object the user holds (``NOTE [ A rebuilt AutoLoader ]``), and every argument
survives the rebuild."""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler, SequentialSampler

from autoloader import AutoLoader, InvalidInputError
from tests.lazy import LazyModule
from tests.test_lightning import ROOT, SlowItems

pytestmark = [pytest.mark.slow, pytest.mark.late]  # Lightning DDP fits; imports Lightning

# Imported by the tests that use them (tests/lazy.py): each is skipped without Lightning.
lightning_data = LazyModule("lightning.pytorch.utilities.data")
models = LazyModule("tests.lightning_models")

LENGTH = 1024  # items to train on
VALIDATION = 64  # items to validate on


class IndexedItems(SlowItems):
    """SlowItems with each item's index, for the loop to say which it saw."""

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # type: ignore[override]
        x, y = super().__getitem__(index)
        return x, y, torch.tensor(index)


DDP_SCRIPT = textwrap.dedent(
    """
    import json, sys
    from pathlib import Path
    import lightning.pytorch as pl
    from tests.lightning_models import (
        Seen, StopWhenTuned, Validated, slow_autoloader, trainer as quiet_trainer,
    )

    def fit(model, **kwargs):
        model.seen = {}
        trainer = quiet_trainer(devices=2, strategy="ddp", **kwargs)
        trainer.fit(model)
        return trainer

    def said(model, trainer, held):
        used = trainer.train_dataloader
        return {
            "seen": model.seen,
            "sampler": type(used.sampler).__name__,
            "copy": used is not held,
            "tuned": held.tuned,
            "trials": len(held.history),
            "same_history": used.history == held.history,
            "workers": [held.num_workers, used.num_workers],
        }

    pl.seed_everything(0, verbose=False)
    out = {}
    # Made outside any hook, in the module's __init__: tuned by a first fit, rebuilt
    # by a second one with its tuned attributes.
    model = Seen(slow_autoloader())
    first = fit(model, max_epochs=100, callbacks=[StopWhenTuned()])
    out["first"] = said(model, first, model.loader)
    out["chosen"] = model.loader.result.params
    out["trials"] = [
        (t.phase, t.params["num_workers"], t.state, t.epoch_samples_per_second,
         t.relative_error, t.reason)
        for t in model.loader.history
    ]
    second = fit(model, max_epochs=2)
    out["second"] = said(model, second, model.loader)
    # Made in the hooks: Lightning rebuilds them from the arguments it recorded.
    hooked = Validated()
    third = fit(hooked, max_epochs=100, callbacks=[StopWhenTuned()])
    out["hook"] = said(hooked, third, hooked.made)
    validating = third.val_dataloaders
    out["validation"] = {
        "seen": hooked.validated,
        "sampler": type(validating.sampler).__name__,
        "shared": validating is not hooked.validating
        and validating.tuning is hooked.validating.tuning,
    }
    out["rank"] = third.global_rank
    Path(sys.argv[1], f"rank{third.global_rank}.json").write_text(json.dumps(out))
    """
)


def _distributed_order(length: int, rank: int, epoch: int) -> list[int]:
    """The items a rank of 2 trains on in ``epoch``, in order, as Lightning's
    DistributedSampler gives them (``seed_everything(0)``)."""
    sampler = DistributedSampler(range(length), num_replicas=2, rank=rank, shuffle=True, seed=0)
    sampler.set_epoch(epoch)
    return list(sampler)


@pytest.mark.calm
def test_a_ddp_fit_rebuilds_an_autoloader_as_a_copy_that_shares_its_tuning(
    tmp_path: Path,
) -> None:
    """Every rank's copy trains on its DistributedSampler's items, each once per epoch,
    in its order; one tuning per rank, the user's object reporting it: made outside a
    hook and tuned (its num_workers the chosen one), or made in the hook. The same for
    a validation loader, made in its hook, each epoch validating each item once."""
    script = tmp_path / "ddp_rebuild.py"
    script.write_text(DDP_SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, str(script), str(tmp_path)], cwd=ROOT, env=env, capture_output=True,
        text=True, timeout=240,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    ranks = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    assert ranks[0]["chosen"] == ranks[1]["chosen"], "the ranks tuned together"
    for rank, out in enumerate(ranks):
        assert out["rank"] == rank
        for fit in ("first", "second", "hook"):
            said = out[fit]
            assert said["sampler"] == "DistributedSampler", fit
            assert said["copy"], fit
            # One tuning, seen from the object the user holds.
            assert said["tuned"] and said["trials"] > 0 and said["same_history"], fit
            assert said["seen"], fit
            for epoch, items in said["seen"].items():
                assert items == _distributed_order(LENGTH, rank, int(epoch)), (fit, epoch)
        validation = out["validation"]
        assert validation["sampler"] == "DistributedSampler" and validation["shared"]
        assert validation["seen"]
        for epoch, items in validation["seen"].items():
            expected = DistributedSampler(
                range(VALIDATION), num_replicas=2, rank=rank, shuffle=False
            )
            assert items == list(expected), ("validation", epoch)
        # The tuned loader's rebuild: no trial more, the chosen setting shown by both
        # (and given back by Lightning as an argument).
        assert out["second"]["trials"] == out["first"]["trials"]
        chosen = out["chosen"]["num_workers"]
        # The defaults win a tie within a short trial's error (NOTE [ A tie within the
        # best's error ]): the items wait long enough that workers lead by more.
        assert chosen > 0, ("a latency-bound dataset wants workers", out["trials"])
        assert out["first"]["workers"] == out["second"]["workers"] == [chosen, chosen]


@pytest.mark.light  # mostly waits
def test_predict_and_validate_load_through_the_users_autoloader() -> None:
    """Lightning rebuilds a loader to predict with its index-recording batch sampler:
    the copy tunes, through the tuning of the loader the user gave, and predicts every
    item once, in order, the indices recorded."""
    with contextlib.ExitStack() as closing:  # the persistent workers a tuning keeps
        loader = AutoLoader(
            IndexedItems(length=400, latency=0.003), batch_size=8, time_budget=2, verbose=False
        )
        closing.callback(loader.close)
        trainer = models.trainer(devices=1)
        predicted = trainer.predict(models.Seen(), dataloaders=loader)
        copy = trainer.predict_dataloaders
        assert copy is not loader and copy.tuning is loader.tuning and copy.untuned is None
        assert torch.cat(predicted).tolist() == list(range(400))
        recorded = copy.batch_sampler.seen_batch_indices
        assert [i for batch in recorded for i in batch] == list(range(400))
        assert loader.history and loader.history == copy.history

        # Made in the hook: rebuilt from the arguments Lightning recorded, tuning included.
        class Hooked(models.Seen):
            def predict_dataloader(self) -> DataLoader[Any]:
                self.made = AutoLoader(
                    IndexedItems(length=64), batch_size=8, time_budget=2, verbose=False
                )
                closing.callback(self.made.close)
                return self.made

        module = Hooked()
        trainer = models.trainer(devices=1)
        predicted = trainer.predict(module)
        assert torch.cat(predicted).tolist() == list(range(64))
        copy = trainer.predict_dataloaders
        assert module.made is not None and copy is not module.made
        assert copy.tuning is module.made.tuning and copy.tuning.stage.name != "WAITING"

        # Validation in one process is not rebuilt: the user's loader itself.
        class Validating(models.Seen):
            def validation_step(self, batch: Any, batch_idx: int) -> None:
                self.seen.setdefault(0, []).extend(batch[2].tolist())

        validating = Validating()
        models.trainer(devices=1).validate(validating, dataloaders=loader)
        assert validating.seen[0] == list(range(400))


class FixedBatches(AutoLoader[Any]):
    """A subclass of the user's whose ``__init__`` takes the arguments Lightning
    rebuilds a loader with, but not all of AutoLoader's."""

    def __init__(
        self,
        dataset: Any,
        batch_size: int | None = 1,
        shuffle: bool | None = None,
        sampler: Any = None,
        batch_sampler: Any = None,
        drop_last: bool = False,
    ) -> None:
        super().__init__(
            dataset, batch_size=batch_size, shuffle=shuffle, sampler=sampler,
            batch_sampler=batch_sampler, drop_last=drop_last, time_budget=2, verbose=False,
        )  # fmt: skip


def test_a_subclass_that_takes_no_tuning_argument_is_rebuilt_as_lightning_can() -> None:
    """Lightning rebuilds a subclass made in a hook from the arguments its ``__init__``
    takes, and refuses others: the copy, given no ``tuning``, tunes on its own."""

    class Hooked(models.Seen):
        def predict_dataloader(self) -> DataLoader[Any]:
            self.made = FixedBatches(IndexedItems(length=32), batch_size=8)
            return self.made

    module = Hooked()
    trainer = models.trainer(devices=1)
    predicted = trainer.predict(module)
    assert torch.cat(predicted).tolist() == list(range(32))
    assert type(trainer.predict_dataloaders) is FixedBatches


def test_every_argument_survives_a_rebuild() -> None:
    """Lightning's rebuild, from the attributes of an AutoLoader made outside a hook,
    gives each argument back, the workers' start method included."""

    def seed_workers(worker_id: int) -> None:
        pass

    def collate(batch: list[Any]) -> Any:
        return torch.utils.data.default_collate(batch)

    generator = torch.Generator().manual_seed(5)
    given: dict[str, Any] = dict(
        batch_size=3, drop_last=True, timeout=7.0, worker_init_fn=seed_workers,
        collate_fn=collate, generator=generator, pin_memory_device="cpu",
        time_budget=4.0, n_trials=9, memory_budget="1GiB", search_space={"num_workers": (1, 2)},
        device="cpu", seed=3,
    )  # fmt: skip
    loader = AutoLoader(
        IndexedItems(length=40), multiprocessing_context="spawn", verbose=False, **given
    )
    copy = lightning_data._update_dataloader(loader, SequentialSampler(loader.dataset))
    assert type(copy) is AutoLoader and copy.tuning is loader.tuning
    for name, value in given.items():
        assert getattr(copy, name) == value, name
    assert copy.multiprocessing_context is loader.multiprocessing_context
    assert copy.multiprocessing_context.get_start_method() == "spawn"
    assert copy.verbose is False and copy.dataset is loader.dataset
    # A copy takes its original's tuned settings; another is refused.
    with pytest.raises(InvalidInputError, match="copy of an AutoLoader"):
        AutoLoader(loader.dataset, batch_size=3, num_workers=2, tuning=loader.tuning)
    with pytest.raises(InvalidInputError, match="starts workers as its original does"):
        AutoLoader(
            loader.dataset, batch_size=3, multiprocessing_context="fork", tuning=loader.tuning
        )


def test_the_loader_the_user_holds_shows_the_setting_its_rebuilt_copy_loads_with() -> None:
    """Lightning trains with its rebuilt copy; the user's own object reports the setting
    that loads the batches, not ``None``."""
    loader = AutoLoader(IndexedItems(length=40), batch_size=4, time_budget=4.0, verbose=False)
    copy = lightning_data._update_dataloader(loader, SequentialSampler(loader.dataset))
    assert loader.setting is None
    epoch = iter(copy)
    try:
        next(epoch)
        assert copy.setting is not None
        assert loader.setting == copy.setting
    finally:
        del epoch
        loader.close()
    assert loader.setting is None  # the copy's epoch is gone


CONTEXT_SCRIPT = textwrap.dedent(
    """
    import json, sys
    import tests.workloads as workloads
    from autoloader import AutoLoader

    if __name__ == "__main__":  # not in a spawned worker, which imports this script
        workloads.PARENT_MARK = 1
        loader = AutoLoader(
            workloads.StartMarkedDataset(length=96, latency=0.004), batch_size=4,
            multiprocessing_context=sys.argv[1], search_space={"num_workers": (1, 2)},
            time_budget=float(sys.argv[2]), verbose=False,
        )
        epochs = range(int(sys.argv[3]))
        rows = [row.tolist() for _ in epochs for batch in loader for row in batch]
        loader.close()
        print(json.dumps({"rows": rows, "trials": [t.params for t in loader.history]}))
    """
)


# Beside two other tests (three at once), the spawned workers of its 6 s budget once
# delivered no batch before their trial ended. Epochs enough for spawn's two workers to
# start while the loop loads in-process (0.4 s an epoch): in a quiet full run, beside
# one other test, 4 ended before they did (2026-11-29); alone, they took over within
# the second epoch. 10 epochs took 11.9 s alone, 4 took 7.5 s.
_CONTEXT_EPOCHS = 10


@pytest.mark.calm
def test_a_multiprocessing_context_starts_every_settings_worker_processes(
    tmp_path: Path,
) -> None:
    """DataLoader takes a start method with workers only; AutoLoader, which chooses
    them, takes it for every setting with worker processes (checked as DataLoader
    checks it): spawned workers do not inherit what the parent set after its imports.
    In a process of its own, which its workers and spawn's helpers leave with it."""
    dataset = IndexedItems(length=16)
    with pytest.raises(ValueError, match="should specify a valid start method"):
        AutoLoader(dataset, batch_size=4, multiprocessing_context="bad")
    with pytest.raises(TypeError, match="should be a valid context"):
        AutoLoader(dataset, batch_size=4, multiprocessing_context=object())
    context = multiprocessing.get_context("spawn")
    # DataLoader's refusal, where a setting without workers may be chosen (nothing would
    # use the context then): PyTorch's own test of it holds for AutoLoader.
    with pytest.raises(ValueError, match=r"multi-process loading \(num_workers > 0\), but got"):
        AutoLoader(dataset, batch_size=4, multiprocessing_context=context)
    workers = {"num_workers": (1, 2)}
    loader = AutoLoader(
        dataset, batch_size=4, multiprocessing_context=context, search_space=workers, verbose=False
    )
    assert loader.multiprocessing_context is context
    with pytest.raises(InvalidInputError, match="at construction"):
        loader.multiprocessing_context = "fork"

    script = tmp_path / "context.py"
    script.write_text(CONTEXT_SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, str(script), "spawn", "6", str(_CONTEXT_EPOCHS)], cwd=ROOT, env=env,
        capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    said = json.loads(done.stdout.splitlines()[-1])
    rows = said["rows"]
    assert sorted(index for index, _, _ in rows) == sorted(list(range(96)) * _CONTEXT_EPOCHS)
    by_workers = [mark for _, in_worker, mark in rows if in_worker]
    assert by_workers, f"no setting with workers loaded a batch: {said['trials']}"
    assert set(by_workers) == {0}, "a worker was forked, not spawned"
    assert {mark for _, in_worker, mark in rows if not in_worker} <= {1}
