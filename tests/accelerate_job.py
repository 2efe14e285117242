"""A training script for tests/test_accelerate.py: an ``AutoLoader`` prepared by
``autoloader.accelerate.prepare()`` with a DDP model, under torchrun on the CPU.

Run as ``torchrun --standalone --nproc_per_node=N -m tests.accelerate_job OUT``; each
rank writes to ``OUT/rank<r>.json`` the items of each epoch's batches, in order, the
loader's tuning (its trials' settings and its result) and its steps.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import DataLoaderConfiguration

import autoloader
import autoloader.accelerate
from tests.test_accelerate import BATCH, BUDGET, MAX_EPOCHS, Items


def main(out: Path) -> int:
    accelerator = Accelerator(
        cpu=True, dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True)
    )
    torch.manual_seed(0)
    model = torch.nn.Linear(1, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    loader = autoloader.AutoLoader(
        Items(), batch_size=BATCH, shuffle=True, time_budget=BUDGET, verbose=False
    )
    model, optimizer, loader = autoloader.accelerate.prepare(accelerator, model, optimizer, loader)
    epochs: list[list[int]] = []
    steps = 0
    # Tuned, then one epoch more with the chosen setting.
    while len(epochs) < MAX_EPOCHS and (not epochs or not loader.tuned or len(epochs) < 2):
        was_tuned = loader.tuned
        items: list[int] = []
        for batch in loader:
            items += batch.view(-1).tolist()
            loss = model(batch.float()).sum()
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            steps += 1
        epochs.append(items)
        if was_tuned:
            break
    report = {
        "rank": accelerator.process_index,
        "epochs": epochs,
        "steps": steps,
        "settings": [record.params for record in loader.history],
        "result": None if loader.result is None else loader.result.params,
    }
    loader.close()
    (out / f"rank{accelerator.process_index}.json").write_text(json.dumps(report))
    accelerator.end_training()
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1])))
