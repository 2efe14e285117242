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
- ``copy_on_read``: with fork, bytes of private memory a forked process gains per item
  it reads for the first time (see ``NOTE [ Copy-on-read probe ]``), and
  ``copy_on_read_items``, how many items that was measured over; ``None`` if not
  measured (another start method, an iterable dataset, fewer than 1,000 items);
  ``process_bytes``, this process's resident memory then, which bounds the copy.

NOTE [ Copy-on-read probe ]
A forked worker shares its parent's pages until it writes to one. Reading a Python
object writes its reference count, so a worker that reads a list of Python objects
copies, page by page, the part of the dataset it reads: over an epoch, each worker can
end up with its own copy. The memory watchdog cannot tell this slow growth from noise
in a trial of a few seconds, so it is measured directly: a forked process reads a few
items (a quarter second at most) to warm the allocator up, then fresh items for up to
half a second (pass A), then the same items again (pass B), reading its private memory
(USS) between passes.
Copy-on-read grows in A only; a leak grows in both; the allocator's reuse in neither.
The per-item copy is ``(A - B) / items``.
"""

from __future__ import annotations

import contextlib
import math
import multiprocessing
import shutil
import time
import warnings
from collections.abc import Mapping
from multiprocessing.connection import Connection
from typing import Any

import numpy as np
import psutil
from torch.utils.data import DataLoader, Dataset, IterableDataset, default_collate

from autoloader._batching import same_batch

# Options of the user's loader that decide how workers start and read.
_WORKER_OPTIONS = ("worker_init_fn", "multiprocessing_context", "collate_fn")


# Copy-on-read probe (see NOTE [ Copy-on-read probe ]).
_PROBE_MIN_ITEMS = 1000
_PROBE_WARMUP_ITEMS = 32
_PROBE_MAX_ITEMS = 4000
_PROBE_SECONDS = 0.5
_PROBE_TIMEOUT = 30.0
# Bytes copied per item read from which copy-on-read is worth a word...
_COPY_PER_ITEM = 1024
# ... and copied in all by the probe, below which the allocator's noise could explain it
# (a latency-bound image dataset measured 1.2 KiB per item over 148 items).
_COPY_MEASURED = 1 << 20


def dataset_facts(
    dataset: Dataset[Any],
    dataset_length: int | None,
    fixed: Mapping[str, Any],
    *,
    start_method: str,
) -> dict[str, Any]:
    """Measure the facts of the module docstring; none of them raises."""
    random_items = _random_items(dataset, dataset_length)
    return {
        "shm_bytes": shm_bytes(),
        "random_items": random_items,
        "workers_repeat_randomness": (
            _workers_repeat_randomness(dataset, fixed) if random_items else None
        ),
        **copy_on_read_facts(dataset, dataset_length, start_method=start_method),
    }


def copy_on_read_facts(
    dataset: Dataset[Any], dataset_length: int | None, *, start_method: str
) -> dict[str, Any]:
    """``dataset_length``, ``copy_on_read``, ``copy_on_read_items`` and
    ``process_bytes`` of the module docstring."""
    per_item, items = (
        _copy_on_read(dataset, dataset_length)
        if start_method == "fork" and dataset_length
        else (None, None)
    )
    return {
        "dataset_length": dataset_length,
        "copy_on_read": per_item,
        "copy_on_read_items": items,
        "process_bytes": psutil.Process().memory_info().rss,
    }


def copied_per_worker(facts: Mapping[str, Any]) -> float | None:
    """Bytes of the dataset each forked worker can end up copying over an epoch, if the
    probe found copy-on-read beyond the allocator's noise; else ``None``.

    The copy is bounded by what this process held: a worker cannot copy more pages than
    its parent has.
    """
    per_item, items = facts.get("copy_on_read"), facts.get("copy_on_read_items")
    length = facts.get("dataset_length")
    if not (per_item and items and length):
        return None
    if per_item < _COPY_PER_ITEM or per_item * items < _COPY_MEASURED:
        return None
    return float(min(per_item * length, facts.get("process_bytes") or math.inf))


def _copy_on_read(dataset: Dataset[Any], length: int) -> tuple[float | None, int | None]:
    """Bytes copied per item read in a forked process, and over how many items."""
    if isinstance(dataset, IterableDataset) or length < _PROBE_MIN_ITEMS:
        return None, None
    try:
        context = multiprocessing.get_context("fork")
    except ValueError:  # no fork on this platform
        return None, None
    # O(items) whatever the length (no permutation of a billion indices).
    count = min(length, _PROBE_WARMUP_ITEMS + _PROBE_MAX_ITEMS)
    order = np.random.default_rng(0).choice(length, size=count, replace=False)
    receiver, sender = context.Pipe(duplex=False)
    process = context.Process(
        target=_probe, args=(dataset, order.tolist(), sender), name="autoloader-probe"
    )
    process.start()
    sender.close()
    try:
        if not receiver.poll(_PROBE_TIMEOUT):
            return None, None
        first, second, items = receiver.recv()
    except (EOFError, OSError):  # the probe died: the baseline reports a broken dataset
        return None, None
    finally:
        receiver.close()
        process.join(1.0)
        if process.is_alive():
            process.kill()
            process.join()
        process.close()  # its sentinel is a file descriptor too
    if items == 0:
        return None, None
    return max(0.0, (first - second) / items), items


def _probe(dataset: Dataset[Any], order: list[int], out: Connection) -> None:
    """In a forked process: the private memory passes A and B gained (see the NOTE)."""
    me = psutil.Process()
    try:
        until = time.monotonic() + _PROBE_SECONDS / 2
        for index in order[:_PROBE_WARMUP_ITEMS]:
            dataset[index]
            if time.monotonic() > until:  # slow items: warm enough
                break
        fresh = order[_PROBE_WARMUP_ITEMS:]
        before = me.memory_full_info().uss
        read, until = 0, time.monotonic() + _PROBE_SECONDS
        while read < len(fresh) and time.monotonic() < until:
            dataset[fresh[read]]
            read += 1
        after_first = me.memory_full_info().uss
        for index in fresh[:read]:
            dataset[index]
        after_second = me.memory_full_info().uss
        out.send((after_first - before, after_second - after_first, read))
    except Exception:
        out.send((0, 0, 0))
    finally:
        out.close()


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
