"""tune_trainer() on real Hugging Face Trainers: training after it ends with the same
weights, bit for bit, as without it, with the tuned loader; a saved result is reused;
what it cannot tune is refused before any trial.

The model is a 2-layer GPT-2 built from a config (dropout on: the random stream
matters), the items are made from their index, nothing is downloaded.
"""

from __future__ import annotations

import functools
import logging
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch
from torch.utils.data import Dataset, IterableDataset

import autoloader
import autoloader.transformers as hf
from autoloader import InvalidInputError
from autoloader.loader._torch_compat import shutdown_workers
from autoloader.transformers import tune_trainer
from tests.lazy import LazyModule, skip_unless_installed

# Imported by the first test that uses it, not at collection, where every pytest-xdist
# worker would hold it for the whole run (tests/lazy.py). The Trainer needs accelerate.
transformers = LazyModule("transformers")
pytestmark = skip_unless_installed("transformers", "accelerate")

# Items of 4 ms, batches of 4: loading a batch takes about as long as a step here, so
# workers pay; 24 batches an epoch, so a trial has batches to time.
ITEMS, BATCH, LATENCY = 96, 4, 0.004
# Into the second epoch: its first draws are where a loader's persistence shows.
STEPS, EPOCHS = ITEMS // BATCH + 4, 2
BUDGET = 4.5


class SlowTokens(Dataset[dict[str, torch.Tensor]]):
    """Token ids made from the index (no random draw), each item ``LATENCY`` seconds;
    records the threads that read it."""

    def __init__(self, latency: float = LATENCY) -> None:
        self.latency = latency
        self.readers: set[str] = set()

    def __len__(self) -> int:
        return ITEMS

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        time.sleep(self.latency)
        self.readers.add(threading.current_thread().name)
        ids = (torch.arange(12) * (index + 1)) % 64
        return {"input_ids": ids, "labels": ids.clone()}


class Stream(IterableDataset[dict[str, torch.Tensor]]):
    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        for index in range(ITEMS):
            ids = torch.arange(12) * index % 64
            yield {"input_ids": ids, "labels": ids}


class _SpyEvents:
    """The loader train() iterates, and the processes it starts while it does."""

    def __init__(self) -> None:
        self.loader: Any = None
        self.before: set[int] = set()
        self.workers: set[int] = set()

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.loader = kwargs["train_dataloader"]
        self.before = {p.pid for p in psutil.Process().children()}

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.workers |= {p.pid for p in psutil.Process().children()} - self.before


def _spy() -> Any:
    """A ``TrainerCallback`` that records as :class:`_SpyEvents` says."""
    return type("Spy", (_SpyEvents, transformers.TrainerCallback), {})()


def _trainer(
    tmp_path: Path, dataset: Any = None, *, spy: _SpyEvents | None = None, **arguments: Any
) -> Any:
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2, bos_token_id=0,
        eos_token_id=0,
    )  # fmt: skip
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path),
        per_device_train_batch_size=BATCH,
        max_steps=STEPS,
        learning_rate=1e-3,
        seed=0,
        use_cpu=True,
        report_to="none",
        save_strategy="no",
        logging_strategy="no",
        disable_tqdm=True,
        **arguments,
    )
    return transformers.Trainer(
        model=transformers.GPT2LMHeadModel(config),
        args=args,
        train_dataset=SlowTokens() if dataset is None else dataset,
        callbacks=[spy] if spy is not None else None,
    )


def _weights(trainer: Any) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in trainer.model.named_parameters()}


_UNTUNED: dict[str, dict[str, torch.Tensor]] = {}


def _untuned(arguments: dict[str, Any], tmp_path: Path) -> dict[str, torch.Tensor]:
    """The weights train() ends with, without tune_trainer(); once per arguments."""
    key = repr(sorted(arguments.items()))
    if key not in _UNTUNED:
        spy = _spy()
        trainer = _trainer(tmp_path, spy=spy, **arguments)
        start = _weights(trainer)
        trainer.train()
        _release(spy.loader)
        trained = _weights(trainer)
        assert any(not torch.equal(start[n], trained[n]) for n in start), "nothing trained"
        _UNTUNED[key] = trained
    return _UNTUNED[key]


def _release(loader: Any) -> None:
    """Stop the persistent workers train() leaves running (as it does untuned): they
    end with their loader, which the Trainer's reference cycles keep until the garbage
    collector runs, and then after seconds of waiting."""
    shutdown_workers(None, loader.base_dataloader)


PROCESSES = {"worker_kind": "processes", "worker_threads": None}
# The search space, and the TrainingArguments of both runs.
ROUTES: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    # worker processes, not persistent: the TrainingArguments can say it
    "arguments": ({**PROCESSES, "persistent_workers": False}, {}),
    # persistent workers where the Trainer's loader had none: a loader that draws as it would
    "persistent": ({**PROCESSES, "persistent_workers": True}, {}),
    # threads where the Trainer's loader had a persistent worker process, and a sampler
    # that draws its permutation from the global generator
    "threads": (
        {"worker_kind": "threads"},
        {
            "dataloader_num_workers": 1,
            "dataloader_persistent_workers": True,
            "accelerator_config": {"use_seedable_sampler": False},
        },
    ),
}


@pytest.fixture
def one_torch_thread() -> Iterator[None]:
    """Torch's intra-op threads at one while the test runs. Beside three torch processes
    of two threads each and a busy loop (a full run's neighbours), this GPT-2's step took
    118-121 ms (median; at most 0.85-1.03 s) on two threads, 26-30 ms (at most 48-58 ms)
    on one: OpenMP's threads wait for each other where 2 CPUs hold more threads than
    that. A baseline batch past its 3 s failed the test once in a full run."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


# The fast tier keeps the first route; the full suite every one.
@pytest.mark.usefixtures("one_torch_thread")
@pytest.mark.parametrize(
    "route",
    [next(iter(ROUTES)), *(pytest.param(r, marks=pytest.mark.slow) for r in list(ROUTES)[1:])],
)
def test_training_after_tuning_is_bit_identical_and_uses_the_tuned_loader(
    route: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    space, arguments = ROUTES[route]
    untuned = _untuned(arguments, tmp_path_factory.mktemp("untuned"))
    spy = _spy()
    trainer = _trainer(tmp_path_factory.mktemp("tuned"), spy=spy, **arguments)
    before = _weights(trainer)
    threads = torch.get_num_threads()

    result = tune_trainer(trainer, time_budget=BUDGET, search_space=space, show_progress=False)
    # The tuned threads are the process's for train(), whose sums they may order
    # otherwise: the bit-for-bit comparison trains on the threads the untuned run had.
    assert torch.get_num_threads() == (result.params["step_threads"] or threads)
    torch.set_num_threads(threads)

    # Tuning left the model and the Trainer as they were.
    assert all(torch.equal(before[n], p) for n, p in trainer.model.named_parameters())
    assert trainer.optimizer is None and trainer.lr_scheduler is None
    assert "current_gradient_accumulation_steps" not in vars(trainer)
    assert trainer.accelerator._dataloaders == []

    dataset = trainer.train_dataset
    dataset.readers.clear()
    trainer.train()
    _release(spy.loader)

    tuned = _weights(trainer)
    different = [name for name in untuned if not torch.equal(untuned[name], tuned[name])]
    assert not different, f"{route}: {result.params} changed {different}"

    # The loader train() iterated is the tuned one.
    params = result.params
    base = spy.loader.base_dataloader
    assert base.num_workers == params["num_workers"]
    assert isinstance(base, autoloader.ThreadLoader) == (params["worker_kind"] == "threads")
    if params["worker_kind"] == "threads":
        assert {n for n in dataset.readers if n.startswith("autoloader-thread-worker-")}
    else:
        assert bool(base.persistent_workers) == params["persistent_workers"]
        epochs = 1 if params["persistent_workers"] else EPOCHS  # workers started anew each
        assert len(spy.workers) == params["num_workers"] * epochs
    if route == "arguments":  # said by the TrainingArguments, not by a loader of ours
        assert "get_train_dataloader" not in vars(trainer)
        assert trainer.args.dataloader_num_workers == params["num_workers"]
        assert type(base) is torch.utils.data.DataLoader


# The reuse check times the saved setting against the defaults' loop: beside other
# tests and a busy loop it found the setting slower and tuned again; alone beside a busy
# loop, at 4 ms items, so did a full run (2 thread workers tuned, 1 on the tune again).
# At 0.5 ms the step outweighs loading: what is checked is that the file is reused.
_REUSED_LATENCY = 0.0005


@pytest.mark.alone
@pytest.mark.slow  # over 2.5 s here: the full suite's (docs/development/checks.md)
def test_a_saved_result_is_reused_without_tuning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # The reuse check's readings (the defaults' loop, the CPUs others used) are logged
    # at INFO: a failure shows them.
    caplog.set_level(logging.INFO, logger="autoloader")
    path = tmp_path / "loader.json"
    space = {"worker_kind": "threads"}
    first = tune_trainer(
        _trainer(tmp_path, SlowTokens(_REUSED_LATENCY)),
        time_budget=BUDGET,
        path=path,
        search_space=space,
        show_progress=False,
    )
    assert path.exists()

    spy = _spy()
    trainer = _trainer(tmp_path, SlowTokens(_REUSED_LATENCY), spy=spy)
    again = tune_trainer(
        trainer, time_budget=BUDGET, path=path, search_space=space, show_progress=False
    )

    assert again.params == first.params
    # The trials and the tuning time are the saved ones: nothing ran.
    assert again.trials == first.trials
    assert again.tuning_seconds == first.tuning_seconds
    trainer.train()
    assert spy.loader.base_dataloader.num_workers == first.params["num_workers"]


def test_tuning_steps_the_optimizer_once_per_accumulated_batches(tmp_path: Path) -> None:
    trainer = _trainer(tmp_path, gradient_accumulation_steps=2)
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(BATCH)])
    stepped_at: list[int] = []
    with hf._training(trainer) as step:
        assert trainer.current_gradient_accumulation_steps == 2  # training_step() divides by it
        optimizer_step = step.optimizer.step

        def counted(*args: Any, **kwargs: Any) -> Any:
            stepped_at.append(step.micro_batches)
            return optimizer_step(*args, **kwargs)

        step.optimizer.step = counted
        for _ in range(5):
            step(batch)
    assert stepped_at == [2, 4]
    # The temporary optimizer is gone: train() makes its own.
    assert trainer.optimizer is None
    assert "current_gradient_accumulation_steps" not in vars(trainer)


def _refused(trainer: Any, monkeypatch: pytest.MonkeyPatch, **kwargs: Any) -> str:
    """The message tune_trainer() refuses ``trainer`` with, before any trial."""

    def no_tuning(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("tune() was called")

    # The same signature: tune_trainer() checks its arguments against it.
    monkeypatch.setattr(hf, "tune", functools.wraps(hf.tune)(no_tuning))
    with pytest.raises(InvalidInputError) as refused:
        tune_trainer(trainer, time_budget=BUDGET, **kwargs)
    # Nothing left behind.
    if trainer is not None:
        assert trainer.optimizer is None
        assert "current_gradient_accumulation_steps" not in vars(trainer)
        assert trainer.accelerator._dataloaders == []
    return str(refused.value)


def test_a_trainer_without_a_train_dataset_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    trainer = _trainer(tmp_path)
    trainer.train_dataset = None
    assert "no train_dataset" in _refused(trainer, monkeypatch)


@pytest.mark.parametrize(("package", "old"), [("transformers", "4.45.2"), ("accelerate", "1.0.1")])
def test_versions_below_the_floor_are_refused(
    package: str, old: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = hf._installed_version
    monkeypatch.setattr(hf, "_installed_version", lambda n: old if n == package else real(n))
    message = _refused(None, monkeypatch)
    assert f"{package}>=" in message and old in message


def test_a_dispatched_iterable_dataset_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # accelerate dispatches an IterableDataset's batches from one process by default.
    trainer = _trainer(tmp_path, Stream())
    assert "dispatch_batches" in _refused(trainer, monkeypatch)


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"search_space": {"batched_fetch": True}}, "batched_fetch"),
        ({"batch_size": 8}, "from the Trainer"),
        ({"epochs": 3}, "does not take"),
    ],
)
def test_arguments_that_cannot_apply_are_refused(
    kwargs: dict[str, Any], words: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert words in _refused(_trainer(tmp_path), monkeypatch, **kwargs)


@pytest.mark.slow  # over 2.5 s here: the full suite's (docs/development/checks.md)
def test_importing_autoloader_imports_no_framework() -> None:
    code = (
        "import sys, autoloader, autoloader.transformers, autoloader.accelerate\n"
        "print(sorted(m for m in ('transformers', 'accelerate', 'lightning')"
        " if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    ).stdout
    assert out.strip() == "[]"
