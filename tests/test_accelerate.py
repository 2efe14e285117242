"""AutoLoader under real accelerate (``NOTE [ AutoLoader under accelerate ]``):
``autoloader.accelerate.prepare()`` keeps it tuning inside the loader accelerate
prepares, with accelerate's batches, in one process and in a 2-process torchrun job,
and in a Hugging Face Trainer's ``get_train_dataloader()``; accelerate's own
``prepare()`` refuses it, in the user's call, naming that route.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset

import autoloader
import autoloader.accelerate
from autoloader import AutoLoader, InvalidInputError
from tests.lazy import LazyModule, skip_unless_installed

# Imported by the first test that uses it, not at collection, where every pytest-xdist
# worker would hold it for the whole run (tests/lazy.py).
accelerate = LazyModule("accelerate")
pytestmark = skip_unless_installed("accelerate")

ROOT = Path(__file__).resolve().parents[1]
# Items of 3 ms, batches of 4: 24 batches an epoch in one process, 12 in each of two.
ITEMS, BATCH, LATENCY = 96, 4, 0.003
BUDGET = 4.0
# Training stops once tuned (an epoch more) or after this many epochs. The budget is
# measured training time, and a fast setting's epoch of 12 batches takes about 30 ms:
# the 4 s can take 130 epochs and more (60 was too few on CI). A cap, not a goal.
MAX_EPOCHS = 400


class Items(Dataset[torch.Tensor]):
    """Item ``i`` is ``[i]``, after ``LATENCY`` seconds."""

    def __len__(self) -> int:
        return ITEMS

    def __getitem__(self, index: int) -> torch.Tensor:
        time.sleep(LATENCY)
        return torch.tensor([index])


class Stream(IterableDataset[torch.Tensor]):
    def __iter__(self) -> Iterator[torch.Tensor]:
        return iter(torch.arange(ITEMS).view(-1, 1))


def _accelerator(**config: Any) -> Any:
    configuration = accelerate.utils.DataLoaderConfiguration(**config)
    return accelerate.Accelerator(cpu=True, dataloader_config=configuration)


def _epoch(loader: Any) -> list[list[int]]:
    return [batch.view(-1).tolist() for batch in loader]


# The fast tier keeps one sampler; the full suite both.
@pytest.mark.light  # mostly waits
@pytest.mark.parametrize("seedable", [True, pytest.param(False, marks=pytest.mark.slow)])
def test_a_prepared_autoloader_tunes_and_loads_the_batches_accelerate_would(
    seedable: bool,
) -> None:
    """Epoch by epoch, the AutoLoader accelerate prepared loads exactly the batches that
    accelerate's loader for a DataLoader of the same arguments loads, from the same
    random state, while it tunes, and once tuned."""
    accelerator = _accelerator(use_seedable_sampler=seedable)
    model = torch.nn.Linear(1, 1)
    torch.manual_seed(0)
    loader = AutoLoader(Items(), batch_size=BATCH, shuffle=True, time_budget=BUDGET, verbose=False)
    model, prepared = autoloader.accelerate.prepare(accelerator, model, loader)
    tuned: list[list[list[int]]] = []
    try:
        while len(tuned) < MAX_EPOCHS and not (loader.tuned and tuned):
            tuned.append(_epoch(prepared))
        tuned.append(_epoch(prepared))  # with the chosen setting
    finally:
        prepared.close()

    # It tuned: settings with workers loaded batches, and a result came.
    assert loader.tuned, loader.report()
    assert any(record.params["num_workers"] > 0 for record in loader.history)
    # The prepared loader is accelerate's, around the AutoLoader, and answers for it.
    assert type(prepared) is accelerate.data_loader.DataLoaderShard
    assert prepared.base_dataloader is loader
    assert isinstance(prepared, AutoLoader)
    assert prepared.result is loader.result
    assert prepared.device == accelerator.device

    torch.manual_seed(0)
    plain = accelerator.prepare(
        DataLoader(Items(), batch_size=BATCH, shuffle=True), device_placement=[True]
    )
    expected = [_epoch(plain) for _ in tuned]
    assert tuned == expected
    for epoch in tuned:
        assert sorted(i for batch in epoch for i in batch) == list(range(ITEMS))
    assert len(set(map(str, tuned))) > 1  # shuffled anew each epoch


def test_accelerates_own_prepare_refuses_a_tuning_autoloader_naming_the_route() -> None:
    accelerator = _accelerator()
    loader = AutoLoader(Items(), batch_size=BATCH, verbose=False)
    model = torch.nn.Linear(1, 1)
    for call in (
        lambda: accelerator.prepare(model, loader),
        lambda: accelerator.prepare_data_loader(loader),
    ):
        with pytest.raises(InvalidInputError, match=r"autoloader\.accelerate\.prepare\("):
            call()
    assert accelerator._dataloaders == []


def test_an_autoloader_that_does_not_tune_is_prepared_as_a_dataloader() -> None:
    """Untuned, an AutoLoader is the DataLoader of its arguments: accelerate prepares
    it as one, by either route."""
    accelerator = _accelerator()
    loader = AutoLoader(Stream(), batch_size=BATCH, verbose=False)
    assert loader.untuned is not None
    for prepared in (
        accelerator.prepare(loader),
        autoloader.accelerate.prepare(accelerator, loader),
    ):
        assert type(prepared.base_dataloader) is DataLoader
        assert [i for batch in _epoch(prepared) for i in batch] == list(range(ITEMS))


@pytest.mark.parametrize(
    ("config", "words"),
    [
        ({"dispatch_batches": True}, "dispatch_batches=False"),
        ({"use_stateful_dataloader": True}, "use_stateful_dataloader=False"),
    ],
)
def test_configurations_that_would_not_load_by_the_autoloader_are_refused(
    config: dict[str, Any], words: str
) -> None:
    accelerator = _accelerator(**config)
    loader = AutoLoader(Items(), batch_size=BATCH, verbose=False)
    with pytest.raises(InvalidInputError, match=words):
        autoloader.accelerate.prepare(accelerator, loader)
    assert accelerator._dataloaders == []


def test_an_autoloader_told_of_another_device_than_accelerates_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On a GPU (faked: the check comes before accelerate uses the device), an
    AutoLoader must be told the device accelerate moves its batches to."""
    accelerator = _accelerator()
    monkeypatch.setattr(
        accelerate.Accelerator, "device", property(lambda self: torch.device("cuda", 0))
    )
    loader = AutoLoader(Items(), batch_size=BATCH, verbose=False)
    with pytest.raises(InvalidInputError, match=r"device=accelerator\.device"):
        autoloader.accelerate.prepare(accelerator, loader)
    assert accelerator._dataloaders == []
    told = AutoLoader(Items(), batch_size=BATCH, device="cpu", verbose=False)
    with pytest.raises(InvalidInputError, match=r"device=accelerator\.device"):
        autoloader.accelerate.prepare(accelerator, told, device_placement=[True])
    # Not moved by accelerate, its batches stay where they are loaded.
    prepared = autoloader.accelerate.prepare(accelerator, loader, device_placement=[False])
    assert prepared.base_dataloader is loader and prepared.device is None


@pytest.mark.slow
def test_two_processes_tune_together_and_load_every_item_once_an_epoch(tmp_path: Path) -> None:
    """A 2-process torchrun job, DDP on gloo: each process loads its share of every
    epoch, the shares together every item once, and both ranks tune as one."""
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
        "-m", "tests.accelerate_job", str(tmp_path),
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    job = subprocess.run(
        command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=150
    )
    assert job.returncode == 0, (job.stdout + job.stderr)[-3000:]
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]

    first, second = reports
    assert first["result"] is not None and first["result"] == second["result"]
    assert first["settings"] == second["settings"]
    assert any(params["num_workers"] > 0 for params in first["settings"])
    assert first["steps"] == second["steps"]
    assert len(first["epochs"]) == len(second["epochs"]) >= 2
    for mine, theirs in zip(first["epochs"], second["epochs"], strict=True):
        assert len(mine) == len(theirs) == ITEMS // 2
        assert Counter(mine + theirs) == Counter(range(ITEMS))


# A Hugging Face Trainer whose get_train_dataloader() gives an AutoLoader ----------------

# Its steps are slower than the loops' above: the checks and the baseline take longer.
TRAINER_BUDGET = 5.0


class Tokens(Dataset[dict[str, torch.Tensor]]):
    """Token ids made from the index, with the index, after ``LATENCY`` seconds."""

    def __len__(self) -> int:
        return ITEMS

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        time.sleep(LATENCY)
        ids = (torch.arange(12) * (index + 1)) % 64
        return {"input_ids": ids, "labels": ids.clone(), "index": torch.tensor(index)}


def _trainer(tmp_path: Path, route: str, epochs: int) -> Any:
    """A Trainer of a 1-layer GPT-2 made from a config, whose train loader is an
    AutoLoader prepared by ``route``; it records each micro-batch's items."""
    transformers = pytest.importorskip("transformers")

    class AutoLoaderTrainer(transformers.Trainer):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.loaders: list[Any] = []
            self.items: list[int] = []

        def get_train_dataloader(self) -> Any:
            loader = AutoLoader(
                self.train_dataset,
                batch_size=self._train_batch_size,
                shuffle=True,
                collate_fn=self.data_collator,
                time_budget=TRAINER_BUDGET,
                verbose=False,
            )
            self.loaders.append(loader)
            if route == "accelerate":
                return self.accelerator.prepare(loader)
            return autoloader.accelerate.prepare(self.accelerator, loader)

        def training_step(self, model: Any, inputs: dict[str, Any], *args: Any) -> Any:
            self.items += inputs.pop("index").tolist()
            return super().training_step(model, inputs, *args)

    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=64, n_positions=16, n_embd=16, n_layer=1, n_head=2, bos_token_id=0,
        eos_token_id=0,
    )  # fmt: skip
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path),
        per_device_train_batch_size=BATCH,
        num_train_epochs=epochs,
        learning_rate=1e-3,
        seed=0,
        use_cpu=True,
        report_to="none",
        save_strategy="no",
        logging_strategy="no",
        disable_tqdm=True,
    )
    return AutoLoaderTrainer(
        model=transformers.GPT2LMHeadModel(config), args=args, train_dataset=Tokens()
    )


@pytest.mark.slow
def test_a_trainers_autoloader_prepared_by_the_route_tunes_in_train(tmp_path: Path) -> None:
    """get_train_dataloader() gives an AutoLoader through autoloader.accelerate.prepare():
    train() steps through its batches, every item once an epoch, and it tunes (training
    stops at the end of the epoch after the one where it was tuned)."""
    transformers = pytest.importorskip("transformers")
    trainer = _trainer(tmp_path, "autoloader", MAX_EPOCHS)

    class StopOnceTuned(transformers.TrainerCallback):
        def __init__(self) -> None:
            self.tuned_before = False

        def on_epoch_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            (loader,) = trainer.loaders
            control.should_training_stop = self.tuned_before
            self.tuned_before = loader.tuned

    trainer.add_callback(StopOnceTuned())
    try:
        trainer.train()
    finally:
        for loader in trainer.loaders:
            loader.close()
    (loader,) = trainer.loaders
    assert loader.tuned, loader.report()
    assert any(record.params["num_workers"] > 0 for record in loader.history)
    epochs, rest = divmod(len(trainer.items), ITEMS)
    assert rest == 0 and 2 <= epochs < MAX_EPOCHS
    per_epoch = [trainer.items[e * ITEMS : (e + 1) * ITEMS] for e in range(epochs)]
    for items in per_epoch:
        assert sorted(items) == list(range(ITEMS))
    assert len({tuple(items) for items in per_epoch}) == epochs  # shuffled anew each epoch


@pytest.mark.slow  # over 2.5 s here: the full suite's (docs/development/checks.md)
def test_a_trainers_autoloader_given_to_accelerate_is_refused_when_train_starts(
    tmp_path: Path,
) -> None:
    trainer = _trainer(tmp_path, "accelerate", 1)
    with pytest.raises(
        InvalidInputError, match=r"autoloader\.accelerate\.prepare\(self\.accelerator"
    ):
        trainer.train()
    assert trainer.items == []
