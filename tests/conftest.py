from __future__ import annotations

import time
from collections.abc import Iterator

import psutil
import pytest


@pytest.fixture(autouse=True)
def no_leftover_processes() -> Iterator[None]:
    """Fail any test that leaves a child process (e.g. a DataLoader worker) behind."""
    me = psutil.Process()
    before = {p.pid for p in me.children(recursive=True)}
    yield
    deadline = time.monotonic() + 10
    while True:
        left = [p for p in me.children(recursive=True) if p.pid not in before]
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    for process in left:
        process.kill()
    assert not left, f"test left child processes behind: {[p.pid for p in left]}"
