"""The copy-on-read probe on datasets that copy their parent's pages, and on datasets
that only allocate or cache: what it measures per item, and whether the report advises.

Each dataset has read one item in this process first, as ``tune()`` has before its
probe runs (so a cache made in ``__init__`` or on a first read lives in the parent).

    python benchmarks/copy_on_read.py [--data DIR]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import ConcatDataset, Dataset, TensorDataset

from autoloader.checks._copy_on_read import copied_per_worker
from autoloader.checks._facts import Checks
from autoloader.measure._units import format_bytes


class Records(Dataset[torch.Tensor]):
    """A list of dicts of Python objects, as a dataset parsed from JSON is."""

    def __init__(self, length: int) -> None:
        self.records = [
            {"id": i, "name": f"record-{i}", "values": [float(i + k) for k in range(16)]}
            for i in range(length)
        ]

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.tensor(self.records[index]["values"])


class Memo(Dataset[np.ndarray]):
    """Keeps every item it makes: it grows, but copies nothing of its parent's."""

    def __init__(self, length: int) -> None:
        self.length = length
        self.cache: dict[int, np.ndarray] = {}

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> np.ndarray:
        if index not in self.cache:
            self.cache[index] = np.full(2048, float(index))
        return self.cache[index]


class RewrittenCache(Dataset[np.ndarray]):
    """A 32 MiB buffer made in ``__init__``, rewritten slot by slot: a one-off copy."""

    def __init__(self, length: int) -> None:
        self.length = length
        self.buffer = np.ones((512, 8192))

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> np.ndarray:
        slot = index % len(self.buffer)
        self.buffer[slot] = index
        return self.buffer[slot, :4].copy()


def main() -> None:
    # Here, not at the top: the tests import this module's datasets as benchmarks.*.
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from pipelines import SMALL, build

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    default_data = Path(tempfile.gettempdir()) / "autoloader-corpus-small"
    parser.add_argument("--data", type=Path, default=default_data)
    args = parser.parse_args()
    datasets: list[tuple[str, Any]] = [
        ("200,000 dicts (Python objects)", Records(200_000)),
        ("TensorDataset 200,000 x 16", TensorDataset(torch.randn(200_000, 16))),
        ("memo cache (16 KiB new per item)", Memo(20_000)),
        ("32 MiB cache rewritten in place", RewrittenCache(20_000)),
    ]
    for name in ("images", "hf-text", "hdf5", "hdf5-open-in-init"):
        pipeline = build(name, args.data, SMALL)
        # The probe reads datasets of 1,000 items or more.
        dataset = pipeline.dataset
        repeats = -(-1000 // len(dataset))
        datasets.append((f"{name} (corpus)", ConcatDataset([dataset] * repeats)))
    print(f"{'dataset':<36} {'copied per item':>16} {'items':>6} {'seconds':>8}  advice")
    for name, dataset in datasets:
        dataset[0]
        started = time.perf_counter()
        checks = Checks(dataset, {}, batch_size=1, seconds=10.0)
        facts = checks.copy_on_read(len(dataset), start_method="fork")
        seconds = time.perf_counter() - started
        per_worker = copied_per_worker(facts)
        advice = f"each worker copies {format_bytes(per_worker)}" if per_worker else "none"
        per_item = facts["copy_on_read"]
        shown = format_bytes(per_item) if per_item is not None else str(checks.missing)
        print(
            f"{name:<36} {shown:>16} {facts['copy_on_read_items'] or 0:>6} {seconds:>8.1f}  "
            f"{advice}"
        )


if __name__ == "__main__":
    main()
