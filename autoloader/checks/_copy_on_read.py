"""The copy-on-read probe: how much of the dataset a forked worker copies by reading it.

NOTE [ Copy-on-read probe ]
A forked worker shares its parent's pages until one of them writes to a page. Reading a
Python object writes its reference count, so a worker that reads a list of Python
objects copies, page by page, the part of the dataset it reads: over an epoch, each
worker can end up with its own copy. The memory watchdog cannot tell this slow growth
from noise in a trial of a few seconds, so it is measured directly: a forked process
reads a few items to warm up, then two runs of fresh items, and reads how much of the
memory it shares dirty with its parent (``Shared_Dirty`` of ``/proc/self/smaps_rollup``)
each run turned private. Memory the process allocates itself (a cache, a leak, the
allocator's arenas) is private from the start and does not count: it is not a copy.
The per-item copy is the smaller of the two runs' rates: copy-on-read grows with the
items read, in both runs alike, while a one-off copy (a cache the parent allocated, such
as HDF5's chunk cache, rewritten once in the child) falls in one run only. The
collector's first full pass in a worker also copies every object it visits; that is
paid once per worker, not per item, so the probe freezes the collector.
The allocator writes shared pages too: a block the parent freed in its C heap is still
its page, and the child's next allocations (an HDF5 chunk cache, a memo) fill such free
blocks and write their headers, item after item, as copy-on-read does. So the probe first
hands the heap's free pages back (``malloc_trim``) and takes its free blocks for itself,
largest first, before it measures: what the reads allocate then comes from fresh pages.
(A fragmented 100 MiB heap: 19 KB per item before, 2 B after; glibc only, elsewhere the
probe goes without.)
A first run that copied less than the report would ever speak of (under
``_COPY_PER_ITEM`` an item, or under half of ``_COPY_MEASURED``: the second run reads
no more items than the first) ends the probe there: nothing the other runs could find
would lower the figure into advice, and the figure kept is that run's, an upper bound.
Most datasets (files, arrays, tensors) end so, in half the probe's reading time, which
an ``AutoLoader`` would otherwise keep its training waiting for.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import itertools
import math
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
from torch.utils.data import Dataset, IterableDataset

from autoloader.checks._forked import ForkedCheckFailed, can_fork, run_forked

# Copy-on-read probe (see NOTE [ Copy-on-read probe ]).
_PROBE_MIN_ITEMS = 1000
_PROBE_WARMUP_ITEMS = 32
_PROBE_MAX_ITEMS = 4000
# Share of the probe's time its reads may take; the rest is for forking and reporting.
# They take at most _PROBE_MAX_READING seconds: a quarter to warm up, a quarter for
# each of its three runs (see NOTE [ Copy-on-read probe ]).
_PROBE_READING_SHARE = 0.8
_PROBE_MAX_READING = 2.0
# Free blocks of the inherited C heap the probe takes before it reads, largest first.
_TAKE_LARGEST = 1 << 20
_TAKE_SMALLEST = 32
_TAKE_MOST = 200_000
_SMAPS = Path("/proc/self/smaps_rollup")
# Bytes copied per item read from which copy-on-read is worth a word...
_COPY_PER_ITEM = 1024
# ... and copied in all by the probe, below which noise could explain it (datasets that
# only allocate or cache measure 0-110 B per item: benchmarks/copy_on_read.py).
_COPY_MEASURED = 1 << 20


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


def copy_on_read(dataset: Dataset[Any], length: int, seconds: float) -> tuple[float, int] | None:
    """Bytes copied per item read in a forked process, and over how many items."""
    if isinstance(dataset, IterableDataset) or length < _PROBE_MIN_ITEMS:
        return None
    if not _SMAPS.exists():
        raise ForkedCheckFailed(f"the probe reads {_SMAPS}, which this system does not have")
    if not can_fork():
        return None
    # O(items) whatever the length (no permutation of a billion indices).
    count = min(length, _PROBE_WARMUP_ITEMS + _PROBE_MAX_ITEMS)
    order = np.random.default_rng(0).choice(length, size=count, replace=False).tolist()
    warmup, fresh = order[:_PROBE_WARMUP_ITEMS], order[_PROBE_WARMUP_ITEMS:]
    # The two runs read items of different halves of the dataset, so that the second
    # does not find pages the first copied (items stored side by side share pages).
    runs = ([i for i in fresh if i < length // 2], [i for i in fresh if i >= length // 2])
    reading = min(_PROBE_MAX_READING, _PROBE_READING_SHARE * seconds)
    (first, again, second), items, second_items = run_forked(
        _probe,
        (dataset, warmup, runs, reading),
        seconds=seconds,
        stage="reading items in the copy-on-read probe",
        name="autoloader-probe",
    )
    if not items or first is None:
        return None
    if again is None:  # the first run copied too little to be worth a word
        return max(0.0, first / items), items
    if not second_items or second is None:
        return None
    per_item = min(first / items, second / second_items) - again / items
    return max(0.0, per_item), items + second_items


def _below_advice(copied: int, items: int) -> bool:
    """Whether a first run that copied ``copied`` bytes over ``items`` items leaves the
    probe's figure below what the report speaks of (``NOTE [ Copy-on-read probe ]``)."""
    return copied < max(_COPY_PER_ITEM * items, _COPY_MEASURED / 2)


def _probe(
    dataset: Dataset[Any], warmup: list[int], runs: tuple[list[int], list[int]], seconds: float
) -> tuple[list[int | None], int, int]:
    """In a forked process: shared memory turned private by a run of fresh items, by the
    same items again, and by as many fresh items of the dataset's other half; only the
    first where it copied too little to be worth a word (the others ``None`` and 0)."""
    gc.freeze()
    _take_free_heap()
    _read(dataset, warmup, until=time.monotonic() + seconds / 4)  # slow items: enough
    shared = [_shared_dirty()]
    items = _read(dataset, runs[0], until=time.monotonic() + seconds / 4)
    shared.append(_shared_dirty())
    if items and _below_advice(shared[0] - shared[1], items):
        return [shared[0] - shared[1], None, None], items, 0
    _read(dataset, runs[0][:items], until=math.inf)
    shared.append(_shared_dirty())
    second = _read(dataset, runs[1][:items], until=time.monotonic() + seconds / 4)
    shared.append(_shared_dirty())
    lost: list[int | None] = [before - after for before, after in itertools.pairwise(shared)]
    return lost, items, second


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena", "ordblks", "smblks", "hblks", "hblkhd",
            "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost",
        )
    ]  # fmt: skip


def _take_free_heap() -> int:
    """Keep what this process allocates next off the C heap's pages inherited from the
    parent (see NOTE [ Copy-on-read probe ]); how many blocks that took."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.malloc_trim(0)
        mallinfo2 = libc.mallinfo2
    except (OSError, AttributeError):
        return 0  # not glibc (or older than 2.33): the probe goes without
    mallinfo2.restype = _MallInfo2
    libc.malloc.restype = ctypes.c_void_p
    libc.malloc.argtypes = [ctypes.c_size_t]

    def free_in_bins() -> int:
        info = mallinfo2()
        return int(info.fordblks) - int(info.keepcost)  # free, less the top chunk

    taken, size = 0, _TAKE_LARGEST
    free = free_in_bins()
    while size >= _TAKE_SMALLEST and taken < _TAKE_MOST:
        if free < size or not libc.malloc(size):
            size //= 2
            continue
        taken += 1
        free, before = free_in_bins(), free
        if free >= before:  # from the top of the heap: no free block this large is left
            size //= 2
    return taken


def _read(dataset: Dataset[Any], indices: list[int], *, until: float) -> int:
    """Read items in order until ``until``; how many were read."""
    for read, index in enumerate(indices):
        if time.monotonic() >= until:
            return read
        dataset[index]
    return len(indices)


def _shared_dirty() -> int:
    """Bytes of this process's memory shared dirty with another process (its parent)."""
    for line in _SMAPS.read_text().splitlines():
        if line.startswith("Shared_Dirty:"):
            return int(line.split()[1]) * 1024
    raise ForkedCheckFailed(f"{_SMAPS} has no Shared_Dirty line")
