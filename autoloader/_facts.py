"""Facts about the dataset and the machine that the report's advice rests on.

Measured once, before the search, and saved with the result (``TuneResult.facts``):

- ``dataset_length``: items in the dataset, or ``None`` without ``__len__``.
- ``shm_bytes``: size of ``/dev/shm``, where workers put the tensors of the batches they
  hand over, or ``None`` where there is none.
- ``random_items``: two reads of item 0 in this process differ (random augmentations),
  or ``None`` if not checked (an iterable dataset).
- ``workers_repeat_randomness``: with ``random_items``, the first read of item 0 in two
  different workers gave the same result. A dataset that holds its own random generator
  (``self.rng = np.random.default_rng()``) has it copied into every worker, so the
  workers draw the same "random" numbers; ``None`` if not checked.
"""

from __future__ import annotations

import contextlib
import shutil
import warnings
from collections.abc import Mapping
from typing import Any

from torch.utils.data import DataLoader, Dataset, IterableDataset, default_collate

from autoloader._batching import same_batch

# Options of the user's loader that decide how workers start and read.
_WORKER_OPTIONS = ("worker_init_fn", "multiprocessing_context", "collate_fn")


def dataset_facts(
    dataset: Dataset[Any], dataset_length: int | None, fixed: Mapping[str, Any]
) -> dict[str, Any]:
    """Measure the facts of the module docstring; none of them raises."""
    random_items = _random_items(dataset, dataset_length)
    return {
        "dataset_length": dataset_length,
        "shm_bytes": shm_bytes(),
        "random_items": random_items,
        "workers_repeat_randomness": (
            _workers_repeat_randomness(dataset, fixed) if random_items else None
        ),
    }


def shm_bytes() -> int | None:
    try:
        return shutil.disk_usage("/dev/shm").total
    except OSError:
        return None


def _random_items(dataset: Dataset[Any], dataset_length: int | None) -> bool | None:
    if isinstance(dataset, IterableDataset) or not dataset_length:
        return None
    try:  # collated, so that numpy arrays and numbers compare as tensors
        first, second = default_collate([dataset[0]]), default_collate([dataset[0]])
    except Exception:  # the baseline reports a broken dataset properly
        return None
    return not same_batch(first, second)


def _workers_repeat_randomness(dataset: Dataset[Any], fixed: Mapping[str, Any]) -> bool | None:
    """Read item 0 first in each of two workers and compare what they returned."""
    options = {k: fixed[k] for k in _WORKER_OPTIONS if k in fixed}
    loader = DataLoader(dataset, batch_size=1, sampler=[0, 0], num_workers=2, **options)
    iterator = None
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="This DataLoader will create")
            iterator = iter(loader)
            first, second = next(iterator), next(iterator)
    except Exception:
        return None
    finally:
        with contextlib.suppress(Exception):
            iterator._shutdown_workers()  # type: ignore[union-attr,attr-defined]
    return bool(same_batch(first, second))
