"""LoaderTuner in real Lightning fits: the fit trains with the tuned loader, bit for bit
as without the tuner, reuses a saved result, and refuses what it cannot tune."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from autoloader import InvalidInputError
from tests.lazy import LazyModule

# Imported by the tests that use them (tests/lazy.py): each is skipped without Lightning.
pl = LazyModule("lightning.pytorch")
adapter = LazyModule("autoloader.lightning")
models = LazyModule("tests.lightning_models")

pytestmark = pytest.mark.late  # imports Lightning (tests/seats.py)

ROOT = Path(__file__).resolve().parents[1]


class SlowItems(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Deterministic items that take ``latency`` seconds each: a loader with workers
    pays."""

    def __init__(self, length: int = 192, latency: float = 0.002) -> None:
        self.length, self.latency = length, latency

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        time.sleep(self.latency)
        x = torch.arange(8, dtype=torch.float32) * (index % 7) / 7
        return x, x.sum(dim=0, keepdim=True)


def _fit(callbacks: list[Any], *, epochs: int = 2) -> tuple[Any, Any]:
    pl.seed_everything(0, verbose=False)
    model = models.Regression()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=epochs,
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model)
    return model, trainer


def test_a_fit_with_the_tuner_trains_bit_for_bit_as_without_it_with_the_tuned_loader(
    tmp_path: Path,
) -> None:
    plain, plain_trainer = _fit([])
    torch_threads = torch.get_num_threads()

    path = tmp_path / "loader.json"
    tuner = adapter.LoaderTuner(time_budget=8, path=path, show_progress=False)
    tuned, trainer = _fit([tuner])
    result = tuner.result
    assert result is not None
    assert result.params["num_workers"] > 0, "a latency-bound dataset wants workers"
    used = trainer.train_dataloader
    assert used.num_workers == result.params["num_workers"]
    threads = result.params["worker_kind"] == "threads"
    assert type(used).__name__ == ("DrawingThreadLoader" if threads else "DrawingLoader")
    assert used.persistent_workers == result.params["persistent_workers"]
    for (name, a), b in zip(plain.state_dict().items(), tuned.state_dict().values(), strict=True):
        assert torch.equal(a, b), f"{name} differs after a fit with the tuner"
    assert trainer.global_step == plain_trainer.global_step
    assert trainer.callback_metrics["loss_epoch"] == plain_trainer.callback_metrics["loss_epoch"]
    assert tuned.epoch_losses == plain.epoch_losses  # each epoch's own batches only
    assert trainer.fit_loop._data_source is not None
    assert type(trainer.fit_loop._data_source).__name__ == "_DataLoaderSource"  # given back
    assert torch.get_num_threads() == torch_threads  # the tuned step_threads: the fit's only
    assert json.loads(path.read_text())["params"] == result.params

    # The same problem again: the file's settings, no tuning, the same training.
    again = adapter.LoaderTuner(time_budget=8, path=path, show_progress=False)
    reused, _ = _fit([again])
    assert again.result is not None
    assert again.result.tuning_seconds == result.tuning_seconds
    for a, b in zip(plain.state_dict().values(), reused.state_dict().values(), strict=True):
        assert torch.equal(a, b)


def test_what_the_tuner_cannot_tune_is_refused_before_any_trial() -> None:
    with pytest.raises(InvalidInputError, match="takes 'batch_size' from the fit"):
        adapter.LoaderTuner(batch_size=8)
    with pytest.raises(InvalidInputError, match="cannot pass 'isolation'"):
        adapter.LoaderTuner(isolation="subprocess")
    with pytest.raises(InvalidInputError, match=r"'n_trail', which autoloader\.tune"):
        adapter.LoaderTuner(n_trail=5)
    with pytest.raises(InvalidInputError, match="num_workers"):
        adapter.LoaderTuner(search_space={"num_workers": (4, 2)})
    with pytest.raises(InvalidInputError, match=r"Lightning 2\.6 or later; this is 2\.5\.2"):
        adapter.check_version("2.5.2")
    adapter.check_version("2.6.6")
    adapter.check_version("3.0.0rc1")

    class NoLoader(models.Regression):
        train_dataloader = pl.LightningModule.train_dataloader  # type: ignore[assignment]

    class BatchSamplerLoader(models.Regression):
        def train_dataloader(self) -> DataLoader[Any]:
            items = SlowItems(latency=0)
            sampler = torch.utils.data.BatchSampler(range(len(items)), 8, drop_last=False)
            return DataLoader(items, batch_sampler=sampler)

    class Unsharded(torch.utils.data.IterableDataset[torch.Tensor]):
        """Every worker yields every item: DataLoader would repeat them."""

        def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
            return (SlowItems(latency=0)[i] for i in range(64))

    class UnshardedLoader(models.Regression):
        def train_dataloader(self) -> DataLoader[Any]:
            return DataLoader(Unsharded(), batch_size=8)

    class IteratorStep(models.Regression):
        def training_step(self, dataloader_iter: Iterator[Any]) -> torch.Tensor:  # type: ignore[override]
            return super().training_step(next(dataloader_iter), 0)

    for model, message in [
        (NoLoader(), "define no train_dataloader"),
        (IteratorStep(), "takes dataloader_iter"),
        (BatchSamplerLoader(), "made with batch_size"),
        (UnshardedLoader(), "repeat"),
    ]:
        trainer = pl.Trainer(
            accelerator="cpu", max_epochs=1, callbacks=[adapter.LoaderTuner(time_budget=5)],
            logger=False, enable_checkpointing=False, enable_progress_bar=False,
        )  # fmt: skip
        with pytest.raises(InvalidInputError, match=message):
            trainer.fit(model)


def test_a_lightning_without_an_internal_the_tuner_uses_is_named_before_any_trial(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    trainer = pl.Trainer(
        accelerator="cpu", max_epochs=1, callbacks=[adapter.LoaderTuner(time_budget=5)],
        logger=False, enable_checkpointing=False, enable_progress_bar=False,
    )  # fmt: skip
    # As in a Lightning whose training epoch loop builds a step's arguments elsewhere.
    monkeypatch.delattr(type(trainer.fit_loop.epoch_loop), "_build_kwargs")
    with pytest.raises(
        InvalidInputError,
        match=r"lightning \S+ has no Trainer\.fit_loop\.epoch_loop\._build_kwargs\. Install",
    ):
        trainer.fit(models.Regression())


def test_tuning_steps_accumulate_gradients_as_the_fit_does() -> None:
    class Probe(pl.Callback):
        """Runs four tuning steps at the fit's start, counting optimizer steps."""

        def on_fit_start(self, trainer: Any, module: Any) -> None:
            optimizer = trainer.optimizers[0]
            real, self.stepped = optimizer.step, []
            step = adapter._TrainingStep(trainer, module)

            def counted(*args: Any, **kwargs: Any) -> Any:
                self.stepped.append(step.batches)
                return real(*args, **kwargs)

            optimizer.step = counted
            batch = next(iter(DataLoader(SlowItems(latency=0), batch_size=8)))
            for _ in range(4):
                step(batch)
            optimizer.step = real
            self.ready = trainer.fit_loop.epoch_loop.batch_progress.current.ready

    probe = Probe()
    trainer = pl.Trainer(
        accelerator="cpu", max_steps=1, accumulate_grad_batches=2, callbacks=[probe],
        logger=False, enable_checkpointing=False, enable_progress_bar=False,
    )  # fmt: skip
    trainer.fit(models.Regression())
    assert probe.stepped == [1, 3]  # after the 2nd and 4th batches
    assert probe.ready == 4


def test_ctrl_c_while_tuning_stops_the_fit(monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.test_result import _result

    interrupted = dataclasses.replace(_result(), partial=True)
    monkeypatch.setattr("autoloader.lightning.tune", lambda *args, **kwargs: interrupted)
    tuner = adapter.LoaderTuner(time_budget=5)
    trainer = pl.Trainer(
        accelerator="cpu", max_epochs=1, callbacks=[tuner], logger=False,
        enable_checkpointing=False, enable_progress_bar=False,
    )  # fmt: skip
    sigint = signal.getsignal(signal.SIGINT)
    try:
        # Lightning ends a fit interrupted by Ctrl-C with exit code 1.
        with pytest.raises(SystemExit):
            trainer.fit(models.Regression())
    finally:
        signal.signal(signal.SIGINT, sigint)  # Lightning ignores Ctrl-C after one
    assert tuner.result is interrupted
    assert trainer.global_step == 0


def test_a_fast_dev_run_is_not_tuned() -> None:
    tuner = adapter.LoaderTuner(time_budget=5)
    trainer = pl.Trainer(
        accelerator="cpu", fast_dev_run=2, callbacks=[tuner], logger=False,
        enable_progress_bar=False,
    )  # fmt: skip
    with pytest.warns(UserWarning, match="does not tune this fit: fast_dev_run"):
        trainer.fit(models.Regression())
    assert tuner.result is None


DDP_SCRIPT = textwrap.dedent(
    """
    import json, sys
    from pathlib import Path
    import torch
    import lightning.pytorch as pl
    from autoloader.lightning import LoaderTuner
    from tests.lightning_models import Regression

    def fit(callbacks):
        pl.seed_everything(0, verbose=False)
        model = Regression()
        trainer = pl.Trainer(
            accelerator="cpu", devices=2, strategy="ddp", max_epochs=2, callbacks=callbacks,
            logger=False, enable_checkpointing=False, enable_progress_bar=False,
            enable_model_summary=False,
        )
        trainer.fit(model)
        return model, trainer

    plain, _ = fit([])
    tuner = LoaderTuner(time_budget=6, show_progress=False)
    tuned, trainer = fit([tuner])
    used = trainer.train_dataloader
    out = Path(sys.argv[1]) / f"rank{trainer.global_rank}.json"
    out.write_text(json.dumps({
        "rank": trainer.global_rank,
        "params": tuner.result.params,
        "ranks": tuner.result.environment.world_size,
        "used_workers": used.num_workers,
        "sampler": type(used.sampler).__name__,
        "same_weights": all(torch.equal(a, b) for a, b in
                            zip(plain.state_dict().values(), tuned.state_dict().values())),
    }))
    """
)


@pytest.mark.slow
def test_a_ddp_fit_tunes_every_rank_together(tmp_path: Path) -> None:
    script = tmp_path / "ddp_fit.py"
    script.write_text(DDP_SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, str(script), str(tmp_path)], cwd=ROOT, env=env, capture_output=True,
        text=True, timeout=150,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    said = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    assert [s["rank"] for s in said] == [0, 1]
    assert said[0]["params"] == said[1]["params"], "every rank trains with the same settings"
    for rank in said:
        assert rank["ranks"] == 2
        assert rank["used_workers"] == rank["params"]["num_workers"]
        assert rank["sampler"] == "DistributedSampler"
        assert rank["same_weights"], f"rank {rank['rank']}: the weights differ with the tuner"
