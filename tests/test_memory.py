from __future__ import annotations

import mmap
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
import torch

from autoloader import InvalidInputError
from autoloader.measure._memory import (
    Growth,
    MemoryBudgetExceeded,
    MemoryWatch,
    available_memory,
    is_oom_error,
    total_memory,
)
from autoloader.measure._process_memory import process_memory_parts, tree_memory
from autoloader.measure._units import format_bytes, parse_bytes
from tests.workloads import ended


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (1024, 1024),
        ("6GiB", 6 * 1024**3),
        ("6G", 6 * 1024**3),
        ("2GB", 2 * 1000**3),
        ("512 MiB", 512 * 1024**2),
        ("1.5GiB", int(1.5 * 1024**3)),
        ("100", 100),
        (" 3kb ", 3000),
    ],
)
def test_parse_bytes(text: int | str, expected: int) -> None:
    assert parse_bytes(text) == expected


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("6 gigs", "is not a size"),
        ("GiB", "is not a size"),
        ("", "is not a size"),
        (0, "must be positive"),
        (-5, "must be positive"),
        ("0GiB", "must be positive"),
        (True, "must be a number of bytes"),
        (1.5, "must be a number of bytes"),
    ],
)
def test_parse_bytes_rejects(value: object, message: str) -> None:
    with pytest.raises(InvalidInputError, match=message):
        parse_bytes(value)  # type: ignore[arg-type]


def test_format_bytes() -> None:
    assert format_bytes(512) == "512 B"
    assert format_bytes(1536) == "1.5 KiB"
    assert format_bytes(6 * 1024**3) == "6.0 GiB"


def test_cgroup_v2_limit_caps_total_and_available(tmp_path: Path) -> None:
    (tmp_path / "memory.max").write_text(f"{1024**3}\n")
    (tmp_path / "memory.current").write_text(f"{768 * 1024**2}\n")
    assert total_memory(cgroup_root=tmp_path) == 1024**3
    assert available_memory(cgroup_root=tmp_path) == 256 * 1024**2


def test_cgroup_v2_unlimited(tmp_path: Path) -> None:
    (tmp_path / "memory.max").write_text("max\n")
    assert total_memory(cgroup_root=tmp_path) == psutil.virtual_memory().total


def test_cgroup_v1_limit(tmp_path: Path) -> None:
    (tmp_path / "memory").mkdir()
    (tmp_path / "memory" / "memory.limit_in_bytes").write_text(f"{2 * 1024**3}\n")
    (tmp_path / "memory" / "memory.usage_in_bytes").write_text(f"{1024**3}\n")
    assert total_memory(cgroup_root=tmp_path) == 2 * 1024**3
    assert available_memory(cgroup_root=tmp_path) <= 1024**3


def test_cgroup_v1_unlimited_is_ignored(tmp_path: Path) -> None:
    (tmp_path / "memory").mkdir()
    (tmp_path / "memory" / "memory.limit_in_bytes").write_text("9223372036854771712\n")
    assert total_memory(cgroup_root=tmp_path) == psutil.virtual_memory().total


@pytest.mark.parametrize(
    "error",
    [
        MemoryError(),
        torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
        RuntimeError(
            "[enforce fail at alloc_cpu.cpp:118] DefaultCPUAllocator: can't allocate memory: "
            "you tried to allocate 1099511627776 bytes."
        ),
        RuntimeError("HIP out of memory"),
    ],
)
def test_is_oom_error(error: BaseException) -> None:
    assert is_oom_error(error)


@pytest.mark.parametrize("error", [RuntimeError("shape mismatch"), ValueError("out of memory")])
def test_is_not_oom_error(error: BaseException) -> None:
    assert not is_oom_error(error)


def _hog(megabytes: int, *, wait_ready: bool = True) -> subprocess.Popen[bytes]:
    """A real process holding ``megabytes`` of touched memory."""
    code = (
        f"import time; block = bytearray({megabytes} * 1024 * 1024); "
        "print('ready', flush=True); time.sleep(60)"
    )
    process = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
    assert process.stdout is not None
    if wait_ready:
        assert process.stdout.readline().strip() == b"ready"
    return process


def test_tree_memory_counts_children() -> None:
    alone = tree_memory()
    child = _hog(200)
    try:
        assert tree_memory() >= alone + 190 * 1024**2
    finally:
        child.kill()
        child.wait()


def test_watch_kills_the_trial_workers_over_budget() -> None:
    budget = tree_memory() + 100 * 1024**2
    child: subprocess.Popen[bytes] | None = None  # named to the watch as the trial's worker
    with MemoryWatch(
        budget, interval=0.05, workers=lambda: [] if child is None else [child.pid]
    ) as watch:
        child = _hog(300, wait_ready=False)
        try:
            child.wait(timeout=10)
        finally:
            child.kill()
            child.wait()
        assert watch.exceeded
        assert child.returncode == -9
        assert watch.peak > budget
        with pytest.raises(MemoryBudgetExceeded, match="over the memory budget"):
            watch.check()


@pytest.mark.alone  # the watch samples a peak a busy machine may miss
def test_watch_under_budget_records_peak_and_kills_nothing() -> None:
    with MemoryWatch(tree_memory() + 2 * 1024**3, interval=0.05) as watch:
        child = _hog(100)
        time.sleep(0.7)  # past the children refresh, so the child is read
        assert child.poll() is None
        child.kill()
        child.wait()
    assert not watch.exceeded
    assert watch.peak >= 100 * 1024**2
    watch.check()


def test_growth_is_the_slower_half_of_the_window() -> None:
    growth = Growth(window=2.0, min_span=1.0)
    for tenth in range(6):
        growth.add(tenth / 10, 100 * tenth)
    assert growth.rate() is None  # 0.5 s of samples: too short to tell
    for tenth in range(6, 21):
        growth.add(tenth / 10, 100 * tenth)
    assert growth.rate() == pytest.approx(1000.0)
    growth.add(2.5, 3000)  # the window slides: samples older than 0.5 s are gone
    assert growth.rate() == pytest.approx(1000.0, rel=0.5)


def test_a_burst_is_not_growth() -> None:
    growth = Growth(window=2.0, min_span=1.0)
    for tenth in range(21):
        growth.add(tenth / 10, 0 if tenth < 3 else 10**9)  # one allocation, then flat
    assert growth.rate() == pytest.approx(0.0)
    growth.reset()
    assert growth.rate() is None


@pytest.mark.light  # mostly waits
@pytest.mark.slow  # over 2.5 s here: the full suite's (docs/development/checks.md)
def test_watch_under_budget_with_a_flat_tree_is_not_stopped_by_projection() -> None:
    # The child is ready before the watch starts. Started under the watch, its start-up
    # grows the tree for as long as the machine makes it take: a child growing 3 MB each
    # 0.1 s for 1 s before its allocation grew in both halves of the window, which 58 s
    # to the trial's end made a projection (5 of 5 runs here). Beside four tests and a
    # busy loop, the test started its child under the watch and failed in two full runs.
    child = _hog(200)  # allocates once, then holds
    try:
        budget = tree_memory() + 100 * 1024**2
        with MemoryWatch(budget, interval=0.05, ends_at=time.monotonic() + 60) as watch:
            time.sleep(2.5)  # past the growth window
    finally:
        child.kill()
        child.wait()
    assert not watch.exceeded
    assert watch.projected is None
    assert watch.peak >= 200 * 1024**2


# Run outside the test's process tree: maps the first ``size`` bytes of ``path``, reads a
# byte of each page, says so through ``ready``, and holds them until ``stop`` (30 s at most).
_MAP_ELSEWHERE = """
import mmap, pathlib, sys, time
path, size, ready, stop = sys.argv[1], int(sys.argv[2]), *map(pathlib.Path, sys.argv[3:5])
with open(path, "rb") as file:
    view = mmap.mmap(file.fileno(), size, prot=mmap.PROT_READ)
    sum(view[at] for at in range(0, size, mmap.PAGESIZE))
    ready.touch()
    deadline = time.monotonic() + 30
    while not stop.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
"""


def _map_elsewhere(path: Path, size: int, ready: Path, stop: Path) -> int:
    """Start ``_MAP_ELSEWHERE`` as an orphan (its shell exits at once): another job on
    the machine, not a child of this process. Its pid."""
    shell = '"$0" -c "$1" "$2" "$3" "$4" "$5" >/dev/null 2>&1 & echo $!'
    started = subprocess.run(
        ["sh", "-c", shell, sys.executable, _MAP_ELSEWHERE, *map(str, (path, size, ready, stop))],
        capture_output=True,
        text=True,
        check=True,
    )
    return int(started.stdout)


@pytest.mark.slow  # over 2.5 s here: the full suite's (docs/development/checks.md)
@pytest.mark.skipif(not Path("/proc/self/smaps_rollup").exists(), reason="reads Linux's PSS")
def test_other_processes_mapping_the_trees_files_do_not_hide_its_growth(tmp_path: Path) -> None:
    # A torchrun rank's tree leaked 30 MB/s, but four processes elsewhere imported torch
    # meanwhile: libtorch's pages, now divided among more processes, took 57 MB off this
    # process's PSS in 1.5 s, read as the tree shrinking, and the rank reported its
    # peer's hang instead of its memory fault (NOTE [ Growth of the tree's own memory ]).
    size = 128 << 20
    path = tmp_path / "shared.bin"
    path.write_bytes(b"\x01" * size)
    files_before = process_memory_parts(psutil.Process())[1]
    with path.open("rb") as file:
        view = mmap.mmap(file.fileno(), size, prot=mmap.PROT_READ)
    sum(view[at] for at in range(0, size, mmap.PAGESIZE))
    if process_memory_parts(psutil.Process())[1] - files_before < size // 2:
        pytest.skip(f"{tmp_path} keeps no file pages (tmpfs): nothing to share")
    ready, stop, kept = tmp_path / "ready", tmp_path / "stop", []
    pid = None
    try:
        with MemoryWatch(tree_memory() + (1 << 30), interval=0.05) as watch:
            began = time.monotonic()
            while time.monotonic() - began < 2.4:  # past the growth window
                kept.append(mmap.mmap(-1, 256 << 10))  # about 25 MB/s of fresh pages
                kept[-1].write(b"\x01" * (256 << 10))
                if pid is None and time.monotonic() - began > 1.2:
                    pid = _map_elsewhere(path, size, ready, stop)  # this PSS falls 64 MB
                time.sleep(0.01)
            assert ready.exists(), "the other process did not map the file in time"
            grown = watch.outgrows(1000.0)
    finally:
        stop.touch()
        view.close()
        assert pid is None or ended(pid, within=10.0)
    assert grown is not None and grown.projected is not None


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads Linux's RssFile")
def test_shared_memory_the_tree_fills_grows_between_exact_readings(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A DataLoader's batches are in /dev/shm, and LeakingDataset keeps MAP_SHARED maps:
    # statm counts such pages as "shared", with the files. Read from it, the tree's own
    # memory grew only at the exact readings, which a busy machine makes rare, and a
    # 128 MiB/s leak passed the budget without a projection (test_measure.py, beside
    # other tests; NOTE [ Growth of the tree's own memory ]).
    monkeypatch.setattr(MemoryWatch, "_CALIBRATION_DUTY", 1e-6)  # one exact reading only
    kept = []
    with MemoryWatch(tree_memory() + (1 << 30), interval=0.05) as watch:
        began = time.monotonic()
        while time.monotonic() - began < 1.6:  # past the growth's shortest span
            kept.append(mmap.mmap(-1, 512 << 10))  # about 50 MB/s of shared pages
            kept[-1].write(b"\x01" * (512 << 10))
            time.sleep(0.01)
        grown = watch.outgrows(1000.0)
    assert grown is not None and grown.projected is not None


class _SlowToSayItRuns(threading.Thread):
    """A thread that runs 0.3 s before it says so (``Thread._started``), and a Ctrl-C
    (SIGALRM, ``_ctrl_c``) 0.05 s into its ``start()``, which it cuts short, as one did
    in a CLI run beside a busy loop. Armed in ``start()`` itself: armed before the
    watch's ``start()``, the interrupt could land in its first sample instead."""

    def start(self) -> None:
        signal.setitimer(signal.ITIMER_REAL, 0.05)
        super().start()

    def _bootstrap_inner(self) -> None:
        time.sleep(0.3)
        super()._bootstrap_inner()  # type: ignore[misc]


def _ctrl_c(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def test_a_ctrl_c_inside_the_watchs_start_leaves_a_thread_stop_can_join(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    watch = MemoryWatch(2**40)
    previous = signal.signal(signal.SIGALRM, _ctrl_c)
    try:
        with monkeypatch.context() as patched:
            patched.setattr(threading, "Thread", _SlowToSayItRuns)
            with pytest.raises(KeyboardInterrupt):
                watch.start()
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    thread = watch._thread
    assert thread is not None and not thread.is_alive()  # not said to run yet
    watch.stop()  # raised "cannot join thread before it is started"
    assert not thread.is_alive() and thread.ident is not None  # it ran, and was joined
    assert not any(t.name == "autoloader-memory" for t in threading.enumerate())
