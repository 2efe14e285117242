"""Ctrl-C during a tuning run: a real SIGINT to a real tuning process and its workers."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

pytestmark = pytest.mark.slow  # Ctrl-C in real runs

SCRIPT = textwrap.dedent(
    """
    import json, logging, signal, sys
    import autoloader
    from tests.workloads import HoldsOnceArmed, sleep_step

    # Ctrl-C as in a terminal: a shell that started the tests in the background (a CI
    # job, `cmd &`) has them, and so this process, ignore SIGINT.
    signal.signal(signal.SIGINT, signal.default_int_handler)

    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    result = autoloader.tune(
        HoldsOnceArmed(100_000, *sys.argv[1:3]), sleep_step, batch_size=4, time_budget=120,
        show_progress=False,
    )
    print(json.dumps({"partial": result.partial, "params": result.params,
                      "states": [t.state for t in result.trials],
                      "reasons": [t.reason for t in result.trials]}))
    """
)


def test_ctrl_c_returns_the_best_so_far_and_leaves_no_process(tmp_path: Path) -> None:
    root = Path(__file__).resolve().parents[1]
    armed, holding = tmp_path / "armed", tmp_path / "holding"
    child = subprocess.Popen(
        [sys.executable, "-c", SCRIPT, str(armed), str(holding)],
        cwd=root,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own process group, like a job in a terminal
    )
    assert child.stderr is not None
    descendants: set[int] = set()
    try:
        for line in child.stderr:  # wait until the search is under way
            if line.startswith("trial 2 "):
                break
        # Interrupt a trial while its workers run, not the moment between two trials: the
        # next worker process to read an item holds it, so its trial cannot end first.
        armed.touch()
        give_up = time.monotonic() + 60
        while not holding.exists() and child.poll() is None and time.monotonic() < give_up:
            time.sleep(0.05)
        assert holding.exists(), "no trial with worker processes came"
        descendants = {p.pid for p in psutil.Process(child.pid).children(recursive=True)}
        os.killpg(child.pid, signal.SIGINT)  # what Ctrl-C in a terminal does
        out, err = child.communicate(timeout=60)
    finally:
        if child.poll() is None:
            os.killpg(child.pid, signal.SIGKILL)
            child.wait()
    assert child.returncode == 0, err
    result = json.loads(out.strip().splitlines()[-1])
    assert result["partial"] is True, err
    assert result["states"][0] == "complete"  # the baseline survived the interruption
    # The trial under way, the last, is recorded as interrupted.
    assert (result["states"][-1], result["reasons"][-1]) == ("failed", "interrupted (Ctrl-C)"), err
    assert descendants, "the trial had workers when it was interrupted"
    assert not [pid for pid in descendants if psutil.pid_exists(pid)]
