"""Datasets and steps for the tests: module-level so spawned workers can import them."""

from __future__ import annotations

import mmap
import multiprocessing
import os
import time
from typing import Any

import numpy as np
import psutil
import torch
from threadpoolctl import threadpool_info
from torch.utils.data import Dataset, IterableDataset, get_worker_info


class SleepDataset(Dataset[torch.Tensor]):
    """Each item waits ``latency`` seconds, like a read from remote storage."""

    def __init__(self, length: int = 512, latency: float = 0.002, width: int = 8) -> None:
        self.length = length
        self.latency = latency
        self.width = width

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> torch.Tensor:
        if self.latency:
            time.sleep(self.latency)
        return torch.full((self.width,), float(index))


class SlowsDownDataset(SleepDataset):
    """Each item waits ``latency`` seconds, ``slowed`` once the file ``switch`` exists:
    storage that slows down mid-training, seen by the workers too (persistent ones
    included)."""

    def __init__(self, length: int, latency: float, slowed: float, switch: str) -> None:
        super().__init__(length, latency=latency)
        self.slowed = slowed
        self.switch = switch

    def __getitem__(self, index: int) -> torch.Tensor:
        time.sleep(self.slowed if os.path.exists(self.switch) else self.latency)
        return torch.full((self.width,), float(index))


class BusyDataset(SleepDataset):
    """Each item keeps a CPU busy for ``cpu_seconds`` in Python, like a decode."""

    def __init__(self, length: int = 512, cpu_seconds: float = 0.005) -> None:
        super().__init__(length, latency=0.0)
        self.cpu_seconds = cpu_seconds

    def __getitem__(self, index: int) -> torch.Tensor:
        until = time.process_time() + self.cpu_seconds
        while time.process_time() < until:
            pass
        return super().__getitem__(index)


class CountingDataset(SleepDataset):
    """Counts reads made in this process (fork workers count in their own copy)."""

    def __init__(self, length: int = 64) -> None:
        super().__init__(length, latency=0.0)
        self.reads = 0

    def __getitem__(self, index: int) -> torch.Tensor:
        self.reads += 1
        return super().__getitem__(index)


class FailingDataset(SleepDataset):
    """Raises on one item (``bad``), in every process."""

    def __init__(self, length: int = 512, latency: float = 0.002, bad: int = 3) -> None:
        super().__init__(length, latency=latency)
        self.bad = bad

    def __getitem__(self, index: int) -> torch.Tensor:
        if index == self.bad:
            raise ValueError(f"corrupt record {index}")
        return super().__getitem__(index)


class FailsInWorkersDataset(SleepDataset):
    """Works in the main process and one worker; raises from a second worker on."""

    def __getitem__(self, index: int) -> torch.Tensor:
        info = get_worker_info()
        if info is not None and info.id >= 1:
            raise OSError("cannot open the second shard from this worker")
        return super().__getitem__(index)


class OutOfMemoryInWorkersDataset(SleepDataset):
    """Raises the allocator's real out-of-memory errors, only in DataLoader workers."""

    def __getitem__(self, index: int) -> torch.Tensor:
        info = get_worker_info()
        if info is not None:
            if info.id % 2:
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
            raise MemoryError
        return super().__getitem__(index)


class MemoryHogDataset(SleepDataset):
    """Each worker holds ``hog_bytes`` of fresh memory once it starts reading."""

    def __init__(self, hog_bytes: int, length: int = 4096) -> None:
        super().__init__(length, latency=0.002)
        self.hog_bytes = hog_bytes
        self._hog: torch.Tensor | None = None

    def __getitem__(self, index: int) -> torch.Tensor:
        if get_worker_info() is not None and self._hog is None:
            self._hog = torch.ones(self.hog_bytes // 4, dtype=torch.float32)  # touched pages
        return super().__getitem__(index)


class NoLenDataset(Dataset[int]):
    def __getitem__(self, index: int) -> int:
        return index


class ShardedStream(IterableDataset[torch.Tensor]):
    """An iterable dataset that splits its items between workers."""

    def __init__(self, length: int = 256) -> None:
        self.length = length

    def __iter__(self):  # type: ignore[no-untyped-def]
        info = get_worker_info()
        start, step = (0, 1) if info is None else (info.id, info.num_workers)
        for index in range(start, self.length, step):
            time.sleep(0.001)
            yield torch.full((4,), float(index))


def sleep_step(batch: object) -> None:
    time.sleep(0.002)


def sleep_10ms_step(batch: object) -> None:
    """A step on an accelerator, standing in: it waits, using no CPU."""
    time.sleep(0.01)


def slow_step(batch: object) -> None:
    """A step that dwarfs loading, as a large model's would: even receiving a batch from a
    worker (about 1.3 ms) is under 1% of it."""
    time.sleep(0.2)


def noop_step(batch: object) -> None:
    return None


def failing_step(batch: object) -> None:
    raise RuntimeError("shape mismatch in step")


def oom_step(batch: object) -> None:
    raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")


class FaultInWorkersDataset(SleepDataset):
    """Works in the main process; a worker meets a real fault on its first item.

    ``fault`` is a signal name ("SIGSEGV", "SIGKILL", "SIGBUS"...) the worker sends
    itself, or "hang", "exit", "enospc", "emfile". Only workers with an id of at least
    ``from_worker`` meet it: with ``from_worker=1`` one worker is fine, two are not.
    With ``after``, a worker meets it once it has loaded that many items.
    """

    def __init__(self, fault: str, length: int = 512, from_worker: int = 0, after: int = 0) -> None:
        super().__init__(length, latency=0.001)
        self.fault = fault
        self.from_worker = from_worker
        self.after = after
        self._loaded = 0

    def __getitem__(self, index: int) -> torch.Tensor:
        info = get_worker_info()
        if info is not None and info.id >= self.from_worker:
            if self._loaded >= self.after:
                _fault(self.fault)
            self._loaded += 1
        return super().__getitem__(index)


class HoldsOnceArmed(SleepDataset):
    """Reads like ``SleepDataset`` until the file ``armed`` exists. From then on, a worker
    process that reads an item creates the file ``holding`` and holds the item until a
    signal ends it (Ctrl-C): a trial with workers under way, which cannot end before it
    is interrupted. The main process and thread workers read on as before."""

    def __init__(self, length: int, armed: str, holding: str) -> None:
        super().__init__(length)
        self.armed = armed
        self.holding = holding

    def __getitem__(self, index: int) -> torch.Tensor:
        import signal

        if get_worker_info() is not None and os.path.exists(self.armed):
            with open(self.holding, "a"):
                pass
            while True:
                signal.pause()
        return super().__getitem__(index)


def _fault(fault: str) -> None:
    import errno
    import os
    import resource
    import signal

    if fault == "hang":
        time.sleep(3600)
    elif fault == "exit":
        os._exit(3)
    elif fault == "die-holding-lock":
        # Killed while holding the lock of the event workers check in their loop, as a
        # worker SIGKILLed at the wrong moment would be.
        import sys

        frame = sys._getframe()
        while "done_event" not in frame.f_locals:
            frame = frame.f_back  # type: ignore[assignment]
        frame.f_locals["done_event"]._cond.acquire()
        os.kill(os.getpid(), signal.SIGKILL)
    elif fault == "enospc":
        raise OSError(errno.ENOSPC, "No space left on device", "/dev/shm/torch_123")
    elif fault == "emfile":
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        # A limit of 0: no new descriptor at all, whatever other threads open or close.
        resource.setrlimit(resource.RLIMIT_NOFILE, (0, hard))
        try:
            os.close(os.open(os.devnull, os.O_RDONLY))  # a real EMFILE
        finally:
            # Give the descriptors back, or the worker could not even report the error.
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    else:
        os.kill(os.getpid(), getattr(signal, fault))


def hanging_step(batch: object) -> None:
    time.sleep(3600)


class LeakingDataset(SleepDataset):
    """Each worker keeps ``leak_bytes`` of fresh memory per item it reads: a steady leak
    (``in_workers_only=False``: the main process too, reading without workers). Fresh:
    pages of an anonymous map of its own, written, where torch's allocator could hand
    back heap that earlier tests freed and is still resident, growing nothing (it did,
    after test_measure.py, in the main process)."""

    def __init__(
        self, leak_bytes: int, length: int = 100_000, *, in_workers_only: bool = True
    ) -> None:
        super().__init__(length, latency=0.002)
        self.leak_bytes = leak_bytes
        self.in_workers_only = in_workers_only
        self._kept: list[mmap.mmap] = []

    def __getitem__(self, index: int) -> torch.Tensor:
        if not self.in_workers_only or get_worker_info() is not None:
            kept = mmap.mmap(-1, self.leak_bytes)
            kept.write(b"\x01" * self.leak_bytes)
            self._kept.append(kept)
        return super().__getitem__(index)


class StepWithFault:
    """A step that meets ``fault`` (see ``_fault``) in the trial's own main process,
    once the loader runs at least ``from_workers`` workers; below that it does nothing.

    "blocked-hang" hangs with SIGALRM blocked: the trial's own deadline cannot break it.
    """

    def __init__(self, fault: str, from_workers: int = 1) -> None:
        self.fault = fault
        self.from_workers = from_workers

    def __call__(self, batch: object) -> None:
        import multiprocessing
        import signal

        if len(multiprocessing.active_children()) < self.from_workers:
            return
        if self.fault == "blocked-hang":
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})
            time.sleep(3600)
        _fault(self.fault)


class ProcessRecordingStep:
    """At its first step, writes its process's pid, parent's pid, process group and
    SIGTERM handler to ``folder/<pid>.json``; with ``kill_parent``, then SIGKILLs its parent (under
    isolation, the helper that forked the trial's process)."""

    def __init__(self, folder: str, *, kill_parent: bool = False) -> None:
        self.folder = folder
        self.kill_parent = kill_parent
        self.recorded = False

    def __call__(self, batch: object) -> None:
        import json
        import signal

        if self.recorded:
            return
        self.recorded = True
        me = {
            "pid": os.getpid(),
            "ppid": os.getppid(),
            "pgid": os.getpgid(0),
            "sigterm": str(signal.getsignal(signal.SIGTERM)),
        }
        with open(os.path.join(self.folder, f"{me['pid']}.json"), "w") as out:
            json.dump(me, out)
        if self.kill_parent:
            os.kill(me["ppid"], signal.SIGKILL)


class UnloadableDataset(SleepDataset):
    """Pickles, but raises when unpickled: a class that only the tuning process knows."""

    def __setstate__(self, state: dict[str, object]) -> None:
        raise AttributeError("Can't get attribute 'NotebookDataset' on <module '__main__'>")


class ExitOnLoadDataset(SleepDataset):
    """Its process exits while unpickling it, as a script without a __main__ guard does."""

    def __setstate__(self, state: dict[str, object]) -> None:
        import os

        os._exit(1)


class StartMethodCheckingStep:
    """Raises unless the workers of this process start with ``expected``."""

    def __init__(self, expected: str) -> None:
        self.expected = expected

    def __call__(self, batch: object) -> None:
        import multiprocessing

        method = multiprocessing.get_start_method()
        if method != self.expected:
            raise RuntimeError(f"workers start with {method!r}, not {self.expected!r}")


class ArrayDataset(Dataset[dict[str, Any]]):
    """Backed by a numpy array: ``dataset[list]`` is one fancy indexing."""

    def __init__(self, length: int = 64) -> None:
        self.features = np.arange(length * 3, dtype=np.float32).reshape(length, 3)
        self.labels = np.arange(length)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: Any) -> dict[str, Any]:
        return {"x": self.features[index], "y": self.labels[index]}


class FirstOnlyDataset(ArrayDataset):
    """Accepts a list of indices, but answers it with the first item's features only."""

    def __getitem__(self, index: Any) -> dict[str, Any]:
        first = index[0] if isinstance(index, list) else index
        return {"x": self.features[first], "y": self.labels[index]}


class AugmentedDataset(ArrayDataset):
    """Random noise on every read: two loads of a batch never agree."""

    def __getitem__(self, index: Any) -> dict[str, Any]:
        item = super().__getitem__(index)
        return {"x": item["x"] + np.random.rand(*np.shape(item["x"])), "y": item["y"]}


class ThreadsInWorker(Dataset[torch.Tensor]):
    """Each item reports the threads its worker's native pools may run, and the
    environment variables they read: BLAS, OpenMP, torch, ``OMP_NUM_THREADS``."""

    def __len__(self) -> int:
        return 8

    def __getitem__(self, index: int) -> torch.Tensor:
        pools = {pool["user_api"]: pool["num_threads"] for pool in threadpool_info()}
        omp = int(os.environ.get("OMP_NUM_THREADS", "0"))
        return torch.tensor([pools.get("blas", 0), torch.get_num_threads(), omp])


def mark_worker(worker_id: int) -> None:
    """A user's ``worker_init_fn``: leaves a trace the worker's items can report."""
    os.environ["AUTOLOADER_TEST_WORKER"] = str(worker_id)


class WorkerMarks(Dataset[int]):
    def __len__(self) -> int:
        return 4

    def __getitem__(self, index: int) -> int:
        return int(os.environ.get("AUTOLOADER_TEST_WORKER", "-1"))


class HangsIn(Dataset[torch.Tensor]):
    """Reads like ``SleepDataset`` with no latency, but hangs in one place only.

    ``where`` is "probe" (the copy-on-read probe's forked process, by its name: the
    threads check runs in a forked process too), "workers" (DataLoader workers), "list"
    (indexed with a list, as the batched-fetch check does) or "item 0 here" (item 0, in
    the process that made the dataset). With ``random``, items carry noise from numpy's
    global generator.
    """

    def __init__(self, where: str, length: int = 2048, random: bool = False) -> None:
        self.where = where
        self.length = length
        self.random = random
        self.owner = os.getpid()

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: Any) -> torch.Tensor:
        in_worker = get_worker_info() is not None
        hangs = {
            "probe": multiprocessing.current_process().name == "autoloader-probe",
            "workers": in_worker,
            "list": isinstance(index, list),
            "item 0 here": index == 0 and os.getpid() == self.owner,
        }[self.where]
        if hangs:
            time.sleep(3600)
        noise = float(np.random.rand()) if self.random else 0.0
        return torch.full((4,), float(np.mean(index)) + noise)


class Stream(IterableDataset[Any]):
    """Items ``{"x": ..., "id": i, "label": i % 3}``, split between workers by
    ``get_worker_info()`` unless ``shard`` is false; ``augment`` adds random noise to
    ``x``; without ``ids`` the items carry no ``id``. ``hang_in_workers`` hangs there."""

    def __init__(
        self,
        length: int = 256,
        *,
        shard: bool = True,
        augment: bool = False,
        ids: bool = True,
        hang_in_workers: bool = False,
    ) -> None:
        self.length = length
        self.shard = shard
        self.augment = augment
        self.ids = ids
        self.hang_in_workers = hang_in_workers

    def __iter__(self):  # type: ignore[no-untyped-def]
        info = get_worker_info()
        if info is not None and self.hang_in_workers:
            time.sleep(3600)
        start, step = (0, 1) if info is None or not self.shard else (info.id, info.num_workers)
        for index in range(start, self.length, step):
            x = torch.full((4,), float(index))
            if self.augment:
                x = x + torch.rand(4)
            item: dict[str, Any] = {"x": x, "label": index % 3}
            if self.ids:
                item["id"] = index
            yield item


class TorchOpsDataset(Dataset[torch.Tensor]):
    """Normalises a 3x112x112 image per item, as torchvision's ``Normalize`` does: an
    op large enough to run torch's intra-op thread pool."""

    def __init__(self, length: int = 2048) -> None:
        self.length = length
        self.mean = torch.tensor([0.485, 0.456, 0.406]).view(3, 1, 1)
        self.std = torch.tensor([0.229, 0.224, 0.225]).view(3, 1, 1)

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> torch.Tensor:
        image = torch.full((3, 112, 112), index / self.length)
        return ((image - self.mean) / self.std).mean(dim=(1, 2))


class SharedBufferDataset(SleepDataset):
    """Fills one buffer of its own for each read, waits, then copies it out: read from
    several threads at once, one read's item comes out with another's values."""

    def __init__(self, length: int = 256) -> None:
        super().__init__(length, latency=0.0)
        self.buffer = torch.zeros(8)

    def __getitem__(self, index: int) -> torch.Tensor:
        self.buffer.fill_(float(index))
        time.sleep(0.002)  # a read: other threads run meanwhile
        return self.buffer.clone()


class FailsInThreadsDataset(SleepDataset):
    """Works in the main thread; raises in any other, like a handle bound to a thread."""

    def __getitem__(self, index: int) -> torch.Tensor:
        import threading

        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError("this handle was opened in another thread")
        return super().__getitem__(index)


class GetItemsDataset(SleepDataset):
    """Loads a batch's items with one ``__getitems__`` call, as HF datasets do."""

    def __init__(self, length: int = 64) -> None:
        super().__init__(length, latency=0.0)
        self.calls = 0

    def __getitems__(self, indices: list[int]) -> list[torch.Tensor]:
        self.calls += 1
        return [self[i] for i in indices]


class SlowFirstItemInWorkers(SleepDataset):
    """A worker with an id of ``from_worker`` or more computes for ``cpu_seconds`` of its
    CPU on its first item, in Python, as a slow first decode or a cache it builds would;
    the other reads are ``SleepDataset``'s."""

    def __init__(self, cpu_seconds: float, from_worker: int, length: int = 512) -> None:
        super().__init__(length, latency=0.001)
        self.cpu_seconds = cpu_seconds
        self.from_worker = from_worker
        self._first = True

    def __getitem__(self, index: int) -> torch.Tensor:
        info = get_worker_info()
        if self._first and info is not None and info.id >= self.from_worker:
            self._first = False
            until = time.process_time() + self.cpu_seconds
            while time.process_time() < until:
                pass
        return super().__getitem__(index)


class GrowsWhileHanging(SleepDataset):
    """A worker's first item never returns: it keeps ``bytes_per_second`` more memory
    every second, as a decoder stuck filling a buffer would."""

    def __init__(self, bytes_per_second: int, length: int = 512) -> None:
        super().__init__(length, latency=0.001)
        self.bytes_per_second = bytes_per_second

    def __getitem__(self, index: int) -> torch.Tensor:
        if get_worker_info() is not None:
            kept = []
            while True:
                kept.append(torch.ones(self.bytes_per_second // 10, dtype=torch.uint8))
                time.sleep(0.1)
        return super().__getitem__(index)


def slow_start(worker_id: int) -> None:
    """A worker_init_fn that takes 30 s: workers slower to start than a trial lasts."""
    time.sleep(30)


class ThreadsSeenStep:
    """A step that trains on the CPU (a matrix product on torch's pool, about 2 ms)
    and records the thread count it ran with (NOTE [ Step threads ])."""

    def __init__(self) -> None:
        self.seen: list[int] = []
        self.weights = torch.randn(192, 192)

    def __call__(self, batch: object) -> None:
        self.seen.append(torch.get_num_threads())
        until = time.perf_counter() + 0.002
        while time.perf_counter() < until:
            self.weights @ self.weights


class ThreadSettingStep(ThreadsSeenStep):
    """A step that sets the process's threads itself, as some training code does."""

    def __call__(self, batch: object) -> None:
        torch.set_num_threads(1)
        super().__call__(batch)


# Set to 1 by a test in its own process: a forked worker inherits it, one started by
# spawn or a fork server imports this module afresh and sees 0.
PARENT_MARK = 0


class StartMarkedDataset(SleepDataset):
    """Each item ``[index, in a worker, PARENT_MARK as the loading process sees it]``:
    which items worker processes loaded, and whether they were forked."""

    def __getitem__(self, index: int) -> torch.Tensor:
        if self.latency:
            time.sleep(self.latency)
        return torch.tensor([index, get_worker_info() is not None, PARENT_MARK])


def ended(pid: int, *, within: float) -> bool:
    """Whether process ``pid`` is gone, or a zombie, within ``within`` seconds."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.05)
    return False
