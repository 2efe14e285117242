"""A process's memory, read from /proc where it can be: PSS (proportional set size) and
its part in file pages, exactly and at a cost (``smaps_rollup``); RSS and its part in
file pages, cheaply (``status``). ``NOTE [ Growth of the tree's own memory ]`` in
``_memory.py`` says why the file pages are told apart."""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

import psutil


def process_memory(process: psutil.Process) -> int:
    """PSS in bytes of one process (RSS where PSS cannot be read)."""
    return process_memory_parts(process)[0]


def process_memory_parts(process: psutil.Process) -> tuple[int, int]:
    """PSS in bytes of one process, and the part of it in file pages (shared
    libraries, mapped files: ``NOTE [ Growth of the tree's own memory ]``). Where PSS
    cannot be read, RSS and no file part; where only the total can, no file part."""
    rollup = _smaps_rollup(process.pid)
    if rollup is not None and "Pss" in rollup:
        return rollup["Pss"], rollup.get("Pss_File", 0)
    try:
        return int(process.memory_full_info().pss), 0
    except (psutil.AccessDenied, AttributeError):
        return int(process.memory_info().rss), 0


def _smaps_rollup(pid: int) -> dict[str, int] | None:
    """The sizes /proc/<pid>/smaps_rollup gives (Linux 4.14 on), in bytes; ``None``
    where it cannot be read. A process that has ended raises ``psutil.NoSuchProcess``."""
    try:
        text = Path(f"/proc/{pid}/smaps_rollup").read_text()
    except (FileNotFoundError, ProcessLookupError):
        if Path(f"/proc/{pid}").exists() or not Path("/proc/self/smaps_rollup").exists():
            return None  # no rollup here (not Linux, an older kernel), not an ended process
        raise psutil.NoSuchProcess(pid) from None
    except OSError:  # not ours to read
        return None
    sizes = {}
    for line in text.splitlines()[1:]:
        name, _, value = line.partition(":")
        number, _, unit = value.strip().partition(" ")
        if unit == "kB" and number.isdigit():
            sizes[name] = int(number) * 1024
    return sizes


def tree_memory(root: psutil.Process | None = None) -> int:
    """PSS in bytes of ``root`` (this process by default) and all its descendants."""
    return tree_memory_parts(root)[0]


def tree_memory_parts(root: psutil.Process | None = None) -> tuple[int, int]:
    """PSS in bytes of ``root`` (this process by default) and all its descendants, and
    the part of it in file pages (:func:`process_memory_parts`)."""
    root = root or psutil.Process()
    try:
        descendants = root.children(recursive=True)
    except (psutil.NoSuchProcess, psutil.ZombieProcess):
        return 0, 0
    total = files = 0
    for process in (root, *descendants):
        try:
            pss, in_files = process_memory_parts(process)
        except (psutil.NoSuchProcess, psutil.ZombieProcess):
            continue  # exited while we were reading: it no longer holds memory
        total, files = total + pss, files + in_files
    return total, files


def rss_sums(processes: Iterable[psutil.Process]) -> tuple[int, int]:
    """The RSS of ``processes``, and its part not in file pages: anonymous and shared
    memory (``NOTE [ Growth of the tree's own memory ]``). Where the platform does not
    tell them apart (not Linux), all of it."""
    total = own = 0
    for process in processes:
        sizes = _status_rss(process.pid)
        if sizes is None:
            try:
                info = process.memory_info()
            except (psutil.NoSuchProcess, psutil.ZombieProcess):
                continue
            sizes = int(info.rss), 0
        rss, in_files = sizes
        total, own = total + rss, own + rss - in_files
    return total, own


def _status_rss(pid: int) -> tuple[int, int] | None:
    """RSS and its file pages from /proc/<pid>/status (Linux): ``(0, 0)`` for a process
    that has ended or holds no memory (a zombie), ``None`` where it cannot be read.
    ``statm``'s "shared", which ``memory_info()`` reads, counts shared memory with the
    file pages: a tree's own ``/dev/shm`` batches and ``MAP_SHARED`` maps."""
    try:
        with open(f"/proc/{pid}/status", "rb") as status:
            text = status.read()
    except (FileNotFoundError, ProcessLookupError):
        return (0, 0) if os.path.exists("/proc/self/status") else None
    except OSError:
        return None
    rss = in_files = None
    for line in text.splitlines():
        if line.startswith(b"VmRSS:"):
            rss = int(line.split()[1]) * 1024
        elif line.startswith(b"RssFile:"):
            in_files = int(line.split()[1]) * 1024
            break
    if rss is None:
        return (0, 0) if b"State:\tZ" in text or b"State:\tX" in text else None
    return rss, in_files or 0
