"""A DataLoader whose workers are threads of this process (the worker kind "threads").

NOTE [ Thread workers ]
DataLoader's worker processes hand each batch to the main process through a pipe: the
main process reads it, receives a file descriptor per tensor and unpickles the batch,
about 1.3 ms per batch on the development VM (``benchmarks/dataloader_overhead.py``).
On a loop whose step takes 10 ms that caps the best DataLoader at 0.875 of what the
step allows. A worker process also copies the Python objects it reads (copy-on-read
under fork) and, under spawn or forkserver, pickles the dataset and takes seconds to
start. Threads pay none of this: a batch loaded by a thread is handed over as a
reference, and a read that waits on storage or the network releases the GIL, so
threads overlap I/O as well as processes do. They lose where loading is Python code
that holds the GIL (a Python transform): there, only processes (or a free-threaded
CPython) run in parallel. Which wins is measured, not assumed (``SearchSpace``'s
``worker_kind``).

:class:`ThreadLoader` is a ``DataLoader``: the same options, sampler, batch sampler,
collate function, ``drop_last``, generator and epochs (it draws from ``generator``
exactly as DataLoader does, so a seeded shuffle gives the same batches), ``len()``, and
``isinstance(loader, DataLoader)``. Its iterator runs ``num_workers`` threads that
load batches (item by item and a collate, ``__getitems__``, or one indexing for a
``BatchSampler`` given as the sampler, as DataLoader's fetchers do) ahead of the loop,
``num_workers x prefetch_factor`` batches at most, handed over in the sampler's order
or, with ``in_order=False``, as soon as any is ready. With ``pin_memory`` where an
accelerator exists, each thread pins the batch it loaded.

The dataset is read from several threads at once: it must allow that (most do: reading
files, decoding images, indexing tensors or arrays). One that keeps per-read state in
``self`` (a shared buffer, a file position) does not; the tuner checks a few batches
before it offers threads (``autoloader.checks._facts``). ``get_worker_info()`` is ``None`` in
the threads, there is no ``worker_init_fn`` to run, and an ``IterableDataset`` is not
split among threads: those need processes.
"""

from __future__ import annotations

import logging
import threading
import time
import traceback
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeVar

import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, Sampler

from autoloader._exceptions import InvalidInputError
from autoloader.loader._torch_compat import BaseDataLoaderIter, KeyErrorMessage
from autoloader.loader._torch_compat import pin_memory as _pin

_logger = logging.getLogger(__name__)

_T_co = TypeVar("_T_co", covariant=True)

# Seconds shutdown waits for the threads to finish the item each is reading; a thread
# still reading then (a read that does not return) is left to end when it returns.
_JOIN_SECONDS = 2.0
# Indices of a batch named in an error, at most.
_NAMED_INDICES = 8
# The name of each worker thread, then its number: how a stuck one is told apart.
THREAD_WORKER_PREFIX = "autoloader-thread-worker-"


class ThreadLoader(DataLoader[_T_co]):
    """A ``DataLoader`` whose ``num_workers`` workers are threads of this process.

    Takes DataLoader's arguments and gives its interface (see ``NOTE [ Thread
    workers ]``). ``num_workers=0`` loads in the main thread, as DataLoader does.
    DataLoader's other options (``batch_size``, ``shuffle``, ``sampler``,
    ``batch_sampler``, ``collate_fn``, ``pin_memory``, ``drop_last``, ``generator``,
    ``pin_memory_device``) mean what they mean there.

    Args:
        dataset (Dataset): a map-style dataset that may be read from several threads.
        num_workers (int, optional): threads loading batches. (default: ``0``)
        prefetch_factor (int, optional): batches each thread loads ahead; ``None``
            means 2 with threads. (default: ``None``)
        persistent_workers (bool, optional): accepted for DataLoader's sake; threads
            start in microseconds, so each epoch starts its own. (default: ``False``)
        in_order (bool, optional): hand batches over in the sampler's order; ``False``
            hands over each as soon as it is loaded. (default: ``True``)
        timeout (float, optional): seconds to wait for a batch before raising;
            ``0`` waits as long as it takes. (default: ``0``)

    Raises:
        InvalidInputError: (a ``ValueError``) an option that only worker processes
            have (``worker_init_fn``, ``multiprocessing_context``), an
            ``IterableDataset``, or DataLoader's own checks.

    Example::

        loader = autoloader.ThreadLoader(dataset, batch_size=64, num_workers=8)
        for batch in loader:
            ...
    """

    def __init__(
        self,
        dataset: Dataset[_T_co],
        batch_size: int | None = 1,
        shuffle: bool | None = None,
        sampler: Sampler[Any] | Iterable[Any] | None = None,
        batch_sampler: Sampler[list[Any]] | Iterable[list[Any]] | None = None,
        num_workers: int = 0,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        pin_memory: bool = False,
        drop_last: bool = False,
        timeout: float = 0,
        worker_init_fn: Callable[[int], None] | None = None,
        multiprocessing_context: object = None,
        generator: torch.Generator | None = None,
        *,
        prefetch_factor: int | None = None,
        persistent_workers: bool = False,
        pin_memory_device: str = "",
        in_order: bool = True,
    ) -> None:
        if isinstance(dataset, IterableDataset):
            raise InvalidInputError(
                "ThreadLoader loads map-style datasets: an IterableDataset is split among "
                "worker processes by get_worker_info(), which threads do not have. Use a "
                "DataLoader with worker processes."
            )
        if worker_init_fn is not None or multiprocessing_context is not None:
            option = "worker_init_fn" if worker_init_fn is not None else "multiprocessing_context"
            raise InvalidInputError(
                f"ThreadLoader's workers are threads of this process: {option} sets up "
                "worker processes. Drop it, or use a DataLoader with worker processes."
            )
        if num_workers < 0:
            raise InvalidInputError(
                "num_workers option should be non-negative; use num_workers=0 to load in "
                "the main thread."
            )
        if prefetch_factor is not None and prefetch_factor < 1:
            raise InvalidInputError(
                f"prefetch_factor must be at least 1 but got {prefetch_factor}."
            )
        try:
            super().__init__(
                dataset,
                batch_size=batch_size,
                shuffle=shuffle,
                sampler=sampler,
                batch_sampler=batch_sampler,
                num_workers=0,
                collate_fn=collate_fn,
                pin_memory=pin_memory,
                drop_last=drop_last,
                timeout=timeout,
                generator=generator,
                pin_memory_device=pin_memory_device,
                in_order=in_order,
            )
        except ValueError as error:  # DataLoader's own checks (batch_size with a batch_sampler...)
            raise InvalidInputError(str(error)) from error
        # DataLoader was built without workers, which it would start as processes.
        self.num_workers = num_workers
        self.prefetch_factor = (prefetch_factor or 2) if num_workers > 0 else None
        self.worker_kind = "threads"
        del persistent_workers  # threads start in microseconds: nothing to keep

    def _get_iterator(self) -> BaseDataLoaderIter:
        return _ThreadIterator(self)

    def __repr__(self) -> str:
        return (
            f"ThreadLoader(num_workers={self.num_workers}, prefetch_factor="
            f"{self.prefetch_factor}, batch_size={self.batch_size}, in_order={self.in_order})"
        )


class _Pool:
    """The threads of one epoch and what they share. The iterator holds the pool, the
    threads hold only the pool: an iterator dropped by ``break`` is collected at once,
    and its ``__del__`` stops the threads."""

    def __init__(self, fetch: Callable[[Any], Any], pin: Callable[[Any], Any] | None) -> None:
        self.fetch = fetch
        self.pin = pin
        self.lock = threading.Condition()
        self.tasks: list[tuple[int, Any]] = []  # (batch number, index), taken from the end
        self.done: dict[int, tuple[Any, _Failure | None]] = {}
        self.stopping = False
        self.threads: list[threading.Thread] = []

    def start(self, count: int) -> None:
        for number in range(count):
            thread = threading.Thread(
                target=self._work, args=(number,), name=f"{THREAD_WORKER_PREFIX}{number}",
                daemon=True,
            )  # fmt: skip
            thread.start()
            self.threads.append(thread)

    def put(self, number: int, index: Any) -> None:
        with self.lock:
            self.tasks.insert(0, (number, index))
            self.lock.notify()

    def _work(self, worker: int) -> None:
        while True:
            with self.lock:
                while not self.tasks and not self.stopping:
                    self.lock.wait()
                if self.stopping:
                    return
                number, index = self.tasks.pop()
            failure = None
            data = None
            try:
                data = self.fetch(index)
                if self.pin is not None:
                    data = self.pin(data)
            except BaseException as error:  # sent to the main thread, which raises it
                failure = _Failure(error, worker, index)
            with self.lock:
                self.done[number] = (data, failure)
                self.lock.notify_all()

    def stop(self) -> None:
        with self.lock:
            self.stopping = True
            self.tasks.clear()
            self.done.clear()
            self.lock.notify_all()
        ends = time.monotonic() + _JOIN_SECONDS
        current = threading.current_thread()
        for thread in self.threads:
            if thread is not current:
                thread.join(max(0.0, ends - time.monotonic()))
        alive = [t.name for t in self.threads if t.is_alive() and t is not current]
        if alive:
            _logger.warning(
                "%d thread worker(s) still reading an item after %.0f s (%s); each ends "
                "when its read returns",
                len(alive),
                _JOIN_SECONDS,
                ", ".join(alive),
            )
        self.threads = []


class _Failure:
    """An exception a thread worker raised, and where."""

    def __init__(self, error: BaseException, worker: int, index: Any) -> None:
        self.error = error
        self.where = f"thread worker {worker} loading {_describe_index(error, index)}"

    def reraise(self) -> None:
        """Raise an exception of the same type, whose message names the thread and
        the item and holds the original traceback; the original is its cause."""
        original = "".join(traceback.format_exception(self.error))
        message = f"Caught {type(self.error).__name__} in {self.where}.\nOriginal {original}"
        if isinstance(self.error, KeyError):
            message = KeyErrorMessage(message)
        try:
            raised = type(self.error)(message)
        except Exception:  # an exception whose __init__ takes other arguments
            raised = RuntimeError(message)
        try:
            raise raised from self.error
        finally:
            # This frame, in the traceback, would hold the exception: a cycle that keeps
            # the epoch's iterator, and so its threads, alive until the garbage collector
            # runs, where dropping the exception should stop them (as with DataLoader).
            del raised


def _describe_index(error: BaseException, index: Any) -> str:
    item = getattr(error, "_autoloader_item", None)
    if item is not None:
        return f"item {item!r}"
    if isinstance(index, Sequence) and not isinstance(index, str | bytes):
        shown = ", ".join(repr(i) for i in list(index)[:_NAMED_INDICES])
        more = ", ..." if len(index) > _NAMED_INDICES else ""
        return f"items [{shown}{more}]"
    return f"item {index!r}"


class _Fetcher:
    """Loads one batch as DataLoader's map-style fetcher does, naming the item that
    failed (see ``_MapDatasetFetcher`` in torch's ``torch/utils/data/_utils/fetch.py``).
    A thing of its own, not a method of the iterator, which the threads must not keep
    alive."""

    def __init__(
        self, dataset: Dataset[Any], auto_collation: bool, collate_fn: Callable[[Any], Any]
    ) -> None:
        self.dataset = dataset
        self.auto_collation = auto_collation
        self.collate_fn = collate_fn

    def __call__(self, index: Any) -> Any:
        dataset = self.dataset
        if not self.auto_collation:
            return self.collate_fn(dataset[index])
        getitems = getattr(dataset, "__getitems__", None)
        if getitems:
            return self.collate_fn(getitems(index))
        items = []
        for item in index:
            try:
                items.append(dataset[item])
            except Exception as error:
                error._autoloader_item = item  # type: ignore[attr-defined]
                raise
        return self.collate_fn(items)


class _ThreadIterator(BaseDataLoaderIter):
    """One epoch of a :class:`ThreadLoader`."""

    def __init__(self, loader: ThreadLoader[Any]) -> None:
        super().__init__(loader)
        self._in_order = loader.in_order
        self._in_flight = loader.num_workers * (loader.prefetch_factor or 0)
        pin = None
        if self._pin_memory:
            device = self._pin_memory_device

            def pin(data: Any) -> Any:
                return _pin(data, device)

        self._pin = pin
        self._fetch = _Fetcher(self._dataset, self._auto_collation, self._collate_fn)
        self._pool: _Pool | None = None
        self._sent = 0
        self._received = 0
        self._exhausted = False
        if self._num_workers > 0:
            self._pool = _Pool(self._fetch, pin)
            self._pool.start(self._num_workers)
            for _ in range(self._in_flight):
                self._try_put_index()

    def _try_put_index(self) -> None:
        if self._exhausted or self._pool is None:
            return
        try:
            index = self._next_index()  # type: ignore[no-untyped-call]
        except StopIteration:
            self._exhausted = True
            return
        self._pool.put(self._sent, index)
        self._sent += 1

    def _next_data(self) -> Any:
        if self._num_workers == 0:
            return self._load_here()
        if self._pool is None or (self._received == self._sent and self._exhausted):
            self._shutdown_workers()
            raise StopIteration
        try:
            data, failure = self._take()
        except BaseException:
            # Ctrl-C, a deadline or a timeout while waiting: this epoch is over.
            self._shutdown_workers()
            raise
        self._received += 1
        self._try_put_index()
        if failure is not None:
            failure.reraise()
        return data

    def _load_here(self) -> Any:
        index = self._next_index()  # type: ignore[no-untyped-call]  # may raise StopIteration
        try:
            data = self._fetch(index)
        except Exception as error:
            if getattr(error, "_autoloader_item", None) is not None:
                error.add_note(f"(loading {_describe_index(error, index)})")
            raise
        return self._pin(data) if self._pin is not None else data

    def _take(self) -> tuple[Any, _Failure | None]:
        pool = self._pool
        assert pool is not None
        ends = time.monotonic() + self._timeout if self._timeout > 0 else None
        with pool.lock:
            while True:
                if self._in_order:
                    if self._received in pool.done:
                        return pool.done.pop(self._received)
                elif pool.done:
                    return pool.done.pop(min(pool.done))
                left = None if ends is None else ends - time.monotonic()
                if left is not None and left <= 0:
                    # DataLoader's own error and words for its timeout: a drop-in.
                    raise RuntimeError(f"DataLoader timed out after {self._timeout} seconds")
                pool.lock.wait(left)

    def _shutdown_workers(self) -> None:
        """Stop this epoch's threads (also what the trial runner calls to clean up)."""
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.stop()
            self._exhausted = True
            self._received = self._sent

    def __del__(self) -> None:
        self._shutdown_workers()
