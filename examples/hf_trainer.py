"""A Hugging Face Trainer whose train loader is tuned before it trains: ``tune_trainer``.

The dataset reads token ids that each wait 3 ms (a read from remote storage), and the
TrainingArguments say nothing of workers, as most do. ``tune_trainer`` tunes the
Trainer's own loader (its dataset, collator, batch size and sampler) with the Trainer's
real training step, then ``train()`` trains with the tuned settings. A second run with
the same ``--out`` file reuses them, once a short trial agrees, and searches nothing.
The model is a 2-layer GPT-2 built from a config: nothing is downloaded.

    python examples/hf_trainer.py [--time-budget 10] [--steps 60] [--out hf_trainer.json]

Needs ``pip install 'torch-autoloader[transformers]'``.
"""

from __future__ import annotations

import argparse
import logging
import tempfile
import time
from typing import Any

import torch
import transformers
from torch.utils.data import Dataset

import autoloader
from autoloader.transformers import tune_trainer

ITEM_LATENCY = 0.003
SEQUENCE = 32


class RemoteTokens(Dataset[dict[str, torch.Tensor]]):
    def __init__(self, length: int) -> None:
        self.length = length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        time.sleep(ITEM_LATENCY)
        ids = (torch.arange(SEQUENCE) * (index + 1)) % 256
        return {"input_ids": ids, "labels": ids.clone()}


class TrainTimer(transformers.TrainerCallback):
    """How long train() took, and the loader it iterated."""

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.loader = kwargs["train_dataloader"]
        self.started = time.perf_counter()

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.seconds = time.perf_counter() - self.started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--time-budget", type=float, default=10.0)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--items", type=int, default=1024)
    parser.add_argument("--out", default="hf_trainer.json")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    transformers.logging.set_verbosity_warning()

    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=256, n_positions=SEQUENCE, n_embd=64, n_layer=2, n_head=4,
        bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    timer = TrainTimer()
    with tempfile.TemporaryDirectory() as output_dir:
        training = transformers.TrainingArguments(
            output_dir=output_dir, per_device_train_batch_size=16, max_steps=args.steps,
            use_cpu=True, report_to="none", save_strategy="no", logging_strategy="no",
            disable_tqdm=True, seed=0,
        )  # fmt: skip
        trainer = transformers.Trainer(
            model=transformers.GPT2LMHeadModel(config),
            args=training,
            train_dataset=RemoteTokens(args.items),
            callbacks=[timer],
        )
        result = tune_trainer(trainer, time_budget=args.time_budget, path=args.out)
        trainer.train()
    print(autoloader.report(result))
    loader = timer.loader.base_dataloader  # inside the one accelerate prepared
    kind = "thread" if isinstance(loader, autoloader.ThreadLoader) else "process"
    print(
        f"train() loaded with {loader.num_workers} {kind} workers: {args.steps} steps in "
        f"{timer.seconds:.1f} s"
    )


if __name__ == "__main__":
    main()
